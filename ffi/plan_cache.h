// The dispatch plan of a call from a small cache per thread, so that a repeated call (a decode
// step, a training step) plans nothing: attention_stages, the kernels' check and
// plan_submissions run once per static key; each call then only fills in its own buffers and
// parameters (attention_ffi.cc). Per thread, so the hot path takes no lock.
#ifndef JAX_FLASH_METAL_PLAN_CACHE_H_
#define JAX_FLASH_METAL_PLAN_CACHE_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "dispatch_plan.h"

namespace jfm {

class Device;

// Everything a call's plan depends on besides the submission budget: the device and the
// problem's static shape and attributes.
struct PlanKey {
  const Device* device = nullptr;
  const char* dtype_suffix = nullptr;  // "f32", "f16" or "bf16"
  bool backward = false, dropout = false;
  int variant = 0, gpu_cores = 0;
  int64_t batch = 0, q_len = 0, kv_len = 0, heads = 0, kv_heads = 0, head_dim = 0,
          value_head_dim = 0;

  bool operator==(const PlanKey& other) const;
};

// A call's stages (attention_stages) cut into submissions (plan_submissions).
struct CallPlan {
  std::vector<StageShape> stages;
  std::vector<ChunkedSubmission> submissions;
  size_t dispatches = 0;  // chunks over all submissions
  // Whether the device was found to have every stage's kernel: the caller checks once and sets
  // it (a kernel that exists stays available).
  bool kernels_found = false;
};

// The plan of `key` under a submission budget of `budget_multiply_adds`, planned on a miss
// in this thread's cache of the last kPlanCacheEntries keys. A cached plan serves a new budget
// when it was cut for the same one, or when both budgets hold the whole call (then every stage
// is one chunk of one submission either way), so the Metal device's refined throughput does
// not re-plan small calls. The reference is valid until this thread's next call.
constexpr size_t kPlanCacheEntries = 8;
CallPlan& cached_plan(const PlanKey& key, double budget_multiply_adds);

}  // namespace jfm

#endif  // JAX_FLASH_METAL_PLAN_CACHE_H_
