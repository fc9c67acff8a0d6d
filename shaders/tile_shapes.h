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
#define JFM_KERNEL_DECODE_VECTOR 7   // decode pass 1 without MMA (stage decode_vector)

#define JFM_SIMD_WIDTH 32

// Kernel variants (docs/kernels.md#kernel-variants): every choice below takes a `variant`, an
// index into the tile/register strategies of its family; 0 is the default. The forward's tiles
// (fwd and decode pass 1) and the backward's have JFM_TILE_VARIANTS each (jfm_tile_variants says
// how many differ for a family); decode_vector and decode_combine have one. Each .metal file
// instantiates every variant under its own host name (JFM_VARIANT_STAGE).
#define JFM_TILE_VARIANTS 2

// The head dim a family's tiles are chosen by: the wider of the key head dim (Q, K, dQ, dK) and
// the value head dim (V, O, dO, dV), so that the narrower side's tiles fit the same budgets.
// Every choice below takes it as `head_dim`.
constexpr int jfm_tile_head_dim(int key_head_dim, int value_head_dim) {
  return key_head_dim > value_head_dim ? key_head_dim : value_head_dim;
}

// Forward, docs/kernels.md#forward-tiles: 8 query rows per simdgroup; 32-key blocks up to D 64,
// 16 up to D 128 (as MLX's forward), so that with Q in registers the K and V tiles, which Q is
// staged through first, take at most 16 KiB in f16/bf16 (9 KiB at D 64, 8.5 KiB at D 128).
// Variant 1 above D 128 halves the f16/bf16 key block (fewer S/P registers, more blocks).
// (BQ is the same in every variant: the decode's eligibility depends on it.)
constexpr int jfm_fwd_block_q(int element_bytes, int head_dim, int variant) {
  return element_bytes == 4 && head_dim > 128 && variant >= 0 ? 16 : 32;
}
constexpr int jfm_fwd_block_k(int element_bytes, int head_dim, int variant) {
  return head_dim <= 64    ? 32
         : head_dim <= 128 ? 16
                           : (element_bytes == 2 ? (variant == 1 ? 8 : 16) : 8);
}
// Page sizes of a paged K/V cache (flash_attention_key_blocks.h): powers of two >= 16, so that an
// aligned key block of 8, 16 or 32 keys lies in one page, or (pages of 16, blocks of 32) in two.
constexpr bool jfm_page_size_supported(long size) {
  return size >= 16 && (size & (size - 1)) == 0;
}
// Variant 0: Q fragments live in registers for the whole loop (D <= 128: D / 4 registers; Q is
// staged through the K/V tiles before the first key block), else they are reloaded from their
// own threadgroup tile per key block (D / 4 more would pass the 128-register budget at D 256).
// Variant 1 reloads Q at every D (MFA's choice at large D: Q and O never both resident).
constexpr bool jfm_fwd_q_in_registers(int element_bytes, int head_dim, int variant) {
  return head_dim <= 128 && element_bytes > 0 && variant == 0;
}
// K and V share one threadgroup buffer (K, then V after a barrier) where two would not fit next
// to a Q tile: wherever Q has its own tile.
constexpr bool jfm_fwd_kv_one_buffer(int element_bytes, int head_dim, int variant) {
  return !jfm_fwd_q_in_registers(element_bytes, head_dim, variant);
}
// Backward, docs/kernels.md#backward-tiles. Every backward kernel holds two owner tiles (Q and dO
// for dQ; K and V for dK/dV) of 8 * simdgroups rows and two streamed tiles (K and V; Q and dO) of
// `block` rows, each row head_dim * element_bytes + 16 bytes, so threadgroup memory depends on
// the bytes per row only: the families are chosen by row bytes (<= 26112 B, shaders/README.md).
// Variant 1 halves the simdgroups (owned rows) where there are several, else the streamed block
// where it is above 8 (f32 above D 128 has one backward variant).
constexpr int jfm_bwd_simdgroups_default(int element_bytes, int head_dim) {
  return element_bytes * head_dim <= 256 ? 4 : (element_bytes * head_dim <= 512 ? 2 : 1);
}
constexpr int jfm_bwd_block_default(int element_bytes, int head_dim) {
  return element_bytes * head_dim <= 128 ? 32 : (element_bytes * head_dim <= 256 ? 16 : 8);
}
constexpr int jfm_bwd_simdgroups(int element_bytes, int head_dim, int variant) {
  return jfm_bwd_simdgroups_default(element_bytes, head_dim) /
         (variant == 1 && jfm_bwd_simdgroups_default(element_bytes, head_dim) > 1 ? 2 : 1);
}
constexpr int jfm_bwd_block(int element_bytes, int head_dim, int variant) {
  return jfm_bwd_block_default(element_bytes, head_dim) /
         (variant == 1 && jfm_bwd_simdgroups_default(element_bytes, head_dim) == 1 &&
                  jfm_bwd_block_default(element_bytes, head_dim) > 8
              ? 2
              : 1);
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

// The vector pass 1 (docs/kernels.md#decode-split-kv): one simdgroup per (split, kv head, batch),
// no MMA and no threadgroup memory; it takes the call when G * q_len <= jfm_decode_vector_rows,
// the rows whose q and O each lane holds D/32 of in registers (8 up to D 128, 4 above, within
// the 128-register budget of jfm_tile_registers). Its threadgroups are single simdgroups, so it
// aims at more of them per core (24 simdgroups saturate a core's ALUs) with shorter splits.
constexpr int jfm_decode_vector_rows(int head_dim) { return head_dim <= 128 ? 8 : 4; }
#define JFM_DECODE_VECTOR_GROUPS_PER_CORE 16
#define JFM_DECODE_VECTOR_MIN_SPLIT_KEYS 128

constexpr int jfm_decode_splits(long batch_kv_heads, long kv_len, int gpu_cores, bool vector) {
  return int(jfm_decode_clamp(
      ((vector ? JFM_DECODE_VECTOR_GROUPS_PER_CORE : JFM_DECODE_GROUPS_PER_CORE) *
           long(gpu_cores) + batch_kv_heads - 1) / (batch_kv_heads > 0 ? batch_kv_heads : 1),
      1,
      (kv_len + (vector ? JFM_DECODE_VECTOR_MIN_SPLIT_KEYS : JFM_DECODE_MIN_SPLIT_KEYS) - 1) /
          (vector ? JFM_DECODE_VECTOR_MIN_SPLIT_KEYS : JFM_DECODE_MIN_SPLIT_KEYS)));
}

constexpr bool jfm_is_fwd_tile(int family) {
  return family == JFM_KERNEL_FWD || family == JFM_KERNEL_DECODE_PARTIAL;
}
constexpr bool jfm_is_one_simdgroup(int family) {
  return family == JFM_KERNEL_DECODE_COMBINE || family == JFM_KERNEL_DECODE_VECTOR;
}
constexpr int jfm_tile_simdgroups(int family, int element_bytes, int head_dim, int variant) {
  return jfm_is_fwd_tile(family)        ? jfm_fwd_block_q(element_bytes, head_dim, variant) / 8
         : jfm_is_one_simdgroup(family) ? 1
                                        : jfm_bwd_simdgroups(element_bytes, head_dim, variant);
}
// Rows per threadgroup (pass 2: one query row; the vector pass 1: at most its rows).
constexpr int jfm_tile_rows(int family, int element_bytes, int head_dim, int variant) {
  return family == JFM_KERNEL_DECODE_COMBINE  ? 1
         : family == JFM_KERNEL_DECODE_VECTOR ? jfm_decode_vector_rows(head_dim)
                                              : 8 * jfm_tile_simdgroups(family, element_bytes,
                                                                        head_dim, variant);
}
// Block size of the traversed dimension (pass 2: the splits, one at a time; the vector pass 1:
// one key per lane).
constexpr int jfm_tile_cols(int family, int element_bytes, int head_dim, int variant) {
  return jfm_is_fwd_tile(family)               ? jfm_fwd_block_k(element_bytes, head_dim, variant)
         : family == JFM_KERNEL_DECODE_COMBINE ? 1
         : family == JFM_KERNEL_DECODE_VECTOR  ? JFM_SIMD_WIDTH
                                               : jfm_bwd_block(element_bytes, head_dim, variant);
}
constexpr int jfm_tile_threads(int family, int element_bytes, int head_dim, int variant) {
  return jfm_tile_simdgroups(family, element_bytes, head_dim, variant) * JFM_SIMD_WIDTH;
}
// Whether a family's variant differs from its variant 0 (the variants the host lists).
constexpr bool jfm_variant_differs(int family, int element_bytes, int head_dim, int variant) {
  return variant > 0 && !jfm_is_one_simdgroup(family) &&
         (jfm_tile_rows(family, element_bytes, head_dim, variant) !=
              jfm_tile_rows(family, element_bytes, head_dim, 0) ||
          jfm_tile_cols(family, element_bytes, head_dim, variant) !=
              jfm_tile_cols(family, element_bytes, head_dim, 0) ||
          (jfm_is_fwd_tile(family) && jfm_fwd_q_in_registers(element_bytes, head_dim, variant) !=
                                          jfm_fwd_q_in_registers(element_bytes, head_dim, 0)));
}
// The variants of a family the host may pick: 0 .. jfm_tile_variants - 1.
constexpr int jfm_tile_variants(int family, int element_bytes, int head_dim) {
  return jfm_variant_differs(family, element_bytes, head_dim, 1) ? 2 : 1;
}

// Estimated live 32-bit registers per thread (docs/kernels.md#registers): the fragment arrays
// and per-lane arrays each kernel keeps across its key (query) block loop, 2 per 8x8 float
// fragment and 1 per float, plus JFM_REGISTER_SCALARS for the running statistics, indices and
// pointers. Above JFM_REGISTER_BUDGET a kernel risks spilling to stack memory (Apple GPUs keep
// full ALU use down to 24 simdgroups per core, i.e. about 128 registers of a ~208 KB register
// file); no family may exceed it (tests/tools/test_profile.py).
#define JFM_REGISTER_SCALARS 16
#define JFM_REGISTER_BUDGET 128
constexpr int jfm_tile_registers(int family, int element_bytes, int head_dim, int variant) {
  // fragments along the head dim, along the traversed block; floats of a row per lane
  const int df = head_dim / 8;
  const int bf = jfm_tile_cols(family, element_bytes, head_dim, variant) / 8;
  const int dl = (head_dim + JFM_SIMD_WIDTH - 1) / JFM_SIMD_WIDTH;
  return JFM_REGISTER_SCALARS +
         (jfm_is_fwd_tile(family)
              // O accumulator, S/P block, Q (held, or one reloaded fragment), one K/V operand
              ? 2 * (df + bf + (jfm_fwd_q_in_registers(element_bytes, head_dim, variant) ? df : 1) +
                     1)
          : family == JFM_KERNEL_BWD_DQ
              // dQ accumulator, S and dP blocks, two operands
              ? 2 * (df + 2 * bf + 2)
          : family == JFM_KERNEL_BWD_DKDV
              // dK and dV accumulators, S^T and dP^T blocks, two operands
              ? 2 * (2 * df + 2 * bf + 2)
          : family == JFM_KERNEL_BWD_DK || family == JFM_KERNEL_BWD_DV
              ? 2 * (df + 2 * bf + 2)
          : family == JFM_KERNEL_DECODE_COMBINE
              // the row's weighted sum
              ? dl
              // per row: q and O (dl each), the score / weight of the lane's key, m, l and the
              // row's visible interval; the K or V values of one key
              : jfm_decode_vector_rows(head_dim) * (2 * dl + 5) + dl);
}

#ifndef __METAL_VERSION__
}  // namespace jfm
#endif

#endif  // JAX_FLASH_METAL_TILE_SHAPES_H_
