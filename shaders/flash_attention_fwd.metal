// Forward attention, FlashAttention-2 Algorithm 1 on simdgroup_matrix tiles: O = softmax(S) V with
// S = scale * Q K^T over the visible keys, the natural-log LSE, and the residuals the backward
// recomputes P from, the row max m and log(l) kept apart (jfm_store_statistics). Tile shapes:
// tile_shapes.h; the loop, tiles and memory: shaders/README.md.
#include "flash_attention_key_blocks.h"

#define JFM_FWD_SIGNATURE(T)                                              \
  (device const T* q [[buffer(JFM_BUFFER_Q)]],                            \
   device const T* k [[buffer(JFM_BUFFER_K)]],                            \
   device const T* v [[buffer(JFM_BUFFER_V)]],                            \
   device const int* q_lengths [[buffer(JFM_BUFFER_Q_LENGTHS)]],          \
   device const int* kv_lengths [[buffer(JFM_BUFFER_KV_LENGTHS)]],        \
   device const int* page_table [[buffer(JFM_BUFFER_PAGE_TABLE)]],        \
   device T* o [[buffer(JFM_BUFFER_O)]],                                  \
   device float* lse [[buffer(JFM_BUFFER_LSE)]],                          \
   device float* row_max [[buffer(JFM_BUFFER_ROW_MAX)]],                  \
   device float* log_sum [[buffer(JFM_BUFFER_LOG_SUM)]],                  \
   JFM_FEATURE_BUFFER_ARGS,                                               \
   constant AttentionParams& params [[buffer(JFM_BUFFER_PARAMS)]],        \
   uint3 group [[threadgroup_position_in_grid]],                          \
   uint thread_index [[thread_index_in_threadgroup]],                     \
   uint simd_index [[simdgroup_index_in_threadgroup]],                    \
   uint lane [[thread_index_in_simdgroup]])

#define JFM_FWD_THREADS(T, DK, DV, VARIANT) \
  jfm_tile_threads(JFM_KERNEL_FWD, int(sizeof(T)), jfm_tile_head_dim(DK, DV), VARIANT)

// One threadgroup per block of BQ query rows of head h in batch b, 8 rows per simdgroup; lane
// coordinates give each thread one query row. Per visible key block [j0, j0 + BK): stage K and V
// (zero-filled outside the block's visible union, V sanitized), S = Q K^T by MMA, online softmax,
// O = alpha O + P V by MMA. With score features (flash_attention_features.h) the key-block loop
// is its FEATURES variant and the rows' segment ids sit in the Q tile's row padding; sinks join
// each row's statistic after the loop. Every early return is threadgroup-uniform.
template <typename T, int DK, int DV, int VARIANT>
[[max_total_threads_per_threadgroup(JFM_FWD_THREADS(T, DK, DV, VARIANT))]] kernel void
flash_attention_fwd JFM_FWD_SIGNATURE(T) {
  typedef JfmFwdTraits<T, DK, DV, VARIANT> Traits;
  constexpr int BQ = Traits::BQ;
  constexpr int BK = Traits::BK;
  constexpr int THREADS = Traits::THREADS;
  constexpr bool Q_IN_REGISTERS = Traits::Q_IN_REGISTERS;
  constexpr int LDK = Traits::LDK;
  constexpr int DVF = Traits::DVF;
  static_assert(BQ == 8 * (THREADS / JFM_SIMD_WIDTH), "tile shape");

  // Tiles are declared as 16-byte words so the loader's uint4 accesses are aligned. Where Q
  // lives in registers it is staged through the K/V tiles (the key-block loop reads it into
  // registers before its first barrier), else it has its own tile before them.
  threadgroup uint4 tile_words[Traits::TILE_WORDS];
  // Per simdgroup: the latest key block whose V had Inf/NaN (jfm_note_nonfinite_v).
  threadgroup int nonfinite_v_block[THREADS / JFM_SIMD_WIDTH];
  threadgroup T* q_tile = (threadgroup T*)tile_words;
  threadgroup T* kv_tile = q_tile + (Q_IN_REGISTERS ? 0 : BQ * LDK);

  const JfmTile tile = jfm_tile_of(params, group);
  const int i0 = int(tile.block) * BQ;
  const uint h = tile.head;
  const uint b = tile.batch;
  if (i0 >= int(params.q_len)) {
    return;  // the whole threadgroup: before any barrier
  }
  const uint hk = h / (params.num_heads / params.num_kv_heads);
  const long q_valid = jfm_valid_len(params.has_q_lengths, q_lengths, b, params.q_len);
  const long kv_valid = jfm_valid_len(params.has_kv_lengths, kv_lengths, b, params.kv_len);
  const int valid_rows = int(jfm_min(jfm_max(q_valid - i0, 0), BQ));  // rows < q_valid

  // The block's visible union of keys, from its first and last valid rows (bounds monotone).
  const JfmRange32 first_keys =
      jfm_range32(jfm_keys_of_query(params, i0, q_valid, kv_valid), kv_valid);
  const JfmRange32 last_keys =
      jfm_range32(jfm_keys_of_query(params, i0 + valid_rows - 1, q_valid, kv_valid), kv_valid);
  const int union_lo = first_keys.lo;
  const int union_hi = valid_rows > 0 ? last_keys.hi : -1;

  // This thread's query row and its visible keys (empty past q_valid).
  const JfmFragCoord at = jfm_frag_coord(lane);
  const int band = int(simd_index) * 8;  // the simdgroup's rows within the block
  const int i = i0 + band + int(at.row);
  const JfmRange32 keys = jfm_range32(jfm_keys_of_query(params, i, q_valid, kv_valid), kv_valid);
  const bool features = jfm_has_score_features(params);  // uniform
  JfmFeatureLane f = jfm_feature_lane(params, JFM_FEATURE_BUFFERS, b, h, i,
                                      jfm_alignment_offset(params, q_valid, kv_valid));

  const uint q_stride = params.num_heads * uint(DK);  // elements between consecutive rows
  device const T* k_head = k + jfm_kv_head_offset(params, b, hk, DK);
  device const T* v_head = v + jfm_kv_head_offset(params, b, hk, DV);

  float m = JFM_MAX_SENTINEL;  // running max of the row's scores
  float l = 0.0f;              // this lane's share of the running sum of exp(S - m)
  JfmFrag acc[DVF];            // the row band's unnormalised O
  JFM_PRAGMA_UNROLL
  for (int d = 0; d < DVF; ++d) {
    acc[d] = jfm_frag_zero();
  }

  if (union_lo <= union_hi) {  // uniform: some row of the block sees some key
    jfm_load_tile<T, BQ, DK, THREADS, false>(
        q_tile, q + jfm_row_offset(b, i0, h, params.q_len, params.num_heads, DK), q_stride, 0,
        valid_rows, thread_index);
    if (features && params.has_segment_ids != 0) {
      jfm_stage_segment_ids<T, BQ, DK, THREADS>(
          q_tile, f.in.q_segment_ids + ulong(b) * params.q_len + i0, uint(BQ), BQ, 0, valid_rows,
          thread_index);
    }
    if (thread_index < uint(THREADS / JFM_SIMD_WIDTH)) {
      nonfinite_v_block[thread_index] = -1;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const JfmKeyBlocks<T> blocks = {q_tile + band * LDK,
                                    kv_tile,
                                    nonfinite_v_block,
                                    k_head,
                                    v_head,
                                    params.num_kv_heads * uint(DK),
                                    params.num_kv_heads * uint(DV),
                                    jfm_kv_rows(params, page_table, b),
                                    first_keys,
                                    last_keys,
                                    valid_rows == BQ,
                                    union_lo,
                                    union_hi,
                                    keys,
                                    at,
                                    thread_index,
                                    lane};
    if (features) {
      jfm_lane_segments<T, DK>(params, q_tile, band + int(at.row), valid_rows, f);
      jfm_attend_key_blocks<T, DK, DV, VARIANT, true>(blocks, params, f, m, l, acc);
    } else {
      jfm_attend_key_blocks<T, DK, DV, VARIANT, false>(blocks, params, f, m, l, acc);
    }
  }

  // Epilogue: normalise and store this lane's row (rows past the allocated q_len do not exist).
  float row_l = jfm_row_sum(l);
  if (jfm_has_sinks(params)) {  // uniform
    const float alpha = jfm_fold_sink(f.in.sinks[h], m, row_l);
    JFM_PRAGMA_UNROLL
    for (int d = 0; d < DVF; ++d) {
      acc[d].thread_elements() *= alpha;
    }
  }
  if (i < int(params.q_len)) {
    const bool empty = row_l == 0.0f;  // no visible key (and no sink): l is >= 1 otherwise
    device T* o_row = o + jfm_row_offset(b, i, h, params.q_len, params.num_heads, DV);
    JFM_PRAGMA_UNROLL
    for (int d = 0; d < DVF; ++d) {
      // An empty row accumulated only P = 0 times finite (sanitized) V: acc is exactly 0.
      jfm_frag_store_row(o_row + d * 8, acc[d], empty ? 0.0f : 1.0f / row_l, at);
    }
    if (at.col == 0) {  // one lane per row writes the statistics
      jfm_store_statistics(lse, row_max, log_sum,
                           jfm_stat_offset(b, h, i, params.num_heads, params.q_len), m, row_l);
    }
  }
}

// The instantiation grid: every family of kernel_families.h, each tile variant under its host
// name (variant v > 0: stage fwd_var<v>).
static_assert(JFM_TILE_VARIANTS == 2, "one instantiation per tile variant");
#define JFM_INSTANTIATE_FWD(T, SUFFIX, DK, DV, NAME)                                           \
  JFM_IF_FAMILY(T, NAME,                                                                      \
                template [[host_name(JFM_HOST_NAME(flash_attention_fwd, SUFFIX, NAME))]]      \
                kernel void flash_attention_fwd<T, DK, DV, 0> JFM_FWD_SIGNATURE(T);           \
                template [[host_name(JFM_HOST_NAME(flash_attention_fwd_var1, SUFFIX, NAME))]] \
                kernel void flash_attention_fwd<T, DK, DV, 1> JFM_FWD_SIGNATURE(T);)

JFM_FAMILIES(JFM_INSTANTIATE_FWD)
