// The device interface the FFI handlers encode kernels on, and its two implementations:
// the emulated device (MSL-on-CPU emulator, every platform) and the Metal device (macOS only).
#ifndef JAX_FLASH_METAL_DEVICE_H_
#define JAX_FLASH_METAL_DEVICE_H_

#include <array>
#include <cstddef>
#include <cstdint>
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
};

// One kernel launch: grid of `groups` threadgroups of `group_size` threads.
struct Dispatch {
  std::string kernel;
  std::array<uint32_t, 3> groups{1, 1, 1};
  std::array<uint32_t, 3> group_size{1, 1, 1};
  std::vector<Binding> buffers;
  std::vector<uint8_t> constants;  // bytes bound as `constant T&` at constants_index
  int constants_index = 0;
};

// Dispatches that run in order, each seeing the writes of the ones before it. On Metal a
// submission is one command buffer; a call is split into several submissions when it is large
// enough to risk the GPU watchdog.
using Submission = std::vector<Dispatch>;

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
  // Runs the submissions in order and returns when all have finished. Returns "" on success,
  // else the device's error message. Safe to call from several threads at once.
  virtual std::string run(const std::vector<Submission>& submissions) = 0;
};

// The process-wide emulated device.
Device& emulated_device();

#ifdef JFM_HAVE_METAL
// The process-wide Metal device, or nullptr when this machine has no Metal GPU (or an OS too
// old for Metal Shading Language 3.0). `metal_unavailable_reason()` says why.
Device* metal_device();
std::string metal_unavailable_reason();
#endif

// Emulator fiber schedule for every later emulated run: "forward", "reverse" or "random"
// (seeded). Returns "" or an error message for an unknown name. For tests: a missing barrier in
// a kernel shows up as results that differ between schedules.
std::string set_emulator_schedule(const std::string& schedule, uint64_t seed);
std::string emulator_schedule_name();
uint64_t emulator_schedule_seed();

// Test hook: while non-empty, an emulated run of this kernel fails with an error instead of
// running, so tests can check that device errors surface as JAX exceptions.
void set_emulator_fault(const std::string& kernel);

}  // namespace jfm

#endif  // JAX_FLASH_METAL_DEVICE_H_
