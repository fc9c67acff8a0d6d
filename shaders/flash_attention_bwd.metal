// Backward attention (FlashAttention-2 recompute): a preprocess kernel for
// delta_i = rowsum(dO_i * O_i) - g_lse_i, a dQ kernel parallel over query rows and a dK/dV kernel
// parallel over key rows that loops over its kv head's query-head group. Every output element is
// written by exactly one simdgroup: no atomics, bit-identical results run to run.
// With log2-domain scores s2 = scale * log2(e) * q.k (computed bit-identically to the forward),
// the softmax probability of a visible pair is p = exp2((s2 * ln2 - lse) * log2(e))
// (jfm_probability), dS = p * (dO.v - delta), dQ = scale * dS K, dK = scale * dS^T Q, dV = P^T dO.
#include "flash_attention_common.h"

// ---- preprocess: no threadgroup memory ----

#define JFM_BWD_PREPROCESS_SIGNATURE(T)                                   \
  (device const T* o [[buffer(JFM_BUFFER_O)]],                            \
   device const T* d_o [[buffer(JFM_BUFFER_DO)]],                         \
   device const float* g_lse [[buffer(JFM_BUFFER_G_LSE)]],                \
   device const int* q_lengths [[buffer(JFM_BUFFER_Q_LENGTHS)]],          \
   device float* delta [[buffer(JFM_BUFFER_DELTA)]],                      \
   constant AttentionParams& params [[buffer(JFM_BUFFER_PARAMS)]],        \
   uint3 group [[threadgroup_position_in_grid]],                          \
   uint simd_index [[simdgroup_index_in_threadgroup]],                    \
   uint lane [[thread_index_in_simdgroup]])

// One simdgroup per query row: lanes take dims lane + 32 * c, simd_sum reduces. Rows past the
// batch's q_len get 0 and read nothing.
template <typename T, int D>
kernel void flash_attention_bwd_preprocess JFM_BWD_PREPROCESS_SIGNATURE(T) {
  const JfmTile tile = jfm_tile_of(params, group);
  const long i = long(tile.block) * JFM_ROWS_PER_GROUP + long(simd_index);
  const uint h = tile.head;
  const uint b = tile.batch;
  if (i >= long(params.q_len)) {
    return;
  }
  const ulong stat_index = jfm_stat_offset(b, h, i, params.num_heads, params.q_len);
  const long q_valid = jfm_valid_len(params.has_q_lengths, q_lengths, b, params.q_len);
  if (i >= q_valid) {
    if (lane == 0) {
      delta[stat_index] = 0.0f;
    }
    return;
  }
  const ulong row = jfm_row_offset(b, i, h, params.q_len, params.num_heads, D);
  float partial = 0.0f;
  for (uint d = lane; d < uint(D); d += JFM_SIMD_WIDTH) {
    partial = fma(jfm_to_float(d_o[row + d]), jfm_to_float(o[row + d]), partial);
  }
  const float total = simd_sum(partial);
  if (lane == 0) {
    delta[stat_index] = total - g_lse[stat_index];
  }
}

// ---- dQ: threadgroup memory (2 * JFM_ROWS_PER_GROUP * D + JFM_ROWS_PER_GROUP * 2 * 32) floats
// = 32 * D + 1024 bytes: 1536 B for D = 16 up to 9216 B for D = 256 ----

#define JFM_BWD_SIGNATURE(T, OUTPUTS)                                     \
  (device const T* q [[buffer(JFM_BUFFER_Q)]],                            \
   device const T* k [[buffer(JFM_BUFFER_K)]],                            \
   device const T* v [[buffer(JFM_BUFFER_V)]],                            \
   device const T* d_o [[buffer(JFM_BUFFER_DO)]],                         \
   device const float* lse [[buffer(JFM_BUFFER_LSE)]],                    \
   device const float* delta [[buffer(JFM_BUFFER_DELTA)]],                \
   device const int* q_lengths [[buffer(JFM_BUFFER_Q_LENGTHS)]],          \
   device const int* kv_lengths [[buffer(JFM_BUFFER_KV_LENGTHS)]],        \
   OUTPUTS,                                                               \
   constant AttentionParams& params [[buffer(JFM_BUFFER_PARAMS)]],        \
   uint3 group [[threadgroup_position_in_grid]],                          \
   uint simd_index [[simdgroup_index_in_threadgroup]],                    \
   uint lane [[thread_index_in_simdgroup]])

#define JFM_DQ_OUTPUTS(T) device T* dq [[buffer(JFM_BUFFER_DQ)]]
#define JFM_DKDV_OUTPUTS(T) \
  device T* dk [[buffer(JFM_BUFFER_DK)]], device T* dv [[buffer(JFM_BUFFER_DV)]]

// One simdgroup per query row i of head h: over the row's visible keys in blocks of 32, lane t
// recomputes p and dS for key (block start + t); dS goes through threadgroup memory and each lane
// accumulates its dims of dS K. Empty rows (and rows past q_len) write 0 and read no K/V.
// The dS tile is double-buffered, so one simdgroup_barrier per block suffices (see the forward).
template <typename T, int D>
kernel void flash_attention_bwd_dq JFM_BWD_SIGNATURE(T, JFM_DQ_OUTPUTS(T)) {
  threadgroup float q_tile[JFM_ROWS_PER_GROUP * D];
  threadgroup float do_tile[JFM_ROWS_PER_GROUP * D];
  threadgroup float ds_tile[JFM_ROWS_PER_GROUP * 2 * JFM_SIMD_WIDTH];

  const JfmTile tile = jfm_tile_of(params, group);
  const long i = long(tile.block) * JFM_ROWS_PER_GROUP + long(simd_index);
  const uint h = tile.head;
  const uint b = tile.batch;
  if (i >= long(params.q_len)) {
    return;
  }
  const uint hk = h / (params.num_heads / params.num_kv_heads);
  const long q_valid = jfm_valid_len(params.has_q_lengths, q_lengths, b, params.q_len);
  const long kv_valid = jfm_valid_len(params.has_kv_lengths, kv_lengths, b, params.kv_len);
  const JfmRange keys = jfm_keys_of_query(params, i, q_valid, kv_valid);

  const ulong row = jfm_row_offset(b, i, h, params.q_len, params.num_heads, D);
  if (keys.lo > keys.hi) {
    jfm_store_zero_row<T, D>(dq + row, lane);
    return;
  }

  threadgroup float* q_s = q_tile + simd_index * D;
  threadgroup float* do_s = do_tile + simd_index * D;
  threadgroup float* ds_s = ds_tile + simd_index * 2 * JFM_SIMD_WIDTH;
  jfm_stage_row<T, D>(q_s, q + row, params.scale_log2, lane);
  jfm_stage_row<T, D>(do_s, d_o + row, 1.0f, lane);
  simdgroup_barrier(mem_flags::mem_threadgroup);

  const ulong stat_index = jfm_stat_offset(b, h, i, params.num_heads, params.q_len);
  const float lse_i = lse[stat_index];
  const float delta_i = delta[stat_index];
  const ulong kv_head_base = jfm_row_offset(b, 0, hk, params.kv_len, params.num_kv_heads, D);
  const ulong kv_row_stride = ulong(params.num_kv_heads) * D;

  float acc[JFM_DIM_CHUNKS(D)];
  for (int c = 0; c < JFM_DIM_CHUNKS(D); ++c) {
    acc[c] = 0.0f;
  }

  uint tile_half = 0;  // which half of the double-buffered tile this block uses
  for (long start = keys.lo; start <= keys.hi; start += JFM_SIMD_WIDTH) {
    const long j = start + long(lane);
    float ds = 0.0f;
    if (j <= keys.hi) {
      const ulong key_row = kv_head_base + ulong(j) * kv_row_stride;
      const float p = jfm_probability(jfm_dot<T, D>(q_s, k + key_row), lse_i);
      ds = p * (jfm_dot<T, D>(do_s, v + key_row) - delta_i);
    }
    threadgroup float* ds_block = ds_s + tile_half;
    ds_block[lane] = ds;
    simdgroup_barrier(mem_flags::mem_threadgroup);
    const int n = int(jfm_min(keys.hi - start + 1, JFM_SIMD_WIDTH));
    for (int t = 0; t < n; ++t) {
      jfm_axpy_row<T, D>(acc, ds_block[t], k + kv_head_base + ulong(start + t) * kv_row_stride,
                         lane);
    }
    tile_half ^= JFM_SIMD_WIDTH;
  }

  jfm_store_row<T, D>(dq + row, acc, params.scale, lane);
}

// ---- dK/dV: threadgroup memory (2 * JFM_ROWS_PER_GROUP * D + 2 * JFM_ROWS_PER_GROUP * 2 * 32)
// floats = 32 * D + 2048 bytes: 2560 B for D = 16 up to 10240 B for D = 256 ----

// One simdgroup per key row j of kv head hk: for each query head of the group and each block of
// 32 queries that see key j, lane t recomputes p and dS for query (block start + t); p and dS go
// through threadgroup memory and each lane accumulates its dims of P^T dO and dS^T Q. Keys past
// kv_len and keys no query sees write 0. The p/dS tiles are double-buffered (one barrier a block).
template <typename T, int D>
kernel void flash_attention_bwd_dkdv JFM_BWD_SIGNATURE(T, JFM_DKDV_OUTPUTS(T)) {
  threadgroup float k_tile[JFM_ROWS_PER_GROUP * D];
  threadgroup float v_tile[JFM_ROWS_PER_GROUP * D];
  threadgroup float p_tile[JFM_ROWS_PER_GROUP * 2 * JFM_SIMD_WIDTH];
  threadgroup float ds_tile[JFM_ROWS_PER_GROUP * 2 * JFM_SIMD_WIDTH];

  const JfmTile tile = jfm_tile_of(params, group);
  const long j = long(tile.block) * JFM_ROWS_PER_GROUP + long(simd_index);
  const uint hk = tile.head;
  const uint b = tile.batch;
  if (j >= long(params.kv_len)) {
    return;
  }
  const long q_valid = jfm_valid_len(params.has_q_lengths, q_lengths, b, params.q_len);
  const long kv_valid = jfm_valid_len(params.has_kv_lengths, kv_lengths, b, params.kv_len);
  const JfmRange queries = jfm_queries_of_key(params, j, q_valid, kv_valid);

  const ulong key_row = jfm_row_offset(b, j, hk, params.kv_len, params.num_kv_heads, D);
  if (queries.lo > queries.hi) {
    jfm_store_zero_row<T, D>(dk + key_row, lane);
    jfm_store_zero_row<T, D>(dv + key_row, lane);
    return;
  }

  threadgroup float* k_s = k_tile + simd_index * D;
  threadgroup float* v_s = v_tile + simd_index * D;
  threadgroup float* p_s = p_tile + simd_index * 2 * JFM_SIMD_WIDTH;
  threadgroup float* ds_s = ds_tile + simd_index * 2 * JFM_SIMD_WIDTH;
  jfm_stage_row<T, D>(k_s, k + key_row, 1.0f, lane);
  jfm_stage_row<T, D>(v_s, v + key_row, 1.0f, lane);
  simdgroup_barrier(mem_flags::mem_threadgroup);

  const uint group_size = params.num_heads / params.num_kv_heads;
  const ulong q_row_stride = ulong(params.num_heads) * D;

  float dk_acc[JFM_DIM_CHUNKS(D)];
  float dv_acc[JFM_DIM_CHUNKS(D)];
  for (int c = 0; c < JFM_DIM_CHUNKS(D); ++c) {
    dk_acc[c] = 0.0f;
    dv_acc[c] = 0.0f;
  }

  uint tile_half = 0;  // which half of the double-buffered tile this block uses
  for (uint g = 0; g < group_size; ++g) {
    const uint h = hk * group_size + g;
    const ulong head_base = jfm_row_offset(b, 0, h, params.q_len, params.num_heads, D);
    const ulong stat_base = jfm_stat_offset(b, h, 0, params.num_heads, params.q_len);
    for (long start = queries.lo; start <= queries.hi; start += JFM_SIMD_WIDTH) {
      const long i = start + long(lane);
      float p = 0.0f;
      float ds = 0.0f;
      if (i <= queries.hi) {
        // Query i sees key j, so its row is not empty and its LSE is finite.
        const ulong q_row = head_base + ulong(i) * q_row_stride;
        // Scaled like the forward's staged q row, so the score matches it bit for bit.
        p = jfm_probability(jfm_dot_scaled<T, D>(q + q_row, params.scale_log2, k_s),
                            lse[stat_base + ulong(i)]);
        ds = p * (jfm_dot<T, D>(v_s, d_o + q_row) - delta[stat_base + ulong(i)]);
      }
      threadgroup float* p_block = p_s + tile_half;
      threadgroup float* ds_block = ds_s + tile_half;
      p_block[lane] = p;
      ds_block[lane] = ds;
      simdgroup_barrier(mem_flags::mem_threadgroup);
      const int n = int(jfm_min(queries.hi - start + 1, JFM_SIMD_WIDTH));
      for (int t = 0; t < n; ++t) {
        const ulong q_row = head_base + ulong(start + t) * q_row_stride;
        jfm_axpy_row<T, D>(dv_acc, p_block[t], d_o + q_row, lane);
        jfm_axpy_row<T, D>(dk_acc, ds_block[t], q + q_row, lane);
      }
      tile_half ^= JFM_SIMD_WIDTH;
    }
  }

  jfm_store_row<T, D>(dk + key_row, dk_acc, params.scale, lane);
  jfm_store_row<T, D>(dv + key_row, dv_acc, 1.0f, lane);
}

// Explicit instantiations under the host names of attention_params.h.
#define JFM_INSTANTIATE_BWD(PRE_NAME, DQ_NAME, DKDV_NAME, T, D)                                \
  JFM_IF_FAMILY(T, D,                                                                          \
      template [[host_name(PRE_NAME)]] kernel void flash_attention_bwd_preprocess<T, D>        \
          JFM_BWD_PREPROCESS_SIGNATURE(T);                                                     \
      template [[host_name(DQ_NAME)]] kernel void flash_attention_bwd_dq<T, D>                 \
          JFM_BWD_SIGNATURE(T, JFM_DQ_OUTPUTS(T));                                             \
      template [[host_name(DKDV_NAME)]] kernel void flash_attention_bwd_dkdv<T, D>             \
          JFM_BWD_SIGNATURE(T, JFM_DKDV_OUTPUTS(T));)

JFM_INSTANTIATE_BWD("flash_attention_bwd_preprocess_f32_d16", "flash_attention_bwd_dq_f32_d16",
                    "flash_attention_bwd_dkdv_f32_d16", float, 16)
JFM_INSTANTIATE_BWD("flash_attention_bwd_preprocess_f32_d32", "flash_attention_bwd_dq_f32_d32",
                    "flash_attention_bwd_dkdv_f32_d32", float, 32)
JFM_INSTANTIATE_BWD("flash_attention_bwd_preprocess_f32_d48", "flash_attention_bwd_dq_f32_d48",
                    "flash_attention_bwd_dkdv_f32_d48", float, 48)
JFM_INSTANTIATE_BWD("flash_attention_bwd_preprocess_f32_d64", "flash_attention_bwd_dq_f32_d64",
                    "flash_attention_bwd_dkdv_f32_d64", float, 64)
JFM_INSTANTIATE_BWD("flash_attention_bwd_preprocess_f32_d80", "flash_attention_bwd_dq_f32_d80",
                    "flash_attention_bwd_dkdv_f32_d80", float, 80)
JFM_INSTANTIATE_BWD("flash_attention_bwd_preprocess_f32_d96", "flash_attention_bwd_dq_f32_d96",
                    "flash_attention_bwd_dkdv_f32_d96", float, 96)
JFM_INSTANTIATE_BWD("flash_attention_bwd_preprocess_f32_d128", "flash_attention_bwd_dq_f32_d128",
                    "flash_attention_bwd_dkdv_f32_d128", float, 128)
JFM_INSTANTIATE_BWD("flash_attention_bwd_preprocess_f32_d160", "flash_attention_bwd_dq_f32_d160",
                    "flash_attention_bwd_dkdv_f32_d160", float, 160)
JFM_INSTANTIATE_BWD("flash_attention_bwd_preprocess_f32_d192", "flash_attention_bwd_dq_f32_d192",
                    "flash_attention_bwd_dkdv_f32_d192", float, 192)
JFM_INSTANTIATE_BWD("flash_attention_bwd_preprocess_f32_d256", "flash_attention_bwd_dq_f32_d256",
                    "flash_attention_bwd_dkdv_f32_d256", float, 256)
JFM_INSTANTIATE_BWD("flash_attention_bwd_preprocess_f16_d16", "flash_attention_bwd_dq_f16_d16",
                    "flash_attention_bwd_dkdv_f16_d16", half, 16)
JFM_INSTANTIATE_BWD("flash_attention_bwd_preprocess_f16_d32", "flash_attention_bwd_dq_f16_d32",
                    "flash_attention_bwd_dkdv_f16_d32", half, 32)
JFM_INSTANTIATE_BWD("flash_attention_bwd_preprocess_f16_d48", "flash_attention_bwd_dq_f16_d48",
                    "flash_attention_bwd_dkdv_f16_d48", half, 48)
JFM_INSTANTIATE_BWD("flash_attention_bwd_preprocess_f16_d64", "flash_attention_bwd_dq_f16_d64",
                    "flash_attention_bwd_dkdv_f16_d64", half, 64)
JFM_INSTANTIATE_BWD("flash_attention_bwd_preprocess_f16_d80", "flash_attention_bwd_dq_f16_d80",
                    "flash_attention_bwd_dkdv_f16_d80", half, 80)
JFM_INSTANTIATE_BWD("flash_attention_bwd_preprocess_f16_d96", "flash_attention_bwd_dq_f16_d96",
                    "flash_attention_bwd_dkdv_f16_d96", half, 96)
JFM_INSTANTIATE_BWD("flash_attention_bwd_preprocess_f16_d128", "flash_attention_bwd_dq_f16_d128",
                    "flash_attention_bwd_dkdv_f16_d128", half, 128)
JFM_INSTANTIATE_BWD("flash_attention_bwd_preprocess_f16_d160", "flash_attention_bwd_dq_f16_d160",
                    "flash_attention_bwd_dkdv_f16_d160", half, 160)
JFM_INSTANTIATE_BWD("flash_attention_bwd_preprocess_f16_d192", "flash_attention_bwd_dq_f16_d192",
                    "flash_attention_bwd_dkdv_f16_d192", half, 192)
JFM_INSTANTIATE_BWD("flash_attention_bwd_preprocess_f16_d256", "flash_attention_bwd_dq_f16_d256",
                    "flash_attention_bwd_dkdv_f16_d256", half, 256)
JFM_INSTANTIATE_BWD("flash_attention_bwd_preprocess_bf16_d16", "flash_attention_bwd_dq_bf16_d16",
                    "flash_attention_bwd_dkdv_bf16_d16", ushort, 16)
JFM_INSTANTIATE_BWD("flash_attention_bwd_preprocess_bf16_d32", "flash_attention_bwd_dq_bf16_d32",
                    "flash_attention_bwd_dkdv_bf16_d32", ushort, 32)
JFM_INSTANTIATE_BWD("flash_attention_bwd_preprocess_bf16_d48", "flash_attention_bwd_dq_bf16_d48",
                    "flash_attention_bwd_dkdv_bf16_d48", ushort, 48)
JFM_INSTANTIATE_BWD("flash_attention_bwd_preprocess_bf16_d64", "flash_attention_bwd_dq_bf16_d64",
                    "flash_attention_bwd_dkdv_bf16_d64", ushort, 64)
JFM_INSTANTIATE_BWD("flash_attention_bwd_preprocess_bf16_d80", "flash_attention_bwd_dq_bf16_d80",
                    "flash_attention_bwd_dkdv_bf16_d80", ushort, 80)
JFM_INSTANTIATE_BWD("flash_attention_bwd_preprocess_bf16_d96", "flash_attention_bwd_dq_bf16_d96",
                    "flash_attention_bwd_dkdv_bf16_d96", ushort, 96)
JFM_INSTANTIATE_BWD("flash_attention_bwd_preprocess_bf16_d128", "flash_attention_bwd_dq_bf16_d128",
                    "flash_attention_bwd_dkdv_bf16_d128", ushort, 128)
JFM_INSTANTIATE_BWD("flash_attention_bwd_preprocess_bf16_d160", "flash_attention_bwd_dq_bf16_d160",
                    "flash_attention_bwd_dkdv_bf16_d160", ushort, 160)
JFM_INSTANTIATE_BWD("flash_attention_bwd_preprocess_bf16_d192", "flash_attention_bwd_dq_bf16_d192",
                    "flash_attention_bwd_dkdv_bf16_d192", ushort, 192)
JFM_INSTANTIATE_BWD("flash_attention_bwd_preprocess_bf16_d256", "flash_attention_bwd_dq_bf16_d256",
                    "flash_attention_bwd_dkdv_bf16_d256", ushort, 256)
