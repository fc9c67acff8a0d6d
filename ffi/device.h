// The device interface the FFI handlers encode kernels on, and its two implementations:
// the emulated device (MSL-on-CPU emulator, every platform) and the Metal device (macOS only).
#ifndef JAX_FLASH_METAL_DEVICE_H_
#define JAX_FLASH_METAL_DEVICE_H_

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace jfm {

// Host memory bound at one [[buffer(n)]] index. On Apple silicon the GPU reads and writes this
// memory directly (or through a staging copy when it cannot be wrapped).
struct Binding {
  int index = 0;
  void* data = nullptr;
  size_t size = 0;      // bytes
  bool written = false;  // the kernel writes it (a staging copy must be copied back)
  // A small read-only host array (the lengths) that the device copies when encoding instead of
  // binding the memory in place (Metal: setBytes up to 4 KB, else a staging buffer).
  bool copy = false;
};

// The bool function constants of every attention kernel (JFM_FUNCTION_CONSTANTS of
// shaders/function_constants.h, which dispatch_plan.cc checks this against): a pipeline is
// specialised by bits 0 .. kFunctionConstants - 1 of Dispatch::function_constants.
constexpr int kFunctionConstants = 6;

// Bytes bound as `constant T&` (a kernel's parameter block), held in the dispatch itself, so a
// handler call allocates nothing for them.
constexpr size_t kMaxConstantBytes = 256;
class ConstantBytes {
 public:
  // Copies `size` bytes; false (and nothing copied) above kMaxConstantBytes.
  bool assign(const void* data, size_t size) {
    if (size > kMaxConstantBytes) return false;
    std::memcpy(bytes_.data(), data, size);
    size_ = size;
    return true;
  }
  const uint8_t* data() const { return bytes_.data(); }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

 private:
  std::array<uint8_t, kMaxConstantBytes> bytes_;  // the first size_ are set
  size_t size_ = 0;
};

// One kernel launch: grid of `groups` threadgroups of `group_size` threads.
struct Dispatch {
  std::string kernel;
  std::array<uint32_t, 3> groups{1, 1, 1};
  std::array<uint32_t, 3> group_size{1, 1, 1};
  std::vector<Binding> buffers;
  ConstantBytes constants;  // bound as `constant T&` at constants_index (if any)
  int constants_index = 0;
  // Bit n: the bool [[function_constant(n)]] the kernel's pipeline is specialised with
  // (shaders/function_constants.h); one pipeline per (kernel, function_constants).
  uint32_t function_constants = 0;
  double multiply_adds = 0;  // the plan's estimate of its work (Metal calibrates from it)
  // Whether this dispatch must wait for every earlier dispatch of its submission and see their
  // writes (mark_barriers, dispatch_plan.h). Dispatches between two barriers may run in any
  // order or at once: on Metal they share one concurrent compute encoder.
  bool barrier_before = false;
};

// The dispatches of one command buffer on Metal (one concurrent compute encoder, a buffer
// memory barrier before each dispatch with barrier_before). Submissions run in order, each
// seeing the writes of the ones before it; a call is split into several when it is large enough
// to risk the GPU watchdog (dispatch_plan.h).
using Submission = std::vector<Dispatch>;

// The throughput a plan assumes before anything was measured: multiply-adds per second of the
// attention kernels on the slowest supported GPU (Apple7, M1: ~1.3e12 fp32 multiply-adds per
// second at peak), taken well below peak so that the first submissions are short.
constexpr double kInitialMultiplyAddsPerSecond = 5e10;

// Called once when a Device::run_async has finished: "" on success, else the error message.
using RunDone = std::function<void(const std::string& error)>;

class Device {
 public:
  virtual ~Device() = default;
  // "emulator" or "metal": the implementation name used by the Python package.
  virtual const char* kind() const = 0;
  // Human-readable device name (the GPU's name on Metal).
  virtual std::string name() const = 0;
  // Whether a kernel of that name exists (compiling the shader library on first use).
  virtual bool has_kernel(const std::string& kernel) = 0;
  // Every kernel name the device can run, sorted.
  virtual std::vector<std::string> kernel_names() = 0;
  // Why kernels may be missing (e.g. a shader compile error); "" when nothing went wrong.
  virtual std::string library_error() = 0;
  // Warnings of the shader compiles so far (Metal compiles lazily); "" when none.
  virtual std::string library_warnings() = 0;
  // Estimated multiply-adds per second of the kernels: sizes submissions (dispatch_plan.h).
  // Fixed on the emulated device (kInitialMultiplyAddsPerSecond); on Metal refined from the GPU
  // time of earlier command buffers.
  virtual double multiply_adds_per_second() = 0;
  // GPU cores: sizes the decode's key splits (tile_shapes.h jfm_decode_splits). The emulated
  // device reports a fixed kEmulatedGpuCores; Metal has no API for it, so the Metal device reads
  // the IORegistry's "gpu-core-count" of the GPU (gpu_core_count).
  virtual int gpu_cores() = 0;
  // Starts the submissions in order and returns without waiting for them; calls `done` exactly
  // once when all have finished, with "" on success, else the device's error message naming the
  // kernel. `done` may run on another thread (Metal: a global dispatch queue, once the last
  // command buffer's completion handler ran; the emulated device: a worker thread) and may run
  // before run_async returns. The host memory of
  // every binding must stay valid until `done` runs. Safe to call from several threads at once.
  // The emulated device runs the dispatches between two barriers in the order of its thread
  // schedule (reversed or shuffled under "reverse" and "random"), so a missing barrier changes
  // results.
  virtual void run_async(std::vector<Submission> submissions, RunDone done) = 0;
};

// The kernel a fault-injection test hook names (set_metal_fault, set_emulator_fault), read by
// every call: one atomic load while none is set, so the hot path takes no global lock.
class FaultKernel {
 public:
  void set(const std::string& kernel) {
    std::lock_guard<std::mutex> lock(mutex_);
    kernel_ = kernel;
    on_.store(!kernel.empty(), std::memory_order_release);
  }
  // The kernel, or "" when none is set.
  std::string get() const {
    if (!on_.load(std::memory_order_acquire)) return "";
    std::lock_guard<std::mutex> lock(mutex_);
    return kernel_;
  }

 private:
  std::atomic<bool> on_{false};
  mutable std::mutex mutex_;
  std::string kernel_;  // guarded by mutex_
};

// Runs the submissions on `device` and waits for them: run_async's error message, or "".
std::string run_and_wait(Device& device, std::vector<Submission> submissions);

// The emulated device's core count: a 32-core GPU (M1 Max class), so the emulated plan is the
// one of a mid-size Apple GPU.
constexpr int kEmulatedGpuCores = 32;

// The GPU cores of an Apple GPU by its MTLDevice name ("Apple M2 Pro"): the largest
// configuration of that chip (binned parts have fewer; only the decode's split count depends
// on it), 10 for a name not in the table. Plain C++, tested on every platform.
int gpu_cores_by_name(const std::string& name);

// The GPU cores the Metal device uses: `registry_cores` (the IORegistry's "gpu-core-count" of
// the GPU, 0 when it could not be read) when it is plausible (1 to 1024), else
// gpu_cores_by_name(name). Plain C++, tested on every platform.
int gpu_core_count(long registry_cores, const std::string& name);

// $JAX_FLASH_METAL_DEBUG as the Python package parsed it on import (ffi_lowering.py): while
// on, Metal command buffers are created with encoder execution status (Apple: it may add CPU
// and GPU overhead) and each dispatch carries a debug signpost, so a failed command buffer names
// the status of its encoder and the dispatches in it. Off: the error still names Metal's
// error and the kernels of the failed command buffer.
void set_metal_debug(bool on);
bool metal_debug();

// The process-wide emulated device.
Device& emulated_device();

// The GPUs the kernels are written for: Apple silicon (GPU family Apple7 or newer, unified
// memory, 32-wide simdgroups; on other GPUs the kernels would give wrong results). Returns ""
// when a GPU with these traits qualifies, else why not. `simd_width` is a pipeline's
// threadExecutionWidth (0 = not known yet). Plain C++, so it is tested on every platform.
std::string apple_gpu_gate(const std::string& name, bool apple7, bool unified_memory,
                           uint32_t simd_width);

#ifdef JFM_HAVE_METAL
// The process-wide Metal device, or nullptr when this machine has no qualifying GPU (see
// apple_gpu_gate), or an OS too old for Metal Shading Language 3.0. `metal_unavailable_reason()`
// says why. A device that passes at creation becomes unavailable if a pipeline turns out not to
// run 32-wide simdgroups.
Device* metal_device();
std::string metal_unavailable_reason();

// Seconds of GPU time (GPUEndTime - GPUStartTime) of every Metal command buffer that completed
// successfully in this process so far, 0 without a Metal device. A process-wide total rather
// than a per-call figure: XLA may run a handler on a thread other than the caller's, so a caller
// reads the total before and after its call; the difference is that call's GPU time when no other
// Metal call runs at the same time (concurrent calls add to the same total).
double metal_gpu_seconds_total();

// Test hook: while non-empty, a Metal command buffer holding this kernel is reported as failed
// (through the same path as a real GPU error, with a synthetic encoder status), so tests on a
// Mac can check that command buffer errors surface as JAX exceptions naming the kernel.
void set_metal_fault(const std::string& kernel);
#endif

// Emulator fiber schedule for every later emulated run: "forward", "reverse" or "random"
// (seeded). Returns "" or an error message for an unknown name. For tests: a missing barrier in
// a kernel shows up as results that differ between schedules.
std::string set_emulator_schedule(const std::string& schedule, uint64_t seed);
std::string emulator_schedule_name();
uint64_t emulator_schedule_seed();
// The emulated device's sanitizer (emulator/sanitizer.h, docs/testing.md) for every later call:
// "off", "first" (the first finding fails the call) or "all" (every finding of the call, when it
// ends). Returns "" or an error (unknown mode; a build without the counting variants).
std::string set_emulator_sanitizer(const std::string& mode);
std::string emulator_sanitizer();

// Test hook: while non-empty, an emulated run of this kernel fails with an error instead of
// running, so tests can check that device errors surface as JAX exceptions.
void set_emulator_fault(const std::string& kernel);

// Test hook: while on, every emulated run waits on its worker thread before running until the
// hold is turned off (failing after kEmulatorHoldSeconds), so a test can show that other work of
// the same XLA program completes while an attention call is in flight. emulator_runs_held() is
// the number of runs waiting on the hold now.
constexpr int kEmulatorHoldSeconds = 30;
void set_emulator_hold(bool on);
int emulator_runs_held();

}  // namespace jfm

#endif  // JAX_FLASH_METAL_DEVICE_H_
