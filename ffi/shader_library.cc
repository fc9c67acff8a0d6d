// See shader_library in shader_sources.h.
#include <cstring>
#include <string>
#include <vector>

#include "kernel_families.h"
#include "shader_sources.h"

namespace jfm {
namespace {

// The source whose text holds `needle`.
const ShaderSource* source_with(const std::vector<ShaderSource>& sources,
                                const std::string& needle) {
  for (const ShaderSource& s : sources) {
    if (std::strstr(s.text, needle.c_str()) != nullptr) return &s;
  }
  return nullptr;
}

}  // namespace

const std::vector<KernelFamily>& kernel_families() {
#define JFM_FAMILY_ENTRY(T, SUFFIX, DK, DV, NAME) KernelFamily{#T, #SUFFIX, DK, DV, #NAME},
  static const std::vector<KernelFamily> families = {JFM_FAMILIES(JFM_FAMILY_ENTRY)};
#undef JFM_FAMILY_ENTRY
  return families;
}

ShaderLibrary shader_library(const std::vector<ShaderSource>& sources, const std::string& kernel) {
  ShaderLibrary library;
  for (const KernelFamily& f : kernel_families()) {
    const std::string tail = std::string("_") + f.suffix + "_d" + f.name;
    if (kernel.size() <= tail.size() ||
        kernel.compare(kernel.size() - tail.size(), tail.size(), tail) != 0) {
      continue;
    }
    // Its instantiation grid names the stage: JFM_HOST_NAME(STAGE, SUFFIX, D).
    library.source = source_with(
        sources, "JFM_HOST_NAME(" + kernel.substr(0, kernel.size() - tail.size()) + ",");
    if (library.source == nullptr) return library;
    library.family = std::string(f.type) + "_" + f.name;
    library.macros = {{"JFM_ONE_FAMILY", "1"}, {"JFM_FAMILY_" + library.family, "JFM_SELECTED"}};
    return library;
  }
  library.source = source_with(sources, "kernel void " + kernel + "(");
  return library;
}

}  // namespace jfm
