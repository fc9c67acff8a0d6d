// The contract between the host (ffi/) and the attention kernels (shaders/*.metal).
// Valid both as Metal Shading Language and as C++: the host includes it directly, and the
// shader source embedded for run-time Metal compilation has it inlined at build time.
#ifndef JAX_FLASH_METAL_ATTENTION_PARAMS_H_
#define JAX_FLASH_METAL_ATTENTION_PARAMS_H_

#include "tile_shapes.h"

#ifndef __METAL_VERSION__
#include <cstddef>
#include <cstdint>
namespace jfm {
typedef uint32_t uint;
typedef int64_t jfm_long;
#else
typedef long jfm_long;  // 64-bit in MSL
#endif

// Window bound meaning "no bound on this side".
#define JFM_UNBOUNDED (-1)

// Buffer indices ([[buffer(n)]]), one table for every kernel; each kernel binds a subset.
#define JFM_BUFFER_Q 0
#define JFM_BUFFER_K 1
#define JFM_BUFFER_V 2
#define JFM_BUFFER_O 3
#define JFM_BUFFER_LSE 4
#define JFM_BUFFER_DO 5
#define JFM_BUFFER_DELTA 6
#define JFM_BUFFER_G_LSE 7
#define JFM_BUFFER_Q_LENGTHS 8
#define JFM_BUFFER_KV_LENGTHS 9
#define JFM_BUFFER_DQ 10
#define JFM_BUFFER_DK 11
#define JFM_BUFFER_DV 12
#define JFM_BUFFER_PARAMS 13
#define JFM_BUFFER_ROW_MAX 14   // the forward's residuals: the row maximum m ...
#define JFM_BUFFER_WORKSPACE 15  // the decode's float32 split partials (jfm_decode_workspace_row)
// Optional features (ffi/attention_ffi.h, shaders/flash_attention_features.h).
#define JFM_BUFFER_Q_SEGMENT_IDS 16
#define JFM_BUFFER_KV_SEGMENT_IDS 17
#define JFM_BUFFER_BIAS 18
#define JFM_BUFFER_MASK 19
#define JFM_BUFFER_SINKS 20
#define JFM_BUFFER_DBIAS 21
#define JFM_BUFFER_LOG_SUM 22   // ... and log(l) of its softmax sum (JFM_EMPTY_ROW_MAX)
#define JFM_BUFFER_DROPOUT 23   // uint32 [B, H, JFM_DROPOUT_WORDS] (flash_attention_dropout.h)
#define JFM_BUFFER_DALIBI 24
#define JFM_BUFFER_PAGE_TABLE 25  // int32 [B, kv_len / page_size] of a paged K/V cache
#define JFM_BUFFER_ALIBI_SLOPES 26

// Words per (batch, query head) of the dropout operand: the key's two words, the counter's
// (b, n) and the global position maps of rows and keys (JfmDropout).
#define JFM_DROPOUT_WORDS 8

// AttentionParams::has_bias: no bias, a bias in the dtype of q, or a float32 bias.
#define JFM_BIAS_NONE 0
#define JFM_BIAS_OF_Q 1
#define JFM_BIAS_FLOAT32 2

// The forward's residuals (float32 [B, H, Tq] each, what the backward recomputes P from) are
// the row's maximum score m and log(l), l its softmax sum relative to m, in natural log:
// P = exp2((S - m) log2(e) - log(l) log2(e)). Kept apart, not as m + log(l), because S - m is
// exact for nearby float32 scores while m + log(l) rounds to m when |m| is huge (a row hidden
// by an additive -1e9 mask). A row with no visible key stores m = JFM_EMPTY_ROW_MAX, log(l) = 0:
// finite, so no infinity enters any arithmetic (fast-math safe), and so large that P is exactly
// 0 for every score |s| <= JFM_SCORE_LIMIT. The user's natural-log LSE of such a row is -inf.
#define JFM_EMPTY_ROW_MAX 8.50705917e37f

// Scores and statistics are natural-log float32 values; the kernels take exp2 of a difference
// times JFM_LOG2E (one definition for host and kernels).
#define JFM_LOG2E 1.44269504088896341f

// Dispatch shapes (threads and rows per threadgroup, per kernel, dtype and head dim) are in
// tile_shapes.h. Kernels declare all threadgroup memory statically (no [[threadgroup(n)]]
// arguments).

// Bound at JFM_BUFFER_PARAMS as `constant AttentionParams&`. Layout is plain 4-byte fields, then
// 8-byte fields at an 8-byte-aligned offset, so host C++ and MSL agree on it without padding.
struct AttentionParams {
  uint batch;
  uint q_len;         // allocated query length Tq
  uint kv_len;        // allocated key/value length Tkv
  uint num_heads;     // H
  uint num_kv_heads;  // HKV, divides H (grouped-query attention)
  uint head_dim;      // D, equal to the kernel's template head dim
  float scale;        // softmax scale, used literally
  uint padding;       // keeps the 8-byte fields 8-byte aligned (offset 120)
  int window_left;    // local window, inclusive; JFM_UNBOUNDED = none
  int window_right;
  uint causal;        // 1: key j visible only if j <= i + off
  uint bottom_right;  // causal/window alignment: off = kv_len_b - q_len_b (else 0)
  uint has_q_lengths;   // 1: int32 [batch] bound at JFM_BUFFER_Q_LENGTHS
  uint has_kv_lengths;  // 1: int32 [batch] bound at JFM_BUFFER_KV_LENGTHS
  // A call split into several submissions (GPU watchdog) runs each part as its own grid: the
  // threadgroup at grid position (x, y, z) works on row block x + block_offset, head
  // y + head_offset and batch z + batch_offset (jfm_tile_of in flash_attention_common.h).
  uint block_offset;
  uint head_offset;
  uint batch_offset;
  uint splits;  // decode only: key splits per (batch, kv head), the pass-1 grid's x extent
  // Optional features (ffi/attention_ffi.h, shaders/flash_attention_features.h).
  uint has_segment_ids;  // 1: int32 [B, Tq] / [B, Tkv] at JFM_BUFFER_{Q,KV}_SEGMENT_IDS
  uint has_bias;         // JFM_BIAS_*: bias at JFM_BUFFER_BIAS, strides in bias_strides
  uint has_mask;         // 1: uchar mask at JFM_BUFFER_MASK, strides in mask_strides
  uint has_sinks;        // 1: float [H] at JFM_BUFFER_SINKS
  uint bias_grad;        // 1: the dQ kernel writes dbias float [B, H, Tq, Tkv] at JFM_BUFFER_DBIAS
  float soft_cap;        // c > 0: scores become c * tanh(score / c) before the bias; 0 = none
  uint has_alibi;        // 1: float [B, H] slopes at JFM_BUFFER_ALIBI_SLOPES
  uint alibi_grad;       // 1: the dQ kernel writes float [B, H, Tq] at JFM_BUFFER_DALIBI, row i's
                         // share -sum_j dS_ij |i + off - j| of d(loss)/d(slope[b, h])
  // Dropout (flash_attention_dropout.h): a Philox word >= floor(rate 2^32) keeps its entry,
  // weighted float(1 / (1 - rate)); dropout_scale 0 = no dropout.
  uint dropout_threshold;
  float dropout_scale;
  // A paged K/V cache (flash_attention_key_blocks.h): K and V are pages [num_pages, page_size,
  // HKV, D] and logical key j of batch b is row j % page_size of page
  // page_table[b, j / page_size] (JFM_BUFFER_PAGE_TABLE); kv_len is the logical length.
  uint page_size;        // a power of two >= 16 (jfm_page_size_supported); 0 = contiguous K/V
  uint num_pages;
  // Element strides over [B, H, Tq, Tkv], 0 on a broadcast axis; 64-bit because b and h
  // strides of a full bias exceed 2^31 elements at long lengths. 8-byte aligned (offset 120).
  jfm_long bias_strides[4];
  jfm_long mask_strides[4];
};

#ifndef __METAL_VERSION__
static_assert(offsetof(AttentionParams, bias_strides) == 120 && sizeof(AttentionParams) == 184,
              "AttentionParams layout must match the shaders");
}  // namespace jfm
#endif

#endif  // JAX_FLASH_METAL_ATTENTION_PARAMS_H_
