// The emulated device: runs the translated shaders/*.metal kernels on the CPU through the
// MSL-on-CPU emulator (ffi/emulator), so the whole FFI path is testable without an Apple GPU.
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "device.h"
#include "emulator/emulator.h"
#include "emulator_profile.h"

namespace jfm {
namespace {

std::atomic<int> g_schedule{static_cast<int>(emu::Schedule::kForward)};
std::atomic<uint64_t> g_seed{0};

std::mutex g_fault_mutex;
std::string g_fault_kernel;  // guarded by g_fault_mutex

std::atomic<bool> g_profiling{false};
std::mutex g_profile_mutex;
std::vector<ProfileRecord> g_profile;  // guarded by g_profile_mutex

const char* schedule_name(emu::Schedule s) {
  switch (s) {
    case emu::Schedule::kForward:
      return "forward";
    case emu::Schedule::kReverse:
      return "reverse";
    case emu::Schedule::kRandom:
      return "random";
  }
  return "?";
}

// The order in which the emulated device runs a submission's dispatches: within each run of
// dispatches between two barriers (Dispatch::barrier_before), which Metal may execute in any
// order or at once, the order of the thread schedule: as planned, reversed, or shuffled.
std::vector<size_t> dispatch_order(const Submission& submission, emu::Schedule schedule,
                                   std::mt19937_64* rng) {
  std::vector<size_t> order(submission.size());
  std::iota(order.begin(), order.end(), size_t{0});
  size_t start = 0;  // the first dispatch after the last barrier
  for (size_t i = 1; i <= submission.size(); ++i) {
    if (i < submission.size() && !submission[i].barrier_before) continue;
    const auto first = order.begin() + static_cast<ptrdiff_t>(start);
    const auto last = order.begin() + static_cast<ptrdiff_t>(i);
    if (schedule == emu::Schedule::kReverse) std::reverse(first, last);
    if (schedule == emu::Schedule::kRandom) std::shuffle(first, last, *rng);
    start = i;
  }
  return order;
}

class EmulatedDevice final : public Device {
 public:
  const char* kind() const override { return "emulator"; }
  std::string name() const override { return "MSL-on-CPU emulator"; }
  bool has_kernel(const std::string& kernel) override { return emu::has_kernel(kernel); }
  std::vector<std::string> kernel_names() override { return emu::kernel_names(); }
  std::string library_error() override { return ""; }
  std::string library_warnings() override { return ""; }
  // A fixed figure, so the emulated device cuts a call exactly as a Metal device does before
  // its first measurement.
  double multiply_adds_per_second() override { return kInitialMultiplyAddsPerSecond; }
  int gpu_cores() override { return kEmulatedGpuCores; }

  std::string run(const std::vector<Submission>& submissions) override {
    emu::Launch launch;
    launch.schedule = static_cast<emu::Schedule>(g_schedule.load());
    launch.seed = g_seed.load();
    std::string fault;
    {
      std::lock_guard<std::mutex> lock(g_fault_mutex);
      fault = g_fault_kernel;
    }
    std::mt19937_64 rng(launch.seed);
    for (const Submission& submission : submissions) {
      for (size_t index : dispatch_order(submission, launch.schedule, &rng)) {
        const Dispatch& d = submission[index];
        if (!fault.empty() && d.kernel == fault) {
          return "emulator: injected fault in kernel " + d.kernel;
        }
        int max_index = d.constants.empty() ? 0 : d.constants_index;
        for (const Binding& b : d.buffers) max_index = std::max(max_index, b.index);
        std::vector<emu::Arg> args(static_cast<size_t>(max_index) + 1);
        for (const Binding& b : d.buffers) args[b.index] = emu::Arg{b.data, b.size};
        // The emulator reads constants in place; the dispatch outlives the run.
        if (!d.constants.empty()) {
          args[d.constants_index] =
              emu::Arg{const_cast<uint8_t*>(d.constants.data()), d.constants.size()};
        }
        launch.groups = d.groups;
        launch.group_size = d.group_size;
        launch.function_constants = d.function_constants;
        ProfileRecord record{d.kernel, d.groups, d.group_size, d.function_constants, {}};
        const bool profiling = g_profiling.load();
        launch.profile = profiling ? &record.counts : nullptr;
        std::string error = emu::run(d.kernel, args, launch);
        if (!error.empty()) return error;
        if (profiling) {
          std::lock_guard<std::mutex> lock(g_profile_mutex);
          g_profile.push_back(record);
        }
      }
    }
    return "";
  }
};

}  // namespace

Device& emulated_device() {
  static EmulatedDevice device;
  return device;
}

std::string set_emulator_schedule(const std::string& schedule, uint64_t seed) {
  emu::Schedule s;
  if (schedule == "forward") {
    s = emu::Schedule::kForward;
  } else if (schedule == "reverse") {
    s = emu::Schedule::kReverse;
  } else if (schedule == "random") {
    s = emu::Schedule::kRandom;
  } else {
    return "unknown emulator schedule '" + schedule + "' (expected forward, reverse or random)";
  }
  g_schedule.store(static_cast<int>(s));
  g_seed.store(seed);
  return "";
}

std::string emulator_schedule_name() {
  return schedule_name(static_cast<emu::Schedule>(g_schedule.load()));
}

uint64_t emulator_schedule_seed() { return g_seed.load(); }

std::string set_emulator_profiling(bool on) {
  if (on && !emu::has_counting_variant())
    return "this build has no counting kernel variants: reinstall with JFM_EMULATOR_COUNTING=ON "
           "in the environment (off by default; a compiler without -fsanitize=thread cannot "
           "build them)";
  std::lock_guard<std::mutex> lock(g_profile_mutex);
  g_profile.clear();
  g_profiling.store(on);
  return "";
}

std::vector<ProfileRecord> take_emulator_profile() {
  std::lock_guard<std::mutex> lock(g_profile_mutex);
  std::vector<ProfileRecord> records;
  records.swap(g_profile);
  return records;
}

void set_emulator_fault(const std::string& kernel) {
  std::lock_guard<std::mutex> lock(g_fault_mutex);
  g_fault_kernel = kernel;
}

}  // namespace jfm
