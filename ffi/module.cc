// jax_flash_metal._ext: one nanobind module for the whole native side.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>
#include <vector>

#include "attention_ffi.h"
#include "bwd_tile_shapes.h"
#include "device.h"
#include "shader_sources.h"

namespace nb = nanobind;

namespace jfm {
void bind_emulator(nb::module_& m);  // ffi/emulator/bindings.cc

namespace {

// The device an implementation name refers to, or a Python ValueError.
Device& device_named(const std::string& implementation) {
  if (implementation == "emulator") return emulated_device();
#ifdef JFM_HAVE_METAL
  if (implementation == "metal") {
    if (Device* device = metal_device()) return *device;
    throw nb::value_error(("no Metal device: " + metal_unavailable_reason()).c_str());
  }
#endif
  throw nb::value_error(("this build has no device '" + implementation + "'").c_str());
}

void bind_devices(nb::module_& m) {
  m.def(
      "ffi_targets",
      [] {
        nb::dict targets;
        targets["jax_flash_metal_attention_fwd_emulator"] =
            nb::capsule(reinterpret_cast<void*>(JfmAttentionFwdEmulator));
        targets["jax_flash_metal_attention_bwd_emulator"] =
            nb::capsule(reinterpret_cast<void*>(JfmAttentionBwdEmulator));
#ifdef JFM_HAVE_METAL
        targets["jax_flash_metal_attention_fwd_metal"] =
            nb::capsule(reinterpret_cast<void*>(JfmAttentionFwdMetal));
        targets["jax_flash_metal_attention_bwd_metal"] =
            nb::capsule(reinterpret_cast<void*>(JfmAttentionBwdMetal));
#endif
        return targets;
      },
      "dict[str, PyCapsule]: XLA FFI handlers (api_version 1) of this build, by target name "
      "jax_flash_metal_attention_{fwd,bwd}_{emulator,metal}; metal ones only in macOS builds.");
  m.def(
      "metal_available",
      [] {
#ifdef JFM_HAVE_METAL
        return metal_device() != nullptr;
#else
        return false;
#endif
      },
      nb::call_guard<nb::gil_scoped_release>(),
      "bool: this build has the Metal device and the machine has a Metal GPU (macOS 13+).");
  m.def(
      "metal_unavailable_reason",
      []() -> std::string {
#ifdef JFM_HAVE_METAL
        return metal_unavailable_reason();
#else
        return "this build has no Metal support (it was not built on macOS)";
#endif
      },
      nb::call_guard<nb::gil_scoped_release>(),
      "str: why metal_available() is False (empty when it is True).");
  m.def(
      "device_name", [](const std::string& implementation) {
        return device_named(implementation).name();
      },
      nb::arg("implementation"),
      "str: name of the device behind 'emulator' or 'metal' (the GPU's name). ValueError if "
      "that device is unavailable.");
  m.def(
      "kernel_names",
      [](const std::string& implementation) {
        Device& device = device_named(implementation);
        nb::gil_scoped_release release;  // Metal compiles the shader library on first use
        return device.kernel_names();
      },
      nb::arg("implementation"),
      "list[str]: sorted kernel names the device behind 'emulator' or 'metal' can run. "
      "ValueError if that device is unavailable.");
  m.def(
      "library_error",
      [](const std::string& implementation) {
        Device& device = device_named(implementation);
        nb::gil_scoped_release release;
        return device.library_error();
      },
      nb::arg("implementation"),
      "str: shader compile errors of that device's library (empty when none).");
  m.def(
      "set_emulator_schedule",
      [](const std::string& schedule, uint64_t seed) {
        std::string error = set_emulator_schedule(schedule, seed);
        if (!error.empty()) throw nb::value_error(error.c_str());
      },
      nb::arg("schedule"), nb::arg("seed") = 0,
      "Fiber resume order for every later emulated kernel run: 'forward' (default), "
      "'reverse' or 'random' (seeded). ValueError for other names.");
  m.def(
      "emulator_schedule",
      [] { return nb::make_tuple(emulator_schedule_name(), emulator_schedule_seed()); },
      "(schedule: str, seed: int) currently used by the emulated device.");
  m.def(
      "_set_emulator_fault", [](const std::string& kernel) { set_emulator_fault(kernel); },
      nb::arg("kernel"),
      "Test hook: emulated runs of this kernel fail with a device error ('' turns it off).");
  m.def("_set_submission_budget", &set_submission_budget, nb::arg("multiply_adds"),
        "Test hook: work per submission (command buffer) before a call is split by batch; "
        "returns the previous value.");
  m.def(
      "_bwd_tile_shape",
      [](uint32_t element_bytes, uint32_t head_dim) {
        const uint32_t row_bytes = element_bytes * head_dim;
        return nb::make_tuple(jfm_bwd_simdgroups(row_bytes), jfm_bwd_block(row_bytes),
                              jfm_bwd_shared_stream(row_bytes), jfm_bwd_split_dkdv(head_dim));
      },
      nb::arg("element_bytes"), nb::arg("head_dim"),
      "(simdgroups, block, shared_stream, split_dkdv) of the backward kernels "
      "(shaders/bwd_tile_shapes.h), for the kernel test harness.");
  m.def(
      "shader_sources",
      [] {
        nb::dict sources;
        for (const ShaderSource& s : shader_sources()) {
          sources[s.file] = nb::str(s.text, s.size);
        }
        return sources;
      },
      "dict[str, str]: the embedded shaders/*.metal sources (quoted includes inlined) that the "
      "Metal device compiles at run time.");
}

}  // namespace
}  // namespace jfm

NB_MODULE(_ext, m) {
  nb::module_ emulator = m.def_submodule("emulator", "MSL-on-CPU emulator (tests)");
  jfm::bind_emulator(emulator);
  jfm::bind_devices(m);
}
