// See working_memory.h.
#include "working_memory.h"

#include <algorithm>
#include <atomic>

#include "attention_params.h"

namespace jfm {
namespace {

struct Counter {
  std::atomic<uint64_t> calls{0}, last{0}, peak{0};

  void record(uint64_t bytes) {
    last.store(bytes, std::memory_order_relaxed);
    uint64_t peak_now = peak.load(std::memory_order_relaxed);
    while (bytes > peak_now && !peak.compare_exchange_weak(peak_now, bytes)) {
    }
    calls.fetch_add(1, std::memory_order_relaxed);
  }
};

Counter g_arguments, g_staging;

}  // namespace

uint64_t argument_bytes(size_t dispatches, int64_t batch) {
  // The lengths are copied as int32 [max(batch, 1)] each (q and kv).
  return dispatches * sizeof(AttentionParams) +
         2 * sizeof(int32_t) * static_cast<uint64_t>(std::max<int64_t>(batch, 1));
}

void record_argument_bytes(uint64_t bytes) { g_arguments.record(bytes); }

void record_staging_bytes(uint64_t bytes) { g_staging.record(bytes); }

WorkingMemory take_working_memory() {
  WorkingMemory w;
  w.calls = g_arguments.calls.exchange(0);
  w.last_bytes = g_arguments.last.exchange(0);
  w.peak_bytes = g_arguments.peak.exchange(0);
  w.staging_calls = g_staging.calls.exchange(0);
  w.last_staging_bytes = g_staging.last.exchange(0);
  w.peak_staging_bytes = g_staging.peak.exchange(0);
  return w;
}

}  // namespace jfm
