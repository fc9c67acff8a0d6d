// XLA FFI handlers (typed FFI, api_version 1) of the flash-attention custom calls.
//
// One target per (direction, device): the device is fixed by the target, never by an attribute,
// so a compiled computation always runs where it was lowered for.
//
// Forward  args:    q [B,Tq,H,D], k [B,Tkv,HKV,D], v [B,Tkv,HKV,D], then the optional
//                   q_lengths int32 [B] and kv_lengths int32 [B] (in that order, each present
//                   only when its has_* attribute is true; bound as the handler's remaining args)
//          results: o [B,Tq,H,D] (dtype of q), lse float32 [B,H,Tq]
// Backward args:    q, k, v, o, lse, do [B,Tq,H,D], g_lse float32 [B,H,Tq], then the optional
//                   lengths as above
//          results: dq, dk, dv (shapes/dtypes of q, k, v), delta float32 [B,H,Tq] (workspace
//                   for D_i = rowsum(dO*O) - g_lse_i; the lowering allocates it as an XLA
//                   result so its memory is planned by XLA and shows in memory_analysis)
// Attributes (exact types): scale f32, is_causal i1, window_left i32, window_right i32
//   (-1 = unbounded), bottom_right i1, has_q_lengths i1, has_kv_lengths i1.
// q, k, v (and o, do, dq, dk, dv) share one dtype: f32, f16 or bf16.
#ifndef JAX_FLASH_METAL_ATTENTION_FFI_H_
#define JAX_FLASH_METAL_ATTENTION_FFI_H_

#include <cstdint>
#include <vector>

#include "dispatch_plan.h"
#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JfmAttentionFwdEmulator);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JfmAttentionBwdEmulator);
#ifdef JFM_HAVE_METAL
XLA_FFI_DECLARE_HANDLER_SYMBOL(JfmAttentionFwdMetal);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JfmAttentionBwdMetal);
#endif

namespace jfm {

// The kernels a call runs, in order, with their grids and estimated work: forward the fwd
// kernel; backward bwd_preprocess (D), bwd_dq, bwd_dkdv. The handlers cut exactly these into
// submissions with plan_submissions (dispatch_plan.h); tests read them through _ext.
std::vector<StageShape> attention_stages(bool backward, const char* dtype_suffix, int64_t batch,
                                         int64_t q_len, int64_t kv_len, int64_t heads,
                                         int64_t kv_heads, int64_t head_dim);

}  // namespace jfm

#endif  // JAX_FLASH_METAL_ATTENTION_FFI_H_
