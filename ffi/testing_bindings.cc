// jax_flash_metal._ext.testing: the test hooks. Fault injection on both devices, the submission
// budget that forces the dispatch plan to split, and the plain C++ rules the Metal device applies
// (its GPU gate, its core count, the barriers between dispatches), so Linux CI can check them.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "device.h"
#include "dispatch_plan.h"
#include "host_timing.h"
#include "tile_shapes.h"

namespace nb = nanobind;

namespace jfm {
namespace {

// A dispatch for mark_barriers: its kernel and its host ranges (address, bytes, written).
using RangesOf = std::pair<std::string, std::vector<std::tuple<uint64_t, uint64_t, bool>>>;

}  // namespace

void bind_testing(nb::module_& m) {
  m.def("metal_gate", &apple_gpu_gate, nb::arg("name"), nb::arg("apple7"),
        nb::arg("unified_memory"), nb::arg("simd_width"),
        "The Metal device's GPU requirement (GPU family Apple7+, unified memory, 32-wide "
        "simdgroups) applied to these traits: '' when they qualify, else why not.");
#ifdef JFM_HAVE_METAL
  m.def(
      "set_metal_fault", [](const std::string& kernel) { set_metal_fault(kernel); },
      nb::arg("kernel"),
      "Metal command buffers holding this kernel are reported as failed ('' turns it off).");
#endif
  m.def(
      "set_emulator_fault", [](const std::string& kernel) { set_emulator_fault(kernel); },
      nb::arg("kernel"),
      "Emulated runs of this kernel fail with a device error ('' turns it off).");
  m.def("set_emulator_hold", &set_emulator_hold, nb::arg("on"),
        "While on, every emulated run waits on its worker thread until the hold is turned off "
        "(failing with a device error after a time limit), so a test can order other work "
        "of the same program before an attention call completes.");
  m.def("set_host_timing", &set_host_timing, nb::arg("on"),
        "While on, every FFI handler call adds the wall time of its host phases to totals "
        "that take_host_times() returns (turning it on or off clears them).");
  m.def(
      "take_host_times",
      [] {
        const HostTimes t = take_host_times();
        nb::dict seconds;
#define JFM_HOST_PHASE_NAME(enumerator, name) #name,
        const char* names[kHostPhases] = {JFM_HOST_PHASES(JFM_HOST_PHASE_NAME)};
#undef JFM_HOST_PHASE_NAME
        for (int p = 0; p < kHostPhases; ++p) seconds[names[p]] = t.nanoseconds[p] * 1e-9;
        return nb::make_tuple(t.calls, seconds);
      },
      "(calls, {phase: seconds}): the handler calls timed since the last take and the total "
      "seconds of each host phase (validate, lookup, plan, launch: host_timing.h); clears "
      "them.");
  m.def("emulator_runs_held", &emulator_runs_held,
        "int: the emulated runs waiting on set_emulator_hold now.");
  m.def(
      "mark_barriers",
      [](const std::vector<RangesOf>& dispatches) {
        Submission submission;
        for (const auto& [kernel, ranges] : dispatches) {
          Dispatch d;
          d.kernel = kernel;
          for (const auto& [address, size, written] : ranges) {
            void* data = reinterpret_cast<void*>(static_cast<uintptr_t>(address));
            d.buffers.push_back(Binding{0, data, static_cast<size_t>(size), written, false});
          }
          submission.push_back(std::move(d));
        }
        mark_barriers(&submission);
        std::vector<bool> barriers;
        for (const Dispatch& d : submission) barriers.push_back(d.barrier_before);
        return barriers;
      },
      nb::arg("dispatches"),
      "mark_barriers (ffi/dispatch_plan.h) on dispatches given as (kernel, [(address, "
      "bytes, written), ...]); returns each dispatch's barrier_before.");
  m.def("set_submission_budget", &set_submission_budget_seconds, nb::arg("seconds"),
        "Sets the estimated GPU time per submission (command buffer), in seconds, before "
        "a call is split by batch, head and row block; returns the previous value.");
  m.def(
      "page_size_supported", [](long size) { return jfm_page_size_supported(size); },
      nb::arg("size"),
      "jfm_page_size_supported (shaders/tile_shapes.h): whether the kernels, and the FFI "
      "handler, take a paged K/V cache of this many keys per page.");
  m.def("gpu_core_count", &gpu_core_count, nb::arg("registry_cores"), nb::arg("name"),
        "int: the Metal device's rule: the IORegistry's gpu-core-count when plausible (1 to "
        "1024; 0 = could not be read), else gpu_cores_by_name(name).");
}

}  // namespace jfm
