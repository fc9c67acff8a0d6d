// See apple_gpu_gate in device.h.
#include <cstdint>
#include <string>

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

}  // namespace jfm
