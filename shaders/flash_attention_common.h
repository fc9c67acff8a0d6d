// Shared helpers of the attention kernels: element conversion (f32/f16/bf16), per-batch lengths,
// Shared helpers of the attention kernels: element conversion (f32/f16/bf16), per-batch lengths,
// the visibility interval of docs/design.md#visibility, addressing, the softmax probability and
// the row statistics. MSL 3.0 (C++14 base).
#ifndef JAX_FLASH_METAL_FLASH_ATTENTION_COMMON_H_
#define JAX_FLASH_METAL_FLASH_ATTENTION_COMMON_H_

#include <metal_stdlib>

#include "attention_params.h"
#include "function_constants.h"
#include "kernel_families.h"

using namespace metal;

// Scores of masked lanes; simd_max ignores them next to any real score. Finite on purpose: the
// kernels never rely on infinities, so they behave the same under fast math.
#define JFM_MASKED_SCORE (-3.40282347e38f)
// The largest score magnitude (FLT_MAX / 4, natural units): finite scores beyond it saturate
// (jfm_saturate_score), so the difference of any two scores times log2(e) stays finite.
#define JFM_SCORE_LIMIT 8.50705917e37f
// Initial running max: the lowest saturated score, so a row whose every score saturates there (a
// bias of finfo.min, an additive mask) gets a uniform softmax, as jax.nn gives it.
#define JFM_MAX_SENTINEL (-JFM_SCORE_LIMIT)

// Before every loop over a fragment array (a thread-local array of simdgroup_matrix fragments or
// of per-lane values such as the decode's row sums, or a fragment's thread_elements()): a loop the
// compiler keeps rolled indexes the array at run time, which puts it in stack memory instead of
// registers. The emulator's strict pass rejects such a loop without it (shaders/README.md).
#define JFM_PRAGMA_UNROLL _Pragma("clang loop unroll(full)")

// ---- instantiation families (lazy compiles) ----

// JFM_IF_FAMILY(T, NAME, code) is `code` when the family (T, NAME) of kernel_families.h (element
// type, head-dim tag such as 64 or 128_v64) is being compiled, else nothing; every kernel
// instantiation goes through it. The emulator and the strict pass compile every family
// (JFM_ONE_FAMILY undefined). The Metal device compiles one family at a time, on first use, by
// defining JFM_ONE_FAMILY and JFM_FAMILY_<T>_<NAME> as JFM_SELECTED (e.g.
// JFM_FAMILY_half_64=JFM_SELECTED); an undefined JFM_FAMILY_<T>_<NAME> selects 0.
#ifdef JFM_ONE_FAMILY
#define JFM_SELECTED ~, 1
#define JFM_SECOND_(a, b, ...) b
#define JFM_SECOND(...) JFM_SECOND_(__VA_ARGS__)
#define JFM_CAT_(a, b) a##b
#define JFM_CAT(a, b) JFM_CAT_(a, b)
#define JFM_KEEP_1(...) __VA_ARGS__
#define JFM_KEEP_0(...)
#define JFM_IF_FAMILY(T, NAME, ...) \
  JFM_CAT(JFM_KEEP_, JFM_SECOND(JFM_FAMILY_##T##_##NAME, 0, ~))(__VA_ARGS__)
#else
#define JFM_IF_FAMILY(T, NAME, ...) __VA_ARGS__
#endif

// ---- element types: float, half, and bf16 held as ushort bits (bfloat needs MSL 3.1) ----

inline float jfm_to_float(float x) { return x; }
inline float jfm_to_float(half x) { return float(x); }
inline float jfm_to_float(ushort bf16_bits) { return as_type<float>(uint(bf16_bits) << 16); }

// Round to nearest even; a NaN stays a (quiet) NaN instead of rounding into an infinity.
inline ushort jfm_float_to_bf16(float x) {
  uint bits = as_type<uint>(x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    return ushort((bits >> 16) | 0x0040u);
  }
  uint rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return ushort((bits + rounding_bias) >> 16);
}

inline void jfm_store(device float* p, float x) { *p = x; }
inline void jfm_store(device half* p, float x) { *p = half(x); }
inline void jfm_store(device ushort* p, float x) { *p = jfm_float_to_bf16(x); }

inline float jfm_negative_infinity() { return as_type<float>(0xff800000u); }

// A score from a non-finite input (Inf or NaN in a visible q or k row) becomes NaN, so it
// poisons its row instead of vanishing as exp2(-inf) = 0. A bit test, valid under fast math.
inline float jfm_finite_or_nan(float x) {
  return (as_type<uint>(x) & 0x7f800000u) != 0x7f800000u ? x : as_type<float>(0x7fc00000u);
}

// A score with its magnitude clamped to JFM_SCORE_LIMIT (a finite input whose score is beyond
// it, e.g. a bias of finfo.min, saturates); an overflow to +-inf saturates, a NaN stays NaN. Bit
// tests, valid under fast math.
inline float jfm_saturate_score(float x) {
  const uint magnitude = as_type<uint>(x) & 0x7fffffffu;
  if (magnitude > 0x7f800000u) {
    return x;  // NaN
  }
  const float limit = as_type<float>((as_type<uint>(x) & 0x80000000u) |
                                     as_type<uint>(JFM_SCORE_LIMIT));
  return magnitude >= as_type<uint>(JFM_SCORE_LIMIT) ? limit : x;
}

// ---- grid position ----

// The (row block, head, batch) a threadgroup works on: its grid position plus the offsets of
// the submission it belongs to (AttentionParams).
struct JfmTile {
  uint block;
  uint head;
  uint batch;
};

inline JfmTile jfm_tile_of(constant AttentionParams& p, uint3 group) {
  JfmTile t;
  t.block = group.x + p.block_offset;
  t.head = group.y + p.head_offset;
  t.batch = group.z + p.batch_offset;
  return t;
}

// ---- lengths and visibility ----

inline long jfm_min(long a, long b) { return a < b ? a : b; }
inline long jfm_max(long a, long b) { return a > b ? a : b; }

// Valid length of batch b: the lengths buffer entry clamped to [0, allocated], read only if bound.
inline long jfm_valid_len(uint has_lengths, device const int* lengths, uint b, uint allocated) {
  if (!jfm_fc_lengths || has_lengths == 0) {
    return long(allocated);
  }
  return jfm_min(jfm_max(long(lengths[b]), 0), long(allocated));
}

// Inclusive index interval [lo, hi]; empty when lo > hi.
struct JfmRange {
  long lo;
  long hi;
};

inline long jfm_alignment_offset(constant AttentionParams& p, long q_valid, long kv_valid) {
  return p.bottom_right != 0 ? kv_valid - q_valid : 0;
}

// Keys visible to query row i: j < kv_valid, and with c = i + off, causal j <= c, window
// c - left <= j <= c + right. Empty for i >= q_valid. All conditions are bounds on j, so the
// visible set is one interval.
inline JfmRange jfm_keys_of_query(constant AttentionParams& p, long i, long q_valid,
                                  long kv_valid) {
  JfmRange r;
  r.lo = 0;
  r.hi = kv_valid - 1;
  if (i >= q_valid) {
    r.hi = -1;
    return r;
  }
  long c = i + jfm_alignment_offset(p, q_valid, kv_valid);
  if (jfm_fc_causal && p.causal != 0) {
    r.hi = jfm_min(r.hi, c);
  }
  if (p.window_right >= 0) {
    r.hi = jfm_min(r.hi, c + long(p.window_right));
  }
  if (p.window_left >= 0) {
    r.lo = jfm_max(r.lo, c - long(p.window_left));
  }
  return r;
}

// Queries that see key j: the same rule solved for i (causal i >= j - off, window
// j - off - right <= i <= j - off + left), i < q_valid. Empty for j >= kv_valid.
inline JfmRange jfm_queries_of_key(constant AttentionParams& p, long j, long q_valid,
                                   long kv_valid) {
  JfmRange r;
  r.lo = 0;
  r.hi = q_valid - 1;
  if (j >= kv_valid) {
    r.hi = -1;
    return r;
  }
  long c = j - jfm_alignment_offset(p, q_valid, kv_valid);
  if (jfm_fc_causal && p.causal != 0) {
    r.lo = jfm_max(r.lo, c);
  }
  if (p.window_right >= 0) {
    r.lo = jfm_max(r.lo, c - long(p.window_right));
  }
  if (p.window_left >= 0) {
    r.hi = jfm_min(r.hi, c + long(p.window_left));
  }
  return r;
}

// ---- addressing (64-bit: B * T * H * D can exceed 2^31) ----

// Element offset of row t of head h in a [batch, len, heads, D] tensor.
inline ulong jfm_row_offset(uint b, long t, uint h, uint len, uint heads, uint head_dim) {
  return ((ulong(b) * ulong(len) + ulong(t)) * ulong(heads) + ulong(h)) * ulong(head_dim);
}

// Offset of (b, h, t) in a float [batch, heads, len] tensor (LSE, delta).
inline ulong jfm_stat_offset(uint b, uint h, long t, uint heads, uint len) {
  return (ulong(b) * ulong(heads) + ulong(h)) * ulong(len) + ulong(t);
}

// ---- softmax ----

// fast::exp2 promises nothing for a non-finite argument (fast math: fast::exp2(-inf) need not be
// 0). Arguments here are finite, -inf (a -inf sink, i.e. no sink) or NaN (a poisoned score,
// which must stay NaN): -inf is clamped to a finite floor, where exp2 underflows to 0 exactly,
// and a NaN bypasses exp2 (a bit test). One max and one select per call.
#define JFM_EXP2_FLOOR (-256.0f)
inline float jfm_exp2(float x) {
  const float p = fast::exp2(max(x, JFM_EXP2_FLOOR));
  return (as_type<uint>(x) & 0x7fffffffu) > 0x7f800000u ? x : p;
}

// exp(s - m) as exp2((s - m) log2(e)). The difference comes first: it is exact for nearby float32
// scores, so a row whose every score sits at a huge offset (an additive -1e9 mask) keeps its
// softmax; folding log2(e) into the scores first would round them at that offset.
inline float jfm_exp(float s, float m) {
  return jfm_exp2((s - m) * JFM_LOG2E);
}

// Softmax probability of a score s given the row's residuals m and log2_l = log(l) log2(e)
// (jfm_log2_sum). The backward recomputes s bit for bit, so a row whose softmax is one-hot
// (l = 1) gets p = exp2(0) = 1 exactly; an empty row's JFM_EMPTY_ROW_MAX gives p = 0 without
// any infinity.
inline float jfm_probability(float s, float m, float log2_l) {
  return jfm_exp2((s - m) * JFM_LOG2E - log2_l);
}

// The residual log(l) in the base jfm_probability takes, once per row.
inline float jfm_log2_sum(float log_l) {
  return log_l * JFM_LOG2E;
}

// Writes row `stat`'s LSE and residuals from its max m and softmax sum l (relative to m):
// LSE = m + log(l), m and log(l) apart; a row with l = 0 saw no key and has no sink: LSE = -inf,
// m = JFM_EMPTY_ROW_MAX, log(l) = 0.
inline void jfm_store_statistics(device float* lse, device float* row_max, device float* log_sum,
                                 ulong stat, float m, float l) {
  const bool empty = l == 0.0f;
  const float log_l = precise::log(l);
  row_max[stat] = empty ? JFM_EMPTY_ROW_MAX : m;
  log_sum[stat] = empty ? 0.0f : log_l;
  lse[stat] = empty ? jfm_negative_infinity() : m + log_l;
}

#endif  // JAX_FLASH_METAL_FLASH_ATTENTION_COMMON_H_
