// The shaders/*.metal sources embedded at build time (ffi/embed_shaders.py), each with its
// quoted #includes inlined, for run-time compilation by the Metal device.
#ifndef JAX_FLASH_METAL_SHADER_SOURCES_H_
#define JAX_FLASH_METAL_SHADER_SOURCES_H_

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace jfm {

struct ShaderSource {
  const char* file;  // e.g. "flash_attention.metal"
  const char* text;  // NUL-terminated
  size_t size;       // bytes, without the NUL
};

// One entry per shaders/*.metal file, in file-name order.
std::vector<ShaderSource> shader_sources();

// What the Metal device compiles to get a kernel: the source that defines it and the
// preprocessor macros (MTLCompileOptions.preprocessorMacros) that keep only its (element type,
// head dims) family, JFM_IF_FAMILY in shaders/flash_attention_common.h. A kernel name without a
// dtype and head-dim suffix ("_f16_d64", "_f16_d128_v64"), e.g. the self-check's probe, takes
// the whole source.
struct ShaderLibrary {
  const ShaderSource* source = nullptr;  // nullptr: no source defines the kernel
  std::string family;                    // e.g. "half_64", "half_128_v64"; "" for the whole source
  std::vector<std::pair<std::string, std::string>> macros;  // (name, value)
};

// The library of `kernel` among `sources`. A kernel "STAGE_SUFFIX_dNAME" of a family of
// shaders/kernel_families.h comes from the source whose instantiation grid names the stage
// (JFM_HOST_NAME(STAGE, ...), expanded for every family); any other name from the source that
// defines it as a plain kernel function. Plain C++, so the offline compile (python -m
// jax_flash_metal.fused.shader_libraries) and the tests use the host's own rule.
ShaderLibrary shader_library(const std::vector<ShaderSource>& sources, const std::string& kernel);

// One (element type, key head dim, value head dim) family of shaders/kernel_families.h.
struct KernelFamily {
  const char* type;    // MSL element type: "float", "half", "ushort" (bf16 bits)
  const char* suffix;  // dtype suffix of the kernel names: "f32", "f16", "bf16"
  int key_head_dim;    // of Q and K
  int value_head_dim;  // of V and O
  const char* name;    // the kernel names' tag after "_d": "64", "128_v64" (family_name)
};

// Every family, in the list's order.
const std::vector<KernelFamily>& kernel_families();

}  // namespace jfm

#endif  // JAX_FLASH_METAL_SHADER_SOURCES_H_
