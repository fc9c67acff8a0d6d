// See shader_library in shader_sources.h.
#include <cstring>
#include <string>
#include <vector>

#include "shader_sources.h"

namespace jfm {
namespace {

// The MSL element type of a kernel-name dtype suffix (the T of the instantiation lines).
const char* element_type(const std::string& suffix) {
  if (suffix == "f32") return "float";
  if (suffix == "f16") return "half";
  if (suffix == "bf16") return "ushort";
  return nullptr;
}

const ShaderSource* source_of(const std::vector<ShaderSource>& sources, const std::string& kernel) {
  const std::string quoted = "\"" + kernel + "\"";
  const std::string plain = "kernel void " + kernel + "(";
  for (const ShaderSource& s : sources) {
    if (std::strstr(s.text, quoted.c_str()) != nullptr ||
        std::strstr(s.text, plain.c_str()) != nullptr) {
      return &s;
    }
  }
  return nullptr;
}

}  // namespace

ShaderLibrary shader_library(const std::vector<ShaderSource>& sources, const std::string& kernel) {
  ShaderLibrary library;
  library.source = source_of(sources, kernel);
  if (library.source == nullptr) return library;
  const size_t d = kernel.rfind("_d");
  const size_t t = d == std::string::npos || d == 0 ? std::string::npos : kernel.rfind('_', d - 1);
  const char* type = t == std::string::npos ? nullptr : element_type(kernel.substr(t + 1, d - t - 1));
  const std::string dim = d == std::string::npos ? "" : kernel.substr(d + 2);
  if (type == nullptr || dim.empty() || dim.find_first_not_of("0123456789") != std::string::npos) {
    return library;
  }
  library.family = std::string(type) + "_" + dim;
  library.macros = {{"JFM_ONE_FAMILY", "1"}, {"JFM_FAMILY_" + library.family, "JFM_SELECTED"}};
  return library;
}

}  // namespace jfm
