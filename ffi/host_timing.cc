// See host_timing.h.
#include "host_timing.h"

#include <atomic>

namespace jfm {
namespace {

std::atomic<bool> g_on{false};
std::atomic<uint64_t> g_calls{0};
std::array<std::atomic<uint64_t>, kHostPhases> g_nanoseconds{};

thread_local bool t_marked = false;
thread_local std::chrono::steady_clock::time_point t_start;

}  // namespace

void set_host_timing(bool on) {
  take_host_times();
  g_on.store(on, std::memory_order_relaxed);
}

bool host_timing() { return g_on.load(std::memory_order_relaxed); }

HostTimes take_host_times() {
  HostTimes times;
  times.calls = g_calls.exchange(0);
  for (int p = 0; p < kHostPhases; ++p) times.nanoseconds[p] = g_nanoseconds[p].exchange(0);
  return times;
}

void add_host_times(const std::array<uint64_t, kHostPhases>& nanoseconds) {
  for (int p = 0; p < kHostPhases; ++p) g_nanoseconds[p].fetch_add(nanoseconds[p]);
  g_calls.fetch_add(1);
}

void mark_host_call_start() {
  if (!host_timing()) return;
  t_start = std::chrono::steady_clock::now();
  t_marked = true;
}

std::chrono::steady_clock::time_point take_host_call_start() {
  if (!t_marked) return std::chrono::steady_clock::now();
  t_marked = false;
  return t_start;
}

}  // namespace jfm
