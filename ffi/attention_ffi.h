// XLA FFI handlers (typed FFI, api_version 1) of the flash-attention custom calls; their operands,
// results and attributes: docs/design.md#the-ffi-contract.
#ifndef JAX_FLASH_METAL_ATTENTION_FFI_H_
#define JAX_FLASH_METAL_ATTENTION_FFI_H_

#include <cstddef>
#include <cstdint>

#include "xla/ffi/api/api.h"

// The static attributes of both targets, once: X(C++ type, name) each, with float = f32,
// double = f64, int32_t = i32 and bool = i1 (pred). Both handlers decode them into one jfm::Attributes
// (attention_ffi.cc), the extension lists them (_ext.ffi_attributes()) and the Python lowering
// builds its attribute dict from that list (ffi_lowering._attributes), so a lowering and a
// handler cannot disagree. To add an attribute: one line here, its static parameter in
// jax_flash_metal/core/contract.py (a StaticParams field, not in HOST_ONLY_PARAMS; tests/fused/test_ffi.py
// checks the two lists agree), and its use in the handlers (make_params in attention_ffi.cc
// copies attributes into AttentionParams).
//   scale            f32   multiplies q.k
//   is_causal        i1
//   window_left      i32   keys visible before a query's diagonal; -1 = unbounded
//   window_right     i32   keys visible after it; -1 = unbounded
//   bottom_right     i1    the diagonal (and window) aligned to the bottom-right corner
//   has_*            i1    which optional operands follow the main ones (docs/design.md#the-ffi-contract)
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

// The optional operands after the main ones, once, in their operand order: X(name, flag) each,
// present exactly when the attribute `flag` is set (dropout_rate: when > 0). A handler finds an
// operand among its remaining args from this list (operand_slots in attention_ffi.cc), never by
// counting; jax_flash_metal/contract.py's Operands is the same list on the Python side, with
// the same flags (the extension lists this one: _ext.optional_operands(); tests/fused/test_ffi.py
// checks the two agree).
#define JFM_OPTIONAL_OPERANDS(X)     \
  X(q_lengths, has_q_lengths)        \
  X(kv_lengths, has_kv_lengths)      \
  X(q_segment_ids, has_segment_ids)  \
  X(kv_segment_ids, has_segment_ids) \
  X(bias, has_bias)                  \
  X(mask, has_mask)                  \
  X(sinks, has_sinks)                \
  X(alibi_slopes, has_alibi)         \
  X(page_table, has_page_table)      \
  X(dropout, dropout_rate)

namespace jfm {

// JFM_OPTIONAL_OPERANDS's entries, in order; kOperandCount counts them.
enum Operand : int {
#define JFM_OPERAND_ENUMERATOR(name, flag) kOperand_##name,
  JFM_OPTIONAL_OPERANDS(JFM_OPERAND_ENUMERATOR)
#undef JFM_OPERAND_ENUMERATOR
  kOperandCount
};

// The attributes of a call (decoded by attribute_decoding.h): one field per JFM_FFI_ATTRIBUTES
// entry, in its order.
struct Attributes {
#define JFM_ATTRIBUTE_FIELD(type, name) type name;
  JFM_FFI_ATTRIBUTES(JFM_ATTRIBUTE_FIELD)
#undef JFM_ATTRIBUTE_FIELD
};

// JFM_FFI_ATTRIBUTES's entries.
#define JFM_COUNT_ATTRIBUTE(type, name) +1
constexpr size_t kAttributeCount = 0 JFM_FFI_ATTRIBUTES(JFM_COUNT_ATTRIBUTE);
#undef JFM_COUNT_ATTRIBUTE

}  // namespace jfm

XLA_FFI_DECLARE_HANDLER_SYMBOL(JfmAttentionFwdEmulator);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JfmAttentionBwdEmulator);
#ifdef JFM_HAVE_METAL
XLA_FFI_DECLARE_HANDLER_SYMBOL(JfmAttentionFwdMetal);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JfmAttentionBwdMetal);
#endif

#endif  // JAX_FLASH_METAL_ATTENTION_FFI_H_
