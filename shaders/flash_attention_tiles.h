// The pieces every tiled kernel is built from (docs/kernels.md#conventions-of-every-tiled-kernel):
// cooperative tile loads device -> threadgroup, 8x8 simdgroup_matrix fragments in float, row
// reductions across a fragment's lanes, and block classification from the per-row visibility
// interval. MSL 3.0 (C++14 base).
#ifndef JAX_FLASH_METAL_FLASH_ATTENTION_TILES_H_
#define JAX_FLASH_METAL_FLASH_ATTENTION_TILES_H_

#include "flash_attention_common.h"

// ---- threadgroup tiles ----
//
// A tile holds R rows of D elements in the storage type T (float, half, or bf16 bits as ushort),
// each row padded by 16 bytes (spreads rows over threadgroup-memory banks), so the row stride is
// jfm_tile_stride<T>(D) elements.

template <typename T>
constexpr int jfm_tile_stride(int head_dim) {
  return head_dim + 16 / int(sizeof(T));
}

// 16-byte words: which bits of the elements of T packed in a uint word to keep so that every
// non-finite element (Inf or NaN) becomes 0.
inline uint jfm_finite_mask(uint word, float) {
  return (word & 0x7f800000u) == 0x7f800000u ? 0u : 0xffffffffu;
}
inline uint jfm_finite_mask16(uint word, uint exponent) {  // two 16-bit elements
  const uint lo = (word & exponent) == exponent ? 0u : 0x0000ffffu;
  const uint hi = ((word >> 16) & exponent) == exponent ? 0u : 0xffff0000u;
  return lo | hi;
}
inline uint jfm_finite_mask(uint word, half) { return jfm_finite_mask16(word, 0x7c00u); }
inline uint jfm_finite_mask(uint word, ushort) { return jfm_finite_mask16(word, 0x7f80u); }

// Cooperative copy of rows [0, R) of a block into a tile, the rows read in runs: row
// r = s * run + t (t < run) starts at src + s * run_stride + t * src_stride (run_stride may be
// negative: the runs of a paged block are pages in any order). Row r is read when r is in
// [row_begin, row_end) and t in [valid_begin, valid_end); every other row is zero-filled and
// never read (padding past a length, rows outside a block's visible union). All THREADS threads
// of the group call it with the same arguments; each moves 16 bytes per step. With SANITIZE, non-finite
// elements are stored as 0 and the return value says whether this thread met one (the caller
// publishes it): a value invisible to one row of an MMA must not reach it as 0 * NaN.
// src, src_stride, run_stride and dst must keep 16-byte alignment (D * sizeof(T) is a multiple
// of 16; declare the tile as threadgroup uint4 words and point a T* at it). LD: the tile's row
// stride in elements, by default its own; a narrower operand takes the wider one's in a buffer
// they share, so that it leaves the wider rows' padding (segment ids) untouched.
template <typename T, int R, int D, int THREADS, bool SANITIZE, int LD = jfm_tile_stride<T>(D)>
inline bool jfm_load_tile_runs(threadgroup T* dst, device const T* src, uint src_stride,
                               uint run, jfm_long run_stride, int row_begin, int row_end,
                               int valid_begin, int valid_end, uint thread_index) {
  static_assert((D * int(sizeof(T))) % 16 == 0, "tile rows must be whole 16-byte words");
  constexpr int WORDS = D * int(sizeof(T)) / 16;  // 16-byte words per row
  constexpr int STRIDE = LD;
  static_assert(LD >= jfm_tile_stride<T>(D), "a row's elements and padding fit its stride");
  bool nonfinite = false;
  for (uint w = thread_index; w < uint(R * WORDS); w += THREADS) {
    const int r = int(w / WORDS);
    const uint c = w % WORDS;
    const uint s = uint(r) / run;
    const int t = int(uint(r) - s * run);
    uint4 word = uint4(0u);
    if (r >= row_begin && r < row_end && t >= valid_begin && t < valid_end) {
      word = ((device const uint4*)(src + jfm_long(s) * run_stride + uint(t) * src_stride))[c];
      if (SANITIZE) {
        const uint4 keep = uint4(jfm_finite_mask(word.x, T()), jfm_finite_mask(word.y, T()),
                                 jfm_finite_mask(word.z, T()), jfm_finite_mask(word.w, T()));
        nonfinite = nonfinite || any(keep != uint4(0xffffffffu));
        word &= keep;
      }
    }
    ((threadgroup uint4*)(dst + r * STRIDE))[c] = word;
  }
  return nonfinite;
}

// The common case: one run, row r at src + r * src_stride.
template <typename T, int R, int D, int THREADS, bool SANITIZE, int LD = jfm_tile_stride<T>(D)>
inline bool jfm_load_tile(threadgroup T* dst, device const T* src, uint src_stride,
                          int valid_begin, int valid_end, uint thread_index) {
  return jfm_load_tile_runs<T, R, D, THREADS, SANITIZE, LD>(dst, src, src_stride, uint(R), 0,
                                                            valid_begin, valid_end, 0, R,
                                                            thread_index);
}

inline bool jfm_is_finite(float x) { return jfm_finite_mask(as_type<uint>(x), x) != 0u; }
inline bool jfm_is_finite(half x) { return (as_type<ushort>(x) & 0x7c00u) != 0x7c00u; }
inline bool jfm_is_finite(ushort bf16_bits) { return (bf16_bits & 0x7f80u) != 0x7f80u; }

// ---- 8x8 fragments ----
//
// simdgroup_matrix<float, 8, 8> everywhere (S, P, dP, dS and every accumulator are float; the
// inputs are converted from the storage type when a fragment is loaded). Lane L of a simdgroup
// holds row (q & 4) + (L / 2) % 4 and columns c, c + 1 of a fragment, c = (q & 2) * 2 +
// (L % 2) * 2, q = L / 4 (the Apple GPU layout, emulator/README.md): a lane owns one row of
// every fragment in its row band, and the 4 lanes that share a row differ in lane bits 0 and 3.

typedef simdgroup_matrix<float, 8, 8> JfmFrag;

struct JfmFragCoord {
  uint row;  // row of this lane's two elements in every fragment
  uint col;  // first of its two columns
};

inline JfmFragCoord jfm_frag_coord(uint lane) {
  const uint q = lane / 4;
  JfmFragCoord c;
  c.row = (q & 4u) + (lane / 2) % 4;
  c.col = (q & 2u) * 2 + (lane % 2) * 2;
  return c;
}

inline JfmFrag jfm_frag_zero() { return make_filled_simdgroup_matrix<float, 8, 8>(0.0f); }

// Fragment (r, c) = tile[r * stride + c], tile pointing at its (0, 0) element.
template <typename T>
inline JfmFrag jfm_frag_load(threadgroup const T* tile, uint stride, JfmFragCoord at) {
  JfmFrag f;
  threadgroup const T* p = tile + at.row * stride + at.col;
  f.thread_elements()[0] = jfm_to_float(p[0]);
  f.thread_elements()[1] = jfm_to_float(p[1]);
  return f;
}

// jfm_frag_load with Inf/NaN elements read as 0: the second operand of an edge block's product,
// whose masked entries are 0 and must not meet a non-finite value another row sees (0 * Inf).
template <typename T>
inline JfmFrag jfm_frag_load_finite(threadgroup const T* tile, uint stride, JfmFragCoord at) {
  JfmFrag f;
  threadgroup const T* p = tile + at.row * stride + at.col;
  f.thread_elements()[0] = jfm_is_finite(p[0]) ? jfm_to_float(p[0]) : 0.0f;
  f.thread_elements()[1] = jfm_is_finite(p[1]) ? jfm_to_float(p[1]) : 0.0f;
  return f;
}

// The transposed read: fragment (r, c) = tile[c * stride + r], e.g. a K^T fragment (head dims x
// keys) from a row-major K tile, so every tile is stored one way (row-major) only.
template <typename T>
inline JfmFrag jfm_frag_load_transposed(threadgroup const T* tile, uint stride,
                                        JfmFragCoord at) {
  JfmFrag f;
  f.thread_elements()[0] = jfm_to_float(tile[at.col * stride + at.row]);
  f.thread_elements()[1] = jfm_to_float(tile[(at.col + 1) * stride + at.row]);
  return f;
}

// acc += a * b (8x8x8, float accumulation).
inline void jfm_mma(thread JfmFrag& acc, thread const JfmFrag& a, thread const JfmFrag& b) {
  simdgroup_multiply_accumulate(acc, a, b, acc);
}

// Writes this lane's two elements of a fragment (scaled) to a device row segment: row points at
// column 0 of this lane's row.
template <typename T>
inline void jfm_frag_store_row(device T* row, thread const JfmFrag& f, float factor,
                               JfmFragCoord at) {
  jfm_store(row + at.col, f.thread_elements()[0] * factor);
  jfm_store(row + at.col + 1, f.thread_elements()[1] * factor);
}

// ---- row reductions over the 4 lanes that share a fragment row ----
// Uniform control flow only (every lane of the simdgroup calls them).

inline float jfm_row_max(float x) {
  x = max(x, simd_shuffle_xor(x, 1));
  return max(x, simd_shuffle_xor(x, 8));
}

inline float jfm_row_sum(float x) {
  x += simd_shuffle_xor(x, 1);
  return x + simd_shuffle_xor(x, 8);
}

// ---- block classification ----
//
// The visible interval [lo, hi] of a row (jfm_keys_of_query, or jfm_queries_of_key for dK/dV) has
// both bounds non-decreasing in the row index, so a block of rows [first, last] sees at most the
// union [lo(first), hi(last)], and a (row block, column block [c0, c1]) tile is classified from
// its first and last rows alone.

#define JFM_TILE_SKIP 0  // no row sees any column of the block
#define JFM_TILE_FULL 1  // every row sees every column: no per-element test
#define JFM_TILE_EDGE 2  // per-element `visible ? s : masked`

// Interval in 32-bit indices, clamped to [0, bound]: indices inside a head fit 32 bits.
struct JfmRange32 {
  int lo;
  int hi;  // empty when lo > hi
};

inline JfmRange32 jfm_range32(JfmRange r, long bound) {
  JfmRange32 out;
  out.lo = int(jfm_min(jfm_max(r.lo, 0), bound));
  out.hi = int(jfm_max(jfm_min(r.hi, bound - 1), -1));
  return out;
}

// first/last: the intervals of the block's first and last rows; rows_full: every row of the
// block is a real row (none past the valid length).
inline int jfm_classify_tile(JfmRange32 first, JfmRange32 last, bool rows_full, int c0, int c1) {
  if (last.hi < c0 || first.lo > c1 || first.lo > last.hi) {
    return JFM_TILE_SKIP;
  }
  // Bounds are monotone: lo is largest in the last row, hi smallest in the first.
  const bool full = rows_full && last.lo <= c0 && first.hi >= c1 && first.lo <= first.hi;
  return full ? JFM_TILE_FULL : JFM_TILE_EDGE;
}

inline bool jfm_visible(JfmRange32 r, int j) { return j >= r.lo && j <= r.hi; }

#endif  // JAX_FLASH_METAL_FLASH_ATTENTION_TILES_H_
