// The MSL-on-CPU emulator's host API: run a kernel from shaders/*.metal on the CPU.
// Used by the emulated device (ffi/) and by the Python test bindings.
#ifndef JAX_FLASH_METAL_EMULATOR_H_
#define JAX_FLASH_METAL_EMULATOR_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace jfm::emu {

class SanitizerCall;  // sanitizer.h

// Order in which fibers resume after each collective point (barrier, simd operation).
enum class Schedule : int { kForward = 0, kReverse = 1, kRandom = 2 };

// What is bound at one [[buffer(n)]] index: device memory or `constant` bytes.
// An unbound index has data == nullptr.
struct Arg {
  void* data = nullptr;
  size_t size = 0;  // in bytes
};

// Exact counts of one launch (the counting build variant; emulator/README.md defines them).
struct Profile {
  uint64_t threadgroups = 0;
  uint64_t threads_per_threadgroup = 0;
  uint64_t threadgroup_memory_bytes = 0;  // static threadgroup memory of one group (largest)
  // Bytes loaded / stored through each [[buffer(n)]], at the size of each access.
  std::array<uint64_t, 31> buffer_bytes_read{};
  std::array<uint64_t, 31> buffer_bytes_written{};
  std::array<bool, 31> buffer_bound{};     // the kernel binds [[buffer(n)]]
  std::array<bool, 31> constant_buffer{};  // bound as `constant` (not device memory)
  uint64_t device_bytes_read = 0;     // sum over the `device` buffers
  uint64_t device_bytes_written = 0;
  uint64_t threadgroup_bytes_read = 0;
  uint64_t threadgroup_bytes_written = 0;
  uint64_t mma_ops = 0;   // simdgroup_multiply(_accumulate): one 8x8x8 op per simdgroup
  uint64_t simd_ops = 0;  // other simd collectives and simdgroup_barrier, per simdgroup
  uint64_t barriers = 0;  // threadgroup_barrier, once per threadgroup that meets at it
  uint64_t fma_ops = 0;   // scalar fma() calls, per thread (vector fma: per component)
  uint64_t math_ops = 0;  // other scalar math-function calls (exp2, max, ...), per thread
};

struct Launch {
  std::array<uint32_t, 3> groups{1, 1, 1};      // threadgroups per grid
  std::array<uint32_t, 3> group_size{1, 1, 1};  // threads per threadgroup
  Schedule schedule = Schedule::kForward;
  uint64_t seed = 0;      // for Schedule::kRandom
  int num_workers = 0;    // OS threads running threadgroups; 0 = hardware concurrency
  // When set, runs the counting variant of the kernel and fills *profile (overwritten).
  Profile* profile = nullptr;
  // When set, runs the counting variant under the sanitizer (sanitizer.h) on one worker,
  // checking every access against the call's shadow state; not together with `profile`.
  SanitizerCall* sanitizer = nullptr;
  // Bit n: the value of the kernel's bool [[function_constant(n)]] (bound per launch, as Metal
  // binds them per pipeline). All set: every feature branch is live, the unspecialised kernel.
  uint32_t function_constants = ~0u;
};

// Names of every instantiated kernel (host_name or plain kernel name), sorted.
std::vector<std::string> kernel_names();
bool has_kernel(const std::string& name);
// Whether this build has the counting variant (Launch::profile works).
bool has_counting_variant();

// Runs `kernel` over the grid with args[n] bound at [[buffer(n)]]. Returns "" on success, else a
// message naming the kernel (and thread ids where relevant): unknown kernel, bad launch size,
// missing binding, barrier divergence, deadlock. Never aborts the process for kernel faults.
std::string run(const std::string& kernel, const std::vector<Arg>& args, const Launch& launch);

}  // namespace jfm::emu

#endif  // JAX_FLASH_METAL_EMULATOR_H_
