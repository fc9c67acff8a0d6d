// XLA FFI handlers (typed FFI, api_version 1) of the flash-attention custom calls.
//
// One target per (direction, device): the device is fixed by the target, never by an attribute,
// so a compiled computation always runs where it was lowered for.
//
// Forward  args:    q [B,Tq,H,D], k [B,Tkv,HKV,D], v [B,Tkv,HKV,D], then the optional
//                   q_lengths int32 [B] and kv_lengths int32 [B] (in that order, each present
//                   only when its has_* attribute is true; bound as the handler's remaining args),
//                   then the optional feature operands below
//          results: o [B,Tq,H,D] (dtype of q), lse float32 [B,H,Tq] (natural log, -inf for a
//                   row with no visible key), row_max and log_sum float32 [B,H,Tq] each (the
//                   residuals the backward needs: the row's maximum score m and log(l) of its
//                   softmax sum relative to m, kept apart so that P = exp((S - m) - log l) is
//                   exact at any score offset; JFM_EMPTY_ROW_MAX and 0 for an empty row),
//                   workspace float32 [decode_workspace_elements(...)] (the decode's split
//                   partials; [0] when the tiled forward runs; planned by XLA like the
//                   backward's delta)
// Backward args:    q, k, v, o, row_max, log_sum (the forward's), do [B,Tq,H,D], g_lse float32
//                   [B,H,Tq] (the LSE cotangent), then the optional
//                   lengths as above
//          results: dq, dk, dv (shapes/dtypes of q, k, v), dbias float32 [B,H,Tq,Tkv] with
//                   bias_grad, else float32 [0], dalibi float32 [B,H,Tq] with alibi_grad, else
//                   float32 [0] (see the optional features below), delta
//                   float32 [B,H,Tq] (workspace for D_i = rowsum(dO*O) - g_lse_i; the lowering
//                   allocates it as an XLA result so its memory is planned by XLA and shows in
//                   memory_analysis)
// Attributes: JFM_FFI_ATTRIBUTES below, the same for both targets, each of its exact type.
// q, k, v (and o, do, dq, dk, dv) share one dtype: f32, f16 or bf16.
//
// Optional features (docs/design.md#scores; shaders/flash_attention_features.h). The contract below
// is fixed; the kernels of both directions (forward tiled and decode, backward) implement all of
// it.
//   Operands, after the lengths, in this order, each present only when its flag is set; both
//   directions take the same ones (so a call's forward and backward lower to one
//   implementation):
//     q_segment_ids int32 [B, Tq], kv_segment_ids int32 [B, Tkv]   (has_segment_ids)
//     bias  [b, h, tq, tkv], dtype of q or f32                      (has_bias)
//     mask  bool or uint8 [b, h, tq, tkv], 0 = hidden, else visible (has_mask; JAX bool bytes)
//     sinks float32 [H]                                              (has_sinks)
//     alibi_slopes float32 [B, H]                                    (has_alibi)
//     page_table int32 [B, max_pages]                                (has_page_table; forward)
//     dropout uint32 [B, H, 4]                                       (dropout_rate > 0)
//   bias and mask are rank 4 with each axis 1 (broadcast) or the full size of [B, H, Tq, Tkv]
//   (jax_flash_metal.validation makes them so; the lowering converts a bias of another float
//   dtype to float32). An absent operand's buffer index is bound to a placeholder the kernels
//   never read; AttentionParams.has_bias is JFM_BIAS_OF_Q or JFM_BIAS_FLOAT32;
//   logits_soft_cap must be >= 0 and finite. The handler derives per-axis element strides
//   over [B, H, Tq, Tkv] from the dims, 0 on a broadcast axis, and passes them in
//   AttentionParams (bias_strides / mask_strides, 64-bit); a tile reads bias[b, h, i, j] at
//   b*s0 + h*s1 + i*s2 + j*s3. Query head h of the group of kv head h / (H / HKV) indexes h.
//   Semantics: score = scale*q.k, then c*tanh(score/c) with logits_soft_cap c > 0, then
//   + (bias - alibi_slopes[b, h] * |i + off_b - j|) (off_b the alignment offset of the lengths);
//   a -inf bias entry, a 0 mask byte or unequal segment ids hide the key exactly as the band
//   rules do (never NaN); +inf/NaN bias propagates. Sinks join each row's denominator:
//   lse = log(exp(sink_h) + sum exp(score)), o = 0 and lse = sink_h for an empty row.
//   Dropout (shaders/flash_attention_dropout.h): per (batch row, query head) the key's two
//   words and the (b, n) of the keep mask's counter; P V takes P * M / (1 - rate), the LSE and
//   residuals are the undropped scores', and the backward recomputes M (dV from P * M / (1 -
//   rate), dP times M / (1 - rate)). A forward with dropout always runs the tiled kernel, never
//   the split-KV decode (dropout is a training feature; decode_splits is 0 then).
//   Backward: the sinks need no kernel work (lse includes them; dsinks is computed by XLA from
//   O, LSE, dO and g_lse). With bias_grad (the bias's gradient is wanted) the dbias result is
//   float32 [B, H, Tq, Tkv], the full layout, written row block by row block by the dQ kernel
//   (the one owner of each (b, h, row block): no atomics, deterministic): dS = P (dP - D) at
//   visible entries, 0 everywhere else (hidden entries, skipped tiles, rows past the valid
//   length), so every element is written; the lowering sums it over the bias's broadcast axes
//   in XLA. A reduced layout would need several owners per entry (atomics) or a second pass.
//   Without bias_grad the result is [0] (like the forward's workspace): no Tq x Tkv buffer
//   exists. The soft cap's derivative (1 - tanh^2) multiplies dS before dQ and dK, not dbias.
//   With alibi_grad the dQ kernel also writes dalibi float32 [B, H, Tq], per row
//   -sum_j dS_ij |i + off_b - j| (0 for rows past the valid length); the lowering sums it over
//   Tq to the slopes' gradient [B, H]. Without alibi_grad it is [0].
//   A paged K/V cache (has_page_table, the forward only; the backward refuses it): k and v are
//   pages [num_pages, page_size, HKV, D], page_size a power of two >= 16
//   (jfm_page_size_supported), kv_len = max_pages * page_size is the logical length that the
//   segment ids, bias and mask are laid out over, and logical key j of batch b is row
//   j % page_size of page page_table[b, j / page_size]. The kernels read the table entries of
//   the pages that hold keys they visit only (never one past kv_lengths[b], which is then
//   required), and clamp an entry to [0, num_pages).
#ifndef JAX_FLASH_METAL_ATTENTION_FFI_H_
#define JAX_FLASH_METAL_ATTENTION_FFI_H_

#include <cstdint>

#include "xla/ffi/api/api.h"

// The static attributes of both targets, once: X(C++ type, name) each, with float = f32,
// double = f64, int32_t = i32 and bool = i1 (pred). Both handlers decode them into one jfm::Attributes
// (attention_ffi.cc), the extension lists them (_ext.ffi_attributes()) and the Python lowering
// builds its attribute dict from that list (ffi_lowering._attributes), so a lowering and a
// handler cannot disagree. To add an attribute: one line here, its static parameter in
// jax_flash_metal/contract.py (a StaticParams field, not in HOST_ONLY_PARAMS; tests/test_ffi.py
// checks the two lists agree), and its use in the handlers (make_params in attention_ffi.cc
// copies attributes into AttentionParams).
//   scale            f32   multiplies q.k
//   is_causal        i1
//   window_left      i32   keys visible before a query's diagonal; -1 = unbounded
//   window_right     i32   keys visible after it; -1 = unbounded
//   bottom_right     i1    the diagonal (and window) aligned to the bottom-right corner
//   has_*            i1    which optional operands follow the main ones (see below)
//   logits_soft_cap  f32   c of c * tanh(score / c); 0 = no cap
//   dropout_rate     f64   in [0, 1); > 0: a dropout operand follows the sinks. f64 so that
//                          floor(rate 2^32), the keep threshold, is the Python side's exactly
//   kernel_variant   i32   the kernels' tile variant, 0 .. JFM_TILE_VARIANTS - 1
//                          (shaders/tile_shapes.h; decode_vector and decode_combine have one)
//   bias_grad        i1    backward only (false on the forward): the dbias result is wanted;
//                          needs has_bias
//   alibi_grad       i1    backward only (false on the forward): the dalibi result is wanted;
//                          needs has_alibi
#define JFM_FFI_ATTRIBUTES(X) \
  X(float, scale)             \
  X(bool, is_causal)          \
  X(int32_t, window_left)     \
  X(int32_t, window_right)    \
  X(bool, bottom_right)       \
  X(bool, has_q_lengths)      \
  X(bool, has_kv_lengths)     \
  X(bool, has_segment_ids)    \
  X(bool, has_bias)           \
  X(bool, has_mask)           \
  X(bool, has_sinks)          \
  X(float, logits_soft_cap)   \
  X(bool, has_alibi)          \
  X(bool, has_page_table)     \
  X(double, dropout_rate)     \
  X(int32_t, kernel_variant)  \
  X(bool, bias_grad)          \
  X(bool, alibi_grad)

namespace jfm {

// The attributes of a call, decoded by XLA (XLA_FFI_REGISTER_STRUCT_ATTR_DECODING): one field
// per JFM_FFI_ATTRIBUTES entry, in its order.
struct Attributes {
#define JFM_ATTRIBUTE_FIELD(type, name) type name;
  JFM_FFI_ATTRIBUTES(JFM_ATTRIBUTE_FIELD)
#undef JFM_ATTRIBUTE_FIELD
};

}  // namespace jfm

XLA_FFI_DECLARE_HANDLER_SYMBOL(JfmAttentionFwdEmulator);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JfmAttentionBwdEmulator);
#ifdef JFM_HAVE_METAL
XLA_FFI_DECLARE_HANDLER_SYMBOL(JfmAttentionFwdMetal);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JfmAttentionBwdMetal);
#endif

#endif  // JAX_FLASH_METAL_ATTENTION_FFI_H_
