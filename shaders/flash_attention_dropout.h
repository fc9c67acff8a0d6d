// Attention dropout's keep mask in the kernels (docs/design.md#dropout), bit for bit the
// construction of jax_flash_metal/core/dropout.py: M[b, n, i, j] keeps its entry iff word j % 4
// of Philox-4x32-10 (Salmon et al., SC 2011) of the counter (j / 4, i, n, b) under the key
// (key0, key1) is >= AttentionParams::dropout_threshold = floor(rate 2^32); a kept entry weighs
// dropout_scale = float(1 / (1 - rate)). i and j are global positions: the call's row r is
// i = q_first + q_stride r and its key c is j = k_first + k_stride c (a slice of a longer
// sequence). The key words, (b, n) and the maps come from the dropout operand, uint32
// [B, H, JFM_DROPOUT_WORDS], at (batch, query head). The mask is recomputed wherever P is formed
// (forward, dQ, dK/dV), never stored. MSL 3.0 (C++14 base).
#ifndef JAX_FLASH_METAL_FLASH_ATTENTION_DROPOUT_H_
#define JAX_FLASH_METAL_FLASH_ATTENTION_DROPOUT_H_

#include "flash_attention_tiles.h"

// Philox-4x32's round multipliers and key increments (Weyl constants), as in Random123.
#define JFM_PHILOX_M0 0xD2511F53u
#define JFM_PHILOX_M1 0xCD9E8D57u
#define JFM_PHILOX_W0 0x9E3779B9u
#define JFM_PHILOX_W1 0xBB67AE85u
#define JFM_PHILOX_ROUNDS 10

// Philox-4x32-10 of `counter` under the key (key0, key1): the four output words. mulhi is MSL's
// high 32 bits of the 64-bit product; the low 32 bits are the wrapping uint product.
inline uint4 jfm_philox4x32(uint4 counter, uint key0, uint key1) {
  uint c0 = counter.x, c1 = counter.y, c2 = counter.z, c3 = counter.w;
  for (int r = 0; r < JFM_PHILOX_ROUNDS; ++r) {
    if (r > 0) {
      key0 += JFM_PHILOX_W0;
      key1 += JFM_PHILOX_W1;
    }
    const uint hi0 = mulhi(JFM_PHILOX_M0, c0), lo0 = JFM_PHILOX_M0 * c0;
    const uint hi1 = mulhi(JFM_PHILOX_M1, c2), lo1 = JFM_PHILOX_M1 * c2;
    c0 = hi1 ^ c1 ^ key0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ key1;
    c3 = lo0;
  }
  return uint4(c0, c1, c2, c3);
}

// The dropout operand's entry of one (batch, query head), in its order: the key's words, the
// (b, n) of the counter (the call's own indices unless vmap or sharding moved the rows) and the
// global positions of the call's rows and keys (0 and 1 unless the sequence was split).
struct JfmDropout {
  uint key0;
  uint key1;
  uint b;
  uint n;
  uint q_first;
  uint q_stride;
  uint k_first;
  uint k_stride;
};

// Whether the call has dropout (uniform): the host sets dropout_scale >= 1 exactly then.
inline bool jfm_has_dropout(constant AttentionParams& p) {
  return jfm_fc_dropout && p.dropout_scale != 0.0f;
}

// The entry of batch b, query head h; read only with dropout (else a placeholder is bound).
inline JfmDropout jfm_dropout_of(constant AttentionParams& p, device const uint* dropout, uint b,
                                 uint h) {
  JfmDropout d = {0u, 0u, 0u, 0u, 0u, 1u, 0u, 1u};
  if (jfm_has_dropout(p)) {
    device const uint* entry = dropout + (ulong(b) * p.num_heads + h) * JFM_DROPOUT_WORDS;
    d.key0 = entry[0];
    d.key1 = entry[1];
    d.b = entry[2];
    d.n = entry[3];
    d.q_first = entry[4];
    d.q_stride = entry[5];
    d.k_first = entry[6];
    d.k_stride = entry[7];
  }
  return d;
}

// M / (1 - rate) of one Philox word: dropout_scale where kept, 0 where dropped.
inline float jfm_dropout_weight(constant AttentionParams& p, uint word) {
  return word >= p.dropout_threshold ? p.dropout_scale : 0.0f;
}

// The global query position of the call's row i, and of its key j.
inline uint jfm_dropout_row(JfmDropout d, long i) { return d.q_first + d.q_stride * uint(i); }
inline uint jfm_dropout_key(JfmDropout d, int j) { return d.k_first + d.k_stride * uint(j); }

// The four words of global query position gi's global keys [4 (gj / 4), 4 (gj / 4) + 4).
inline uint4 jfm_dropout_words(JfmDropout d, uint gi, uint gj) {
  return jfm_philox4x32(uint4(gj >> 2, gi, d.n, d.b), d.key0, d.key1);
}

// The weight of the call's element (i, j) alone (one Philox per element: the dK/dV kernels,
// whose lane holds one key across several queries).
inline float jfm_dropout_at(constant AttentionParams& p, JfmDropout d, long i, int j) {
  const uint gj = jfm_dropout_key(d, j);
  return jfm_dropout_weight(p, jfm_dropout_words(d, jfm_dropout_row(d, i), gj)[gj & 3u]);
}

// Multiplies this lane's elements of a row band's KF fragments (the call's query row i, keys
// j0 + 8n + at.col + e, with at.col even and j0 a multiple of 8) by their weights M / (1 - rate).
// The lane's two keys share one Philox call when they map to one group of 4 (unit key stride
// from an even k_first, as in every unsplit call); else each key has its own.
template <int KF>
inline void jfm_drop_row(thread JfmFrag* f, constant AttentionParams& p, JfmDropout d, long i,
                         int j0, JfmFragCoord at) {
  const uint gi = jfm_dropout_row(d, i);
  const bool pairs = d.k_stride == 1u && (d.k_first & 1u) == 0u;
  JFM_PRAGMA_UNROLL
  for (int n = 0; n < KF; ++n) {
    const int j = j0 + n * 8 + int(at.col);
    const uint g0 = jfm_dropout_key(d, j), g1 = jfm_dropout_key(d, j + 1);
    const uint4 w0 = jfm_dropout_words(d, gi, g0);
    const uint4 w1 = pairs ? w0 : jfm_dropout_words(d, gi, g1);
    f[n].thread_elements()[0] *= jfm_dropout_weight(p, w0[g0 & 3u]);
    f[n].thread_elements()[1] *= jfm_dropout_weight(p, w1[g1 & 3u]);
  }
}

#endif  // JAX_FLASH_METAL_FLASH_ATTENTION_DROPOUT_H_
