// The Metal function constants every attention kernel is specialised by: one bool per optional
// feature group, so that the pipeline of a call holds only the code its features use (Metal
// compiles `if (constant)` away where the constant is false; MSL spec, "Function Constants").
// Valid both as Metal Shading Language and as C++, like attention_params.h: the indices and the
// host's rule (jfm_function_constants) are shared, the declarations are MSL only.
//
// A constant gates its feature's runtime flag in AttentionParams (`jfm_fc_x && p.has_x`), so the
// flag still carries the value; the host derives both from the same AttentionParams, so a call
// never has a feature whose constant is off. The emulator binds the constants per launch
// (emulator/README.md, "Function constants").
#ifndef JAX_FLASH_METAL_FUNCTION_CONSTANTS_H_
#define JAX_FLASH_METAL_FUNCTION_CONSTANTS_H_

#include "attention_params.h"

// [[function_constant(n)]] indices; bit n of a constant set (jfm_function_constants).
#define JFM_FC_CAUSAL 0          // p.causal
#define JFM_FC_LENGTHS 1         // p.has_q_lengths, p.has_kv_lengths
#define JFM_FC_SCORE_FEATURES 2  // bias, mask, segment ids, soft cap, ALiBi and their gradients
#define JFM_FC_SINKS 3           // p.has_sinks
#define JFM_FC_DROPOUT 4         // p.dropout_scale
#define JFM_FC_PAGED 5           // p.page_size
#define JFM_FUNCTION_CONSTANTS 6

#if defined(__METAL_VERSION__) && defined(JFM_SPECIALISED)
// The offline compile of one constant set (python -m jax_flash_metal.fused.shader_libraries
// --specialise): the set's values as literals, so the compiler keeps exactly the code a pipeline
// specialised with them keeps.
#define JFM_SPECIALISED_BIT(n) (((JFM_SPECIALISED) >> (n)) & 1) != 0
constant bool jfm_fc_causal = JFM_SPECIALISED_BIT(JFM_FC_CAUSAL);
constant bool jfm_fc_lengths = JFM_SPECIALISED_BIT(JFM_FC_LENGTHS);
constant bool jfm_fc_score_features = JFM_SPECIALISED_BIT(JFM_FC_SCORE_FEATURES);
constant bool jfm_fc_sinks = JFM_SPECIALISED_BIT(JFM_FC_SINKS);
constant bool jfm_fc_dropout = JFM_SPECIALISED_BIT(JFM_FC_DROPOUT);
constant bool jfm_fc_paged = JFM_SPECIALISED_BIT(JFM_FC_PAGED);
#elif defined(__METAL_VERSION__)
constant bool jfm_fc_causal [[function_constant(JFM_FC_CAUSAL)]];
constant bool jfm_fc_lengths [[function_constant(JFM_FC_LENGTHS)]];
constant bool jfm_fc_score_features [[function_constant(JFM_FC_SCORE_FEATURES)]];
constant bool jfm_fc_sinks [[function_constant(JFM_FC_SINKS)]];
constant bool jfm_fc_dropout [[function_constant(JFM_FC_DROPOUT)]];
constant bool jfm_fc_paged [[function_constant(JFM_FC_PAGED)]];
#else
namespace jfm {

// The constant set of a call: bit JFM_FC_x set iff the call uses feature x.
inline uint32_t jfm_function_constants(const AttentionParams& p) {
  const bool score = p.has_bias != 0 || p.has_mask != 0 || p.has_segment_ids != 0 ||
                     p.soft_cap > 0.0f || p.has_alibi != 0 || p.bias_grad != 0 ||
                     p.alibi_grad != 0;
  return (p.causal != 0 ? 1u << JFM_FC_CAUSAL : 0u) |
         (p.has_q_lengths != 0 || p.has_kv_lengths != 0 ? 1u << JFM_FC_LENGTHS : 0u) |
         (score ? 1u << JFM_FC_SCORE_FEATURES : 0u) |
         (p.has_sinks != 0 ? 1u << JFM_FC_SINKS : 0u) |
         (p.dropout_scale != 0.0f ? 1u << JFM_FC_DROPOUT : 0u) |
         (p.page_size != 0 ? 1u << JFM_FC_PAGED : 0u);
}

// The name of constant n (a JFM_FC_* index), nullptr beyond them: the Python package's
// function_constant_names and the emulator sanitizer's reports.
inline const char* jfm_function_constant_name(int n) {
  static const char* const names[JFM_FUNCTION_CONSTANTS] = {"causal", "lengths", "score_features",
                                                            "sinks",  "dropout", "paged"};
  return n >= 0 && n < JFM_FUNCTION_CONSTANTS ? names[n] : nullptr;
}

}  // namespace jfm
#endif

#endif  // JAX_FLASH_METAL_FUNCTION_CONSTANTS_H_
