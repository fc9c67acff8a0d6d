// The kernel families: every (element type, head dim) the kernels are instantiated for, once.
// Valid both as Metal Shading Language and as C++ (macros only), like tile_shapes.h. Read by:
// - the .metal files, whose instantiation grids expand JFM_FAMILIES (the backward: each element
//   type's two head-dim lists) with a macro that instantiates one family's kernels;
// - the host (ffi/shader_library.cc): the families a Metal library is compiled for, and the
//   extension's `kernel_families()`, which the tests and the READMEs' head-dim lists are
//   checked against (tests/test_shader_libraries.py).
// To add a head dim: one X(...) entry in the list its backward belongs to (jfm_bwd_split_dkdv in
// tile_shapes.h; the instantiation macros static_assert the choice), and the READMEs' lists.
#ifndef JAX_FLASH_METAL_KERNEL_FAMILIES_H_
#define JAX_FLASH_METAL_KERNEL_FAMILIES_H_

// LIST(T, SUFFIX, X) for each element type: the MSL type T and the dtype suffix of the kernel
// names (bf16 is held as ushort bits: bfloat needs MSL 3.1).
#define JFM_ELEMENT_TYPES(LIST, X) LIST(float, f32, X) LIST(half, f16, X) LIST(ushort, bf16, X)

// X(T, SUFFIX, D) for each head dim whose backward computes dK and dV in one kernel ...
#define JFM_JOINT_BWD_HEAD_DIMS(T, SUFFIX, X)                                             \
  X(T, SUFFIX, 8) X(T, SUFFIX, 16) X(T, SUFFIX, 32) X(T, SUFFIX, 48) X(T, SUFFIX, 64)     \
  X(T, SUFFIX, 72) X(T, SUFFIX, 80) X(T, SUFFIX, 96) X(T, SUFFIX, 112) X(T, SUFFIX, 128)
// ... and for each head dim whose backward splits them into two kernels.
#define JFM_SPLIT_BWD_HEAD_DIMS(T, SUFFIX, X) X(T, SUFFIX, 160) X(T, SUFFIX, 192) X(T, SUFFIX, 256)

#define JFM_ALL_HEAD_DIMS(T, SUFFIX, X) \
  JFM_JOINT_BWD_HEAD_DIMS(T, SUFFIX, X) JFM_SPLIT_BWD_HEAD_DIMS(T, SUFFIX, X)

// X(T, SUFFIX, D) for every family.
#define JFM_FAMILIES(X) JFM_ELEMENT_TYPES(JFM_ALL_HEAD_DIMS, X)

// The host name "STAGE_SUFFIX_dD" of a kernel, e.g. "flash_attention_fwd_f16_d64" (one string
// literal after preprocessing).
#define JFM_STRINGIFY_(x) #x
#define JFM_STRINGIFY(x) JFM_STRINGIFY_(x)
#define JFM_HOST_NAME(STAGE, SUFFIX, D) JFM_STRINGIFY(STAGE##_##SUFFIX##_d##D)

#endif  // JAX_FLASH_METAL_KERNEL_FAMILIES_H_
