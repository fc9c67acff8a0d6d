// The emulated device: runs the translated shaders/*.metal kernels on the CPU through the
// MSL-on-CPU emulator (emulator/), so the whole FFI path is testable without an Apple GPU.
// Each run happens on a worker thread of its own and reports through its completion callback,
// as a Metal command buffer's completion handler does, so the asynchronous FFI handler is
// exercised the same way on both devices.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "device.h"
#include "../emulator/emulator.h"
#include "../emulator/sanitizer.h"
#include "emulator_profile.h"
#include "output_contract.h"

namespace jfm {
namespace {

std::atomic<int> g_schedule{static_cast<int>(emu::Schedule::kForward)};
std::atomic<uint64_t> g_seed{0};

FaultKernel g_fault;  // set_emulator_fault

// set_emulator_hold: the flag is read without the lock on every run; waiting takes it.
std::atomic<bool> g_hold{false};
std::atomic<int> g_held{0};
std::mutex g_hold_mutex;
std::condition_variable g_hold_released;

std::atomic<bool> g_profiling{false};
// Sanitizer mode (sanitizer.h): 0 off, 1 the first finding fails the call, 2 collect all.
// Initially from $JFM_EMULATOR_SANITIZE ("1"/"first" or "all"), then set_emulator_sanitizer.
std::atomic<int> g_sanitize{[] {
  const char* v = std::getenv("JFM_EMULATOR_SANITIZE");
  if (!v || !*v || std::strcmp(v, "0") == 0 || std::strcmp(v, "off") == 0) return 0;
  return std::strcmp(v, "all") == 0 ? 2 : 1;
}()};
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

  void run_async(std::vector<Submission> submissions, RunDone done) override {
    emu::Launch launch;  // the schedule and fault in force when the call was made
    launch.schedule = static_cast<emu::Schedule>(g_schedule.load());
    launch.seed = g_seed.load();
    const std::string fault = g_fault.get();
    try {
      std::thread([submissions = std::move(submissions), done, launch, fault]() mutable {
        std::string error = wait_for_hold();
        if (error.empty()) error = run_now(submissions, launch, fault);
        done(error);
      }).detach();
    } catch (const std::system_error& e) {
      done(std::string("emulator: could not start a worker thread: ") + e.what());
    }
  }

 private:
  // Waits while set_emulator_hold is on; an error after kEmulatorHoldSeconds.
  static std::string wait_for_hold() {
    if (!g_hold.load()) return "";
    std::unique_lock<std::mutex> lock(g_hold_mutex);
    ++g_held;
    const bool released = g_hold_released.wait_for(
        lock, std::chrono::seconds(kEmulatorHoldSeconds), [] { return !g_hold.load(); });
    --g_held;
    if (released) return "";
    return "emulator: run held for " + std::to_string(kEmulatorHoldSeconds) +
           " s by the test hook set_emulator_hold and never released";
  }

  static std::string run_now(const std::vector<Submission>& submissions, emu::Launch launch,
                             const std::string& fault) {
    std::mt19937_64 rng(launch.seed);
    // Under the sanitizer the call's written buffers are poisoned outputs under their write
    // contract, and each dispatch belongs to the segment of the plan between two memory
    // barriers it follows.
    const int sanitize = g_sanitize.load();
    if (sanitize && g_profiling.load())
      return "emulator: the kernel profile and the sanitizer are both on; a call runs one of them";
    std::unique_ptr<emu::SanitizerCall> call;
    std::vector<uint64_t> segment_base;
    if (sanitize) {
      call.reset(new emu::SanitizerCall(sanitize == 2));
      uint64_t segments = 0;
      for (const Submission& submission : submissions) {
        segment_base.push_back(segments);
        for (const Dispatch& d : submission) {
          if (d.barrier_before || &d == &submission.front()) ++segments;
          for (const Binding& b : d.buffers) {
            if (!b.written) continue;
            const OutputContract* contract = output_contract(b.index);
            if (!contract)
              return "emulator sanitizer: [[buffer(" + std::to_string(b.index) + ")]] of " +
                     d.kernel + " is written but has no write contract (output_contract.h)";
            call->add_range(b.data, b.size, contract->rule, contract->name);
          }
        }
      }
      launch.sanitizer = call.get();
    }
    for (size_t s = 0; s < submissions.size(); ++s) {
      const Submission& submission = submissions[s];
      for (size_t index : dispatch_order(submission, launch.schedule, &rng)) {
        if (call) {
          uint64_t segment = segment_base[s];
          for (size_t i = 0; i <= index; ++i)
            if (i == 0 || submission[i].barrier_before) ++segment;
          call->begin_dispatch(segment);
        }
        std::string error = run_dispatch(submission[index], &launch, fault);
        if (!error.empty()) return error;
      }
    }
    return call ? call->finish() : "";
  }

  static std::string run_dispatch(const Dispatch& d, emu::Launch* launch,
                                  const std::string& fault) {
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
    launch->groups = d.groups;
    launch->group_size = d.group_size;
    launch->function_constants = d.function_constants;
    ProfileRecord record{d.kernel, d.groups, d.group_size, d.function_constants, {}};
    const bool profiling = g_profiling.load();
    launch->profile = profiling ? &record.counts : nullptr;
    std::string error = emu::run(d.kernel, args, *launch);
    if (!error.empty()) return error;
    if (profiling) {
      std::lock_guard<std::mutex> lock(g_profile_mutex);
      g_profile.push_back(record);
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

std::string set_emulator_sanitizer(const std::string& mode) {
  int m;
  if (mode == "off") {
    m = 0;
  } else if (mode == "first") {
    m = 1;
  } else if (mode == "all") {
    m = 2;
  } else {
    return "unknown emulator sanitizer mode '" + mode + "' (expected off, first or all)";
  }
  if (m && !emu::has_counting_variant())
    return "the emulator's sanitizer runs the counting kernel variants, which this build lacks: "
           "reinstall with JFM_EMULATOR_COUNTING=ON in the environment";
  g_sanitize.store(m);
  return "";
}

std::string emulator_sanitizer() {
  static const char* const names[] = {"off", "first", "all"};
  return names[g_sanitize.load()];
}

void set_emulator_fault(const std::string& kernel) { g_fault.set(kernel); }

void set_emulator_hold(bool on) {
  {
    std::lock_guard<std::mutex> lock(g_hold_mutex);
    g_hold.store(on);
  }
  g_hold_released.notify_all();
}

int emulator_runs_held() { return g_held.load(); }

}  // namespace jfm
