// jax_flash_metal._ext: one nanobind module for the whole native side.
#include <nanobind/nanobind.h>

namespace jfm {
void bind_emulator(nanobind::module_& m);  // ffi/emulator/bindings.cc
}

NB_MODULE(_ext, m) {
  nanobind::module_ emulator = m.def_submodule("emulator", "MSL-on-CPU emulator (tests)");
  jfm::bind_emulator(emulator);
}
