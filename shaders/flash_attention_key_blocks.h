// The forward's key-block loop (FlashAttention-2 Algorithm 1, inner loop) on simdgroup_matrix
// tiles, shared by the tiled forward (flash_attention_fwd.metal) and pass 1 of the split-KV
// decode (flash_attention_decode.metal): both run it over a band of 8 query rows per simdgroup,
// the forward over the whole visible union of its row block, the decode over one split's chunk.
// Tile shapes: tile_shapes.h (the fwd family); the loop, tiles and memory: shaders/README.md.
#ifndef JAX_FLASH_METAL_FLASH_ATTENTION_KEY_BLOCKS_H_
#define JAX_FLASH_METAL_FLASH_ATTENTION_KEY_BLOCKS_H_

#include "flash_attention_features.h"
#include "kernel_traits.h"

// Online softmax update of one block for this lane's row: s holds the block's scores S in KF
// fragments, JFM_MASKED_SCORE where hidden, and bit 2 n + e of `visible` says whether element e
// of fragment n is visible. On return s holds P = exp(S - m_new) (0 where hidden), m the running
// max, l this lane's share of the running sum, and the result alpha = exp(m_old - m_new)
// rescales the accumulator.
template <int KF>
inline float jfm_softmax_update(thread JfmFrag* s, uint visible, thread float& m,
                                thread float& l) {
  float block_max = JFM_MASKED_SCORE;
  JFM_PRAGMA_UNROLL
  for (int n = 0; n < KF; ++n) {
    JFM_PRAGMA_UNROLL
    for (int e = 0; e < 2; ++e) {
      block_max = max(block_max, s[n].thread_elements()[e]);
    }
  }
  const float m_new = max(m, jfm_row_max(block_max));
  const float alpha = jfm_exp(m, m_new);
  float block_sum = 0.0f;
  JFM_PRAGMA_UNROLL
  for (int n = 0; n < KF; ++n) {
    JFM_PRAGMA_UNROLL
    for (int e = 0; e < 2; ++e) {
      const bool seen = ((visible >> uint(2 * n + e)) & 1u) != 0u;
      const float p = seen ? jfm_exp(s[n].thread_elements()[e], m_new) : 0.0f;
      s[n].thread_elements()[e] = p;
      block_sum += p;
    }
  }
  m = m_new;
  l = l * alpha + block_sum;
  return alpha;
}

// The plain online softmax: s holds S = Q K^T of the row band; EDGE blocks test every element
// against the row's visible interval, others are all visible. A non-finite score becomes NaN
// (jfm_finite_or_nan) so a NaN or Inf input poisons its row.
template <int KF, bool EDGE>
inline float jfm_online_softmax(thread JfmFrag* s, float scale, JfmRange32 keys, int j0,
                                JfmFragCoord at, thread float& m, thread float& l) {
  uint visible = 0u;
  JFM_PRAGMA_UNROLL
  for (int n = 0; n < KF; ++n) {
    JFM_PRAGMA_UNROLL
    for (int e = 0; e < 2; ++e) {
      const bool seen = !EDGE || jfm_visible(keys, j0 + n * 8 + int(at.col) + e);
      const float score = jfm_finite_or_nan(s[n].thread_elements()[e] * scale);
      s[n].thread_elements()[e] = seen ? score : JFM_MASKED_SCORE;
      visible |= uint(seen) << uint(2 * n + e);
    }
  }
  return jfm_softmax_update<KF>(s, visible, m, l);
}

// What the feature loop knows of this lane's query row (flash_attention_features.h).
struct JfmFeatureLane {
  JfmFeatureBuffers in;
  JfmFeatureRow row;              // bias/mask offsets of (b, h, i, 0)
  device const int* kv_segments;  // key segment ids of batch b (has_segment_ids)
  int segment;                    // the row's segment id (has_segment_ids)
  JfmRange32 row_segments;        // [min, max] segment id of the tile's valid rows
  JfmDropout dropout;             // dropout's key and counter indices of (b, h) (with dropout)
  long query;                     // the row's query position i (dropout's counter)
};

// The lane context of query row i of head h in batch b, off its alignment offset; segment and
// row_segments are set by jfm_lane_segments once the rows' ids are staged.
inline JfmFeatureLane jfm_feature_lane(constant AttentionParams& p, JfmFeatureBuffers in,
                                       uint b, uint h, long i, long off) {
  JfmFeatureLane f;
  f.in = in;
  f.row = jfm_feature_row(p, b, h, i, off, jfm_alibi_slope(p, in, b, h));
  f.kv_segments = jfm_has_score_features(p) && p.has_segment_ids != 0
                      ? in.kv_segment_ids + ulong(b) * p.kv_len
                      : in.kv_segment_ids;
  f.segment = 0;
  f.row_segments.lo = 0;
  f.row_segments.hi = 0;
  f.dropout = jfm_dropout_of(p, in.dropout, b, h);
  f.query = i;
  return f;
}

// With segment ids: this lane's id (tile row `row`) and the range of the tile's valid rows
// [0, valid_rows), from the ids staged in q_tile's row padding (barrier passed).
template <typename T, int D>
inline void jfm_lane_segments(constant AttentionParams& p, threadgroup const T* q_tile, int row,
                              int valid_rows, thread JfmFeatureLane& f) {
  if (p.has_segment_ids != 0) {
    f.segment = jfm_segment_of<T, D>(q_tile, row);
    f.row_segments = jfm_segment_range<T, D>(q_tile, 0, valid_rows);
  }
}

// Whether the features keep key j of this lane's row (band-visible j only), its segment id read
// from device memory: the rare path that poisons O for a non-finite V.
template <typename T>
inline bool jfm_lane_keeps(constant AttentionParams& p, thread const JfmFeatureLane& f, int j) {
  const JfmFeatureRow at = jfm_feature_at(p, f.row, j);
  return jfm_feature_keeps(p, f.in.mask, at.mask, f.segment,
                           p.has_segment_ids != 0 ? f.kv_segments[j] : 0,
                           jfm_bias_at<T>(p, f.in.bias, at.bias));
}

// The online softmax with the score features: every element the band shows (all, in a FULL
// tile) goes through jfm_element (cap, bias, ALiBi, mask, segment ids); the key block's segment ids
// are staged in k_tile's row padding.
template <typename T, int D, int KF>
inline float jfm_online_softmax_features(thread JfmFrag* s, constant AttentionParams& p,
                                         thread const JfmFeatureLane& f,
                                         threadgroup const T* k_tile, JfmRange32 keys,
                                         bool edge, int j0, JfmFragCoord at, thread float& m,
                                         thread float& l) {
  uint visible = 0u;
  JFM_PRAGMA_UNROLL
  for (int n = 0; n < KF; ++n) {
    JFM_PRAGMA_UNROLL
    for (int e = 0; e < 2; ++e) {
      const int c = n * 8 + int(at.col) + e;
      float score;
      const bool seen = jfm_element<T>(
          p, true, f.in, jfm_feature_at(p, f.row, j0 + c), f.segment,
          p.has_segment_ids != 0 ? jfm_segment_of<T, D>(k_tile, c) : 0,
          !edge || jfm_visible(keys, j0 + c), s[n].thread_elements()[e], score);
      s[n].thread_elements()[e] = seen ? score : JFM_MASKED_SCORE;
      visible |= uint(seen) << uint(2 * n + e);
    }
  }
  return jfm_softmax_update<KF>(s, visible, m, l);
}

// ---- where the K/V rows are: contiguous, or a paged cache (docs/design.md#paged-kv-cache) ----

// The K/V rows of one batch: contiguous (page_size 0), key j at row j of the (batch, kv head);
// or pages, key j at row page_table[b, j / page_size] * page_size + j % page_size of the pool.
// An entry is read only for a page holding a key the kernel visits (so never past the row's
// length), and one outside [0, num_pages) is clamped, as the xla implementation gathers.
struct JfmKvRows {
  device const int* page_row;  // the batch's row of the page table (page_size > 0)
  uint page_size;
  uint num_pages;
};

inline JfmKvRows jfm_kv_rows(constant AttentionParams& p, device const int* page_table, uint b) {
  JfmKvRows rows;
  rows.page_size = jfm_fc_paged ? p.page_size : 0u;
  rows.num_pages = p.num_pages;
  rows.page_row = rows.page_size != 0 ? page_table + ulong(b) * (p.kv_len / p.page_size)
                                   : page_table;
  return rows;
}

// Element offset of row 0 of kv head hk (batch b when contiguous) in K or V.
inline ulong jfm_kv_head_offset(constant AttentionParams& p, uint b, uint hk, uint head_dim) {
  return jfm_fc_paged && p.page_size != 0 ? ulong(hk) * head_dim
                          : jfm_row_offset(b, 0, hk, p.kv_len, p.num_kv_heads, head_dim);
}

// The pool page of logical page n (a table read).
inline uint jfm_page_of(JfmKvRows rows, uint n) {
  return uint(min(max(rows.page_row[n], 0), int(rows.num_pages) - 1));
}

// The rows of key block [j0, j0 + BK) (j0 a multiple of BK) as jfm_load_tile_runs reads them:
// runs of `run` rows, row t of run s at row + s * run_rows + t (rows of the kv head, each the K
// or V stride apart). Contiguous, or a page size BK divides: one run. A page of 16 under blocks
// of 32: two runs, one per page.
struct JfmKvBlock {
  ulong row;
  jfm_long run_rows;
  uint run;
};

// The block whose keys up to `last` are visited: lanes 0 and 1 of each simdgroup read the
// table entries of its first and second page (the second only when it holds a visited key), and
// broadcast them, so the table costs 4 or 8 bytes per simdgroup and block. Uniform control flow.
template <int BK>
inline JfmKvBlock jfm_kv_block(JfmKvRows rows, int j0, int last, uint lane) {
  JfmKvBlock block;
  block.run = uint(BK);
  block.run_rows = 0;
  block.row = ulong(j0);
  if (rows.page_size == 0) {  // uniform
    return block;
  }
  const uint size = rows.page_size;
  const uint n = uint(j0) / size + lane;  // the lane's logical page
  const bool read = lane < 2u && ulong(n) * size <= ulong(min(last, j0 + BK - 1));
  const uint page = read ? jfm_page_of(rows, n) : 0u;
  const uint first = simd_shuffle(page, ushort(0));
  const uint second = simd_shuffle(page, ushort(1));
  block.run = min(size, uint(BK));
  block.row = ulong(first) * size + uint(j0) % size;
  block.run_rows = (jfm_long(second) - jfm_long(first)) * jfm_long(size);
  return block;
}

// The kv head's row of row r of a block (jfm_kv_block).
inline ulong jfm_kv_block_row(JfmKvBlock block, int r) {
  const uint s = uint(r) / block.run;
  return ulong(jfm_long(block.row) + jfm_long(s) * block.run_rows +
               jfm_long(uint(r) - s * block.run));
}

// The row of key j0 + lane, of a run of keys [j0, last] with one key per lane (last < j0 + 32):
// paged, lane t reads the table entry of the run's t-th page (only lanes whose page holds a key
// of the run) and each lane takes its key's page by simd_shuffle, so the table costs 4 bytes
// per page the run touches. A lane past `last` gets a row it must not read. Uniform control
// flow.
inline uint jfm_kv_lane_row(JfmKvRows rows, int j0, int last, uint lane) {
  const int j = j0 + int(lane);
  if (rows.page_size == 0) {  // uniform
    return uint(j);
  }
  const uint size = rows.page_size;
  const uint first = uint(j0) / size;
  const uint n = first + lane;
  const uint page = ulong(n) * size <= ulong(last) ? jfm_page_of(rows, n) : 0u;
  const uint mine = simd_shuffle(page, ushort(uint(min(j, last)) / size - first));
  return mine * size + uint(j) % size;
}

// What the key-block loop is given of its threadgroup and lane (jfm_attend_key_blocks).
template <typename T>
struct JfmKeyBlocks {
  threadgroup const T* q_band;  // the simdgroup's 8 rows of the staged Q tile (where Q lives in
                                // registers it may lie in kv_tile's memory: it is read into
                                // registers before the first block's barrier, after which K
                                // overwrites it)
  threadgroup T* kv_tile;              // the K/V tiles
  threadgroup int* nonfinite_v_block;  // per simdgroup: the latest block whose V had Inf/NaN
  device const T* k_head;              // row 0 of K and V of the kv head (jfm_kv_head_offset):
  device const T* v_head;              // rows k_stride and v_stride elements apart, contiguous
  uint k_stride, v_stride;             // or paged (rows)
  JfmKvRows rows;
  JfmRange32 first_keys, last_keys;  // intervals bounding every row's (block classification)
  bool rows_full;                    // every row of the tile is a real row
  int union_lo, union_hi;            // the threadgroup-uniform range of keys to visit
  JfmRange32 keys;                   // this lane's row interval
  JfmFragCoord at;
  uint thread_index;
  uint lane;
};

// Notes that key block j0's V had Inf/NaN where this thread staged it (`mine`): each simdgroup
// keeps its own entry, written by its lane 0 (several threads storing one word, even the same
// value, would race), read after the next barrier by jfm_v_block_nonfinite. Uniform control
// flow (a simd_any).
template <typename T>
inline void jfm_note_nonfinite_v(thread const JfmKeyBlocks<T>& c, int j0, bool mine) {
  if (simd_any(mine) && c.lane == 0) {
    c.nonfinite_v_block[c.thread_index / JFM_SIMD_WIDTH] = j0;
  }
}

// Whether any simdgroup noted key block j0's V non-finite (jfm_note_nonfinite_v).
template <typename T, int THREADS>
inline bool jfm_v_block_nonfinite(thread const JfmKeyBlocks<T>& c, int j0) {
  bool any = false;
  for (int s = 0; s < THREADS / JFM_SIMD_WIDTH; ++s) {
    any = any || c.nonfinite_v_block[s] == j0;
  }
  return any;
}

// Key blocks [j0, j0 + BK) from the one holding c.union_lo to the one holding c.union_hi: stage
// K and V (zero-filled outside [union_lo, union_hi], V sanitized), S = Q K^T by MMA, online
// softmax, O = alpha O + P V by MMA (with dropout, P M / (1 - rate) V: the row sum l is of the
// undropped P, so the LSE is the undropped scores'). c.q_band is loaded (barrier passed). On
// return m, l and acc hold this lane's running max, sum share and unnormalised O (DV / 8
// fragments); Q and K have DK columns, V and O DV. FEATURES: the score
// features of `f` apply (flash_attention_features.h): a key block whose segment ids cannot meet
// the rows' is skipped before K and V are staged; without them the loop is the plain one.
template <typename T, int DK, int DV, int VARIANT, bool FEATURES>
inline void jfm_attend_key_blocks(thread const JfmKeyBlocks<T>& c,
                                  constant AttentionParams& params,
                                  thread const JfmFeatureLane& f, thread float& m,
                                  thread float& l, thread JfmFrag* acc) {
  typedef JfmFwdTraits<T, DK, DV, VARIANT> Traits;
  constexpr int BK = Traits::BK;
  constexpr int THREADS = Traits::THREADS;
  constexpr bool Q_IN_REGISTERS = Traits::Q_IN_REGISTERS;
  constexpr bool ONE_KV_BUFFER = Traits::ONE_KV_BUFFER;
  constexpr int LDK = Traits::LDK;
  constexpr int LDV = Traits::LDV;
  constexpr int DKF = Traits::DKF;
  constexpr int DVF = Traits::DVF;
  constexpr int KF = Traits::KF;
  threadgroup const T* q_band = c.q_band;
  const JfmFragCoord at = c.at;
  JfmFrag q_frag[Q_IN_REGISTERS ? DKF : 1];
  if (Q_IN_REGISTERS) {
    JFM_PRAGMA_UNROLL
    for (int d = 0; d < DKF; ++d) {
      q_frag[d] = jfm_frag_load(q_band + d * 8, LDK, at);
    }
  }
  threadgroup T* k_tile = c.kv_tile;
  threadgroup T* v_tile = c.kv_tile + (ONE_KV_BUFFER ? 0 : BK * LDK);

  for (int j0 = c.union_lo / BK * BK; j0 <= c.union_hi; j0 += BK) {
    int kind = jfm_classify_tile(c.first_keys, c.last_keys, c.rows_full, j0, j0 + BK - 1);
    if (kind == JFM_TILE_SKIP) {
      continue;  // uniform
    }
    // Rows of the key block inside the union are loaded; the rest are zero-filled.
    const int load_begin = max(c.union_lo - j0, 0);
    const int load_end = min(c.union_hi - j0 + 1, BK);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the previous block's reads are done
    JfmRange32 block_segments = f.row_segments;
    if (FEATURES && params.has_segment_ids != 0) {  // uniform
      jfm_stage_segment_ids<T, BK, DK, THREADS>(k_tile, f.kv_segments + j0, uint(BK), BK,
                                               load_begin, load_end, c.thread_index);
      threadgroup_barrier(mem_flags::mem_threadgroup);
      block_segments = jfm_segment_range<T, DK>(k_tile, load_begin, load_end);
    }
    if (FEATURES) {
      kind = jfm_classify_feature_tile(params, kind, f.row_segments, block_segments);
      if (kind == JFM_TILE_SKIP) {
        continue;  // uniform: the next block's first barrier orders the ids' reads
      }
    }
    const JfmKvBlock kv = jfm_kv_block<BK>(c.rows, j0, c.union_hi, c.lane);
    jfm_load_tile_runs<T, BK, DK, THREADS, false>(
        k_tile, c.k_head + kv.row * c.k_stride, c.k_stride, kv.run, kv.run_rows * c.k_stride,
        load_begin, load_end, 0, BK, c.thread_index);
    if (!ONE_KV_BUFFER) {
      jfm_note_nonfinite_v(c, j0,
                           jfm_load_tile_runs<T, BK, DV, THREADS, true>(
                               v_tile, c.v_head + kv.row * c.v_stride, c.v_stride, kv.run,
                               kv.run_rows * c.v_stride, load_begin, load_end, 0, BK,
                               c.thread_index));
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // S = Q K^T for the row band.
    JfmFrag s[KF];
    JFM_PRAGMA_UNROLL
    for (int n = 0; n < KF; ++n) {
      s[n] = jfm_frag_zero();
    }
    JFM_PRAGMA_UNROLL
    for (int d = 0; d < DKF; ++d) {
      const JfmFrag qd = Q_IN_REGISTERS ? q_frag[Q_IN_REGISTERS ? d : 0]
                                        : jfm_frag_load(q_band + d * 8, LDK, at);
      JFM_PRAGMA_UNROLL
      for (int n = 0; n < KF; ++n) {
        jfm_mma(s[n], qd, jfm_frag_load_transposed(k_tile + n * 8 * LDK + d * 8, LDK, at));
      }
    }

    const float alpha =
        FEATURES ? jfm_online_softmax_features<T, DK, KF>(s, params, f, k_tile, c.keys,
                                                         kind == JFM_TILE_EDGE, j0, at, m, l)
        : kind == JFM_TILE_EDGE
            ? jfm_online_softmax<KF, true>(s, params.scale, c.keys, j0, at, m, l)
            : jfm_online_softmax<KF, false>(s, params.scale, c.keys, j0, at, m, l);
    JFM_PRAGMA_UNROLL
    for (int d = 0; d < DVF; ++d) {
      acc[d].thread_elements() *= alpha;
    }
    if (jfm_has_dropout(params)) {  // uniform: P V takes P M / (1 - rate); l keeps the full P
      jfm_drop_row<KF>(s, params, f.dropout, f.query, j0, at);
    }

    if (ONE_KV_BUFFER) {  // V replaces K in the one buffer
      threadgroup_barrier(mem_flags::mem_threadgroup);
      jfm_note_nonfinite_v(c, j0,
                           jfm_load_tile_runs<T, BK, DV, THREADS, true>(
                               v_tile, c.v_head + kv.row * c.v_stride, c.v_stride, kv.run,
                               kv.run_rows * c.v_stride, load_begin, load_end, 0, BK,
                               c.thread_index));
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }

    // O += P V.
    JFM_PRAGMA_UNROLL
    for (int n = 0; n < KF; ++n) {
      JFM_PRAGMA_UNROLL
      for (int d = 0; d < DVF; ++d) {
        jfm_mma(acc[d], s[n], jfm_frag_load(v_tile + n * 8 * LDV + d * 8, LDV, at));
      }
    }
    if (jfm_v_block_nonfinite<T, THREADS>(c, j0)) {
      // Rare: the staged V had Inf/NaN, stored as 0. Poison exactly the O elements whose row
      // sees such a value, reading only this row's visible keys.
      const int hi = min(c.keys.hi, j0 + BK - 1);
      for (int j = max(c.keys.lo, j0); j <= hi; ++j) {
        if (FEATURES && !jfm_lane_keeps<T>(params, f, j)) {
          continue;
        }
        device const T* v_row = c.v_head + jfm_kv_block_row(kv, j - j0) * c.v_stride;
        JFM_PRAGMA_UNROLL
        for (int d = 0; d < DVF; ++d) {
          JFM_PRAGMA_UNROLL
          for (int e = 0; e < 2; ++e) {
            if (!jfm_is_finite(v_row[d * 8 + int(at.col) + e])) {
              acc[d].thread_elements()[e] = as_type<float>(0x7fc00000u);
            }
          }
        }
      }
    }
  }
}

#endif  // JAX_FLASH_METAL_FLASH_ATTENTION_KEY_BLOCKS_H_
