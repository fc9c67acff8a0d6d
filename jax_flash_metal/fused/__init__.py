"""The fused implementations' Python side: the FFI lowering and the offline shader-library build."""
