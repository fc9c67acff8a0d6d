// Tile shapes of every kernel family, per element size and head dim: the one table the kernels
// (template constants), the host's dispatch (ffi/attention_ffi.cc) and the Python kernel harness
// (through the extension's `tile_shape` binding) read. Valid both as Metal Shading Language and
// as C++14 (constexpr functions of plain ints), like attention_params.h. The choices and their
// threadgroup-memory and register budgets are justified in shaders/README.md.
//
// Dispatch: a threadgroup of jfm_tile_threads(...) threads (32 per simdgroup) owns
// jfm_tile_rows(...) consecutive rows of one (batch, head); the grid is
// (ceil(rows / jfm_tile_rows), heads, batch), where rows/heads are q_len/num_heads for fwd and
// bwd_dq, and kv_len/num_kv_heads for bwd_dkdv (bwd_dk, bwd_dv). jfm_tile_cols is the block
// size of the traversed dimension (keys for fwd/dQ, queries for dK/dV).
#ifndef JAX_FLASH_METAL_TILE_SHAPES_H_
#define JAX_FLASH_METAL_TILE_SHAPES_H_

#ifndef __METAL_VERSION__
namespace jfm {
#endif

// Kernel families (the stage part of the kernel name flash_attention_{stage}_{type}_d{D}).
#define JFM_KERNEL_FWD 0
#define JFM_KERNEL_BWD_DQ 1
#define JFM_KERNEL_BWD_DKDV 2  // dK and dV in one kernel (head_dim < 160)
#define JFM_KERNEL_BWD_DK 3    // the split pair (head_dim >= 160)
#define JFM_KERNEL_BWD_DV 4

#define JFM_SIMD_WIDTH 32

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

// Backward, KERNELS.md section 4. Every backward kernel holds two owner tiles (Q and dO for dQ;
// K and V for dK/dV) of 8 * simdgroups rows and two streamed tiles (K and V; Q and dO) of
// `block` rows, each row head_dim * element_bytes + 16 bytes, so threadgroup memory depends on
// the bytes per row only: the families are chosen by row bytes (<= 26112 B, shaders/README.md).
constexpr int jfm_bwd_simdgroups(int element_bytes, int head_dim) {
  return element_bytes * head_dim <= 256 ? 4 : (element_bytes * head_dim <= 512 ? 2 : 1);
}
constexpr int jfm_bwd_block(int element_bytes, int head_dim) {
  return element_bytes * head_dim <= 128 ? 32 : (element_bytes * head_dim <= 256 ? 16 : 8);
}
// One streamed tile holds the two streamed operands in turn (V then K for dQ; the operand the
// split dK or dV kernel needs first, then the other) where two would not fit.
constexpr bool jfm_bwd_shared_stream(int element_bytes, int head_dim) {
  return element_bytes * head_dim > 512;
}
// dK and dV by two kernels (one head_dim-wide float accumulator each) where two accumulators
// would not fit the register budget.
constexpr bool jfm_bwd_split_dkdv(int head_dim) { return head_dim >= 160; }

constexpr int jfm_tile_simdgroups(int family, int element_bytes, int head_dim) {
  return family == JFM_KERNEL_FWD ? jfm_fwd_block_q(element_bytes, head_dim) / 8
                                  : jfm_bwd_simdgroups(element_bytes, head_dim);
}
constexpr int jfm_tile_rows(int family, int element_bytes, int head_dim) {
  return 8 * jfm_tile_simdgroups(family, element_bytes, head_dim);
}
constexpr int jfm_tile_cols(int family, int element_bytes, int head_dim) {
  return family == JFM_KERNEL_FWD ? jfm_fwd_block_k(element_bytes, head_dim)
                                  : jfm_bwd_block(element_bytes, head_dim);
}
constexpr int jfm_tile_threads(int family, int element_bytes, int head_dim) {
  return jfm_tile_simdgroups(family, element_bytes, head_dim) * JFM_SIMD_WIDTH;
}

#ifndef __METAL_VERSION__
}  // namespace jfm
#endif

#endif  // JAX_FLASH_METAL_TILE_SHAPES_H_
