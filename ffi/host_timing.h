// Host-path timing of the FFI handlers, for benchmarks/host_path.py: while on, every handler call
// adds the wall time of each phase of its host work (before the kernels run) to process-wide
// totals. Off by default; then a call pays one relaxed atomic load.
#ifndef JAX_FLASH_METAL_HOST_TIMING_H_
#define JAX_FLASH_METAL_HOST_TIMING_H_

#include <array>
#include <chrono>
#include <cstdint>

namespace jfm {

// The phases of a handler call, in order: X(Enumerator, name), the name take_host_times()'s
// Python binding reports.
#define JFM_HOST_PHASES(X)                                                                         \
  X(Validate, validate) /* decoding the attributes, checking them, the operands and results */  \
  X(Lookup, lookup)     /* the kernels' pipelines (Device::has_kernel) */                          \
  X(Plan, plan)         /* the dispatch plan, the AttentionParams, each dispatch's bindings */     \
  X(Launch, launch)     /* Device::run_async until it returns (Metal: encode and commit) */
#define JFM_HOST_PHASE_ENUMERATOR(enumerator, name) kHost##enumerator,
enum HostPhase : int { JFM_HOST_PHASES(JFM_HOST_PHASE_ENUMERATOR) kHostPhases };
#undef JFM_HOST_PHASE_ENUMERATOR

struct HostTimes {
  uint64_t calls = 0;
  std::array<uint64_t, kHostPhases> nanoseconds{};
};

void set_host_timing(bool on);
bool host_timing();
// The totals since the last take (or since timing was turned on), then zeroes them.
HostTimes take_host_times();
void add_host_times(const std::array<uint64_t, kHostPhases>& nanoseconds);

// Marks the start of a call's host work on this thread: the decoding of its attributes
// (attribute_decoding.h), which XLA runs before the handler's body. The call's HostTimer then
// starts there (else where it is made). Nothing while timing is off.
void mark_host_call_start();
// The marked start of this thread's call (then unmarked), else now.
std::chrono::steady_clock::time_point take_host_call_start();

// One call's phases: lap(p) ends phase p; finish() adds the call to the totals.
class HostTimer {
 public:
  HostTimer() : on_(host_timing()) {
    if (on_) last_ = take_host_call_start();
  }
  void lap(HostPhase phase) {
    if (!on_) return;
    const auto now = std::chrono::steady_clock::now();
    laps_[phase] += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(now - last_).count());
    last_ = now;
  }
  void finish() {
    if (on_) add_host_times(laps_);
  }

 private:
  bool on_;
  std::chrono::steady_clock::time_point last_;
  std::array<uint64_t, kHostPhases> laps_{};
};

}  // namespace jfm

#endif  // JAX_FLASH_METAL_HOST_TIMING_H_
