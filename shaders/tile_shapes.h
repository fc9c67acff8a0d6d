// Tile shapes of every kernel family, per element size and head dim: the one table the kernels
// (template constants), the host's dispatch plan (ffi/dispatch_plan.cc) and the Python kernel
// harness (through the extension's `tile_shape` binding) read. Valid both as Metal Shading
// Language and as C++14 (constexpr functions of plain ints), like attention_params.h. The choices
// and their threadgroup-memory and register budgets are justified in shaders/README.md.
//
// Dispatch: a threadgroup of jfm_tile_threads(...) threads (32 per simdgroup) owns
// jfm_tile_rows(...) consecutive rows of one (batch, head); the grid is
// (ceil(rows / jfm_tile_rows), heads, batch), where rows/heads are q_len/num_heads for fwd and
// bwd_dq, kv_len/num_kv_heads for bwd_dkdv (bwd_dk, bwd_dv), splits/num_kv_heads for
// decode_partial and (G * q_len)/num_kv_heads for decode_combine. jfm_tile_cols is the block
// size of the traversed dimension (keys for fwd/dQ/decode, queries for dK/dV).
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
#define JFM_KERNEL_DECODE_PARTIAL 5  // decode pass 1 (stage decode_partial)
#define JFM_KERNEL_DECODE_COMBINE 6  // decode pass 2 (stage decode_combine)

#define JFM_SIMD_WIDTH 32

// Forward, docs/kernels.md#forward-tiles: 8 query rows per simdgroup; BK halves as D and the
// element size grow so the Q, K and V tiles stay within ~26 KiB.
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

// Backward, docs/kernels.md#backward-tiles. Every backward kernel holds two owner tiles (Q and dO
// for dQ; K and V for dK/dV) of 8 * simdgroups rows and two streamed tiles (K and V; Q and dO) of
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

// Decode, docs/kernels.md#decode-split-kv. Pass 1 runs the forward's tiles (its key-block loop, BQ
// rows: every query row of one KV head, G * q_len <= BQ, in one tile; BK keys per block); pass 2 is
// one simdgroup per query row. A call takes the decode path when q_len <= JFM_DECODE_MAX_Q_LEN
// and G * q_len <= the pass-1 rows; it cuts each (batch, kv head)'s keys into
// jfm_decode_splits(...) splits.
#define JFM_DECODE_MAX_Q_LEN 16
// Pass-1 threadgroups aimed at per GPU core (enough to hide memory latency), and the fewest
// allocated keys per split (keeps pass 2 and the workspace small next to K and V).
#define JFM_DECODE_GROUPS_PER_CORE 4
#define JFM_DECODE_MIN_SPLIT_KEYS 256
// x clamped to [lo, max(lo, hi)].
constexpr long jfm_decode_clamp(long x, long lo, long hi) {
  return x < lo ? lo : (x > hi ? (hi < lo ? lo : hi) : x);
}

constexpr int jfm_decode_splits(long batch_kv_heads, long kv_len, int gpu_cores) {
  return int(jfm_decode_clamp((JFM_DECODE_GROUPS_PER_CORE * long(gpu_cores) + batch_kv_heads - 1) /
                                  (batch_kv_heads > 0 ? batch_kv_heads : 1),
                              1,
                              (kv_len + JFM_DECODE_MIN_SPLIT_KEYS - 1) / JFM_DECODE_MIN_SPLIT_KEYS));
}

constexpr bool jfm_is_fwd_tile(int family) {
  return family == JFM_KERNEL_FWD || family == JFM_KERNEL_DECODE_PARTIAL;
}
constexpr int jfm_tile_simdgroups(int family, int element_bytes, int head_dim) {
  return jfm_is_fwd_tile(family)              ? jfm_fwd_block_q(element_bytes, head_dim) / 8
         : family == JFM_KERNEL_DECODE_COMBINE ? 1
                                               : jfm_bwd_simdgroups(element_bytes, head_dim);
}
// Rows per threadgroup (pass 2: one query row).
constexpr int jfm_tile_rows(int family, int element_bytes, int head_dim) {
  return family == JFM_KERNEL_DECODE_COMBINE
             ? 1
             : 8 * jfm_tile_simdgroups(family, element_bytes, head_dim);
}
// Block size of the traversed dimension (pass 2: the splits, one at a time).
constexpr int jfm_tile_cols(int family, int element_bytes, int head_dim) {
  return jfm_is_fwd_tile(family)              ? jfm_fwd_block_k(element_bytes, head_dim)
         : family == JFM_KERNEL_DECODE_COMBINE ? 1
                                               : jfm_bwd_block(element_bytes, head_dim);
}
constexpr int jfm_tile_threads(int family, int element_bytes, int head_dim) {
  return jfm_tile_simdgroups(family, element_bytes, head_dim) * JFM_SIMD_WIDTH;
}

#ifndef __METAL_VERSION__
}  // namespace jfm
#endif

#endif  // JAX_FLASH_METAL_TILE_SHAPES_H_
