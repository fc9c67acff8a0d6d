// Python bindings of the emulator for tests: jax_flash_metal._ext.emulator.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "emulator.h"

namespace nb = nanobind;

namespace jfm {
namespace {

using Dim3 = std::tuple<uint32_t, uint32_t, uint32_t>;

emu::Schedule parse_schedule(const std::string& s) {
  if (s == "forward") return emu::Schedule::kForward;
  if (s == "reverse") return emu::Schedule::kReverse;
  if (s == "random") return emu::Schedule::kRandom;
  throw nb::value_error(("schedule must be 'forward', 'reverse' or 'random', not '" + s + "'").c_str());
}

}  // namespace

// Binds a NumPy array's memory: it must be C-contiguous and writeable (results are written in
// place; a silent copy would lose them).
emu::Arg bind_array(int index, nb::handle array) {
  if (!nb::hasattr(array, "__array_interface__") || !nb::hasattr(array, "flags"))
    throw nb::type_error(("buffer " + std::to_string(index) + " is not a numpy array").c_str());
  nb::object flags = array.attr("flags");
  if (!nb::cast<bool>(flags.attr("c_contiguous")))
    throw nb::value_error(("buffer " + std::to_string(index) + " is not C-contiguous").c_str());
  if (!nb::cast<bool>(flags.attr("writeable")))
    throw nb::value_error(("buffer " + std::to_string(index) + " is not writeable").c_str());
  nb::tuple data = nb::cast<nb::tuple>(array.attr("__array_interface__")["data"]);
  emu::Arg a;
  a.data = reinterpret_cast<void*>(nb::cast<uintptr_t>(data[0]));
  a.size = nb::cast<size_t>(array.attr("nbytes"));
  return a;
}

nb::dict profile_to_dict(const emu::Profile& p) {
  nb::dict d;
  d["threadgroups"] = p.threadgroups;
  d["threads_per_threadgroup"] = p.threads_per_threadgroup;
  d["threadgroup_memory_bytes"] = p.threadgroup_memory_bytes;
  d["device_bytes_read"] = p.device_bytes_read;
  d["device_bytes_written"] = p.device_bytes_written;
  d["threadgroup_bytes_read"] = p.threadgroup_bytes_read;
  d["threadgroup_bytes_written"] = p.threadgroup_bytes_written;
  d["mma_ops"] = p.mma_ops;
  d["simd_ops"] = p.simd_ops;
  d["barriers"] = p.barriers;
  d["fma_ops"] = p.fma_ops;
  d["math_ops"] = p.math_ops;
  nb::dict buffers;
  for (size_t b = 0; b < p.buffer_bound.size(); ++b) {
    if (!p.buffer_bound[b]) continue;
    nb::dict u;
    u["read"] = p.buffer_bytes_read[b];
    u["written"] = p.buffer_bytes_written[b];
    u["constant"] = p.constant_buffer[b];
    buffers[nb::int_(b)] = u;
  }
  d["buffers"] = buffers;
  return d;
}

namespace {

nb::object run(const std::string& kernel, nb::dict buffers, Dim3 groups, Dim3 group_size,
               const std::string& schedule, uint64_t seed, int num_workers, bool profile,
               uint32_t function_constants) {
  emu::Launch launch;
  launch.function_constants = function_constants;
  launch.groups = {std::get<0>(groups), std::get<1>(groups), std::get<2>(groups)};
  launch.group_size = {std::get<0>(group_size), std::get<1>(group_size), std::get<2>(group_size)};
  launch.schedule = parse_schedule(schedule);
  launch.seed = seed;
  launch.num_workers = num_workers;
  std::vector<emu::Arg> args;
  std::vector<nb::object> keep;  // arrays stay alive while the GIL is released
  for (auto item : buffers) {
    int index = nb::cast<int>(item.first);
    if (index < 0 || index > 30)
      throw nb::value_error(("buffer index " + std::to_string(index) + " out of range 0..30").c_str());
    if (args.size() <= size_t(index)) args.resize(size_t(index) + 1);
    args[size_t(index)] = bind_array(index, item.second);
    keep.push_back(nb::borrow(item.second));
  }
  emu::Profile counts;
  launch.profile = profile ? &counts : nullptr;
  std::string error;
  {
    nb::gil_scoped_release release;
    error = emu::run(kernel, args, launch);
  }
  if (!error.empty()) throw std::runtime_error(error);
  if (!profile) return nb::none();
  return profile_to_dict(counts);
}

}  // namespace

void bind_emulator(nb::module_& m) {
  m.def("has_counting_variant", &emu::has_counting_variant,
        "bool: this build has the counting kernel variants (run(..., profile=True)).");
  m.def("kernel_names", &emu::kernel_names,
        "Sorted names of every kernel the emulator can run (shaders/ and tests/emulator/shaders/).");
  m.def("run", &run, nb::arg("kernel"), nb::arg("buffers"), nb::arg("groups"),
        nb::arg("group_size"), nb::arg("schedule") = "forward", nb::arg("seed") = 0,
        nb::arg("num_workers") = 0, nb::arg("profile") = false,
        nb::arg("function_constants") = 0xffffffffu,
        "Run `kernel` on the emulator.\n\n"
        "buffers: dict {buffer index: numpy array} (C-contiguous, writeable; written in place;\n"
        "`constant` structs as byte arrays). groups: threadgroups per grid (x, y, z);\n"
        "group_size: threads per threadgroup (x, y, z). schedule: order in which threads resume\n"
        "after each barrier/simd operation: 'forward', 'reverse' or 'random' (seeded by seed).\n"
        "num_workers: OS threads running threadgroups (0 = all cores).\n"
        "profile: run the counting variant and return its exact counts as a dict\n"
        "(threadgroups, threads_per_threadgroup, threadgroup_memory_bytes, device_bytes_read,\n"
        "device_bytes_written, threadgroup_bytes_read, threadgroup_bytes_written, mma_ops,\n"
        "simd_ops, barriers, fma_ops, math_ops, buffers: {index: {read, written, constant}}; bytes; see\n"
        "emulator/README.md); returns None otherwise.\n"
        "function_constants: bit n is the value of the kernel's bool [[function_constant(n)]]\n"
        "for this launch (default: all true, the unspecialised kernel).\n"
        "Raises RuntimeError with the emulator's message (unknown kernel, bad launch size,\n"
        "missing buffer, barrier divergence, ...), ValueError/TypeError for bad arguments.");
}

}  // namespace jfm
