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

// The counts of a launch, each list written once: Profile declares them, the workers' tallies
// (runtime.cc) sum the operation counts, and the Python bindings name the dict keys after them.
// The launch's totals:
#define JFM_PROFILE_TOTALS(X)                                                              \
  X(threadgroups)                                                                          \
  X(threads_per_threadgroup)                                                               \
  X(threadgroup_memory_bytes) /* static threadgroup memory of one group (largest) */       \
  X(device_bytes_read)        /* sum over the `device` buffers */                          \
  X(device_bytes_written)                                                                  \
  X(threadgroup_bytes_read)                                                                \
  X(threadgroup_bytes_written)
// The operations, summed over the workers:
#define JFM_PROFILE_OPS(X)                                                                 \
  X(mma_ops)  /* simdgroup_multiply(_accumulate): one 8x8x8 op per simdgroup */            \
  X(simd_ops) /* other simd collectives and simdgroup_barrier, per simdgroup */            \
  X(barriers) /* threadgroup_barrier, once per threadgroup that meets at it */             \
  X(fma_ops)  /* scalar fma() calls, per thread (vector fma: per component) */             \
  X(math_ops) /* other scalar math-function calls (exp2, max, ...), per thread */
// Per [[buffer(n)]]: X(key, array of Profile).
#define JFM_PROFILE_BUFFER_FIELDS(X) \
  X(read, buffer_bytes_read) X(written, buffer_bytes_written) X(constant, constant_buffer)
#define JFM_PROFILE_DECLARE_COUNT(name) uint64_t name = 0;

// Exact counts of one launch (the counting build variant; emulator/README.md defines them).
struct Profile {
  JFM_PROFILE_TOTALS(JFM_PROFILE_DECLARE_COUNT)
  JFM_PROFILE_OPS(JFM_PROFILE_DECLARE_COUNT)
  // Bytes loaded / stored through each [[buffer(n)]], at the size of each access.
  std::array<uint64_t, 31> buffer_bytes_read{};
  std::array<uint64_t, 31> buffer_bytes_written{};
  std::array<bool, 31> buffer_bound{};     // the kernel binds [[buffer(n)]]
  std::array<bool, 31> constant_buffer{};  // bound as `constant` (not device memory)
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
