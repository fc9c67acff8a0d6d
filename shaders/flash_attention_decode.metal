// Split-KV decode (docs/kernels.md#decode-split-kv): the forward for short queries against a long
// KV cache. Pass 1 (decode_partial), grid (splits, num_kv_heads, batch): the R = G * q_len query
// rows that share one KV head (G = num_heads / num_kv_heads; row r = g * q_len + i is query
// position i of head hk * G + g) form one tile of 8-row fragments, and one split's contiguous chunk
// of their visible keys runs through the forward's key-block loop, so each K/V element is read once
// per KV head. It writes the chunk's normalised partial O and its max m and sum l per row to the
// float32 workspace. Pass 2 (decode_combine), grid (R, num_kv_heads, batch): combines the splits
// in split order into O, LSE and the residuals m, log(l) with the forward's conventions. Tile
// shapes: tile_shapes.h (decode rows); memory and the split rule: shaders/README.md.
#include "flash_attention_key_blocks.h"

// Workspace row (b, hk, split, r): DV partial-O floats (the value head dim), then m and l.
template <int DV>
inline ulong jfm_decode_workspace_row(uint b, uint hk, uint split, uint r, constant
                                      AttentionParams& p) {
  const uint rows = p.num_heads / p.num_kv_heads * p.q_len;
  return (((ulong(b) * p.num_kv_heads + hk) * p.splits + split) * rows + r) * ulong(DV + 2);
}

// The keys [lo, hi] of split `split` of `splits`: the rows' visible union [union_lo, union_hi]
// (from query positions 0 and q_valid - 1: bounds are monotone in the position; empty unless
// any_row) is cut into `splits` runs of whole blocks of `block` keys, split s taking run s; a
// split past the union gets an empty range.
inline JfmRange32 jfm_decode_chunk(int union_lo, int union_hi, bool any_row, uint split,
                                   uint splits, int block) {
  const int block_lo = union_lo / block;
  const int blocks = any_row ? union_hi / block - block_lo + 1 : 0;
  const int per_split = (blocks + int(splits) - 1) / int(splits);
  JfmRange32 chunk;
  chunk.lo = max(union_lo, (block_lo + int(split) * per_split) * block);
  chunk.hi = min(union_hi, (block_lo + (int(split) + 1) * per_split) * block - 1);
  if (!any_row) {
    chunk.hi = chunk.lo - 1;
  }
  return chunk;
}

#define JFM_DECODE_PARTIAL_SIGNATURE(T)                                   \
  (device const T* q [[buffer(JFM_BUFFER_Q)]],                            \
   device const T* k [[buffer(JFM_BUFFER_K)]],                            \
   device const T* v [[buffer(JFM_BUFFER_V)]],                            \
   device const int* q_lengths [[buffer(JFM_BUFFER_Q_LENGTHS)]],          \
   device const int* kv_lengths [[buffer(JFM_BUFFER_KV_LENGTHS)]],        \
   device const int* page_table [[buffer(JFM_BUFFER_PAGE_TABLE)]],        \
   device float* workspace [[buffer(JFM_BUFFER_WORKSPACE)]],              \
   JFM_FEATURE_BUFFER_ARGS,                                               \
   constant AttentionParams& params [[buffer(JFM_BUFFER_PARAMS)]],        \
   uint3 group [[threadgroup_position_in_grid]],                          \
   uint thread_index [[thread_index_in_threadgroup]],                     \
   uint simd_index [[simdgroup_index_in_threadgroup]],                    \
   uint lane [[thread_index_in_simdgroup]])

#define JFM_DECODE_THREADS(T, DK, DV, VARIANT) \
  jfm_tile_threads(JFM_KERNEL_DECODE_PARTIAL, int(sizeof(T)), jfm_tile_head_dim(DK, DV), VARIANT)

// One threadgroup per (split, kv head, batch), over its chunk of keys (jfm_decode_chunk, blocks
// of BK keys); a split past the union writes empty rows (m the sentinel, l = 0, O = 0), so every
// workspace row pass 2 reads is written. Score features run
// the loop's FEATURES variant (as the forward), the rows' segment ids staged by position.
template <typename T, int DK, int DV, int VARIANT>
[[max_total_threads_per_threadgroup(JFM_DECODE_THREADS(T, DK, DV, VARIANT))]] kernel void
flash_attention_decode_partial JFM_DECODE_PARTIAL_SIGNATURE(T) {
  typedef JfmFwdTraits<T, DK, DV, VARIANT> Traits;  // pass 1 runs the forward's tiles
  constexpr int BQ = Traits::BQ;
  constexpr int BK = Traits::BK;
  constexpr int THREADS = Traits::THREADS;
  constexpr bool Q_IN_REGISTERS = Traits::Q_IN_REGISTERS;
  constexpr int LDK = Traits::LDK;
  constexpr int DVF = Traits::DVF;
  static_assert(BQ == jfm_tile_rows(JFM_KERNEL_DECODE_PARTIAL, Traits::EB, Traits::D, VARIANT) &&
                    THREADS == JFM_DECODE_THREADS(T, DK, DV, VARIANT) &&
                    BK == jfm_tile_cols(JFM_KERNEL_DECODE_PARTIAL, Traits::EB, Traits::D,
                                        VARIANT),
                "tile shape");

  // The forward's tiles (Q staged through the K/V tiles where it lives in registers).
  threadgroup uint4 tile_words[Traits::TILE_WORDS];
  // Per simdgroup: the latest key block whose V had Inf/NaN (jfm_note_nonfinite_v).
  threadgroup int nonfinite_v_block[THREADS / JFM_SIMD_WIDTH];
  threadgroup T* q_tile = (threadgroup T*)tile_words;
  threadgroup T* kv_tile = q_tile + (Q_IN_REGISTERS ? 0 : BQ * LDK);

  const JfmTile tile = jfm_tile_of(params, group);
  const uint split = tile.block;
  const uint hk = tile.head;
  const uint b = tile.batch;
  const uint G = params.num_heads / params.num_kv_heads;
  const int rows = int(G * params.q_len);  // <= BQ (the host's decode rule)
  const long q_valid = jfm_valid_len(params.has_q_lengths, q_lengths, b, params.q_len);
  const long kv_valid = jfm_valid_len(params.has_kv_lengths, kv_lengths, b, params.kv_len);

  const JfmRange32 first_keys = jfm_range32(jfm_keys_of_query(params, 0, q_valid, kv_valid),
                                            kv_valid);
  const JfmRange32 last_keys =
      jfm_range32(jfm_keys_of_query(params, q_valid - 1, q_valid, kv_valid), kv_valid);
  const bool any_row = q_valid > 0 && first_keys.lo <= last_keys.hi;
  const JfmRange32 chunk =
      jfm_decode_chunk(first_keys.lo, last_keys.hi, any_row, split, params.splits, BK);
  const int chunk_lo = chunk.lo;
  const int chunk_hi = chunk.hi;

  // This lane's row (g, i); rows past `rows` are padding: zero Q, no keys, never stored.
  const JfmFragCoord at = jfm_frag_coord(lane);
  const int band = int(simd_index) * 8;
  const int r = band + int(at.row);
  const int i = r < rows ? r % int(params.q_len) : int(q_valid);
  const JfmRange32 keys = jfm_range32(jfm_keys_of_query(params, i, q_valid, kv_valid), kv_valid);
  const bool features = jfm_has_score_features(params);  // uniform
  JfmFeatureLane f =
      jfm_feature_lane(params, JFM_FEATURE_BUFFERS, b,
                       hk * G + uint(min(r, rows - 1)) / params.q_len, i,
                       jfm_alignment_offset(params, q_valid, kv_valid));

  const uint q_stride = params.num_heads * uint(DK);
  device const T* k_head = k + jfm_kv_head_offset(params, b, hk, DK);
  device const T* v_head = v + jfm_kv_head_offset(params, b, hk, DV);

  float m = JFM_MAX_SENTINEL;
  float l = 0.0f;
  JfmFrag acc[DVF];
  JFM_PRAGMA_UNROLL
  for (int d = 0; d < DVF; ++d) {
    acc[d] = jfm_frag_zero();
  }

  if (chunk_lo <= chunk_hi) {  // uniform
    // Runs of q_len rows, one per query head of the group (rows of one head are q_stride apart,
    // consecutive heads DK apart); positions past q_valid are zero-filled.
    jfm_load_tile_runs<T, BQ, DK, THREADS, false>(
        q_tile, q + jfm_row_offset(b, 0, hk * G, params.q_len, params.num_heads, DK), q_stride,
        params.q_len, uint(DK), 0, rows, 0, int(q_valid), thread_index);
    if (features && params.has_segment_ids != 0) {  // row r holds the id of position r % q_len
      jfm_stage_segment_ids<T, BQ, DK, THREADS>(q_tile,
                                                f.in.q_segment_ids + ulong(b) * params.q_len,
                                                params.q_len, rows, 0, int(q_valid), thread_index);
    }
    if (thread_index < uint(THREADS / JFM_SIMD_WIDTH)) {
      nonfinite_v_block[thread_index] = -1;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const bool rows_full = q_valid == long(params.q_len);
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
                                    rows_full,
                                    chunk_lo,
                                    chunk_hi,
                                    keys,
                                    at,
                                    thread_index,
                                    lane};
    if (features) {  // rows [0, q_valid) hold every valid position once
      jfm_lane_segments<T, DK>(params, q_tile, r, int(q_valid), f);
      jfm_attend_key_blocks<T, DK, DV, VARIANT, true>(blocks, params, f, m, l, acc);
    } else {
      jfm_attend_key_blocks<T, DK, DV, VARIANT, false>(blocks, params, f, m, l, acc);
    }
  }

  const float row_l = jfm_row_sum(l);
  if (r < rows) {
    device float* w_row =
        workspace + jfm_decode_workspace_row<DV>(b, hk, split, uint(r), params);
    JFM_PRAGMA_UNROLL
    for (int d = 0; d < DVF; ++d) {
      // A row with no key in the chunk accumulated only P = 0 times finite V: acc is 0.
      jfm_frag_store_row(w_row + d * 8, acc[d], row_l == 0.0f ? 0.0f : 1.0f / row_l, at);
    }
    if (at.col == 0) {
      w_row[DV] = m;
      w_row[DV + 1] = row_l;
    }
  }
}

#define JFM_DECODE_VECTOR_SIGNATURE(T)                                    \
  (device const T* q [[buffer(JFM_BUFFER_Q)]],                            \
   device const T* k [[buffer(JFM_BUFFER_K)]],                            \
   device const T* v [[buffer(JFM_BUFFER_V)]],                            \
   device const int* q_lengths [[buffer(JFM_BUFFER_Q_LENGTHS)]],          \
   device const int* kv_lengths [[buffer(JFM_BUFFER_KV_LENGTHS)]],        \
   device const int* page_table [[buffer(JFM_BUFFER_PAGE_TABLE)]],        \
   device float* workspace [[buffer(JFM_BUFFER_WORKSPACE)]],              \
   JFM_FEATURE_BUFFER_ARGS,                                               \
   constant AttentionParams& params [[buffer(JFM_BUFFER_PARAMS)]],        \
   uint3 group [[threadgroup_position_in_grid]],                          \
   uint lane [[thread_index_in_simdgroup]])

// Pass 1 without MMA, for G * q_len <= R = jfm_decode_vector_rows(max(DK, DV)) rows (a grouped-query
// decode of one token has one row, which a 32-row MMA tile would pad 32-fold). One simdgroup
// per (split, kv head, batch) walks its chunk (jfm_decode_chunk, blocks of 32 keys) reading K and
// V straight from device memory, each key once: lane t holds elements t, t + 32, ... of every
// row's q (DK elements) and O (DV). Per block of 32 keys: each key's q.k for every row by fma and simd_sum, kept by
// the lane whose key it is; then, lane-parallel, the score and visibility of the lane's key
// (the band, and the score features through jfm_element as every kernel forms them), one online
// softmax update per row and block (simd_max, exp, simd_sum), O rescaled once per block, and
// O += p V key by key (p broadcast by simd_shuffle). A visible non-finite V element makes its O
// element NaN, as the other kernels poison it. Writes the same workspace rows as the MMA pass 1,
// which pass 2 combines. No threadgroup memory.
template <typename T, int DK, int DV>
[[max_total_threads_per_threadgroup(JFM_SIMD_WIDTH)]] kernel void
flash_attention_decode_vector JFM_DECODE_VECTOR_SIGNATURE(T) {
  constexpr int R = jfm_decode_vector_rows(jfm_tile_head_dim(DK, DV));
  // Elements per lane of a q or K row, and of a V or O row.
  constexpr int DLK = (DK + JFM_SIMD_WIDTH - 1) / JFM_SIMD_WIDTH;
  constexpr int DLV = (DV + JFM_SIMD_WIDTH - 1) / JFM_SIMD_WIDTH;
  constexpr bool FULL_LANES_K = DK % JFM_SIMD_WIDTH == 0;
  constexpr bool FULL_LANES_V = DV % JFM_SIMD_WIDTH == 0;
  const JfmTile tile = jfm_tile_of(params, group);
  const uint split = tile.block;
  const uint hk = tile.head;
  const uint b = tile.batch;
  const uint G = params.num_heads / params.num_kv_heads;
  const int rows = int(G * params.q_len);  // <= R (the host's decode rule)
  const long q_valid = jfm_valid_len(params.has_q_lengths, q_lengths, b, params.q_len);
  const long kv_valid = jfm_valid_len(params.has_kv_lengths, kv_lengths, b, params.kv_len);
  const JfmRange32 first_keys = jfm_range32(jfm_keys_of_query(params, 0, q_valid, kv_valid),
                                            kv_valid);
  const JfmRange32 last_keys =
      jfm_range32(jfm_keys_of_query(params, q_valid - 1, q_valid, kv_valid), kv_valid);
  const JfmRange32 chunk =
      jfm_decode_chunk(first_keys.lo, last_keys.hi, q_valid > 0 && first_keys.lo <= last_keys.hi,
                       split, params.splits, JFM_SIMD_WIDTH);
  const bool features = jfm_has_score_features(params);  // uniform
  const JfmFeatureBuffers in = JFM_FEATURE_BUFFERS;
  const long off = jfm_alignment_offset(params, q_valid, kv_valid);
  const uint k_stride = params.num_kv_heads * uint(DK);
  const uint v_stride = params.num_kv_heads * uint(DV);
  device const T* k_head = k + jfm_kv_head_offset(params, b, hk, DK);
  device const T* v_head = v + jfm_kv_head_offset(params, b, hk, DV);
  const JfmKvRows kv_rows = jfm_kv_rows(params, page_table, b);
  const bool paged = jfm_fc_paged && params.page_size != 0;  // uniform

  // Row r is query position r % q_len of head hk * G + r / q_len; rows past `rows` and
  // positions past q_valid see no key (empty intervals) and are never computed.
  float qr[R][DLK];
  float o[R][DLV];
  float m[R];
  float l[R];
  float slope[R];  // ALiBi (0 without)
  JfmRange32 keys[R];
  JFM_PRAGMA_UNROLL
  for (int r = 0; r < R; ++r) {
    const int i = r < rows ? r % int(params.q_len) : int(q_valid);
    const uint h = hk * G + uint(min(r, rows - 1)) / params.q_len;
    keys[r] = jfm_range32(jfm_keys_of_query(params, i, q_valid, kv_valid), kv_valid);
    m[r] = JFM_MAX_SENTINEL;
    l[r] = 0.0f;
    slope[r] = jfm_alibi_slope(params, in, b, h);
    device const T* q_row =
        q + jfm_row_offset(b, min(i, int(params.q_len) - 1), h, params.q_len, params.num_heads, DK);
    JFM_PRAGMA_UNROLL
    for (int n = 0; n < DLK; ++n) {
      const int d = int(lane) + n * JFM_SIMD_WIDTH;
      qr[r][n] = keys[r].lo <= keys[r].hi && (FULL_LANES_K || d < DK) ? jfm_to_float(q_row[d])
                                                                      : 0.0f;
    }
    JFM_PRAGMA_UNROLL
    for (int n = 0; n < DLV; ++n) {
      o[r][n] = 0.0f;
    }
  }

  for (int j0 = chunk.lo; j0 <= chunk.hi; j0 += JFM_SIMD_WIDTH) {  // uniform
    const int j_end = min(j0 + JFM_SIMD_WIDTH - 1, chunk.hi);    // last key of the block
    const int j = j0 + int(lane);                                 // this lane's key
    const uint kv_row = jfm_kv_lane_row(kv_rows, j0, j_end, lane);  // and its row
    // sc[r]: the q.k of row r and this lane's key, then its weight p (-1: not visible).
    float sc[R];
    JFM_PRAGMA_UNROLL
    for (int r = 0; r < R; ++r) {
      sc[r] = 0.0f;
    }
    for (int c = 0; c <= j_end - j0; ++c) {
      const uint row = paged ? simd_shuffle(kv_row, ushort(c)) : uint(j0 + c);
      device const T* k_row = k_head + ulong(row) * k_stride;
      float kd[DLK];
      JFM_PRAGMA_UNROLL
      for (int n = 0; n < DLK; ++n) {
        const int d = int(lane) + n * JFM_SIMD_WIDTH;
        kd[n] = FULL_LANES_K || d < DK ? jfm_to_float(k_row[d]) : 0.0f;
      }
      JFM_PRAGMA_UNROLL
      for (int r = 0; r < R; ++r) {
        if (keys[r].lo <= j_end && keys[r].hi >= j0) {  // uniform: the row sees the block
          float part = 0.0f;
          JFM_PRAGMA_UNROLL
          for (int n = 0; n < DLK; ++n) {
            part = fma(qr[r][n], kd[n], part);
          }
          const float qk = simd_sum(part);
          sc[r] = int(lane) == c ? qk : sc[r];
        }
      }
    }
    const int kv_segment = features && params.has_segment_ids != 0 && j <= j_end
                               ? in.kv_segment_ids[ulong(b) * params.kv_len + ulong(j)]
                               : 0;
    JFM_PRAGMA_UNROLL
    for (int r = 0; r < R; ++r) {
      if (keys[r].lo <= j_end && keys[r].hi >= j0) {  // uniform
        const bool band = j <= j_end && jfm_visible(keys[r], j);
        float s;
        bool seen = band;
        if (features) {
          const int i = r % int(params.q_len);
          const uint h = hk * G + uint(r) / params.q_len;
          const int segment = params.has_segment_ids != 0 && band
                                  ? in.q_segment_ids[ulong(b) * params.q_len + ulong(i)]
                                  : 0;
          const JfmFeatureRow row = jfm_feature_row(params, b, h, i, off, slope[r]);
          seen = jfm_element<T>(params, true, in, jfm_feature_at(params, row, j), segment,
                                kv_segment, band, sc[r], s);
        } else {
          s = jfm_finite_or_nan(sc[r] * params.scale);
        }
        const float m_new = max(m[r], simd_max(seen ? s : JFM_MASKED_SCORE));
        const float alpha = jfm_exp(m[r], m_new);
        const float p = seen ? jfm_exp(s, m_new) : 0.0f;
        l[r] = l[r] * alpha + simd_sum(p);
        m[r] = m_new;
        JFM_PRAGMA_UNROLL
        for (int n = 0; n < DLV; ++n) {
          o[r][n] *= alpha;
        }
        sc[r] = seen ? p : -1.0f;
      } else {
        sc[r] = -1.0f;
      }
    }
    for (int c = 0; c <= j_end - j0; ++c) {
      float w[R];  // the weights of key j0 + c, -1 where a row does not see it
      bool any_seen = false;
      JFM_PRAGMA_UNROLL
      for (int r = 0; r < R; ++r) {
        w[r] = keys[r].lo <= j_end && keys[r].hi >= j0 ? simd_shuffle(sc[r], ushort(c)) : -1.0f;
        any_seen = any_seen || !(w[r] < 0.0f);  // a NaN weight is seen (poisons the row)
      }
      if (!any_seen) {
        continue;  // uniform
      }
      const uint row = paged ? simd_shuffle(kv_row, ushort(c)) : uint(j0 + c);
      device const T* v_row = v_head + ulong(row) * v_stride;
      float vd[DLV];
      JFM_PRAGMA_UNROLL
      for (int n = 0; n < DLV; ++n) {
        const int d = int(lane) + n * JFM_SIMD_WIDTH;
        vd[n] = FULL_LANES_V || d < DV ? jfm_to_float(v_row[d]) : 0.0f;
      }
      JFM_PRAGMA_UNROLL
      for (int r = 0; r < R; ++r) {
        if (!(w[r] < 0.0f)) {  // uniform
          JFM_PRAGMA_UNROLL
          for (int n = 0; n < DLV; ++n) {
            o[r][n] = jfm_is_finite(vd[n]) ? fma(w[r], vd[n], o[r][n])
                                           : as_type<float>(0x7fc00000u);
          }
        }
      }
    }
  }

  JFM_PRAGMA_UNROLL
  for (int r = 0; r < R; ++r) {
    if (r < rows) {
      device float* w_row =
          workspace + jfm_decode_workspace_row<DV>(b, hk, split, uint(r), params);
      // A row with no key in the chunk has l = 0 and O = 0.
      const float inv_l = l[r] == 0.0f ? 0.0f : 1.0f / l[r];
      JFM_PRAGMA_UNROLL
      for (int n = 0; n < DLV; ++n) {
        const int d = int(lane) + n * JFM_SIMD_WIDTH;
        if (FULL_LANES_V || d < DV) {
          w_row[d] = o[r][n] * inv_l;
        }
      }
      if (lane == 0) {
        w_row[DV] = m[r];
        w_row[DV + 1] = l[r];
      }
    }
  }
}

#define JFM_DECODE_COMBINE_SIGNATURE(T)                                   \
  (device const float* workspace [[buffer(JFM_BUFFER_WORKSPACE)]],        \
   device T* o [[buffer(JFM_BUFFER_O)]],                                  \
   device float* lse [[buffer(JFM_BUFFER_LSE)]],                          \
   device float* row_max [[buffer(JFM_BUFFER_ROW_MAX)]],                  \
   device float* log_sum [[buffer(JFM_BUFFER_LOG_SUM)]],                  \
   device const float* sinks [[buffer(JFM_BUFFER_SINKS)]],                \
   constant AttentionParams& params [[buffer(JFM_BUFFER_PARAMS)]],        \
   uint3 group [[threadgroup_position_in_grid]],                          \
   uint lane [[thread_index_in_simdgroup]])

// One simdgroup per row (r, kv head, batch); lane t reads the statistics of splits t, t + 32, ...
// once, and the weights are broadcast split by split. M = max m_s, then in split order
// w_s = l_s exp(m_s - M), W = sum w_s, then the head's sink folded into (M, W) as the forward
// does (jfm_fold_sink), O = sum w_s O_s / W, and LSE = M + log(W) with the residuals M and
// log(W) (jfm_store_statistics, as the forward: a row with W = 0 saw no key and has no sink,
// O = 0 and LSE = -inf).
// DV: the value head dim (O and the workspace rows); DK only names the family.
template <typename T, int DK, int DV>
[[max_total_threads_per_threadgroup(JFM_SIMD_WIDTH)]] kernel void
flash_attention_decode_combine JFM_DECODE_COMBINE_SIGNATURE(T) {
  constexpr int DL = (DV + JFM_SIMD_WIDTH - 1) / JFM_SIMD_WIDTH;  // head dims per lane
  const JfmTile tile = jfm_tile_of(params, group);
  const uint r = tile.block;
  const uint hk = tile.head;
  const uint b = tile.batch;
  const uint G = params.num_heads / params.num_kv_heads;
  const uint h = hk * G + r / params.q_len;
  const uint i = r % params.q_len;
  const uint splits = params.splits;

  float big_m = JFM_MAX_SENTINEL;
  for (uint s = lane; s < splits; s += JFM_SIMD_WIDTH) {
    big_m = max(big_m, workspace[jfm_decode_workspace_row<DV>(b, hk, s, r, params) + DV]);
  }
  big_m = simd_max(big_m);

  float weights = 0.0f;
  float sum[DL];
  JFM_PRAGMA_UNROLL
  for (int n = 0; n < DL; ++n) {
    sum[n] = 0.0f;
  }
  float lane_w = 0.0f;  // w of split s0 + lane
  for (uint s = 0; s < splits; ++s) {  // uniform
    if (s % JFM_SIMD_WIDTH == 0) {
      const uint mine = s + lane;
      lane_w = 0.0f;
      if (mine < splits) {
        device const float* stats =
            workspace + jfm_decode_workspace_row<DV>(b, hk, mine, r, params) + DV;
        lane_w = stats[1] * jfm_exp(stats[0], big_m);
      }
    }
    const float w = simd_shuffle(lane_w, ushort(s % JFM_SIMD_WIDTH));
    weights += w;
    device const float* w_row = workspace + jfm_decode_workspace_row<DV>(b, hk, s, r, params);
    JFM_PRAGMA_UNROLL
    for (int n = 0; n < DL; ++n) {
      const uint d = lane + uint(n) * JFM_SIMD_WIDTH;
      if (d < uint(DV)) {
        sum[n] += w * w_row[d];
      }
    }
  }
  if (jfm_has_sinks(params)) {
    const float alpha = jfm_fold_sink(sinks[h], big_m, weights);
    JFM_PRAGMA_UNROLL
    for (int n = 0; n < DL; ++n) {
      sum[n] *= alpha;
    }
  }
  const bool empty = weights == 0.0f;
  device T* o_row = o + jfm_row_offset(b, i, h, params.q_len, params.num_heads, DV);
  JFM_PRAGMA_UNROLL
  for (int n = 0; n < DL; ++n) {
    const uint d = lane + uint(n) * JFM_SIMD_WIDTH;
    if (d < uint(DV)) {
      jfm_store(o_row + d, empty ? 0.0f : sum[n] / weights);
    }
  }
  if (lane == 0) {
    jfm_store_statistics(lse, row_max, log_sum,
                         jfm_stat_offset(b, h, i, params.num_heads, params.q_len), big_m,
                         weights);
  }
}

// The instantiation grid: every family of kernel_families.h, under its host names (pass 1 in
// each tile variant of the forward's tiles; variant v > 0: stage decode_partial_var<v>).
static_assert(JFM_TILE_VARIANTS == 2, "one instantiation per tile variant");
#define JFM_INSTANTIATE_DECODE(T, SUFFIX, DK, DV, NAME)                                      \
  JFM_IF_FAMILY(T, NAME,                                                                     \
      template [[host_name(JFM_HOST_NAME(flash_attention_decode_partial, SUFFIX, NAME))]]    \
      kernel void flash_attention_decode_partial<T, DK, DV, 0>                               \
          JFM_DECODE_PARTIAL_SIGNATURE(T);                                                   \
      template [[host_name(JFM_HOST_NAME(flash_attention_decode_partial_var1, SUFFIX, NAME))]] \
      kernel void flash_attention_decode_partial<T, DK, DV, 1>                               \
          JFM_DECODE_PARTIAL_SIGNATURE(T);                                                   \
      template [[host_name(JFM_HOST_NAME(flash_attention_decode_combine, SUFFIX, NAME))]]    \
      kernel void flash_attention_decode_combine<T, DK, DV> JFM_DECODE_COMBINE_SIGNATURE(T); \
      template [[host_name(JFM_HOST_NAME(flash_attention_decode_vector, SUFFIX, NAME))]]     \
      kernel void flash_attention_decode_vector<T, DK, DV> JFM_DECODE_VECTOR_SIGNATURE(T);)

JFM_FAMILIES(JFM_INSTANTIATE_DECODE)
