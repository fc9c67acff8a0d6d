// Backward attention, FlashAttention-2 Algorithm 2 (recompute) on simdgroup_matrix tiles.
//
// Two kernel families, each output tile written by exactly one threadgroup (no atomics):
//   dQ:   one threadgroup per query block; its prologue also writes D = rowsum(dO * O) - g_lse
//         (dO is staged there anyway), which the dK/dV kernels read.
//   dK/dV: one threadgroup per key block, looping over its kv head's query-head group and the
//         visible query blocks; for head_dim >= 160 split into a dK and a dV kernel.
// Scores: S2 = (Q K^T) * scale * log2(e), the MMA summed over head-dim chunks in ascending
// order, exactly as the forward forms them, so P = exp2(S2 - L2) is bit-identical to the
// forward's probabilities (a one-hot row gives P = 1 exactly). Loops, tiles and memory:
// shaders/README.md; tile shapes: bwd_tile_shapes.h.
#include "bwd_tile_shapes.h"
#include "flash_attention_common.h"

// ---- 8x8 fragments and tiles ----

// This lane's place in every 8x8 simdgroup_matrix: row `row`, columns `col` and `col + 1`.
struct JfmFragCoord {
  uint row;
  uint col;
};

inline JfmFragCoord jfm_frag_coord(uint lane) {
  const uint q = lane / 4;
  JfmFragCoord c;
  c.row = (q & 4u) + (lane / 2) % 4;
  c.col = (q & 2u) * 2 + (lane % 2) * 2;
  return c;
}

// x, or 0 when x is Inf or NaN (a bit test, valid under fast math).
inline float jfm_finite_or_zero(float x) {
  return (as_type<uint>(x) & 0x7f800000u) != 0x7f800000u ? x : 0.0f;
}

// Fragment (r, c) = tile[(row0 + r) * S + col0 + c], as float; non-finite entries become 0 when
// `sanitize` (see the edge-block products below).
template <typename T, uint S>
inline void jfm_frag_load(thread simdgroup_float8x8& m, threadgroup const T* tile, uint row0,
                          uint col0, JfmFragCoord fc, bool sanitize) {
  threadgroup const T* p = tile + (row0 + fc.row) * S + col0 + fc.col;
  float x0 = jfm_to_float(p[0]);
  float x1 = jfm_to_float(p[1]);
  if (sanitize) {
    x0 = jfm_finite_or_zero(x0);
    x1 = jfm_finite_or_zero(x1);
  }
  m.thread_elements()[0] = x0;
  m.thread_elements()[1] = x1;
}

// Transposed: fragment (r, c) = tile[(col0 + c) * S + row0 + r].
template <typename T, uint S>
inline void jfm_frag_load_t(thread simdgroup_float8x8& m, threadgroup const T* tile, uint row0,
                            uint col0, JfmFragCoord fc) {
  threadgroup const T* p = tile + (col0 + fc.col) * S + row0 + fc.row;
  m.thread_elements()[0] = jfm_to_float(p[0]);
  m.thread_elements()[1] = jfm_to_float(p[S]);
}

// Copies ROWS rows of one head (device rows `row_stride` elements apart, starting at `rows`)
// into a threadgroup tile with rows of S elements, in 16-byte pieces shared by all THREADS
// threads. Rows outside [valid_lo, valid_hi] are zero-filled and never read.
template <typename T, uint D, uint S, uint ROWS, uint THREADS>
inline void jfm_bwd_load_tile(threadgroup T* tile, device const T* rows, uint row_stride,
                              int valid_lo, int valid_hi, uint tid) {
  constexpr uint pieces = D * sizeof(T) / 16;
  constexpr uint tile_pieces = S * sizeof(T) / 16;
  threadgroup uint4* dst = reinterpret_cast<threadgroup uint4*>(tile);
  for (uint n = tid; n < ROWS * pieces; n += THREADS) {
    const uint r = n / pieces;
    const uint c = n % pieces;
    uint4 x = uint4(0u);
    if (int(r) >= valid_lo && int(r) <= valid_hi) {
      x = reinterpret_cast<device const uint4*>(rows + r * row_stride)[c];
    }
    dst[r * tile_pieces + c] = x;
  }
}

inline simdgroup_float8x8 jfm_zero_fragment() {
  return make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
}

// ---- signatures ----

#define JFM_BWD_INPUTS(T)                                                 \
  device const T* q [[buffer(JFM_BUFFER_Q)]],                             \
      device const T* k [[buffer(JFM_BUFFER_K)]],                         \
      device const T* v [[buffer(JFM_BUFFER_V)]],                         \
      device const T* d_o [[buffer(JFM_BUFFER_DO)]],                      \
      device const float* l2 [[buffer(JFM_BUFFER_L2)]],                 \
      device const int* q_lengths [[buffer(JFM_BUFFER_Q_LENGTHS)]],       \
      device const int* kv_lengths [[buffer(JFM_BUFFER_KV_LENGTHS)]],     \
      constant AttentionParams& params [[buffer(JFM_BUFFER_PARAMS)]],     \
      uint3 group [[threadgroup_position_in_grid]],                       \
      uint simd_index [[simdgroup_index_in_threadgroup]],                 \
      uint lane [[thread_index_in_simdgroup]]

#define JFM_BWD_DQ_SIGNATURE(T)                                           \
  (JFM_BWD_INPUTS(T), device const T* o [[buffer(JFM_BUFFER_O)]],        \
   device const float* g_lse [[buffer(JFM_BUFFER_G_LSE)]],                \
   device float* delta [[buffer(JFM_BUFFER_DELTA)]],                      \
   device T* dq [[buffer(JFM_BUFFER_DQ)]])

#define JFM_BWD_DKDV_SIGNATURE(T)                                         \
  (JFM_BWD_INPUTS(T), device const float* delta [[buffer(JFM_BUFFER_DELTA)]], \
   device T* dk [[buffer(JFM_BUFFER_DK)]], device T* dv [[buffer(JFM_BUFFER_DV)]])

// ---- dQ ----

// Owner: query rows [i0, i0 + BQ) of head h; simdgroup s holds rows i0 + 8s .. i0 + 8s + 7.
//   stage Q_i, dO_i; D_i = rowsum(dO_i * O_i) - g_lse_i (written for the dK/dV kernels)
//   for each key block j of the block's visible hull:
//     stage K_j, V_j (rows outside the hull zero-filled)
//     dP = dO_i V_j^T;  S2 = Q_i K_j^T * scale log2(e);  P = exp2(S2 - L2_i)
//     dS = P * (dP - D_i)   (edge blocks: 0 where not visible)
//     dQ_i += dS K_j
//   dQ_i *= scale
template <typename T, int D>
[[kernel, max_total_threads_per_threadgroup(JFM_BWD_MAX_THREADS)]] void flash_attention_bwd_dq
    JFM_BWD_DQ_SIGNATURE(T) {
  constexpr uint SG = jfm_bwd_simdgroups(D * sizeof(T));
  constexpr uint THREADS = SG * JFM_SIMD_WIDTH;
  constexpr uint BQ = 8 * SG;
  constexpr uint BK = jfm_bwd_block(D * sizeof(T));
  constexpr bool SHARED = jfm_bwd_shared_stream(D * sizeof(T));
  constexpr uint S = D + JFM_BWD_PAD_BYTES / sizeof(T);  // tile row stride, elements
  constexpr uint S4 = S * sizeof(T) / 16;                // tile row stride, uint4
  threadgroup uint4 q_raw[BQ * S4];
  threadgroup uint4 do_raw[BQ * S4];
  threadgroup uint4 k_raw[BK * S4];
  threadgroup uint4 v_raw[SHARED ? 1 : BK * S4];
  threadgroup T* q_s = reinterpret_cast<threadgroup T*>(q_raw);
  threadgroup T* do_s = reinterpret_cast<threadgroup T*>(do_raw);
  threadgroup T* k_s = reinterpret_cast<threadgroup T*>(k_raw);
  threadgroup T* v_s = SHARED ? k_s : reinterpret_cast<threadgroup T*>(v_raw);

  const JfmTile tile = jfm_tile_of(params, group);
  const uint h = tile.head;
  const uint b = tile.batch;
  const int i0 = int(tile.block * BQ);
  if (i0 >= int(params.q_len)) {
    return;  // whole threadgroup
  }
  const uint hk = h / (params.num_heads / params.num_kv_heads);
  const int q_valid = int(jfm_valid_len(params.has_q_lengths, q_lengths, b, params.q_len));
  const int kv_valid = int(jfm_valid_len(params.has_kv_lengths, kv_lengths, b, params.kv_len));
  const uint tid = simd_index * JFM_SIMD_WIDTH + lane;
  const JfmFragCoord fc = jfm_frag_coord(lane);
  const uint row0 = simd_index * 8;  // this simdgroup's first row in the block
  const int i_me = i0 + int(row0 + fc.row);

  // Every row's key interval lies between those of the block's first and last valid rows
  // (both bounds are non-decreasing in the row), so they give the hull of the visible keys and
  // classify each key block as full (every pair visible) or edge.
  const int rows_hi = min(i0 + int(BQ), q_valid) - 1;
  const JfmRange first = jfm_keys_of_query(params, i0, q_valid, kv_valid);
  const JfmRange last = jfm_keys_of_query(params, rows_hi, q_valid, kv_valid);
  const int hull_lo = int(first.lo);
  const int hull_hi = rows_hi >= i0 ? int(last.hi) : -1;
  const bool rows_all_valid = i0 + int(BQ) <= q_valid;
  const JfmRange my_keys = jfm_keys_of_query(params, i_me, q_valid, kv_valid);

  const uint q_stride = params.num_heads * D;
  const ulong q_block = jfm_row_offset(b, i0, h, params.q_len, params.num_heads, D);
  const ulong stat = jfm_stat_offset(b, h, i0, params.num_heads, params.q_len);
  const int rows_valid = min(int(BQ), q_valid - i0) - 1;
  jfm_bwd_load_tile<T, D, S, BQ, THREADS>(q_s, q + q_block, q_stride, 0, rows_valid, tid);
  jfm_bwd_load_tile<T, D, S, BQ, THREADS>(do_s, d_o + q_block, q_stride, 0, rows_valid, tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // D for this simdgroup's 8 rows (0 past q_len_b); each lane keeps its own row's value.
  float my_delta = 0.0f;
  for (uint r = 0; r < 8; ++r) {
    const uint row = row0 + r;
    const bool valid = i0 + int(row) < q_valid;
    float part = 0.0f;
    if (valid) {
      device const T* o_row = o + q_block + row * q_stride;
      for (uint d = lane; d < uint(D); d += JFM_SIMD_WIDTH) {
        part = fma(jfm_to_float(do_s[row * S + d]), jfm_to_float(o_row[d]), part);
      }
    }
    const float total = simd_sum(part);
    const float row_delta = valid ? total - g_lse[stat + row] : 0.0f;
    if (lane == 0 && i0 + int(row) < int(params.q_len)) {
      delta[stat + row] = row_delta;
    }
    if (r == fc.row) {
      my_delta = row_delta;
    }
  }
  const float my_l2 = i_me < q_valid ? l2[stat + row0 + fc.row] : 0.0f;

  simdgroup_float8x8 dq_acc[D / 8];
  for (uint dd = 0; dd < uint(D) / 8; ++dd) {
    dq_acc[dd] = jfm_zero_fragment();
  }

  const uint kv_stride = params.num_kv_heads * D;
  const ulong kv_head = jfm_row_offset(b, 0, hk, params.kv_len, params.num_kv_heads, D);
  for (int j0 = hull_lo - hull_lo % int(BK); j0 <= hull_hi; j0 += int(BK)) {
    const bool full = rows_all_valid && int(last.lo) <= j0 && int(first.hi) >= j0 + int(BK) - 1;
    const int lo = max(hull_lo - j0, 0);
    const int hi = min(hull_hi - j0, int(BK) - 1);
    const ulong kv_block = kv_head + ulong(j0) * kv_stride;
    jfm_bwd_load_tile<T, D, S, BK, THREADS>(v_s, v + kv_block, kv_stride, lo, hi, tid);
    if (!SHARED) {
      jfm_bwd_load_tile<T, D, S, BK, THREADS>(k_s, k + kv_block, kv_stride, lo, hi, tid);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // dP = dO V^T
    simdgroup_float8x8 dp[BK / 8];
    for (uint f = 0; f < BK / 8; ++f) {
      dp[f] = jfm_zero_fragment();
    }
    for (uint d0 = 0; d0 < uint(D); d0 += 8) {
      simdgroup_float8x8 a;
      jfm_frag_load<T, S>(a, do_s, row0, d0, fc, false);
      for (uint f = 0; f < BK / 8; ++f) {
        simdgroup_float8x8 bt;
        jfm_frag_load_t<T, S>(bt, v_s, d0, 8 * f, fc);
        simdgroup_multiply_accumulate(dp[f], a, bt, dp[f]);
      }
    }
    if (SHARED) {
      threadgroup_barrier(mem_flags::mem_threadgroup);
      jfm_bwd_load_tile<T, D, S, BK, THREADS>(k_s, k + kv_block, kv_stride, lo, hi, tid);
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }

    // S = Q K^T
    simdgroup_float8x8 s[BK / 8];
    for (uint f = 0; f < BK / 8; ++f) {
      s[f] = jfm_zero_fragment();
    }
    for (uint d0 = 0; d0 < uint(D); d0 += 8) {
      simdgroup_float8x8 a;
      jfm_frag_load<T, S>(a, q_s, row0, d0, fc, false);
      for (uint f = 0; f < BK / 8; ++f) {
        simdgroup_float8x8 bt;
        jfm_frag_load_t<T, S>(bt, k_s, d0, 8 * f, fc);
        simdgroup_multiply_accumulate(s[f], a, bt, s[f]);
      }
    }

    // dS = P (dP - D), into s. Edge blocks select 0 where not visible, so a masked pair adds
    // nothing even when its score or dP is NaN.
    for (uint f = 0; f < BK / 8; ++f) {
      for (uint e = 0; e < 2; ++e) {
        const float s2 = jfm_finite_or_nan(s[f].thread_elements()[e] * params.scale_log2);
        const float p = jfm_probability(s2, my_l2);
        float ds = p * (dp[f].thread_elements()[e] - my_delta);
        if (!full) {
          const int j = j0 + int(8 * f + fc.col + e);
          ds = (j >= my_keys.lo && j <= my_keys.hi) ? ds : 0.0f;
        }
        s[f].thread_elements()[e] = ds;
      }
    }

    // dQ += dS K. In an edge block, a key another row of the block sees may hold Inf/NaN; it
    // enters as 0, so it cannot poison rows that do not see it (0 * Inf), while every row that
    // sees it already has NaN dS from its score.
    for (uint dd = 0; dd < uint(D) / 8; ++dd) {
      for (uint f = 0; f < BK / 8; ++f) {
        simdgroup_float8x8 kf;
        jfm_frag_load<T, S>(kf, k_s, 8 * f, 8 * dd, fc, !full);
        simdgroup_multiply_accumulate(dq_acc[dd], s[f], kf, dq_acc[dd]);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  if (i_me < int(params.q_len)) {
    device T* dst = dq + q_block + (row0 + fc.row) * q_stride + fc.col;
    for (uint dd = 0; dd < uint(D) / 8; ++dd) {
      jfm_store(dst + 8 * dd, dq_acc[dd].thread_elements()[0] * params.scale);
      jfm_store(dst + 8 * dd + 1, dq_acc[dd].thread_elements()[1] * params.scale);
    }
  }
}

// ---- dK/dV ----

// Owner: key rows [j0, j0 + BKV) of kv head hk; simdgroup s holds keys j0 + 8s .. j0 + 8s + 7.
//   stage K_j (and V_j for dK)
//   for each query head h of hk's group, for each query block i of the visible hull:
//     stage Q_i, dO_i, L2_i, D_i (rows outside the hull zero-filled)
//     S2^T = K_j Q_i^T * scale log2(e);  P^T = exp2(S2^T - L2_i)  (edge: 0 where not visible)
//     dV_j += P^T dO_i
//     dP^T = V_j dO_i^T;  dS^T = P^T (dP^T - D_i);  dK_j += dS^T Q_i
//   dK_j *= scale
// WANT_DK / WANT_DV select the outputs (both, or one for the split kernels).
template <typename T, int D, bool WANT_DK, bool WANT_DV>
[[kernel, max_total_threads_per_threadgroup(JFM_BWD_MAX_THREADS)]] void flash_attention_bwd_dkdv
    JFM_BWD_DKDV_SIGNATURE(T) {
  constexpr uint SG = jfm_bwd_simdgroups(D * sizeof(T));
  constexpr uint THREADS = SG * JFM_SIMD_WIDTH;
  constexpr uint BKV = 8 * SG;
  constexpr uint BQ = jfm_bwd_block(D * sizeof(T));
  constexpr bool SHARED = jfm_bwd_shared_stream(D * sizeof(T));
  static_assert(!SHARED || WANT_DK != WANT_DV, "a shared streamed tile serves one output");
  constexpr uint S = D + JFM_BWD_PAD_BYTES / sizeof(T);
  constexpr uint S4 = S * sizeof(T) / 16;
  threadgroup uint4 k_raw[BKV * S4];
  threadgroup uint4 v_raw[WANT_DK ? BKV * S4 : 1];
  threadgroup uint4 q_raw[BQ * S4];
  threadgroup uint4 do_raw[SHARED ? 1 : BQ * S4];
  threadgroup float l2_s[BQ];
  threadgroup float delta_s[BQ];
  threadgroup T* k_s = reinterpret_cast<threadgroup T*>(k_raw);
  threadgroup T* v_s = reinterpret_cast<threadgroup T*>(v_raw);
  threadgroup T* q_s = reinterpret_cast<threadgroup T*>(q_raw);
  threadgroup T* do_s = SHARED ? q_s : reinterpret_cast<threadgroup T*>(do_raw);

  const JfmTile tile = jfm_tile_of(params, group);
  const uint hk = tile.head;
  const uint b = tile.batch;
  const int j0 = int(tile.block * BKV);
  if (j0 >= int(params.kv_len)) {
    return;  // whole threadgroup
  }
  const int q_valid = int(jfm_valid_len(params.has_q_lengths, q_lengths, b, params.q_len));
  const int kv_valid = int(jfm_valid_len(params.has_kv_lengths, kv_lengths, b, params.kv_len));
  const uint tid = simd_index * JFM_SIMD_WIDTH + lane;
  const JfmFragCoord fc = jfm_frag_coord(lane);
  const uint row0 = simd_index * 8;
  const int j_me = j0 + int(row0 + fc.row);

  // Query intervals are non-decreasing in the key: hull and full/edge from the first and last.
  const int keys_hi = min(j0 + int(BKV), kv_valid) - 1;
  const JfmRange first = jfm_queries_of_key(params, j0, q_valid, kv_valid);
  const JfmRange last = jfm_queries_of_key(params, keys_hi, q_valid, kv_valid);
  const int hull_lo = int(first.lo);
  const int hull_hi = keys_hi >= j0 ? int(last.hi) : -1;
  const bool keys_all_valid = j0 + int(BKV) <= kv_valid;
  const JfmRange my_queries = jfm_queries_of_key(params, j_me, q_valid, kv_valid);

  const uint kv_stride = params.num_kv_heads * D;
  const ulong kv_block = jfm_row_offset(b, j0, hk, params.kv_len, params.num_kv_heads, D);
  if (hull_lo <= hull_hi) {  // threadgroup-uniform; the first query block's barrier follows
    const int keys_valid = min(int(BKV), kv_valid - j0) - 1;
    jfm_bwd_load_tile<T, D, S, BKV, THREADS>(k_s, k + kv_block, kv_stride, 0, keys_valid, tid);
    if (WANT_DK) {
      jfm_bwd_load_tile<T, D, S, BKV, THREADS>(v_s, v + kv_block, kv_stride, 0, keys_valid, tid);
    }
  }

  simdgroup_float8x8 dk_acc[WANT_DK ? D / 8 : 1];
  simdgroup_float8x8 dv_acc[WANT_DV ? D / 8 : 1];
  for (uint dd = 0; dd < (WANT_DK ? uint(D) / 8 : 0u); ++dd) {
    dk_acc[dd] = jfm_zero_fragment();
  }
  for (uint dd = 0; dd < (WANT_DV ? uint(D) / 8 : 0u); ++dd) {
    dv_acc[dd] = jfm_zero_fragment();
  }

  const uint group_size = params.num_heads / params.num_kv_heads;
  const uint q_stride = params.num_heads * D;
  for (uint g = 0; g < group_size; ++g) {
    const uint h = hk * group_size + g;
    const ulong q_head = jfm_row_offset(b, 0, h, params.q_len, params.num_heads, D);
    const ulong stat_head = jfm_stat_offset(b, h, 0, params.num_heads, params.q_len);
    for (int i0 = hull_lo - hull_lo % int(BQ); i0 <= hull_hi; i0 += int(BQ)) {
      const bool full =
          keys_all_valid && int(last.lo) <= i0 && int(first.hi) >= i0 + int(BQ) - 1;
      const int lo = max(hull_lo - i0, 0);
      const int hi = min(hull_hi - i0, int(BQ) - 1);
      const ulong q_block = q_head + ulong(i0) * q_stride;
      // Shared tile: the operand needed first (dO for dK, Q for dV); otherwise both.
      if (!SHARED || WANT_DK) {
        jfm_bwd_load_tile<T, D, S, BQ, THREADS>(do_s, d_o + q_block, q_stride, lo, hi, tid);
      }
      if (!SHARED || !WANT_DK) {
        jfm_bwd_load_tile<T, D, S, BQ, THREADS>(q_s, q + q_block, q_stride, lo, hi, tid);
      }
      if (tid < BQ) {
        const bool in = int(tid) >= lo && int(tid) <= hi;
        l2_s[tid] = in ? l2[stat_head + ulong(i0) + tid] : 0.0f;
        delta_s[tid] = in ? delta[stat_head + ulong(i0) + tid] : 0.0f;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);

      // dP^T = V dO^T
      simdgroup_float8x8 dp[WANT_DK ? BQ / 8 : 1];
      if (WANT_DK) {
        for (uint f = 0; f < BQ / 8; ++f) {
          dp[f] = jfm_zero_fragment();
        }
        for (uint d0 = 0; d0 < uint(D); d0 += 8) {
          simdgroup_float8x8 a;
          jfm_frag_load<T, S>(a, v_s, row0, d0, fc, false);
          for (uint f = 0; f < BQ / 8; ++f) {
            simdgroup_float8x8 bt;
            jfm_frag_load_t<T, S>(bt, do_s, d0, 8 * f, fc);
            simdgroup_multiply_accumulate(dp[f], a, bt, dp[f]);
          }
        }
        if (SHARED) {
          threadgroup_barrier(mem_flags::mem_threadgroup);
          jfm_bwd_load_tile<T, D, S, BQ, THREADS>(q_s, q + q_block, q_stride, lo, hi, tid);
          threadgroup_barrier(mem_flags::mem_threadgroup);
        }
      }

      // S^T = K Q^T (the same products and order as the forward's Q K^T)
      simdgroup_float8x8 st[BQ / 8];
      for (uint f = 0; f < BQ / 8; ++f) {
        st[f] = jfm_zero_fragment();
      }
      for (uint d0 = 0; d0 < uint(D); d0 += 8) {
        simdgroup_float8x8 a;
        jfm_frag_load<T, S>(a, k_s, row0, d0, fc, false);
        for (uint f = 0; f < BQ / 8; ++f) {
          simdgroup_float8x8 bt;
          jfm_frag_load_t<T, S>(bt, q_s, d0, 8 * f, fc);
          simdgroup_multiply_accumulate(st[f], a, bt, st[f]);
        }
      }

      // P^T into st and dS^T = P^T (dP^T - D) into dp; edge blocks select 0 where not visible.
      for (uint f = 0; f < BQ / 8; ++f) {
        for (uint e = 0; e < 2; ++e) {
          const uint c = 8 * f + fc.col + e;
          const float s2 = jfm_finite_or_nan(st[f].thread_elements()[e] * params.scale_log2);
          float p = jfm_probability(s2, l2_s[c]);
          float ds = WANT_DK ? p * (dp[f].thread_elements()[e] - delta_s[c]) : 0.0f;
          if (!full) {
            const int i = i0 + int(c);
            const bool visible = i >= my_queries.lo && i <= my_queries.hi;
            p = visible ? p : 0.0f;
            ds = visible ? ds : 0.0f;
          }
          st[f].thread_elements()[e] = p;
          if (WANT_DK) {
            dp[f].thread_elements()[e] = ds;
          }
        }
      }

      // dK += dS^T Q. In an edge block a query row some other key sees may hold Inf/NaN; it
      // enters as 0 (every key that sees it already has NaN dS^T from its score).
      if (WANT_DK) {
        for (uint dd = 0; dd < uint(D) / 8; ++dd) {
          for (uint f = 0; f < BQ / 8; ++f) {
            simdgroup_float8x8 qf;
            jfm_frag_load<T, S>(qf, q_s, 8 * f, 8 * dd, fc, !full);
            simdgroup_multiply_accumulate(dk_acc[dd], dp[f], qf, dk_acc[dd]);
          }
        }
      }

      // dV += P^T dO
      if (WANT_DV) {
        if (SHARED) {
          threadgroup_barrier(mem_flags::mem_threadgroup);
          jfm_bwd_load_tile<T, D, S, BQ, THREADS>(do_s, d_o + q_block, q_stride, lo, hi, tid);
          threadgroup_barrier(mem_flags::mem_threadgroup);
        }
        for (uint dd = 0; dd < uint(D) / 8; ++dd) {
          for (uint f = 0; f < BQ / 8; ++f) {
            simdgroup_float8x8 of;
            jfm_frag_load<T, S>(of, do_s, 8 * f, 8 * dd, fc, false);
            simdgroup_multiply_accumulate(dv_acc[dd], st[f], of, dv_acc[dd]);
          }
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
  }

  if (j_me < int(params.kv_len)) {
    const ulong row = kv_block + (row0 + fc.row) * kv_stride + fc.col;
    for (uint dd = 0; dd < (WANT_DK ? uint(D) / 8 : 0u); ++dd) {
      jfm_store(dk + row + 8 * dd, dk_acc[dd].thread_elements()[0] * params.scale);
      jfm_store(dk + row + 8 * dd + 1, dk_acc[dd].thread_elements()[1] * params.scale);
    }
    for (uint dd = 0; dd < (WANT_DV ? uint(D) / 8 : 0u); ++dd) {
      jfm_store(dv + row + 8 * dd, dv_acc[dd].thread_elements()[0]);
      jfm_store(dv + row + 8 * dd + 1, dv_acc[dd].thread_elements()[1]);
    }
  }
}

// ---- instantiations under the host names: one line per (dtype, head dim) ----

#define JFM_INSTANTIATE_DQ(NAME, T, D)                                                       \
  template [[host_name(NAME)]] [[kernel]] void flash_attention_bwd_dq<T, D>                  \
      JFM_BWD_DQ_SIGNATURE(T);
#define JFM_INSTANTIATE_DKDV(NAME, T, D, WANT_DK, WANT_DV)                                   \
  template [[host_name(NAME)]] [[kernel]] void flash_attention_bwd_dkdv<T, D, WANT_DK, WANT_DV> \
      JFM_BWD_DKDV_SIGNATURE(T);

// head_dim < 160: dQ and one dK/dV kernel; head_dim >= 160: dQ, dK and dV kernels.
#define JFM_INSTANTIATE_BWD(TN, T, D)                                                        \
  JFM_INSTANTIATE_DQ("flash_attention_bwd_dq_" TN "_d" #D, T, D)                             \
  JFM_INSTANTIATE_DKDV("flash_attention_bwd_dkdv_" TN "_d" #D, T, D, true, true)
#define JFM_INSTANTIATE_BWD_SPLIT(TN, T, D)                                                  \
  JFM_INSTANTIATE_DQ("flash_attention_bwd_dq_" TN "_d" #D, T, D)                             \
  JFM_INSTANTIATE_DKDV("flash_attention_bwd_dk_" TN "_d" #D, T, D, true, false)              \
  JFM_INSTANTIATE_DKDV("flash_attention_bwd_dv_" TN "_d" #D, T, D, false, true)

JFM_INSTANTIATE_BWD("f32", float, 8)
JFM_INSTANTIATE_BWD("f32", float, 16)
JFM_INSTANTIATE_BWD("f32", float, 32)
JFM_INSTANTIATE_BWD("f32", float, 48)
JFM_INSTANTIATE_BWD("f32", float, 64)
JFM_INSTANTIATE_BWD("f32", float, 72)
JFM_INSTANTIATE_BWD("f32", float, 80)
JFM_INSTANTIATE_BWD("f32", float, 96)
JFM_INSTANTIATE_BWD("f32", float, 112)
JFM_INSTANTIATE_BWD("f32", float, 128)
JFM_INSTANTIATE_BWD_SPLIT("f32", float, 160)
JFM_INSTANTIATE_BWD_SPLIT("f32", float, 192)
JFM_INSTANTIATE_BWD_SPLIT("f32", float, 256)
JFM_INSTANTIATE_BWD("f16", half, 8)
JFM_INSTANTIATE_BWD("f16", half, 16)
JFM_INSTANTIATE_BWD("f16", half, 32)
JFM_INSTANTIATE_BWD("f16", half, 48)
JFM_INSTANTIATE_BWD("f16", half, 64)
JFM_INSTANTIATE_BWD("f16", half, 72)
JFM_INSTANTIATE_BWD("f16", half, 80)
JFM_INSTANTIATE_BWD("f16", half, 96)
JFM_INSTANTIATE_BWD("f16", half, 112)
JFM_INSTANTIATE_BWD("f16", half, 128)
JFM_INSTANTIATE_BWD_SPLIT("f16", half, 160)
JFM_INSTANTIATE_BWD_SPLIT("f16", half, 192)
JFM_INSTANTIATE_BWD_SPLIT("f16", half, 256)
JFM_INSTANTIATE_BWD("bf16", ushort, 8)
JFM_INSTANTIATE_BWD("bf16", ushort, 16)
JFM_INSTANTIATE_BWD("bf16", ushort, 32)
JFM_INSTANTIATE_BWD("bf16", ushort, 48)
JFM_INSTANTIATE_BWD("bf16", ushort, 64)
JFM_INSTANTIATE_BWD("bf16", ushort, 72)
JFM_INSTANTIATE_BWD("bf16", ushort, 80)
JFM_INSTANTIATE_BWD("bf16", ushort, 96)
JFM_INSTANTIATE_BWD("bf16", ushort, 112)
JFM_INSTANTIATE_BWD("bf16", ushort, 128)
JFM_INSTANTIATE_BWD_SPLIT("bf16", ushort, 160)
JFM_INSTANTIATE_BWD_SPLIT("bf16", ushort, 192)
JFM_INSTANTIATE_BWD_SPLIT("bf16", ushort, 256)
