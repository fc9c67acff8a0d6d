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

// Order in which fibers resume after each collective point (barrier, simd operation).
enum class Schedule : int { kForward = 0, kReverse = 1, kRandom = 2 };

// What is bound at one [[buffer(n)]] index: device memory or `constant` bytes.
// An unbound index has data == nullptr.
struct Arg {
  void* data = nullptr;
  size_t size = 0;  // in bytes
};

struct Launch {
  std::array<uint32_t, 3> groups{1, 1, 1};      // threadgroups per grid
  std::array<uint32_t, 3> group_size{1, 1, 1};  // threads per threadgroup
  Schedule schedule = Schedule::kForward;
  uint64_t seed = 0;      // for Schedule::kRandom
  int num_workers = 0;    // OS threads running threadgroups; 0 = hardware concurrency
};

// Names of every instantiated kernel (host_name or plain kernel name), sorted.
std::vector<std::string> kernel_names();
bool has_kernel(const std::string& name);

// Runs `kernel` over the grid with args[n] bound at [[buffer(n)]]. Returns "" on success, else a
// message naming the kernel (and thread ids where relevant): unknown kernel, bad launch size,
// missing binding, barrier divergence, deadlock. Never aborts the process for kernel faults.
std::string run(const std::string& kernel, const std::vector<Arg>& args, const Launch& launch);

}  // namespace jfm::emu

#endif  // JAX_FLASH_METAL_EMULATOR_H_
