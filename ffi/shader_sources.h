// The shaders/*.metal sources embedded at build time (ffi/embed_shaders.py), each with its
// quoted #includes inlined, for run-time compilation by the Metal device.
#ifndef JAX_FLASH_METAL_SHADER_SOURCES_H_
#define JAX_FLASH_METAL_SHADER_SOURCES_H_

#include <cstddef>
#include <vector>

namespace jfm {

struct ShaderSource {
  const char* file;  // e.g. "flash_attention.metal"
  const char* text;  // NUL-terminated
  size_t size;       // bytes, without the NUL
};

// One entry per shaders/*.metal file, in file-name order.
std::vector<ShaderSource> shader_sources();

}  // namespace jfm

#endif  // JAX_FLASH_METAL_SHADER_SOURCES_H_
