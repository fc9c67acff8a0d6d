// The kernel families: every (element type, key head dim, value head dim) the kernels are
// instantiated for, once.
// Valid both as Metal Shading Language and as C++ (macros only), like tile_shapes.h. Read by:
// - the .metal files, whose instantiation grids expand JFM_FAMILIES (the backward: each element
//   type's two head-dim lists) with a macro that instantiates one family's kernels;
// - the host (ffi/shader_library.cc): the families a Metal library is compiled for, and the
//   extension's `kernel_families()`, which the tests and the READMEs' head-dim lists are
//   checked against (tests/fused/test_shader_libraries.py).
// To add a head dim: one entry in the list its backward belongs to (jfm_bwd_split_dkdv of the
// family's tile head dim in tile_shapes.h; the instantiation macros static_assert the choice),
// and the READMEs' lists. Each family adds to the emulator's build time.
#ifndef JAX_FLASH_METAL_KERNEL_FAMILIES_H_
#define JAX_FLASH_METAL_KERNEL_FAMILIES_H_

// LIST(T, SUFFIX, X) for each element type: the MSL type T and the dtype suffix of the kernel
// names (bf16 is held as ushort bits: bfloat needs MSL 3.1).
#define JFM_ELEMENT_TYPES(LIST, X) LIST(float, f32, X) LIST(half, f16, X) LIST(ushort, bf16, X)

// X(T, SUFFIX, DK, DV, NAME) for each family whose backward computes dK and dV in one kernel ...
// (DK: the query/key head dim, DV: the value/O head dim, NAME: the kernel-name tag after "_d",
// DK alone where DV == DK, "DK_vDV" otherwise: flash_attention_fwd_f16_d64,
// flash_attention_fwd_f16_d128_v64) ...
#define JFM_SAME_DIMS(T, SUFFIX, X, D) X(T, SUFFIX, D, D, D)
#define JFM_JOINT_BWD_HEAD_DIMS(T, SUFFIX, X)                                           \
  JFM_SAME_DIMS(T, SUFFIX, X, 8) JFM_SAME_DIMS(T, SUFFIX, X, 16)                        \
  JFM_SAME_DIMS(T, SUFFIX, X, 32) JFM_SAME_DIMS(T, SUFFIX, X, 48)                       \
  JFM_SAME_DIMS(T, SUFFIX, X, 64) JFM_SAME_DIMS(T, SUFFIX, X, 72)                       \
  JFM_SAME_DIMS(T, SUFFIX, X, 80) JFM_SAME_DIMS(T, SUFFIX, X, 96)                       \
  JFM_SAME_DIMS(T, SUFFIX, X, 112) JFM_SAME_DIMS(T, SUFFIX, X, 128)                     \
  X(T, SUFFIX, 128, 64, 128_v64)
// ... and for each family whose backward splits them into two kernels.
#define JFM_SPLIT_BWD_HEAD_DIMS(T, SUFFIX, X)                                           \
  JFM_SAME_DIMS(T, SUFFIX, X, 160) JFM_SAME_DIMS(T, SUFFIX, X, 192)                     \
  JFM_SAME_DIMS(T, SUFFIX, X, 256) X(T, SUFFIX, 192, 128, 192_v128)

#define JFM_ALL_HEAD_DIMS(T, SUFFIX, X) \
  JFM_JOINT_BWD_HEAD_DIMS(T, SUFFIX, X) JFM_SPLIT_BWD_HEAD_DIMS(T, SUFFIX, X)

// X(T, SUFFIX, DK, DV, NAME) for every family.
#define JFM_FAMILIES(X) JFM_ELEMENT_TYPES(JFM_ALL_HEAD_DIMS, X)

// The host name "STAGE_SUFFIX_dNAME" of a kernel, e.g. "flash_attention_fwd_f16_d64" (one string
// literal after preprocessing).
#define JFM_STRINGIFY_(x) #x
#define JFM_STRINGIFY(x) JFM_STRINGIFY_(x)
#define JFM_HOST_NAME(STAGE, SUFFIX, NAME) JFM_STRINGIFY(STAGE##_##SUFFIX##_d##NAME)

#endif  // JAX_FLASH_METAL_KERNEL_FAMILIES_H_
