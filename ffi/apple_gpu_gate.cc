// See apple_gpu_gate, gpu_cores_by_name, gpu_core_count, set_metal_debug and run_and_wait in
// device.h.
#include <atomic>
#include <cstdint>
#include <future>
#include <string>
#include <utility>

#include "attention_params.h"
#include "device.h"

namespace jfm {

std::string apple_gpu_gate(const std::string& name, bool apple7, bool unified_memory,
                           uint32_t simd_width) {
  const std::string gpu = "the GPU '" + name + "'";
  if (!apple7) {
    return gpu + " is not in GPU family Apple7 or newer (the kernels need an Apple-silicon "
           "GPU, M1 or later)";
  }
  if (!unified_memory) return gpu + " has no unified memory (the kernels use host memory in place)";
  if (simd_width != 0 && simd_width != JFM_SIMD_WIDTH) {
    return gpu + " runs " + std::to_string(simd_width) + "-wide simdgroups; the kernels need " +
           std::to_string(JFM_SIMD_WIDTH);
  }
  return "";
}

int gpu_cores_by_name(const std::string& name) {
  // Apple's published GPU core counts, largest configuration of each chip.
  static const std::pair<const char*, int> kCores[] = {
      {"Apple M1", 8},       {"Apple M1 Pro", 16},   {"Apple M1 Max", 32},
      {"Apple M1 Ultra", 64}, {"Apple M2", 10},      {"Apple M2 Pro", 19},
      {"Apple M2 Max", 38},  {"Apple M2 Ultra", 76}, {"Apple M3", 10},
      {"Apple M3 Pro", 18},  {"Apple M3 Max", 40},   {"Apple M3 Ultra", 80},
      {"Apple M4", 10},      {"Apple M4 Pro", 20},   {"Apple M4 Max", 40}};
  for (const auto& [chip, cores] : kCores) {
    if (name == chip) return cores;
  }
  return 10;
}

int gpu_core_count(long registry_cores, const std::string& name) {
  if (registry_cores >= 1 && registry_cores <= 1024) return static_cast<int>(registry_cores);
  return gpu_cores_by_name(name);
}

namespace {
std::atomic<bool> g_metal_debug{false};
}  // namespace

void set_metal_debug(bool on) { g_metal_debug.store(on); }

bool metal_debug() { return g_metal_debug.load(); }

std::string run_and_wait(Device& device, std::vector<Submission> submissions) {
  std::promise<std::string> finished;
  std::future<std::string> error = finished.get_future();
  device.run_async(std::move(submissions),
                   [&finished](const std::string& message) { finished.set_value(message); });
  return error.get();
}

}  // namespace jfm
