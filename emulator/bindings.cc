// Python bindings of the emulator for tests: jax_flash_metal._ext.emulator.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "emulator.h"
#include "sanitizer.h"

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

// The dict of emulator.run(..., profile=True): one key per count of emulator.h's lists, and
// "buffers": {index: {read, written, constant}} for each bound [[buffer(n)]].
nb::dict profile_to_dict(const emu::Profile& p) {
  nb::dict d;
#define JFM_SET_COUNT(name) d[#name] = p.name;
  JFM_PROFILE_TOTALS(JFM_SET_COUNT)
  JFM_PROFILE_OPS(JFM_SET_COUNT)
#undef JFM_SET_COUNT
  nb::dict buffers;
  for (size_t b = 0; b < p.buffer_bound.size(); ++b) {
    if (!p.buffer_bound[b]) continue;
    nb::dict u;
#define JFM_SET_BUFFER_FIELD(key, array) u[#key] = p.array[b];
    JFM_PROFILE_BUFFER_FIELDS(JFM_SET_BUFFER_FIELD)
#undef JFM_SET_BUFFER_FIELD
    buffers[nb::int_(b)] = u;
  }
  d["buffers"] = buffers;
  return d;
}

namespace {

// The arguments of {buffer index: array}; `outputs` must name bound indices. `keep` holds the
// arrays alive while the GIL is released.
std::vector<emu::Arg> bind_buffers(nb::dict buffers, const std::vector<int>& outputs,
                                   std::vector<nb::object>* keep) {
  std::vector<emu::Arg> args;
  for (auto item : buffers) {
    int index = nb::cast<int>(item.first);
    if (index < 0 || index > 30)
      throw nb::value_error(("buffer index " + std::to_string(index) + " out of range 0..30").c_str());
    if (args.size() <= size_t(index)) args.resize(size_t(index) + 1);
    args[size_t(index)] = bind_array(index, item.second);
    keep->push_back(nb::borrow(item.second));
  }
  for (int o : outputs)
    if (o < 0 || size_t(o) >= args.size() || !args[size_t(o)].data)
      throw nb::value_error(("outputs: buffer " + std::to_string(o) + " is not bound").c_str());
  return args;
}

nb::object run(const std::string& kernel, nb::dict buffers, Dim3 groups, Dim3 group_size,
               const std::string& schedule, uint64_t seed, int num_workers, bool profile,
               const std::string& sanitize, std::vector<int> outputs,
               uint32_t function_constants) {
  if (sanitize != "off" && sanitize != "first" && sanitize != "all")
    throw nb::value_error(("sanitize must be 'off', 'first' or 'all', not '" + sanitize + "'").c_str());
  if (sanitize == "off" && !outputs.empty())
    throw nb::value_error("outputs needs sanitize='first' or 'all'");
  emu::Launch launch;
  launch.function_constants = function_constants;
  launch.groups = {std::get<0>(groups), std::get<1>(groups), std::get<2>(groups)};
  launch.group_size = {std::get<0>(group_size), std::get<1>(group_size), std::get<2>(group_size)};
  launch.schedule = parse_schedule(schedule);
  launch.seed = seed;
  launch.num_workers = num_workers;
  std::vector<nb::object> keep;  // arrays stay alive while the GIL is released
  const std::vector<emu::Arg> args = bind_buffers(buffers, outputs, &keep);
  emu::Profile counts;
  launch.profile = profile ? &counts : nullptr;
  std::unique_ptr<emu::SanitizerCall> call;
  if (sanitize != "off") {
    call.reset(new emu::SanitizerCall(sanitize == "all"));
    for (int o : outputs)
      call->add_range(args[size_t(o)].data, args[size_t(o)].size, emu::WriteRule::kOnce);
    launch.sanitizer = call.get();
  }
  std::string error;
  {
    nb::gil_scoped_release release;
    error = emu::run(kernel, args, launch);
    if (error.empty() && call) error = call->finish();
  }
  if (!error.empty()) throw std::runtime_error(error);
  if (!profile) return nb::none();
  return profile_to_dict(counts);
}

using PlanStep = std::tuple<std::string, Dim3, Dim3, bool>;

// Dispatches sharing one set of buffers, as one call under the sanitizer: a step with
// barrier_before false may run concurrently with the step before it (as between the memory
// barriers of a plan on Metal).
void run_plan(std::vector<PlanStep> steps, nb::dict buffers, std::vector<int> outputs,
              const std::string& sanitize, std::vector<int> accumulated) {
  if (sanitize != "first" && sanitize != "all")
    throw nb::value_error(("sanitize must be 'first' or 'all', not '" + sanitize + "'").c_str());
  for (int a : accumulated)
    if (std::find(outputs.begin(), outputs.end(), a) == outputs.end())
      throw nb::value_error(("accumulated: buffer " + std::to_string(a) + " is not in outputs")
                                .c_str());
  std::vector<nb::object> keep;
  const std::vector<emu::Arg> args = bind_buffers(buffers, outputs, &keep);
  emu::SanitizerCall call(sanitize == "all");
  for (int o : outputs) {
    const bool acc = std::find(accumulated.begin(), accumulated.end(), o) != accumulated.end();
    call.add_range(args[size_t(o)].data, args[size_t(o)].size,
                   acc ? emu::WriteRule::kAccumulated : emu::WriteRule::kOnce);
  }
  std::string error;
  {
    nb::gil_scoped_release release;
    uint64_t segment = 0;
    for (size_t i = 0; i < steps.size() && error.empty(); ++i) {
      const auto& [kernel, groups, group_size, barrier_before] = steps[i];
      if (i == 0 || barrier_before) ++segment;
      call.begin_dispatch(segment);
      emu::Launch launch;
      launch.groups = {std::get<0>(groups), std::get<1>(groups), std::get<2>(groups)};
      launch.group_size = {std::get<0>(group_size), std::get<1>(group_size),
                           std::get<2>(group_size)};
      launch.sanitizer = &call;
      error = emu::run(kernel, args, launch);
    }
    if (error.empty()) error = call.finish();
  }
  if (!error.empty()) throw std::runtime_error(error);
}

// profile_to_dict's count keys, in order: emulator.h's lists.
const std::vector<std::string>& count_names() {
#define JFM_COUNT_NAME(name) #name,
  static const std::vector<std::string> names = {
      JFM_PROFILE_TOTALS(JFM_COUNT_NAME) JFM_PROFILE_OPS(JFM_COUNT_NAME)};
#undef JFM_COUNT_NAME
  return names;
}

// "a, b, ..., buffers: {index: {read, ...}}": profile_to_dict's keys, from the same lists.
std::string profile_keys() {
  std::string keys;
  for (const std::string& name : count_names()) keys += name + ", ";
#define JFM_BUFFER_KEY(key, array) ", " #key
  const std::string buffer = JFM_PROFILE_BUFFER_FIELDS(JFM_BUFFER_KEY);
#undef JFM_BUFFER_KEY
  return keys + "buffers: {index: {" + buffer.substr(2) + "}}";
}

}  // namespace

void bind_emulator(nb::module_& m) {
  nb::list counts;
  for (const std::string& name : count_names()) counts.append(name);
  // The count keys of run(..., profile=True)'s dict, in order (the profile tables read them).
  m.attr("PROFILE_COUNTS") = nb::tuple(counts);
  m.def("run_plan", &run_plan, nb::arg("steps"), nb::arg("buffers"),
        nb::arg("outputs") = std::vector<int>(), nb::arg("sanitize") = "first",
        nb::arg("accumulated") = std::vector<int>(),
        "Run dispatches as one call under the sanitizer (docs/testing.md).\n\n"
        "steps: list of (kernel, groups, group_size, barrier_before), in plan order; a step\n"
        "without barrier_before may run concurrently with its predecessor on Metal, so the\n"
        "sanitizer reports a step that touches what such a predecessor wrote. buffers, outputs:\n"
        "as run(), each written once by the call unless listed in accumulated (outputs the\n"
        "steps accumulate: at most one store per step). sanitize: 'first' or 'all'. Raises\n"
        "RuntimeError with the findings, ValueError for an accumulated index not in outputs.");
  m.def("has_counting_variant", &emu::has_counting_variant,
        "bool: this build has the counting kernel variants (run(..., profile=True)).");
  m.def("kernel_names", &emu::kernel_names,
        "Sorted names of every kernel the emulator can run (shaders/ and tests/emulator/shaders/).");
  static const std::string run_doc =
      "Run `kernel` on the emulator.\n\n"
      "buffers: dict {buffer index: numpy array} (C-contiguous, writeable; written in place;\n"
      "`constant` structs as byte arrays). groups: threadgroups per grid (x, y, z);\n"
      "group_size: threads per threadgroup (x, y, z). schedule: order in which threads resume\n"
      "after each barrier/simd operation: 'forward', 'reverse' or 'random' (seeded by seed).\n"
      "num_workers: OS threads running threadgroups (0 = all cores).\n"
      "profile: run the counting variant and return its exact counts as a dict\n(" +
      profile_keys() + "; bytes; see emulator/README.md); returns None otherwise.\n"
      "sanitize: 'first' runs the counting variant under the sanitizer (racecheck, initcheck,\n"
      "memcheck; docs/testing.md) and raises at its first finding; 'all' collects every\n"
      "finding and raises with all of them; 'off' (default). outputs: buffer indices that are\n"
      "outputs: poisoned (0xFF bytes) before the run, every byte must be written exactly once,\n"
      "and reading one before it is written is a finding.\n"
      "function_constants: bit n is the value of the kernel's bool [[function_constant(n)]]\n"
      "for this launch (default: all true, the unspecialised kernel).\n"
      "Raises RuntimeError with the emulator's message (unknown kernel, bad launch size,\n"
      "missing buffer, barrier divergence, ...), ValueError/TypeError for bad arguments.";
  m.def("run", &run, nb::arg("kernel"), nb::arg("buffers"), nb::arg("groups"),
        nb::arg("group_size"), nb::arg("schedule") = "forward", nb::arg("seed") = 0,
        nb::arg("num_workers") = 0, nb::arg("profile") = false, nb::arg("sanitize") = "off",
        nb::arg("outputs") = std::vector<int>(),
        nb::arg("function_constants") = 0xffffffffu,
        run_doc.c_str());
}

}  // namespace jfm
