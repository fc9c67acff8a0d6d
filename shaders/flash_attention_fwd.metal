// Forward attention: O = softmax(scale * Q K^T, masked) V and LSE (natural log), FlashAttention-2
// online softmax in float32. See shaders/README.md for the dispatch shape and tiling.
#include "flash_attention_common.h"

// Threadgroup memory: (JFM_ROWS_PER_GROUP * D + JFM_ROWS_PER_GROUP * 2 * 32) floats
// = 16 * D + 1024 bytes: 1280 B for D = 16 up to 5120 B for D = 256.
#define JFM_FWD_SIGNATURE(T)                                              \
  (device const T* q [[buffer(JFM_BUFFER_Q)]],                            \
   device const T* k [[buffer(JFM_BUFFER_K)]],                            \
   device const T* v [[buffer(JFM_BUFFER_V)]],                            \
   device const int* q_lengths [[buffer(JFM_BUFFER_Q_LENGTHS)]],          \
   device const int* kv_lengths [[buffer(JFM_BUFFER_KV_LENGTHS)]],        \
   device T* o [[buffer(JFM_BUFFER_O)]],                                  \
   device float* lse [[buffer(JFM_BUFFER_LSE)]],                          \
   constant AttentionParams& params [[buffer(JFM_BUFFER_PARAMS)]],        \
   uint3 group [[threadgroup_position_in_grid]],                          \
   uint simd_index [[simdgroup_index_in_threadgroup]],                    \
   uint lane [[thread_index_in_simdgroup]])

// One simdgroup per query row i of head h in batch b. Keys are visited in blocks of 32 over the
// row's visible interval only; lane t scores key (block start + t) with a full dot product against
// the query row staged in threadgroup memory (pre-multiplied by scale * log2(e), so scores feed
// exp2), the block's probabilities go through threadgroup memory, and each lane accumulates its
// own output dims lane + 32 * c. Per block the lanes meet twice: simd_max for the running max and
// one simdgroup_barrier publishing p. The p tile is double-buffered (a block's writes cannot
// overtake reads of the block before last, which precede the previous block's barrier), and each
// lane keeps its own share of the softmax denominator, summed once at the end.
template <typename T, int D>
kernel void flash_attention_fwd JFM_FWD_SIGNATURE(T) {
  threadgroup float q_tile[JFM_ROWS_PER_GROUP * D];
  threadgroup float p_tile[JFM_ROWS_PER_GROUP * 2 * JFM_SIMD_WIDTH];

  const JfmTile tile = jfm_tile_of(params, group);
  const long i = long(tile.block) * JFM_ROWS_PER_GROUP + long(simd_index);
  const uint h = tile.head;
  const uint b = tile.batch;
  if (i >= long(params.q_len)) {
    return;  // the whole simdgroup leaves together; no threadgroup-wide barrier follows
  }
  const uint hk = h / (params.num_heads / params.num_kv_heads);
  const long q_valid = jfm_valid_len(params.has_q_lengths, q_lengths, b, params.q_len);
  const long kv_valid = jfm_valid_len(params.has_kv_lengths, kv_lengths, b, params.kv_len);
  const JfmRange keys = jfm_keys_of_query(params, i, q_valid, kv_valid);

  device T* o_row = o + jfm_row_offset(b, i, h, params.q_len, params.num_heads, D);
  const ulong lse_index = jfm_stat_offset(b, h, i, params.num_heads, params.q_len);
  if (keys.lo > keys.hi) {
    // No visible key (or a row past q_len): exactly 0 and -inf, no K/V read.
    jfm_store_zero_row<T, D>(o_row, lane);
    if (lane == 0) {
      lse[lse_index] = jfm_negative_infinity();
    }
    return;
  }

  threadgroup float* q_s = q_tile + simd_index * D;
  threadgroup float* p_s = p_tile + simd_index * 2 * JFM_SIMD_WIDTH;
  jfm_stage_row<T, D>(q_s, q + jfm_row_offset(b, i, h, params.q_len, params.num_heads, D),
                      params.scale_log2, lane);
  simdgroup_barrier(mem_flags::mem_threadgroup);

  const ulong kv_head_base = jfm_row_offset(b, 0, hk, params.kv_len, params.num_kv_heads, D);
  const ulong kv_row_stride = ulong(params.num_kv_heads) * D;

  float m = JFM_MAX_SENTINEL;  // running max of log2-domain scores
  float l_lane = 0.0f;         // this lane's share of sum exp2(score - m)
  float acc[JFM_DIM_CHUNKS(D)];
  for (int c = 0; c < JFM_DIM_CHUNKS(D); ++c) {
    acc[c] = 0.0f;
  }

  uint tile_half = 0;  // which half of the double-buffered tile this block uses
  for (long start = keys.lo; start <= keys.hi; start += JFM_SIMD_WIDTH) {
    const long j = start + long(lane);
    const bool visible = j <= keys.hi;
    // Loads are guarded: keys outside [lo, hi] (padding past kv_len included) are never read.
    const float s = visible ? jfm_dot<T, D>(q_s, k + kv_head_base + ulong(j) * kv_row_stride)
                            : JFM_MASKED_SCORE;
    const float m_new = max(m, simd_max(s));
    const float p = visible ? exp2(s - m_new) : 0.0f;
    const float alpha = exp2(m - m_new);
    l_lane = l_lane * alpha + p;
    m = m_new;

    threadgroup float* p_block = p_s + tile_half;
    p_block[lane] = p;
    simdgroup_barrier(mem_flags::mem_threadgroup);
    for (int c = 0; c < JFM_DIM_CHUNKS(D); ++c) {
      acc[c] *= alpha;
    }
    const int n = int(jfm_min(keys.hi - start + 1, JFM_SIMD_WIDTH));
    for (int t = 0; t < n; ++t) {
      jfm_axpy_row<T, D>(acc, p_block[t], v + kv_head_base + ulong(start + t) * kv_row_stride,
                         lane);
    }
    tile_half ^= JFM_SIMD_WIDTH;
  }

  const float l = simd_sum(l_lane);
  jfm_store_row<T, D>(o_row, acc, 1.0f / l, lane);
  if (lane == 0) {
    lse[lse_index] = m * JFM_LN2 + log2(l) * JFM_LN2;  // see jfm_probability
  }
}

// Explicit instantiations under the host names of attention_params.h.
#define JFM_INSTANTIATE_FWD(NAME, T, D) \
  JFM_IF_FAMILY(T, D,                  \
      template [[host_name(NAME)]] kernel void flash_attention_fwd<T, D> JFM_FWD_SIGNATURE(T);)

JFM_INSTANTIATE_FWD("flash_attention_fwd_f32_d16", float, 16)
JFM_INSTANTIATE_FWD("flash_attention_fwd_f32_d32", float, 32)
JFM_INSTANTIATE_FWD("flash_attention_fwd_f32_d48", float, 48)
JFM_INSTANTIATE_FWD("flash_attention_fwd_f32_d64", float, 64)
JFM_INSTANTIATE_FWD("flash_attention_fwd_f32_d80", float, 80)
JFM_INSTANTIATE_FWD("flash_attention_fwd_f32_d96", float, 96)
JFM_INSTANTIATE_FWD("flash_attention_fwd_f32_d128", float, 128)
JFM_INSTANTIATE_FWD("flash_attention_fwd_f32_d160", float, 160)
JFM_INSTANTIATE_FWD("flash_attention_fwd_f32_d192", float, 192)
JFM_INSTANTIATE_FWD("flash_attention_fwd_f32_d256", float, 256)
JFM_INSTANTIATE_FWD("flash_attention_fwd_f16_d16", half, 16)
JFM_INSTANTIATE_FWD("flash_attention_fwd_f16_d32", half, 32)
JFM_INSTANTIATE_FWD("flash_attention_fwd_f16_d48", half, 48)
JFM_INSTANTIATE_FWD("flash_attention_fwd_f16_d64", half, 64)
JFM_INSTANTIATE_FWD("flash_attention_fwd_f16_d80", half, 80)
JFM_INSTANTIATE_FWD("flash_attention_fwd_f16_d96", half, 96)
JFM_INSTANTIATE_FWD("flash_attention_fwd_f16_d128", half, 128)
JFM_INSTANTIATE_FWD("flash_attention_fwd_f16_d160", half, 160)
JFM_INSTANTIATE_FWD("flash_attention_fwd_f16_d192", half, 192)
JFM_INSTANTIATE_FWD("flash_attention_fwd_f16_d256", half, 256)
JFM_INSTANTIATE_FWD("flash_attention_fwd_bf16_d16", ushort, 16)
JFM_INSTANTIATE_FWD("flash_attention_fwd_bf16_d32", ushort, 32)
JFM_INSTANTIATE_FWD("flash_attention_fwd_bf16_d48", ushort, 48)
JFM_INSTANTIATE_FWD("flash_attention_fwd_bf16_d64", ushort, 64)
JFM_INSTANTIATE_FWD("flash_attention_fwd_bf16_d80", ushort, 80)
JFM_INSTANTIATE_FWD("flash_attention_fwd_bf16_d96", ushort, 96)
JFM_INSTANTIATE_FWD("flash_attention_fwd_bf16_d128", ushort, 128)
JFM_INSTANTIATE_FWD("flash_attention_fwd_bf16_d160", ushort, 160)
JFM_INSTANTIATE_FWD("flash_attention_fwd_bf16_d192", ushort, 192)
JFM_INSTANTIATE_FWD("flash_attention_fwd_bf16_d256", ushort, 256)
