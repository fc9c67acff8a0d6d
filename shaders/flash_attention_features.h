// The optional score features of docs/design.md#scores (soft cap, bias, ALiBi, mask, segment ids,
// sinks)
// per element and per tile, shared by the forward (and decode) and the backward kernels so that
// both directions form bit-identical scores and visibility. A kernel without any feature never
// calls these: its loop keeps the plain score S = (q.k) * scale and the band tests.
// MSL 3.0 (C++14 base).
#ifndef JAX_FLASH_METAL_FLASH_ATTENTION_FEATURES_H_
#define JAX_FLASH_METAL_FLASH_ATTENTION_FEATURES_H_

#include "flash_attention_dropout.h"
#include "flash_attention_tiles.h"

// The optional buffers as the kernel binds them (the host binds a placeholder where a flag in
// AttentionParams is 0, so nothing is read from them then). The bias is bytes because its dtype
// is the query's or float32 (params.has_bias says which).
struct JfmFeatureBuffers {
  device const int* q_segment_ids;   // int32 [B, Tq]
  device const int* kv_segment_ids;  // int32 [B, Tkv]
  device const uchar* bias;          // [b, h, tq, tkv] through params.bias_strides
  device const uchar* mask;          // uchar, same, through params.mask_strides; 0 = hidden
  device const float* sinks;         // float32 [H], natural-log logits
  device const float* alibi_slopes;  // float32 [B, H]
  device const uint* dropout;        // uint32 [B, H, 8] (flash_attention_dropout.h)
};

// The kernel arguments of the optional buffers (every kernel that reads a feature declares all
// seven, the host binds all seven), and the struct made from them inside the kernel.
#define JFM_FEATURE_BUFFER_ARGS                                             \
  device const int* q_segment_ids [[buffer(JFM_BUFFER_Q_SEGMENT_IDS)]],     \
      device const int* kv_segment_ids [[buffer(JFM_BUFFER_KV_SEGMENT_IDS)]], \
      device const uchar* bias [[buffer(JFM_BUFFER_BIAS)]],                 \
      device const uchar* mask [[buffer(JFM_BUFFER_MASK)]],                 \
      device const float* sinks [[buffer(JFM_BUFFER_SINKS)]],               \
      device const uint* dropout [[buffer(JFM_BUFFER_DROPOUT)]],            \
      device const float* alibi_slopes [[buffer(JFM_BUFFER_ALIBI_SLOPES)]]
#define JFM_FEATURE_BUFFERS                                                              \
  jfm_feature_buffers(q_segment_ids, kv_segment_ids, bias, mask, sinks, dropout, \
                      alibi_slopes)

inline JfmFeatureBuffers jfm_feature_buffers(device const int* q_segment_ids,
                                             device const int* kv_segment_ids,
                                             device const uchar* bias, device const uchar* mask,
                                             device const float* sinks,
                                             device const uint* dropout,
                                             device const float* alibi_slopes) {
  JfmFeatureBuffers in;
  in.q_segment_ids = q_segment_ids;
  in.kv_segment_ids = kv_segment_ids;
  in.bias = bias;
  in.mask = mask;
  in.sinks = sinks;
  in.dropout = dropout;
  in.alibi_slopes = alibi_slopes;
  return in;
}

// Features that change the score or hide single elements; a kernel takes its feature loop iff
// one is set (sinks only enter the row statistic, after the loop).
inline bool jfm_has_score_features(constant AttentionParams& p) {
  return jfm_fc_score_features && (p.has_mask != 0 || p.has_bias != 0 ||
                                    p.has_segment_ids != 0 || p.soft_cap > 0.0f ||
                                    p.has_alibi != 0);
}

// Features that hide elements inside the band: a tile with any of them is never FULL (ALiBi
// only changes scores, so it keeps FULL tiles FULL).
inline bool jfm_has_element_features(constant AttentionParams& p) {
  return jfm_fc_score_features && (p.has_mask != 0 || p.has_bias != 0 || p.has_segment_ids != 0);
}

// Whether the call has sinks (uniform).
inline bool jfm_has_sinks(constant AttentionParams& p) { return jfm_fc_sinks && p.has_sinks != 0; }

// Whether the dQ kernel writes dbias, or the ALiBi slopes' gradient (uniform).
inline bool jfm_bias_grad(constant AttentionParams& p) {
  return jfm_fc_score_features && p.bias_grad != 0;
}
inline bool jfm_alibi_grad(constant AttentionParams& p) {
  return jfm_fc_score_features && p.alibi_grad != 0;
}

// ---- addressing ----

// Element offsets of (b, h, i, 0) in the bias and in the mask: 64-bit, computed once per row
// (or per block), never per element. With ALiBi also the head's slope and the signed distance
// i + off - j of the element from the aligned diagonal (j = 0 here), which the steps below
// move with j and i like the offsets.
struct JfmFeatureRow {
  ulong bias;
  ulong mask;
  float slope;   // slope[b, h]; 0 without ALiBi
  int diagonal;  // i + off - j
};

inline ulong jfm_feature_offset(constant jfm_long* strides, uint b, uint h, long i) {
  return ulong(b) * ulong(strides[0]) + ulong(h) * ulong(strides[1]) +
         ulong(i) * ulong(strides[2]);
}

// The ALiBi slope of head h in batch b (b < batch, h < num_heads), 0 without ALiBi: read once
// per row (or per head of a key block), never per element.
inline float jfm_alibi_slope(constant AttentionParams& p, JfmFeatureBuffers in, uint b, uint h) {
  return jfm_fc_score_features && p.has_alibi != 0 ? in.alibi_slopes[ulong(b) * p.num_heads + h]
                                                   : 0.0f;
}

// off: the row's causal alignment offset (jfm_alignment_offset); slope: jfm_alibi_slope.
inline JfmFeatureRow jfm_feature_row(constant AttentionParams& p, uint b, uint h, long i,
                                     long off, float slope) {
  JfmFeatureRow r;
  r.bias = jfm_feature_offset(p.bias_strides, b, h, i);
  r.mask = jfm_feature_offset(p.mask_strides, b, h, i);
  r.slope = slope;
  r.diagonal = int(i + off);
  return r;
}

// Key j of a row: the key axis is contiguous or broadcast (stride 1 or 0), so a 32-bit index.
inline JfmFeatureRow jfm_feature_at(constant AttentionParams& p, JfmFeatureRow row, int j) {
  row.bias += uint(j) * uint(p.bias_strides[3]);
  row.mask += uint(j) * uint(p.mask_strides[3]);
  row.diagonal -= j;
  return row;
}

// Element (i + r, j) from the offsets of row i (jfm_feature_row): the dK/dV kernels walk a key
// across the rows of a query block, r < its block size, in 32-bit steps (r * Tkv + j < 2^32).
inline JfmFeatureRow jfm_feature_below(constant AttentionParams& p, JfmFeatureRow row, int r,
                                       int j) {
  row.bias += uint(r) * uint(p.bias_strides[2]) + uint(j) * uint(p.bias_strides[3]);
  row.mask += uint(r) * uint(p.mask_strides[2]) + uint(j) * uint(p.mask_strides[3]);
  row.diagonal += r - j;
  return row;
}

// ---- one element ----

// The bias at an offset as float (0 without a bias): stored in the dtype of q (T) or float32.
template <typename T>
inline float jfm_bias_at(constant AttentionParams& p, device const uchar* bias, ulong offset) {
  if (p.has_bias == JFM_BIAS_FLOAT32) {
    return ((device const float*)bias)[offset];
  }
  return p.has_bias == JFM_BIAS_OF_Q ? jfm_to_float(((device const T*)bias)[offset]) : 0.0f;
}

// tanh(s / c) of the scaled score s = scale * q.k, for soft_cap c > 0: the capped score is c
// times it, its derivative 1 - tanh^2 (the backward). A non-finite q.k becomes NaN first (tanh
// would turn an Inf into a finite 1).
inline float jfm_soft_cap_tanh(constant AttentionParams& p, float qk) {
  return precise::tanh(jfm_finite_or_nan(qk * p.scale) / p.soft_cap);
}

// |i + off - j| of an element (jfm_feature_at), the distance ALiBi multiplies by -slope and the
// factor of the slope's gradient: exact in float32 below 2^24.
inline float jfm_alibi_distance(JfmFeatureRow at) {
  return float(abs(at.diagonal));
}

// The score of an element from its q.k sum (the MMA result), bias and ALiBi term
// -slope * |i + off - j|, in float32 as the API defines it: cap(scale q.k) + (bias + ALiBi),
// the sum as the xla implementation forms it. Without cap, bias and ALiBi it is the plain
// kernels' S bit for bit. A non-finite q.k becomes NaN before the cap, and a +inf/NaN bias or
// a non-finite ALiBi term gives NaN: they propagate.
inline float jfm_feature_score(constant AttentionParams& p, float qk, float bias,
                               JfmFeatureRow at) {
  const float s =
      p.soft_cap > 0.0f ? p.soft_cap * jfm_soft_cap_tanh(p, qk) : jfm_finite_or_nan(qk * p.scale);
  if (p.has_bias == 0 && p.has_alibi == 0) {
    return s;
  }
  const float added = p.has_alibi != 0 ? bias - at.slope * jfm_alibi_distance(at) : bias;
  // A finite bias at the float range (finfo.min, an additive mask) saturates, as the float32
  // score of jax.nn stays finite. A +inf bias poisons.
  return jfm_is_finite(added) ? jfm_saturate_score(s + added) : jfm_finite_or_nan(added);
}

// d(score)/d(scale q.k) of the soft cap, 1 - tanh^2, the factor dS takes before dQ and dK
// (dbias is dS itself); 1 without a cap.
inline float jfm_soft_cap_slope(constant AttentionParams& p, float qk) {
  if (p.soft_cap <= 0.0f) {
    return 1.0f;
  }
  const float t = jfm_soft_cap_tanh(p, qk);
  return 1.0f - t * t;
}

// Whether the features keep an element that the band rules show: mask byte != 0, equal segment
// ids, bias != -inf (an additive -inf hides the key exactly as a False mask entry does). Call it
// for band-visible elements only: their offsets are in bounds, others' need not be.
inline bool jfm_feature_keeps(constant AttentionParams& p, device const uchar* mask,
                              ulong mask_offset, int q_segment, int kv_segment, float bias) {
  return (p.has_mask == 0 || mask[mask_offset] != 0) &&
         (p.has_segment_ids == 0 || q_segment == kv_segment) &&
         (p.has_bias == 0 || as_type<uint>(bias) != 0xff800000u);  // -inf, a bit test
}

// Score and visibility of element (i, j), one definition for every kernel: returns whether it
// is visible and sets s, its score. band_visible is the band rules' verdict; with `features`
// the element at `at` (jfm_feature_at) must also pass jfm_feature_keeps and s is
// jfm_feature_score (bias and ALiBi at `at`), else s is the plain S = q.k * scale. The features'
// buffers
// are read for band-visible elements only (others' offsets need not be in bounds).
template <typename T>
inline bool jfm_element(constant AttentionParams& p, bool features, JfmFeatureBuffers in,
                        JfmFeatureRow at, int q_segment, int kv_segment, bool band_visible,
                        float qk, thread float& s) {
  if (!features || !band_visible) {
    s = jfm_finite_or_nan(qk * p.scale);
    return band_visible;
  }
  const float bias = jfm_bias_at<T>(p, in.bias, at.bias);
  s = jfm_feature_score(p, qk, bias, at);
  return jfm_feature_keeps(p, in.mask, at.mask, q_segment, kv_segment, bias);
}

// ---- segment ids of a block, kept in its tile's row padding ----
//
// Every tile row has 16 bytes of padding after its D elements (jfm_tile_stride) that no
// fragment reads and no tile load writes, so a row's segment id lives there: the plain kernels'
// threadgroup memory stays as it is, and restaging the row's data (K then V in one buffer)
// leaves the id in place.

template <typename T, int D>
inline threadgroup int* jfm_segment_slot(threadgroup T* tile, int row) {
  return (threadgroup int*)(tile + row * jfm_tile_stride<T>(D) + D);
}

// The ids of rows [0, R) of a block, with jfm_load_tile_runs' row mapping: row r = s * run + t
// holds ids[t] when r < rows and t in [valid_begin, valid_end), else 0 (never compared: such
// rows are outside every band). All THREADS threads call it; a barrier must follow.
template <typename T, int R, int D, int THREADS>
inline void jfm_stage_segment_ids(threadgroup T* tile, device const int* ids, uint run,
                                  int rows, int valid_begin, int valid_end, uint thread_index) {
  for (uint r = thread_index; r < uint(R); r += THREADS) {
    const int t = int(r % run);
    const bool valid = int(r) < rows && t >= valid_begin && t < valid_end;
    *jfm_segment_slot<T, D>(tile, int(r)) = valid ? ids[t] : 0;
  }
}

template <typename T, int D>
inline int jfm_segment_of(threadgroup const T* tile, int row) {
  return *(threadgroup const int*)(tile + row * jfm_tile_stride<T>(D) + D);
}

// [min, max] of the staged ids of rows [begin, end) (empty, lo > hi, when begin >= end). Every
// thread computes the same range, so decisions on it are threadgroup-uniform.
template <typename T, int D>
inline JfmRange32 jfm_segment_range(threadgroup const T* tile, int begin, int end) {
  JfmRange32 r;
  r.lo = 0x7fffffff;
  r.hi = -0x7fffffff - 1;
  for (int row = begin; row < end; ++row) {
    const int id = jfm_segment_of<T, D>(tile, row);
    r.lo = min(r.lo, id);
    r.hi = max(r.hi, id);
  }
  return r;
}

// ---- a tile ----

// The classification of a (row block, column block) tile with the features: SKIP when the band
// skips it or when the blocks' segment-id ranges cannot meet (no equal pair: packed sequences
// that never see each other cost nothing), never FULL when an element feature may hide an entry
// the band shows. rows_segments/cols_segments: jfm_segment_range of the two blocks (unused
// without segment ids).
inline int jfm_classify_feature_tile(constant AttentionParams& p, int band_kind,
                                     JfmRange32 rows_segments, JfmRange32 cols_segments) {
  if (band_kind == JFM_TILE_SKIP ||
      (p.has_segment_ids != 0 &&
       (rows_segments.hi < cols_segments.lo || cols_segments.hi < rows_segments.lo))) {
    return JFM_TILE_SKIP;
  }
  return jfm_has_element_features(p) ? JFM_TILE_EDGE : band_kind;
}

// ---- sinks ----

// Folds the sink of head h (a logit with no value) into a row's statistics: m becomes
// max(m, sink), l the sum over the keys and the sink relative to it. Returns the factor the
// row's unnormalised O is rescaled by (0 for a row that saw no key: m was the sentinel).
// Afterwards l >= 1, so no row is empty: O = 0 there, m = the sink and log(l) = 0.
inline float jfm_fold_sink(float sink, thread float& m, thread float& l) {
  // A finite sink saturates like a score (jfm_saturate_score); -inf stays "no sink".
  const float saturated = jfm_is_finite(sink) ? jfm_saturate_score(sink) : sink;
  const float m_all = max(m, saturated);
  const float alpha = jfm_exp(m, m_all);
  l = l * alpha + jfm_exp(saturated, m_all);
  m = m_all;
  return alpha;
}

#endif  // JAX_FLASH_METAL_FLASH_ATTENTION_FEATURES_H_
