// See plan_cache.h.
#include "plan_cache.h"

#include <algorithm>
#include <array>
#include <cstring>

namespace jfm {
namespace {

struct Entry {
  bool used = false;
  PlanKey key;
  double budget = 0;      // the budget `plan` was cut for
  double whole_call = 0;  // the least budget that holds every stage in one chunk
  CallPlan plan;
};

struct Cache {
  std::array<Entry, kPlanCacheEntries> entries;
  size_t next = 0;  // the entry a miss replaces (round robin)
};

// A budget of at least this many multiply-adds plans the call as one submission of one chunk
// per stage (plan_submissions clamps each chunk's work at one multiply-add per threadgroup).
double whole_call_budget(const std::vector<StageShape>& stages) {
  double total = 0;
  for (const StageShape& s : stages) {
    total += static_cast<double>(s.blocks() * s.heads * s.batch) *
             std::max(s.multiply_adds_per_group, 1.0);
  }
  return total;
}

bool same_cut(const Entry& e, double budget) {
  return budget == e.budget || (budget >= e.whole_call && e.budget >= e.whole_call);
}

}  // namespace

bool PlanKey::operator==(const PlanKey& o) const {
  return device == o.device && std::strcmp(dtype_suffix, o.dtype_suffix) == 0 &&
         backward == o.backward && dropout == o.dropout && variant == o.variant &&
         gpu_cores == o.gpu_cores && batch == o.batch && q_len == o.q_len &&
         kv_len == o.kv_len && heads == o.heads && kv_heads == o.kv_heads &&
         head_dim == o.head_dim && value_head_dim == o.value_head_dim;
}

CallPlan& cached_plan(const PlanKey& key, double budget_multiply_adds) {
  thread_local Cache cache;
  Entry* entry = nullptr;
  for (Entry& e : cache.entries) {
    if (e.used && e.key == key) entry = &e;
  }
  if (entry != nullptr && same_cut(*entry, budget_multiply_adds)) return entry->plan;
  if (entry == nullptr) {  // a new key: plan its stages
    entry = &cache.entries[cache.next];
    cache.next = (cache.next + 1) % kPlanCacheEntries;
    entry->used = true;
    entry->key = key;
    entry->plan.kernels_found = false;
    entry->plan.stages = attention_stages(
        key.backward, key.dtype_suffix, key.batch, key.q_len, key.kv_len, key.heads,
        key.kv_heads, key.head_dim, key.value_head_dim, key.gpu_cores, key.dropout, key.variant);
    entry->whole_call = whole_call_budget(entry->plan.stages);
  }
  entry->budget = budget_multiply_adds;
  entry->plan.submissions = plan_submissions(entry->plan.stages, budget_multiply_adds);
  entry->plan.dispatches = 0;
  for (const ChunkedSubmission& s : entry->plan.submissions) entry->plan.dispatches += s.size();
  return entry->plan;
}

}  // namespace jfm
