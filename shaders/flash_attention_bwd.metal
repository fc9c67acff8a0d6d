// Backward attention, FlashAttention-2 Algorithm 2 (recompute) on simdgroup_matrix tiles.
//
// Two kernel families, each output tile written by exactly one threadgroup (no atomics):
//   dQ:    one threadgroup per query block; its prologue also writes D = rowsum(dO * O) - g_lse
//          (dO is staged there anyway), which the dK/dV kernels read.
//   dK/dV: one threadgroup per key block, looping over its kv head's query-head group and the
//          visible query blocks; for head_dim >= 160 a dK and a dV kernel (tile_shapes.h).
// Scores S = (Q K^T) * scale, by MMA over head-dim chunks in ascending order from 0, exactly as
// the forward forms them (K Q^T multiplies the same pairs in the same order), so P from the
// forward's residuals, exp((S - m) - log(l)) (jfm_probability), reproduces the forward's
// probabilities: a one-hot row gives P = 1, and S - m is exact at any offset.
// The optional features (soft cap, bias, ALiBi, mask, segment ids) form scores and visibility
// through flash_attention_features.h, as the forward does; a call without them runs the plain
// code.
// Loops, tiles and memory: shaders/README.md.
#include "flash_attention_features.h"
#include "kernel_traits.h"

#define JFM_BWD_INPUTS(T)                                                 \
  device const T* q [[buffer(JFM_BUFFER_Q)]],                             \
      device const T* k [[buffer(JFM_BUFFER_K)]],                         \
      device const T* v [[buffer(JFM_BUFFER_V)]],                         \
      device const T* d_o [[buffer(JFM_BUFFER_DO)]],                      \
      device const float* row_max [[buffer(JFM_BUFFER_ROW_MAX)]],         \
      device const float* log_sum [[buffer(JFM_BUFFER_LOG_SUM)]],         \
      device const int* q_lengths [[buffer(JFM_BUFFER_Q_LENGTHS)]],       \
      device const int* kv_lengths [[buffer(JFM_BUFFER_KV_LENGTHS)]],     \
      JFM_FEATURE_BUFFER_ARGS,                                            \
      constant AttentionParams& params [[buffer(JFM_BUFFER_PARAMS)]],     \
      uint3 group [[threadgroup_position_in_grid]],                       \
      uint thread_index [[thread_index_in_threadgroup]],                  \
      uint simd_index [[simdgroup_index_in_threadgroup]],                 \
      uint lane [[thread_index_in_simdgroup]]

#define JFM_BWD_DQ_SIGNATURE(T)                                           \
  (JFM_BWD_INPUTS(T), device const T* o [[buffer(JFM_BUFFER_O)]],        \
   device const float* g_lse [[buffer(JFM_BUFFER_G_LSE)]],                \
   device float* delta [[buffer(JFM_BUFFER_DELTA)]],                      \
   device T* dq [[buffer(JFM_BUFFER_DQ)]],                                \
   device float* dbias [[buffer(JFM_BUFFER_DBIAS)]],                      \
   device float* dalibi [[buffer(JFM_BUFFER_DALIBI)]])

#define JFM_BWD_DKDV_SIGNATURE(T)                                             \
  (JFM_BWD_INPUTS(T), device const float* delta [[buffer(JFM_BUFFER_DELTA)]], \
   device T* dk [[buffer(JFM_BUFFER_DK)]], device T* dv [[buffer(JFM_BUFFER_DV)]])

#define JFM_BWD_THREADS(FAMILY, T, DK, DV, VARIANT) \
  jfm_tile_threads(FAMILY, int(sizeof(T)), jfm_tile_head_dim(DK, DV), VARIANT)

// Transposed fragment straight from device rows `stride` elements apart: (r, c) = rows[c *
// stride + r], 0 for rows c >= valid (never read).
template <typename T>
inline JfmFrag jfm_frag_load_transposed_rows(device const T* rows, uint stride, int valid,
                                             JfmFragCoord at) {
  JfmFrag f;
  const int c = int(at.col);
  f.thread_elements()[0] = c < valid ? jfm_to_float(rows[uint(c) * stride + at.row]) : 0.0f;
  f.thread_elements()[1] =
      c + 1 < valid ? jfm_to_float(rows[uint(c + 1) * stride + at.row]) : 0.0f;
  return f;
}

// acc[f] = A B^T for the simdgroup's 8 rows: A rows from `a` (its 8-row band), B rows from `b`
// (BR rows, fragment f covering rows 8f..8f+7), both tiles of D columns with row strides LDA and
// LDB; the sum over the head dim runs over chunks of 8 in ascending order (the forward's score
// order).
template <typename T, int D, int LDA, int LDB, int BF>
inline void jfm_mma_abt(thread JfmFrag* acc, threadgroup const T* a, threadgroup const T* b,
                        JfmFragCoord at) {
  JFM_PRAGMA_UNROLL
  for (int f = 0; f < BF; ++f) {
    acc[f] = jfm_frag_zero();
  }
  for (int d = 0; d < D / 8; ++d) {
    const JfmFrag ad = jfm_frag_load(a + d * 8, LDA, at);
    JFM_PRAGMA_UNROLL
    for (int f = 0; f < BF; ++f) {
      jfm_mma(acc[f], ad, jfm_frag_load_transposed(b + f * 8 * LDB + d * 8, LDB, at));
    }
  }
}

// acc[d] += sum_f P[f] B[8f.., 8d..]: a [8 x 8 BF] float operand in fragments times a tile of
// 8 BF rows and D columns. FINITE_ONLY reads Inf/NaN elements of the tile as 0 (edge blocks).
template <typename T, int D, int LD, int BF, bool FINITE_ONLY>
inline void jfm_mma_ab(thread JfmFrag* acc, thread const JfmFrag* p, threadgroup const T* b,
                       JfmFragCoord at) {
  JFM_PRAGMA_UNROLL
  for (int d = 0; d < D / 8; ++d) {
    JFM_PRAGMA_UNROLL
    for (int f = 0; f < BF; ++f) {
      threadgroup const T* tile = b + f * 8 * LD + d * 8;
      jfm_mma(acc[d], p[f],
              FINITE_ONLY ? jfm_frag_load_finite(tile, LD, at) : jfm_frag_load(tile, LD, at));
    }
  }
}

// ---- dQ ----

// Zeros for this lane's dbias elements of a key block the loop skips: columns
// j0 + 8n + at.col + e below kv_len, the ones it would hold in the block's fragments, so the
// lanes of the row band together write every element of the block's rows.
template <int KF>
inline void jfm_zero_dbias_block(device float* dbias_row, int j0, int kv_len, JfmFragCoord at) {
  for (int n = 0; n < KF; ++n) {
    for (int e = 0; e < 2; ++e) {
      const int j = j0 + n * 8 + int(at.col) + e;
      if (j < kv_len) {
        dbias_row[j] = 0.0f;
      }
    }
  }
}

// Owner: query rows [i0, i0 + BQ) of head h, 8 per simdgroup (the lane's row: jfm_frag_coord).
//   stage Q_i, dO_i;  D_i = rowsum(dO_i * O_i) - g_lse_i  (written for the dK/dV kernels)
//   for each key block j of the block's visible union (skip blocks never visited):
//     stage K_j, V_j (rows outside the union zero-filled)
//     dP = (dO_i V_j^T) * Z    (elementwise; Z = M / (1 - rate) with dropout, else 1)
//     S = Q_i K_j^T * scale;  P = exp((S - m_i) - log(l_i))
//     dS = P (dP - D_i)                       (edge blocks: 0 where not visible)
//     dbias_ij = dS (with bias_grad; 0 in every block or element not visited)
//     dslope_i += dS_ij |i + off - j|          (with alibi_grad, summed over the row's lanes)
//     dQ_i += dS (1 - tanh^2) K_j              (the soft cap's derivative, 1 without a cap)
//   dQ_i *= scale;  dalibi_i = -dslope_i       (row i's share of dL/dslope[b, h], with alibi_grad)
// With segment ids, a key block whose id range cannot meet the query block's is skipped.
// Q, K and dQ have DK columns, V, O and dO DV.
template <typename T, int DK, int DV, int VARIANT>
[[max_total_threads_per_threadgroup(JFM_BWD_THREADS(JFM_KERNEL_BWD_DQ, T, DK, DV, VARIANT))]]
kernel void flash_attention_bwd_dq JFM_BWD_DQ_SIGNATURE(T) {
  typedef JfmBwdTraits<T, DK, DV, JFM_KERNEL_BWD_DQ, VARIANT> Traits;
  constexpr int THREADS = Traits::THREADS;
  constexpr int BQ = Traits::OWNED;
  constexpr int BK = Traits::STREAMED;
  constexpr bool ONE_KV_BUFFER = Traits::ONE_STREAM_BUFFER;
  constexpr int LDK = Traits::LDK;
  constexpr int LDV = Traits::LDV;
  // V's stride in the streamed buffer: K's where they share it, so that V leaves the key ids in
  // K's row padding alone.
  constexpr int LDV_STREAM = ONE_KV_BUFFER ? LDK : LDV;
  static_assert(!ONE_KV_BUFFER || DV <= DK, "V fits K's rows in the shared buffer");
  constexpr int DKF = Traits::DKF;
  constexpr int DVF = Traits::DVF;
  constexpr int KF = Traits::SF;
  static_assert(BQ == 8 * (THREADS / JFM_SIMD_WIDTH), "tile shape");

  // Tiles are declared as 16-byte words so the loader's uint4 accesses are aligned.
  threadgroup uint4 q_words[BQ * Traits::ROW_WORDS_K];
  threadgroup uint4 do_words[BQ * Traits::ROW_WORDS_V];
  threadgroup uint4 kv_words[Traits::STREAM_WORDS];
  threadgroup T* q_tile = (threadgroup T*)q_words;
  threadgroup T* do_tile = (threadgroup T*)do_words;
  threadgroup T* kv_tile = (threadgroup T*)kv_words;

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
  const int valid_rows = int(jfm_min(jfm_max(q_valid - i0, 0), BQ));

  // The block's visible union of keys, from its first and last valid rows (bounds monotone).
  const JfmRange32 first_keys =
      jfm_range32(jfm_keys_of_query(params, i0, q_valid, kv_valid), kv_valid);
  const JfmRange32 last_keys =
      jfm_range32(jfm_keys_of_query(params, i0 + valid_rows - 1, q_valid, kv_valid), kv_valid);
  const int union_lo = first_keys.lo;
  const int union_hi = valid_rows > 0 ? last_keys.hi : -1;

  const JfmFragCoord at = jfm_frag_coord(lane);
  const int band = int(simd_index) * 8;
  const int i = i0 + band + int(at.row);
  const JfmRange32 keys = jfm_range32(jfm_keys_of_query(params, i, q_valid, kv_valid), kv_valid);

  // Rows of Q and dQ are q_stride elements apart, of O and dO o_stride; of K k_stride, of V
  // v_stride.
  const uint q_stride = params.num_heads * uint(DK);
  const uint o_stride = params.num_heads * uint(DV);
  const uint k_stride = params.num_kv_heads * uint(DK);
  const uint v_stride = params.num_kv_heads * uint(DV);
  const ulong q_block = jfm_row_offset(b, i0, h, params.q_len, params.num_heads, DK);
  const ulong o_block = jfm_row_offset(b, i0, h, params.q_len, params.num_heads, DV);
  const ulong stat = jfm_stat_offset(b, h, i0, params.num_heads, params.q_len);
  device const T* k_head = k + jfm_row_offset(b, 0, hk, params.kv_len, params.num_kv_heads, DK);
  device const T* v_head = v + jfm_row_offset(b, 0, hk, params.kv_len, params.num_kv_heads, DV);

  jfm_load_tile<T, BQ, DK, THREADS, false>(q_tile, q + q_block, q_stride, 0, valid_rows,
                                           thread_index);
  jfm_load_tile<T, BQ, DV, THREADS, false>(do_tile, d_o + o_block, o_stride, 0, valid_rows,
                                           thread_index);
  const bool features = jfm_has_score_features(params);
  const bool segments = features && params.has_segment_ids != 0;
  const JfmFeatureBuffers in = JFM_FEATURE_BUFFERS;
  const JfmFeatureRow feature_row =
      jfm_feature_row(params, b, h, i, jfm_alignment_offset(params, q_valid, kv_valid),
                      jfm_alibi_slope(params, in, b, h));
  const bool dropout_on = jfm_has_dropout(params);
  const JfmDropout drop = jfm_dropout_of(params, in.dropout, b, h);
  device const int* kv_ids = kv_segment_ids + ulong(b) * params.kv_len;
  if (segments) {  // the query ids in the Q tile's row padding
    jfm_stage_segment_ids<T, BQ, DK, THREADS>(q_tile,
                                              q_segment_ids + ulong(b) * params.q_len + i0,
                                              uint(BQ), BQ, 0, valid_rows, thread_index);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const JfmRange32 q_ids = jfm_segment_range<T, DK>(q_tile, 0, segments ? valid_rows : 0);
  const int q_segment = segments ? jfm_segment_of<T, DK>(q_tile, band + int(at.row)) : 0;
  threadgroup const T* q_band = q_tile + band * LDK;
  threadgroup const T* do_band = do_tile + band * LDV;

  // D = rowsum(dO * O) as the diagonal of dO O^T, by MMA in the order dP = dO V^T is formed, so
  // a one-hot row (O_i = V_j bit for bit) gets dP - D = 0 exactly; 0 for rows past q_len_b.
  JfmFrag dot = jfm_frag_zero();
  device const T* o_band = o + o_block + uint(band) * o_stride;
  for (int d = 0; d < DVF; ++d) {
    jfm_mma(dot, jfm_frag_load(do_band + d * 8, LDV, at),
            jfm_frag_load_transposed_rows(o_band + d * 8, o_stride, valid_rows - band, at));
  }
  const bool own_diagonal = at.col == (at.row & ~1u);  // this lane holds (row, row)
  const float rowsum = jfm_row_sum(own_diagonal ? dot.thread_elements()[at.row & 1u] : 0.0f);
  const float row_delta = i < q_valid ? rowsum - g_lse[stat + band + at.row] : 0.0f;
  if (at.col == 0 && i < int(params.q_len)) {  // one lane per row
    delta[stat + band + at.row] = row_delta;
  }
  // The row's residuals (an empty row's for rows past q_len_b).
  const float row_m = i < q_valid ? row_max[stat + band + at.row] : JFM_EMPTY_ROW_MAX;
  const float row_log2_l = i < q_valid ? jfm_log2_sum(log_sum[stat + band + at.row]) : 0.0f;

  JfmFrag acc[DKF];  // the band's dQ / scale
  JFM_PRAGMA_UNROLL
  for (int d = 0; d < DKF; ++d) {
    acc[d] = jfm_frag_zero();
  }
  threadgroup T* k_tile = kv_tile;
  threadgroup T* v_tile = kv_tile + (ONE_KV_BUFFER ? 0 : BK * LDK);
  // With bias_grad the loop runs over every key block, so that the blocks it skips get their
  // dbias zeros (XLA does not zero results); this lane's row exists below q_len.
  const bool dbias_row = jfm_bias_grad(params) && i < int(params.q_len);
  device float* dbias_out =
      dbias + jfm_stat_offset(b, h, i, params.num_heads, params.q_len) * ulong(params.kv_len);
  const int loop_begin = jfm_bias_grad(params) ? 0 : union_lo / BK * BK;
  const int loop_end = jfm_bias_grad(params) ? int(params.kv_len) - 1 : union_hi;
  float dslope = 0.0f;  // this lane's share of sum_j dS_ij |i + off - j| (alibi_grad)
  for (int j0 = loop_begin; j0 <= loop_end; j0 += BK) {
    int kind = j0 > union_hi || j0 + BK <= union_lo
                   ? JFM_TILE_SKIP
                   : jfm_classify_tile(first_keys, last_keys, valid_rows == BQ, j0, j0 + BK - 1);
    const int load_begin = max(union_lo - j0, 0);
    const int load_end = min(union_hi - j0 + 1, BK);
    if (kind != JFM_TILE_SKIP) {
      threadgroup_barrier(mem_flags::mem_threadgroup);  // the previous block's reads are done
      JfmRange32 kv_block_ids = q_ids;
      if (segments) {  // the key ids in the K tile's row padding, then their range
        jfm_stage_segment_ids<T, BK, DK, THREADS>(k_tile, kv_ids + j0, uint(BK), BK, load_begin,
                                                  load_end, thread_index);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        kv_block_ids = jfm_segment_range<T, DK>(k_tile, load_begin, load_end);
      }
      kind = features ? jfm_classify_feature_tile(params, kind, q_ids, kv_block_ids) : kind;
    }
    if (kind == JFM_TILE_SKIP) {
      if (dbias_row) {
        jfm_zero_dbias_block<KF>(dbias_out, j0, int(params.kv_len), at);
      }
      continue;  // uniform
    }
    const ulong k_offset = ulong(j0) * k_stride;
    const ulong v_offset = ulong(j0) * v_stride;
    jfm_load_tile<T, BK, DV, THREADS, false, LDV_STREAM>(v_tile, v_head + v_offset, v_stride,
                                                         load_begin, load_end, thread_index);
    if (!ONE_KV_BUFFER) {
      jfm_load_tile<T, BK, DK, THREADS, false>(k_tile, k_head + k_offset, k_stride, load_begin,
                                               load_end, thread_index);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    JfmFrag dp[KF];
    jfm_mma_abt<T, DV, LDV, LDV_STREAM, KF>(dp, do_band, v_tile, at);  // dP = dO V^T
    if (ONE_KV_BUFFER) {  // K replaces V in the one buffer
      threadgroup_barrier(mem_flags::mem_threadgroup);
      jfm_load_tile<T, BK, DK, THREADS, false>(k_tile, k_head + k_offset, k_stride, load_begin,
                                               load_end, thread_index);
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    JfmFrag s[KF];
    jfm_mma_abt<T, DK, LDK, LDK, KF>(s, q_band, k_tile, at);  // S = Q K^T
    if (dropout_on) {  // uniform: dP = (dO V^T) M / (1 - rate), the mask recomputed
      jfm_drop_row<KF>(dp, params, drop, i, j0, at);
    }

    // dS = P (dP - D) into s (dbias), times the cap's derivative; edge blocks select 0 where
    // not visible, so a masked pair adds nothing even when its score or dP is NaN.
    JFM_PRAGMA_UNROLL
    for (int n = 0; n < KF; ++n) {
      JFM_PRAGMA_UNROLL
      for (int e = 0; e < 2; ++e) {
        const int c = n * 8 + int(at.col) + e;
        const float qk = s[n].thread_elements()[e];
        const JfmFeatureRow element = jfm_feature_at(params, feature_row, j0 + c);
        float score;
        const bool visible = jfm_element<T>(
            params, features, in, element, q_segment,
            segments ? jfm_segment_of<T, DK>(k_tile, c) : 0,
            kind == JFM_TILE_FULL || jfm_visible(keys, j0 + c), qk, score);
        const float ds = jfm_probability(score, row_m, row_log2_l) *
                         (dp[n].thread_elements()[e] - row_delta);
        s[n].thread_elements()[e] = visible ? ds : 0.0f;
        if (dbias_row && j0 + c < int(params.kv_len)) {
          dbias_out[j0 + c] = s[n].thread_elements()[e];
        }
        if (jfm_alibi_grad(params)) {
          dslope = fma(s[n].thread_elements()[e], jfm_alibi_distance(element), dslope);
        }
        if (params.soft_cap > 0.0f && visible) {  // a hidden pair's q.k may be NaN
          s[n].thread_elements()[e] *= jfm_soft_cap_slope(params, qk);
        }
      }
    }
    // dQ += dS K. In an edge block a key that another row sees may hold Inf/NaN: it enters as
    // 0 (no 0 * Inf in rows that do not see it), and every row that sees it already has NaN dS.
    if (kind == JFM_TILE_EDGE) {
      jfm_mma_ab<T, DK, LDK, KF, true>(acc, s, k_tile, at);
    } else {
      jfm_mma_ab<T, DK, LDK, KF, false>(acc, s, k_tile, at);
    }
  }

  if (jfm_alibi_grad(params)) {  // uniform: every lane takes part in the row sum
    const float row_dslope = jfm_row_sum(dslope);
    if (at.col == 0 && i < int(params.q_len)) {  // one lane per row
      dalibi[stat + band + at.row] = -row_dslope;
    }
  }
  if (i < int(params.q_len)) {
    device T* dq_row = dq + q_block + uint(band + int(at.row)) * q_stride;
    JFM_PRAGMA_UNROLL
    for (int d = 0; d < DKF; ++d) {
      jfm_frag_store_row(dq_row + d * 8, acc[d], params.scale, at);
    }
  }
}

// ---- dK/dV ----

// Owner: key rows [j0, j0 + BKV) of kv head hk, 8 per simdgroup (the lane's key: its row).
//   stage K_j (and V_j for dK)
//   for each query head h of hk's group, for each query block i of the visible union:
//     stage Q_i, dO_i, m_i, log(l_i), D_i (rows outside the union zero-filled)
//     S^T = K_j Q_i^T * scale;  P^T = exp((S^T - m_i) - log(l_i))  (edge blocks: 0 where not
//     visible)
//     dV_j += (P^T * Z^T) dO_i          (elementwise *; Z = M / (1 - rate) with dropout, else 1)
//     dP^T = (V_j dO_i^T) * Z^T;  dS^T = P^T (dP^T - D_i) (1 - tanh^2);  dK_j += dS^T Q_i
//   dK_j *= scale
// With segment ids, a query block whose id range cannot meet the key block's is skipped.
// FAMILY: JFM_KERNEL_BWD_DKDV (both outputs), JFM_KERNEL_BWD_DK or JFM_KERNEL_BWD_DV. Q, K and
// dK have DK columns, V, dO and dV DV.
template <typename T, int DK, int DV, int FAMILY, int VARIANT>
[[max_total_threads_per_threadgroup(JFM_BWD_THREADS(FAMILY, T, DK, DV, VARIANT))]] kernel void
flash_attention_bwd_dkdv JFM_BWD_DKDV_SIGNATURE(T) {
  typedef JfmBwdTraits<T, DK, DV, FAMILY, VARIANT> Traits;
  constexpr bool WANT_DK = FAMILY != JFM_KERNEL_BWD_DV;
  constexpr bool WANT_DV = FAMILY != JFM_KERNEL_BWD_DK;
  constexpr int THREADS = Traits::THREADS;
  constexpr int BKV = Traits::OWNED;
  constexpr int BQ = Traits::STREAMED;
  // One streamed buffer: the operand needed first (dO for dK, Q for dV), then the other.
  constexpr bool ONE_QDO_BUFFER = Traits::ONE_STREAM_BUFFER;
  static_assert(!ONE_QDO_BUFFER || FAMILY != JFM_KERNEL_BWD_DKDV, "one buffer serves one output");
  constexpr int LDK = Traits::LDK;
  constexpr int LDV = Traits::LDV;
  // dO's stride in the streamed buffer: Q's where they share it, so that dO leaves the query ids
  // in Q's row padding alone.
  constexpr int LDO_STREAM = ONE_QDO_BUFFER ? LDK : LDV;
  static_assert(!ONE_QDO_BUFFER || DV <= DK, "dO fits Q's rows in the shared buffer");
  constexpr int DKF = Traits::DKF;
  constexpr int DVF = Traits::DVF;
  constexpr int QF = Traits::SF;
  static_assert(BKV == 8 * (THREADS / JFM_SIMD_WIDTH), "tile shape");

  // Tiles are declared as 16-byte words so the loader's uint4 accesses are aligned; the dV
  // kernel needs no V tile.
  threadgroup uint4 k_words[BKV * Traits::ROW_WORDS_K];
  threadgroup uint4 v_words[WANT_DK ? BKV * Traits::ROW_WORDS_V : 1];
  threadgroup uint4 qdo_words[Traits::STREAM_WORDS];
  // (m, log(l) log2(e), D, unused) of the block's query rows, read as one vector.
  threadgroup float4 stats_tile[BQ];
  threadgroup T* k_tile = (threadgroup T*)k_words;
  threadgroup T* v_tile = (threadgroup T*)v_words;
  threadgroup T* qdo_tile = (threadgroup T*)qdo_words;

  const JfmTile tile = jfm_tile_of(params, group);
  const int j0 = int(tile.block) * BKV;
  const uint hk = tile.head;
  const uint b = tile.batch;
  if (j0 >= int(params.kv_len)) {
    return;  // the whole threadgroup: before any barrier
  }
  const long q_valid = jfm_valid_len(params.has_q_lengths, q_lengths, b, params.q_len);
  const long kv_valid = jfm_valid_len(params.has_kv_lengths, kv_lengths, b, params.kv_len);
  const int valid_keys = int(jfm_min(jfm_max(kv_valid - j0, 0), BKV));

  // The block's visible union of queries, from its first and last valid keys.
  const JfmRange32 first_queries =
      jfm_range32(jfm_queries_of_key(params, j0, q_valid, kv_valid), q_valid);
  const JfmRange32 last_queries =
      jfm_range32(jfm_queries_of_key(params, j0 + valid_keys - 1, q_valid, kv_valid), q_valid);
  const int union_lo = first_queries.lo;
  const int union_hi = valid_keys > 0 ? last_queries.hi : -1;

  const JfmFragCoord at = jfm_frag_coord(lane);
  const int band = int(simd_index) * 8;
  const int j = j0 + band + int(at.row);
  const JfmRange32 queries =
      jfm_range32(jfm_queries_of_key(params, j, q_valid, kv_valid), q_valid);

  // Rows of Q are q_stride elements apart, of dO o_stride; of K and dK k_stride, of V and dV
  // v_stride.
  const uint q_stride = params.num_heads * uint(DK);
  const uint o_stride = params.num_heads * uint(DV);
  const uint k_stride = params.num_kv_heads * uint(DK);
  const uint v_stride = params.num_kv_heads * uint(DV);
  const ulong k_block = jfm_row_offset(b, j0, hk, params.kv_len, params.num_kv_heads, DK);
  const ulong v_block = jfm_row_offset(b, j0, hk, params.kv_len, params.num_kv_heads, DV);
  const bool features = jfm_has_score_features(params);
  const bool segments = features && params.has_segment_ids != 0;
  const bool dropout_on = jfm_has_dropout(params);
  const JfmFeatureBuffers in = JFM_FEATURE_BUFFERS;
  const long off = jfm_alignment_offset(params, q_valid, kv_valid);
  device const int* q_ids = q_segment_ids + ulong(b) * params.q_len;
  if (union_lo <= union_hi) {  // uniform; the first query block's barrier publishes the tiles
    jfm_load_tile<T, BKV, DK, THREADS, false>(k_tile, k + k_block, k_stride, 0, valid_keys,
                                              thread_index);
    if (WANT_DK) {
      jfm_load_tile<T, BKV, DV, THREADS, false>(v_tile, v + v_block, v_stride, 0, valid_keys,
                                                thread_index);
    }
  }
  JfmRange32 kv_ids = {0, -1};
  int kv_segment = 0;
  if (segments) {  // the key ids in the K tile's row padding, and their range
    jfm_stage_segment_ids<T, BKV, DK, THREADS>(
        k_tile, kv_segment_ids + ulong(b) * params.kv_len + j0, uint(BKV), BKV, 0, valid_keys,
        thread_index);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    kv_ids = jfm_segment_range<T, DK>(k_tile, 0, valid_keys);
    kv_segment = jfm_segment_of<T, DK>(k_tile, band + int(at.row));
  }
  threadgroup const T* k_band = k_tile + band * LDK;
  threadgroup const T* v_band = v_tile + band * LDV;
  threadgroup T* q_tile = qdo_tile;
  threadgroup T* do_tile = qdo_tile + (ONE_QDO_BUFFER ? 0 : BQ * LDK);

  JfmFrag dk_acc[WANT_DK ? DKF : 1];  // the band's dK / scale
  JfmFrag dv_acc[WANT_DV ? DVF : 1];
  JFM_PRAGMA_UNROLL
  for (int d = 0; d < (WANT_DK ? DKF : 0); ++d) {
    dk_acc[d] = jfm_frag_zero();
  }
  JFM_PRAGMA_UNROLL
  for (int d = 0; d < (WANT_DV ? DVF : 0); ++d) {
    dv_acc[d] = jfm_frag_zero();
  }

  const uint group_size = params.num_heads / params.num_kv_heads;
  for (uint g = 0; g < group_size; ++g) {
    const uint h = hk * group_size + g;
    device const T* q_head = q + jfm_row_offset(b, 0, h, params.q_len, params.num_heads, DK);
    device const T* do_head = d_o + jfm_row_offset(b, 0, h, params.q_len, params.num_heads, DV);
    const ulong stat_head = jfm_stat_offset(b, h, 0, params.num_heads, params.q_len);
    const float slope = jfm_alibi_slope(params, in, b, h);
    const JfmDropout drop = jfm_dropout_of(params, in.dropout, b, h);
    for (int i0 = union_lo / BQ * BQ; i0 <= union_hi; i0 += BQ) {
      int kind =
          jfm_classify_tile(first_queries, last_queries, valid_keys == BKV, i0, i0 + BQ - 1);
      if (kind == JFM_TILE_SKIP) {
        continue;  // uniform
      }
      const int load_begin = max(union_lo - i0, 0);
      const int load_end = min(union_hi - i0 + 1, BQ);
      const ulong q_offset = ulong(i0) * q_stride;
      const ulong do_offset = ulong(i0) * o_stride;
      threadgroup_barrier(mem_flags::mem_threadgroup);  // the previous block's reads are done
      if (segments) {  // the query ids in the Q tile's row padding, then their range
        jfm_stage_segment_ids<T, BQ, DK, THREADS>(q_tile, q_ids + i0, uint(BQ), BQ, load_begin,
                                                  load_end, thread_index);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        kind = jfm_classify_feature_tile(params, kind, kv_ids,
                                         jfm_segment_range<T, DK>(q_tile, load_begin, load_end));
        if (kind == JFM_TILE_SKIP) {
          continue;  // uniform
        }
      } else if (features) {
        kind = jfm_classify_feature_tile(params, kind, kv_ids, kv_ids);
      }
      const JfmFeatureRow block_row = jfm_feature_row(params, b, h, i0, off, slope);
      if (!ONE_QDO_BUFFER || WANT_DK) {
        jfm_load_tile<T, BQ, DV, THREADS, false, LDO_STREAM>(do_tile, do_head + do_offset,
                                                             o_stride, load_begin, load_end,
                                                             thread_index);
      }
      if (!ONE_QDO_BUFFER || !WANT_DK) {
        jfm_load_tile<T, BQ, DK, THREADS, false>(q_tile, q_head + q_offset, q_stride, load_begin,
                                                 load_end, thread_index);
      }
      if (int(thread_index) < BQ) {
        const bool loaded = int(thread_index) >= load_begin && int(thread_index) < load_end;
        const ulong row = stat_head + ulong(i0) + thread_index;
        stats_tile[thread_index] =
            loaded ? float4(row_max[row], jfm_log2_sum(log_sum[row]), delta[row], 0.0f)
                   : float4(JFM_EMPTY_ROW_MAX, 0.0f, 0.0f, 0.0f);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);

      JfmFrag dp[WANT_DK ? QF : 1];
      if (WANT_DK) {
        jfm_mma_abt<T, DV, LDV, LDO_STREAM, QF>(dp, v_band, do_tile, at);  // dP^T = V dO^T
        if (ONE_QDO_BUFFER) {  // Q replaces dO in the one buffer
          threadgroup_barrier(mem_flags::mem_threadgroup);
          jfm_load_tile<T, BQ, DK, THREADS, false>(q_tile, q_head + q_offset, q_stride,
                                                   load_begin, load_end, thread_index);
          threadgroup_barrier(mem_flags::mem_threadgroup);
        }
      }
      JfmFrag st[QF];
      jfm_mma_abt<T, DK, LDK, LDK, QF>(st, k_band, q_tile, at);  // S^T = K Q^T

      // P^T into st, dS^T = P^T (dP^T - D) (1 - tanh^2) into dp; edge blocks select 0 where
      // not visible.
      JFM_PRAGMA_UNROLL
      for (int n = 0; n < QF; ++n) {
        JFM_PRAGMA_UNROLL
        for (int e = 0; e < 2; ++e) {
          const int c = n * 8 + int(at.col) + e;
          const float qk = st[n].thread_elements()[e];
          const float4 stats = stats_tile[c];
          float score;
          const bool visible = jfm_element<T>(
              params, features, in, jfm_feature_below(params, block_row, c, j),
              segments ? jfm_segment_of<T, DK>(q_tile, c) : 0, kv_segment,
              kind == JFM_TILE_FULL || jfm_visible(queries, i0 + c), qk, score);
          const float p = jfm_probability(score, stats.x, stats.y);
          // M / (1 - rate) of (i0 + c, j), recomputed (1 without dropout).
          const float z = dropout_on ? jfm_dropout_at(params, drop, i0 + c, j) : 1.0f;
          st[n].thread_elements()[e] = visible ? p * z : 0.0f;
          if (WANT_DK) {
            const float ds = p * (dp[n].thread_elements()[e] * z - stats.z);
            dp[n].thread_elements()[e] = visible ? ds : 0.0f;
            if (params.soft_cap > 0.0f && visible) {  // a hidden pair's q.k may be NaN
              dp[n].thread_elements()[e] *= jfm_soft_cap_slope(params, qk);
            }
          }
        }
      }
      // dK += dS^T Q. In an edge block a query row that another key sees may hold Inf/NaN: it
      // enters as 0, and every key that sees it already has NaN dS^T from its score.
      if (WANT_DK) {
        if (kind == JFM_TILE_EDGE) {
          jfm_mma_ab<T, DK, LDK, QF, true>(dk_acc, dp, q_tile, at);
        } else {
          jfm_mma_ab<T, DK, LDK, QF, false>(dk_acc, dp, q_tile, at);
        }
      }
      if (WANT_DV) {
        if (ONE_QDO_BUFFER) {  // dO replaces Q in the one buffer
          threadgroup_barrier(mem_flags::mem_threadgroup);
          jfm_load_tile<T, BQ, DV, THREADS, false, LDO_STREAM>(
              do_tile, do_head + do_offset, o_stride, load_begin, load_end, thread_index);
          threadgroup_barrier(mem_flags::mem_threadgroup);
        }
        jfm_mma_ab<T, DV, LDO_STREAM, QF, false>(dv_acc, st, do_tile, at);  // dV += P^T dO
      }
    }
  }

  if (j < int(params.kv_len)) {
    const ulong k_row = k_block + uint(band + int(at.row)) * k_stride;
    const ulong v_row = v_block + uint(band + int(at.row)) * v_stride;
    JFM_PRAGMA_UNROLL
    for (int d = 0; d < (WANT_DK ? DKF : 0); ++d) {
      jfm_frag_store_row(dk + k_row + d * 8, dk_acc[d], params.scale, at);
    }
    JFM_PRAGMA_UNROLL
    for (int d = 0; d < (WANT_DV ? DVF : 0); ++d) {
      jfm_frag_store_row(dv + v_row + d * 8, dv_acc[d], 1.0f, at);
    }
  }
}

// ---- the instantiation grid: every family of kernel_families.h under its host names, dQ and
// one dK/dV kernel, or dQ, dK and dV where jfm_bwd_split_dkdv (the list says which) ----

// Each kernel in each tile variant (variant v > 0: stage <stage>_var<v>).
static_assert(JFM_TILE_VARIANTS == 2, "one instantiation per tile variant");
#define JFM_INSTANTIATE_DQ(HOST_NAME, T, DK, DV, VARIANT)                                  \
  template [[host_name(HOST_NAME)]] kernel void flash_attention_bwd_dq<T, DK, DV, VARIANT> \
      JFM_BWD_DQ_SIGNATURE(T);
#define JFM_INSTANTIATE_DKDV(HOST_NAME, T, DK, DV, FAMILY, VARIANT)                \
  template [[host_name(HOST_NAME)]] kernel void                                   \
      flash_attention_bwd_dkdv<T, DK, DV, FAMILY, VARIANT> JFM_BWD_DKDV_SIGNATURE(T);

#define JFM_INSTANTIATE_BWD(T, SUFFIX, DK, DV, NAME)                                          \
  JFM_IF_FAMILY(                                                                            \
      T, NAME,                                                                              \
      static_assert(!jfm_bwd_split_dkdv(jfm_tile_head_dim(DK, DV)), "a joint dK/dV family"); \
      JFM_INSTANTIATE_DQ(JFM_HOST_NAME(flash_attention_bwd_dq, SUFFIX, NAME), T, DK, DV, 0)  \
      JFM_INSTANTIATE_DQ(JFM_HOST_NAME(flash_attention_bwd_dq_var1, SUFFIX, NAME), T, DK, DV, \
                         1)                                                                 \
      JFM_INSTANTIATE_DKDV(JFM_HOST_NAME(flash_attention_bwd_dkdv, SUFFIX, NAME), T, DK, DV,  \
                           JFM_KERNEL_BWD_DKDV, 0)                                          \
      JFM_INSTANTIATE_DKDV(JFM_HOST_NAME(flash_attention_bwd_dkdv_var1, SUFFIX, NAME), T, DK, \
                           DV, JFM_KERNEL_BWD_DKDV, 1))
#define JFM_INSTANTIATE_BWD_SPLIT(T, SUFFIX, DK, DV, NAME)                                   \
  JFM_IF_FAMILY(                                                                           \
      T, NAME,                                                                             \
      static_assert(jfm_bwd_split_dkdv(jfm_tile_head_dim(DK, DV)), "a split dK/dV family"); \
      JFM_INSTANTIATE_DQ(JFM_HOST_NAME(flash_attention_bwd_dq, SUFFIX, NAME), T, DK, DV, 0) \
      JFM_INSTANTIATE_DQ(JFM_HOST_NAME(flash_attention_bwd_dq_var1, SUFFIX, NAME), T, DK,    \
                         DV, 1)                                                            \
      JFM_INSTANTIATE_DKDV(JFM_HOST_NAME(flash_attention_bwd_dk, SUFFIX, NAME), T, DK, DV,   \
                           JFM_KERNEL_BWD_DK, 0)                                           \
      JFM_INSTANTIATE_DKDV(JFM_HOST_NAME(flash_attention_bwd_dk_var1, SUFFIX, NAME), T, DK,  \
                           DV, JFM_KERNEL_BWD_DK, 1)                                       \
      JFM_INSTANTIATE_DKDV(JFM_HOST_NAME(flash_attention_bwd_dv, SUFFIX, NAME), T, DK, DV,   \
                           JFM_KERNEL_BWD_DV, 0)                                           \
      JFM_INSTANTIATE_DKDV(JFM_HOST_NAME(flash_attention_bwd_dv_var1, SUFFIX, NAME), T, DK,  \
                           DV, JFM_KERNEL_BWD_DV, 1))

#define JFM_INSTANTIATE_BWD_OF_TYPE(T, SUFFIX, UNUSED)     \
  JFM_JOINT_BWD_HEAD_DIMS(T, SUFFIX, JFM_INSTANTIATE_BWD) \
  JFM_SPLIT_BWD_HEAD_DIMS(T, SUFFIX, JFM_INSTANTIATE_BWD_SPLIT)

JFM_ELEMENT_TYPES(JFM_INSTANTIATE_BWD_OF_TYPE, ~)
