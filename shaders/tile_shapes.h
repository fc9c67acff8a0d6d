// Tile shapes of every kernel family, per element size and head dim: the one table the kernels
// (template constants), the host's dispatch (ffi/attention_ffi.cc) and the Python kernel harness
// (through the extension's `tile_shape` binding) read. Valid both as Metal Shading Language and
// as C++14 (constexpr functions of plain ints), like attention_params.h. The choices and their
// threadgroup-memory and register budgets are justified in shaders/README.md.
//
// Dispatch: a threadgroup of jfm_tile_threads(...) threads (32 per simdgroup) owns
// jfm_tile_rows(...) consecutive rows of one (batch, head); the grid is
// (ceil(rows / jfm_tile_rows), heads, batch), where rows/heads are q_len/num_heads for fwd,
// bwd_preprocess and bwd_dq, and kv_len/num_kv_heads for bwd_dkdv. jfm_tile_cols is the block
// size of the traversed dimension (keys for fwd/dQ, queries for dK/dV).
#ifndef JAX_FLASH_METAL_TILE_SHAPES_H_
#define JAX_FLASH_METAL_TILE_SHAPES_H_

#ifndef __METAL_VERSION__
namespace jfm {
#endif

// Kernel families (the stage part of the kernel name flash_attention_{stage}_{type}_d{D}).
#define JFM_KERNEL_FWD 0
#define JFM_KERNEL_BWD_PREPROCESS 1
#define JFM_KERNEL_BWD_DQ 2
#define JFM_KERNEL_BWD_DKDV 3

#define JFM_SIMD_WIDTH 32

// Rows per threadgroup of the kernels that map one simdgroup to one row (the backward, until it
// is tiled): 4 simdgroups, 4 rows.
#define JFM_ROWS_PER_GROUP 4

// Forward, KERNELS.md section 4: 8 query rows per simdgroup; BK halves as D and the element size
// grow so the Q, K and V tiles stay within ~26 KiB.
constexpr int jfm_fwd_block_q(int element_bytes, int head_dim) {
  return element_bytes == 4 && head_dim > 128 ? 16 : 32;
}
constexpr int jfm_fwd_block_k(int element_bytes, int head_dim) {
  return head_dim <= 64 ? (element_bytes == 2 ? 64 : 32)
                        : head_dim <= 128 ? (element_bytes == 2 ? 32 : 16)
                                          : (element_bytes == 2 ? 16 : 8);
}
// Q fragments live in registers for the whole loop (D <= 64), else they are reloaded from the
// threadgroup tile per key block.
constexpr bool jfm_fwd_q_in_registers(int element_bytes, int head_dim) {
  return head_dim <= 64 && element_bytes > 0;
}
// K and V share one threadgroup buffer (K, then V after a barrier) where two would not fit.
constexpr bool jfm_fwd_kv_one_buffer(int element_bytes, int head_dim) {
  return element_bytes == 4 ? head_dim > 64 : head_dim > 128;
}

constexpr int jfm_tile_rows(int family, int element_bytes, int head_dim) {
  return family == JFM_KERNEL_FWD ? jfm_fwd_block_q(element_bytes, head_dim) : JFM_ROWS_PER_GROUP;
}
constexpr int jfm_tile_cols(int family, int element_bytes, int head_dim) {
  return family == JFM_KERNEL_FWD ? jfm_fwd_block_k(element_bytes, head_dim) : JFM_SIMD_WIDTH;
}
constexpr int jfm_tile_simdgroups(int family, int element_bytes, int head_dim) {
  return family == JFM_KERNEL_FWD ? jfm_fwd_block_q(element_bytes, head_dim) / 8
                                  : JFM_ROWS_PER_GROUP;
}
constexpr int jfm_tile_threads(int family, int element_bytes, int head_dim) {
  return jfm_tile_simdgroups(family, element_bytes, head_dim) * JFM_SIMD_WIDTH;
}

#ifndef __METAL_VERSION__
}  // namespace jfm
#endif

#endif  // JAX_FLASH_METAL_TILE_SHAPES_H_
