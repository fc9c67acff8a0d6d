// jax_flash_metal._ext: one nanobind module for the whole native side.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/set.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <cstdint>
#include <iterator>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "attention_ffi.h"
#include "device.h"
#include "dispatch_plan.h"
#include "emulator_profile.h"
#include "function_constants.h"
#include "shader_sources.h"
#include "working_memory.h"

namespace nb = nanobind;

namespace jfm {
void bind_emulator(nb::module_& m);                // emulator/bindings.cc
nb::dict profile_to_dict(const emu::Profile& p);  // emulator/bindings.cc
emu::Arg bind_array(int index, nb::handle array); // emulator/bindings.cc
void bind_testing(nb::module_& m);                 // ffi/testing_bindings.cc

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

using Dim3 = std::tuple<uint32_t, uint32_t, uint32_t>;

nb::tuple dim3(const std::array<uint32_t, 3>& v) { return nb::make_tuple(v[0], v[1], v[2]); }

// The dicts handed to Python, each field list in one place: X(key, value) with the value an
// expression over the source objects. set_fields fills a dict `d` from a list; field_keys names
// its keys for the docstring, so the two cannot drift apart.
#define JFM_TILE_SHAPE_FIELDS(X)                                                         \
  X(rows, t.rows) X(cols, t.cols) X(simdgroups, t.simdgroups) X(threads, t.threads)     \
  X(q_in_registers, t.q_in_registers) X(kv_one_buffer, t.kv_one_buffer)                 \
  X(registers, t.registers)
#define JFM_DISPATCH_FIELDS(X)                                                           \
  X(kernel, s.kernel) X(groups, dim3(c.groups)) X(threads, s.threads)                    \
  X(rows_per_group, s.rows_per_group) X(block_offset, c.offset[0])                       \
  X(head_offset, c.offset[1]) X(batch_offset, c.offset[2]) X(multiply_adds, c.multiply_adds)
#define JFM_PROFILE_RECORD_FIELDS(X) \
  X(kernel, r.kernel) X(groups, dim3(r.groups)) X(group_size, dim3(r.group_size)) \
  X(function_constants, r.function_constants)
#define JFM_SHADER_LIBRARY_FIELDS(X) \
  X(file, library.source->file) X(family, library.family) X(macros, macros)
#define JFM_SET_FIELD(key, value) d[#key] = value;
#define JFM_FIELD_KEY(key, value) ", " #key

// "a, b, c" from a field list's keys (which JFM_FIELD_KEY prefixes with ", ").
const char* field_keys(const char* prefixed) { return prefixed + 2; }

// One dispatch of `kernel` on the device behind `implementation`, through run_and_wait (on Metal:
// compiled from the embedded sources, buffers wrapped or staged as the FFI handlers' are).
// buffers: {index: C-contiguous writeable NumPy array}; `outputs` the indices the kernel writes.
void run_kernel(const std::string& implementation, const std::string& kernel, nb::dict buffers,
                const std::set<int>& outputs, Dim3 groups, Dim3 group_size) {
  Device& device = device_named(implementation);
  Dispatch d;
  d.kernel = kernel;
  d.groups = {std::get<0>(groups), std::get<1>(groups), std::get<2>(groups)};
  d.group_size = {std::get<0>(group_size), std::get<1>(group_size), std::get<2>(group_size)};
  for (auto item : buffers) {
    const int index = nb::cast<int>(item.first);
    if (index < 0 || index > 30) {
      throw nb::value_error(("buffer index " + std::to_string(index) + " out of range 0..30").c_str());
    }
    const emu::Arg a = bind_array(index, item.second);
    d.buffers.push_back(Binding{index, a.data, a.size, outputs.count(index) > 0, false});
  }
  for (int index : outputs) {
    if (!buffers.contains(nb::int_(index))) {
      throw nb::value_error(("output " + std::to_string(index) + " is not a bound buffer").c_str());
    }
  }
  std::string error;
  {
    nb::gil_scoped_release release;  // the arrays stay alive: `buffers` holds them
    if (!device.has_kernel(kernel)) {
      error = "no kernel '" + kernel + "' on " + device.kind() + ": " + device.library_error();
    } else {
      error = run_and_wait(device, {Submission{d}});
    }
  }
  if (!error.empty()) throw std::runtime_error(error);
}

// The contract of the FFI targets as the handlers take it: attributes and optional operands.
void bind_contract(nb::module_& m) {
  m.def(
      "ffi_attributes",
      [] {
        std::vector<std::pair<std::string, std::string>> attributes;
#define JFM_ATTRIBUTE_ENTRY(type, name) attributes.emplace_back(#name, #type);
        JFM_FFI_ATTRIBUTES(JFM_ATTRIBUTE_ENTRY)
#undef JFM_ATTRIBUTE_ENTRY
        return attributes;
      },
      "list[tuple[str, str]]: the static attributes of every FFI target, in order, as (name, C++ "
      "type): float is f32, int32_t i32, bool pred (JFM_FFI_ATTRIBUTES in ffi/attention_ffi.h). "
      "The lowering builds its attributes from this list.");
  m.def(
      "optional_operands",
      [] {
        std::vector<std::pair<std::string, std::string>> operands;
#define JFM_OPERAND_ENTRY(name, flag) operands.emplace_back(#name, #flag);
        JFM_OPTIONAL_OPERANDS(JFM_OPERAND_ENTRY)
#undef JFM_OPERAND_ENTRY
        return operands;
      },
      "list[tuple[str, str]]: the optional operands of every FFI target, in operand order, as "
      "(name, the attribute that says it is present) (JFM_OPTIONAL_OPERANDS in "
      "ffi/attention_ffi.h); contract.Operands must list the same.");
}

// The FFI targets of this build.
void bind_ffi_targets(nb::module_& m) {
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
}

// Whether the Metal device is there (and why not), the devices' names and the Metal debug mode.
void bind_availability(nb::module_& m) {
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
      "bool: this build has the Metal device and the machine has an Apple-silicon GPU (family "
      "Apple7+, unified memory, 32-wide simdgroups; macOS 13+).");
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
  m.def("set_metal_debug", &set_metal_debug, nb::arg("on"),
        "Metal debug mode for every later command buffer: encoder execution status and a "
        "debug signpost per dispatch, so a failed command buffer names its encoder's status "
        "(set from $JAX_FLASH_METAL_DEBUG on import; no effect without a Metal device).");
  m.def("metal_debug", &metal_debug, "bool: whether the Metal debug mode is on.");
}

// A device's kernels, its shader compiles, its throughput figures, and one-off kernel runs.
void bind_device_state(nb::module_& m) {
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
      "library_warnings",
      [](const std::string& implementation) {
        Device& device = device_named(implementation);
        nb::gil_scoped_release release;
        return device.library_warnings();
      },
      nb::arg("implementation"),
      "str: warnings of the shader compiles so far on that device (Metal compiles each "
      "(dtype, head dim) family on first use and also prints its warnings once to stderr); "
      "empty when none.");
  m.def(
      "multiply_adds_per_second",
      [](const std::string& implementation) {
        return device_named(implementation).multiply_adds_per_second();
      },
      nb::arg("implementation"),
      "float: the throughput estimate that sizes submissions on that device (fixed on the "
      "emulator; on Metal refined from the GPU time of earlier command buffers).");
  m.def(
      "gpu_seconds_total",
      [](const std::string& implementation) -> std::optional<double> {
        Device& device = device_named(implementation);
#ifdef JFM_HAVE_METAL
        if (&device == metal_device()) return metal_gpu_seconds_total();
#endif
        (void)device;
        return std::nullopt;  // the emulated device has no GPU clock
      },
      nb::arg("implementation"),
      "float | None: seconds of GPU time (MTLCommandBuffer GPUEndTime - GPUStartTime) of every "
      "command buffer completed so far in this process on 'metal'; None on 'emulator'. A "
      "process-wide total: read it before and after a call (blocked until ready) for that call's "
      "GPU time, exact when no other Metal call runs concurrently. ValueError if that device is "
      "unavailable.");
  m.def(
      "has_kernel",
      [](const std::string& implementation, const std::string& kernel) {
        Device& device = device_named(implementation);
        nb::gil_scoped_release release;
        return device.has_kernel(kernel);
      },
      nb::arg("implementation"), nb::arg("kernel"),
      "bool: the device behind 'emulator' or 'metal' has this kernel; on Metal this compiles "
      "the kernel's (source, dtype, head dim) library on first use, and library_error() says "
      "why it failed. ValueError if that device is unavailable.");
  m.def("run_kernel", &run_kernel, nb::arg("implementation"), nb::arg("kernel"),
        nb::arg("buffers"), nb::arg("outputs"), nb::arg("groups"), nb::arg("group_size"),
        "Runs one dispatch of `kernel` (e.g. the self-check's probe) on the device behind "
        "'emulator' or 'metal' and waits for it. buffers: {index: NumPy array} (C-contiguous, "
        "writeable), bound at [[buffer(index)]]; outputs: the indices the kernel writes (results "
        "land in those arrays); groups, group_size: (x, y, z). RuntimeError with the device's "
        "message; ValueError for an unavailable device or bad indices.");
}

// The embedded shader sources, the kernel families and how a kernel's library is compiled.
void bind_shader_sources(nb::module_& m) {
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
  m.def(
      "kernel_families",
      [] {
        std::vector<std::tuple<std::string, int, int>> families;
        for (const KernelFamily& f : kernel_families()) {
          families.emplace_back(f.suffix, f.key_head_dim, f.value_head_dim);
        }
        return families;
      },
      "list[tuple[str, int, int]]: every (dtype suffix, key head dim, value head dim) family the "
      "kernels are instantiated for, in order (shaders/kernel_families.h): 'f32', 'f16', "
      "'bf16', each with every pair of head dims.");
  m.def("kernel_name", &kernel_name, nb::arg("stage"), nb::arg("dtype"), nb::arg("head_dim"),
        nb::arg("value_head_dim"),
        "str: the kernel name of a stage ('fwd', 'bwd_dq', ...), dtype suffix ('f32', 'f16', "
        "'bf16') and key and value head dims, e.g. 'flash_attention_fwd_f16_d64', "
        "'flash_attention_fwd_f16_d128_v64' (shaders/kernel_families.h).");
  m.def("tile_head_dim", &tile_head_dim, nb::arg("head_dim"), nb::arg("value_head_dim"),
        "int: the head dim the tiles of the (key, value) head-dim family are chosen by, the "
        "wider of the two: what tile_shape and bwd_stages take.");
  static const std::string shader_library_doc =
      "dict(" + std::string(field_keys(JFM_SHADER_LIBRARY_FIELDS(JFM_FIELD_KEY))) +
      "): what the Metal device compiles to get `kernel`: the embedded source file "
      "(shader_sources()[file]), its (element type, head dim) family such as 'half_64' ('' for "
      "the whole source) and the preprocessor macros {name: value} it passes "
      "(MTLCompileOptions.preprocessorMacros). ValueError when no embedded source defines it.";
  m.def(
      "shader_library",
      [](const std::string& kernel) {
        const std::vector<ShaderSource> sources = shader_sources();
        const ShaderLibrary library = shader_library(sources, kernel);
        if (library.source == nullptr) {
          throw nb::value_error(("no embedded shader source defines '" + kernel + "'").c_str());
        }
        nb::dict macros;
        for (const auto& [name, value] : library.macros) macros[name.c_str()] = value;
        nb::dict d;
        JFM_SHADER_LIBRARY_FIELDS(JFM_SET_FIELD)
        return d;
      },
      nb::arg("kernel"),
      shader_library_doc.c_str());
}

// The emulated device's thread schedule and kernel profile.
void bind_emulator_controls(nb::module_& m) {
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
      "set_emulator_sanitizer",
      [](const std::string& mode) {
        std::string error = set_emulator_sanitizer(mode);
        if (!error.empty()) throw nb::value_error(error.c_str());
      },
      nb::arg("mode"),
      "The emulated device's sanitizer for every later call (docs/testing.md): 'off', 'first' "
      "(the first race, uninitialised read or out-of-bounds access fails the call with a report) "
      "or 'all' (the call fails when it ends, listing every finding). The default comes from "
      "$JFM_EMULATOR_SANITIZE. ValueError for other names or a build without the counting "
      "variants.");
  m.def("emulator_sanitizer", &emulator_sanitizer,
        "str: the emulated device's sanitizer mode ('off', 'first' or 'all').");
  m.def(
      "set_emulator_profiling",
      [](bool on) {
        std::string error = set_emulator_profiling(on);
        if (!error.empty()) throw std::runtime_error(error);
      },
      nb::arg("on"),
      "Kernel profile: while on, every kernel the emulated device runs uses its counting "
      "variant and is recorded (turning it on clears earlier records). RuntimeError if this "
      "build has no counting variants.");
  static const std::string profile_doc =
      "list[dict]: one record per kernel launch since profiling was turned on, in launch "
      "order (" + std::string(field_keys(JFM_PROFILE_RECORD_FIELDS(JFM_FIELD_KEY))) +
      " and the counts of emulator.run(..., profile=True)); clears them.";
  m.def(
      "take_emulator_profile",
      [] {
        nb::list records;
        for (const ProfileRecord& r : take_emulator_profile()) {
          nb::dict d = profile_to_dict(r.counts);
          JFM_PROFILE_RECORD_FIELDS(JFM_SET_FIELD)
          records.append(d);
        }
        return records;
      },
      profile_doc.c_str());
}

nb::dict tile_shape_dict(const TileShape& t) {
  nb::dict d;
  JFM_TILE_SHAPE_FIELDS(JFM_SET_FIELD)
  return d;
}

// The stages of a call (attention_stages) on `device`, its direction and dtype names checked
// (ValueError).
std::vector<StageShape> planned_stages(Device& device, const std::string& direction,
                                       const std::string& dtype, int64_t batch, int64_t q_len,
                                       int64_t kv_len, int64_t num_heads, int64_t num_kv_heads,
                                       int64_t head_dim, std::optional<int64_t> value_head_dim,
                                       bool dropout, int variant) {
  if (direction != "fwd" && direction != "bwd") {
    throw nb::value_error(("direction must be 'fwd' or 'bwd', not " + direction).c_str());
  }
  if (dtype != "f32" && dtype != "f16" && dtype != "bf16") {
    throw nb::value_error(("dtype must be 'f32', 'f16' or 'bf16', not " + dtype).c_str());
  }
  return attention_stages(direction == "bwd", dtype.c_str(), batch, q_len, kv_len, num_heads,
                          num_kv_heads, head_dim, value_head_dim.value_or(head_dim),
                          device.gpu_cores(), dropout, variant);
}

// The arguments of the bindings of one planned problem (over_plan), declared once.
#define JFM_PLANNING_ARGS                                                                  \
  nb::arg("direction"), nb::arg("dtype"), nb::arg("batch"), nb::arg("q_len"),              \
      nb::arg("kv_len"), nb::arg("num_heads"), nb::arg("num_kv_heads"), nb::arg("head_dim"), \
      nb::arg("implementation") = "emulator", nb::arg("value_head_dim") = nb::none(),      \
      nb::arg("dropout") = false, nb::arg("variant") = 0

// A binding of one planned problem (JFM_PLANNING_ARGS): f(stages, plan, batch) over the stages
// and the submissions the handler of `direction` would run on that device.
template <typename F>
auto over_plan(F f) {
  return [f](const std::string& direction, const std::string& dtype, int64_t batch,
             int64_t q_len, int64_t kv_len, int64_t num_heads, int64_t num_kv_heads,
             int64_t head_dim, const std::string& implementation,
             std::optional<int64_t> value_head_dim, bool dropout, int variant) {
    Device& device = device_named(implementation);
    const std::vector<StageShape> stages =
        planned_stages(device, direction, dtype, batch, q_len, kv_len, num_heads, num_kv_heads,
                       head_dim, value_head_dim, dropout, variant);
    return f(stages, plan_for(device, stages), batch);
  };
}

// The FFI handlers' own working memory (working_memory.h): the formula and the measured figures.
void bind_working_memory(nb::module_& m) {
  m.def("working_memory",
        over_plan([](const std::vector<StageShape>&, const std::vector<ChunkedSubmission>& plan,
                     int64_t batch) {
          size_t dispatches = 0;
          for (const ChunkedSubmission& chunks : plan) dispatches += chunks.size();
          return argument_bytes(dispatches, batch);
        }),
        JFM_PLANNING_ARGS,
        "int: bytes of host memory the FFI handler allocates for the kernels' arguments of this "
        "call (arguments as dispatch_plan's; one parameter block per dispatch of the plan and "
        "the copied q/kv lengths), outside XLA's memory analysis. A Metal call may also stage "
        "host ranges it cannot wrap in place: take_working_memory() reports those as measured.");
  m.def(
      "take_working_memory",
      [] {
        const WorkingMemory w = take_working_memory();
        nb::dict d;
#define JFM_WORKING_MEMORY_ITEM(name) d[#name] = w.name;
        JFM_WORKING_MEMORY_FIELDS(JFM_WORKING_MEMORY_ITEM)
#undef JFM_WORKING_MEMORY_ITEM
        return d;
      },
      "dict: the FFI handlers' own working memory since the last take (then zeroed): calls "
      "(handler calls that ran kernels), last_bytes and peak_bytes (host memory a call "
      "allocated for the kernels' arguments, as working_memory() gives it), staging_calls, "
      "last_staging_bytes and peak_staging_bytes (Metal: bytes of staging buffers a call "
      "used for host ranges it could not wrap in place; 0 on the emulated device).");
}

// The dispatch plan the handlers use (dispatch_plan.h), read by the lowering and the tests.
void bind_planning(nb::module_& m) {
  static const std::string dispatch_plan_doc =
      "list[list[dict]]: the submissions (command buffers) the handler of `direction` ('fwd' or "
      "'bwd') would run for this problem on that device (value_head_dim: that of value, default "
      "head_dim; dropout: a call with dropout_rate > 0, whose forward never takes the decode "
      "kernels; variant: the kernel_variant attribute), each a list of dispatches {" +
      std::string(field_keys(JFM_DISPATCH_FIELDS(JFM_FIELD_KEY))) +
      "}: groups (x, y, z), multiply_adds an estimate. Dispatch x covers row blocks "
      "block_offset.., y heads head_offset.., z batch elements batch_offset... ValueError for "
      "bad names.";
  m.def("dispatch_plan",
        over_plan([](const std::vector<StageShape>& stages,
                     const std::vector<ChunkedSubmission>& plan, int64_t) {
          nb::list submissions;
          for (const ChunkedSubmission& chunks : plan) {
            nb::list dispatches;
            for (const Chunk& c : chunks) {
              const StageShape& s = stages[c.stage];
              nb::dict d;
              JFM_DISPATCH_FIELDS(JFM_SET_FIELD)
              dispatches.append(d);
            }
            submissions.append(dispatches);
          }
          return submissions;
        }),
        JFM_PLANNING_ARGS, dispatch_plan_doc.c_str());
  m.def(
      "decode_splits",
      [](const std::string& dtype, int64_t batch, int64_t q_len, int64_t kv_len,
         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
         const std::string& implementation, std::optional<int64_t> value_head_dim,
         bool dropout) {
        if (dtype != "f32" && dtype != "f16" && dtype != "bf16") {
          throw nb::value_error(("dtype must be 'f32', 'f16' or 'bf16', not " + dtype).c_str());
        }
        Device& device = device_named(implementation);
        const int64_t dv = value_head_dim.value_or(head_dim);
        const int64_t splits =
            decode_splits(dtype.c_str(), batch, q_len, kv_len, num_heads, num_kv_heads,
                          tile_head_dim(head_dim, dv), device.gpu_cores(), dropout);
        return nb::make_tuple(splits,
                              decode_workspace_elements(batch, q_len, num_heads, dv, splits));
      },
      nb::arg("dtype"), nb::arg("batch"), nb::arg("q_len"), nb::arg("kv_len"),
      nb::arg("num_heads"), nb::arg("num_kv_heads"), nb::arg("head_dim"),
      nb::arg("implementation") = "emulator", nb::arg("value_head_dim") = nb::none(),
      nb::arg("dropout") = false,
      "(splits, workspace_elements): the split-KV decode's key splits per (batch, kv head) for "
      "this forward problem on that device (0: the tiled forward runs, always with `dropout`) "
      "and the float32 elements of the forward's workspace result, as the handler requires them "
      "(value_head_dim: that of value, default head_dim). ValueError for bad names.");
}

// The core counts and tile shapes the plan is sized by (shaders/tile_shapes.h).
void bind_tiles(nb::module_& m) {
  m.def(
      "gpu_cores",
      [](const std::string& implementation) { return device_named(implementation).gpu_cores(); },
      nb::arg("implementation") = "emulator",
      "int: the GPU core count the device sizes the decode's splits with (emulator: a fixed 32; "
      "metal: by GPU name).");
  m.def("gpu_cores_by_name", &gpu_cores_by_name, nb::arg("name"),
        "int: the core-count table of the Metal device (largest configuration per chip; 10 for "
        "an unknown name).");
  m.def("stage_function_constants", &stage_function_constants, nb::arg("stage"),
        "int: the bool Metal function constants (bit n: [[function_constant(n)]] of "
        "shaders/function_constants.h) the kernels of a stage ('fwd', 'bwd_dq', ...) read; the "
        "constant sets the host may pick for the stage are its subsets. 0 for an unknown stage.");
  m.def(
      "function_constant_names",
      [] {
        std::vector<std::string> names;
        for (int n = 0; n < JFM_FUNCTION_CONSTANTS; ++n)
          names.push_back(jfm_function_constant_name(n));
        return names;
      },
      "list[str]: the function constants by index (JFM_FC_* of shaders/function_constants.h).");
  m.def("bwd_stages", &bwd_stages, nb::arg("head_dim"),
        "list[str]: the backward kernel stages the host dispatches, in order: 'bwd_dq' (which "
        "also writes D), then 'bwd_dkdv', or 'bwd_dk' and 'bwd_dv' for the widest heads.");
  static const std::string tile_shape_doc =
      "dict(" + std::string(field_keys(JFM_TILE_SHAPE_FIELDS(JFM_FIELD_KEY))) +
      "): the tile shape of shaders/tile_shapes.h for a kernel stage ('fwd', 'bwd_dq', "
      "'bwd_dkdv', 'bwd_dk', 'bwd_dv', 'decode_partial', 'decode_combine', 'decode_vector'), "
      "dtype ('f32', 'f16', 'bf16'), head dim and tile variant: rows per threadgroup, block size "
      "of the traversed dimension, simdgroups and threads per threadgroup; forward tiles only: "
      "Q kept in registers, K and V sharing one threadgroup buffer; the estimated live 32-bit "
      "registers per thread (jfm_tile_registers). ValueError for an unknown stage, dtype or "
      "variant.";
  m.def(
      "tile_shape",
      [](const std::string& stage, const std::string& dtype, int head_dim, int variant) {
        const int bytes = element_bytes(dtype);
        TileShape shape;
        if (bytes == 0 || !tile_shape(stage, bytes, head_dim, variant, &shape)) {
          throw nb::value_error(("no tile shape for stage '" + stage + "', dtype '" + dtype +
                                 "' and variant " + std::to_string(variant) +
                                 " (stages fwd, bwd_dq, bwd_dkdv, bwd_dk, bwd_dv, "
                                 "decode_partial, decode_combine, decode_vector; dtypes f32, "
                                 "f16, bf16; variants 0 .. tile_variants(stage) - 1)")
                                    .c_str());
        }
        return tile_shape_dict(shape);
      },
      nb::arg("stage"), nb::arg("dtype"), nb::arg("head_dim"), nb::arg("variant") = 0,
      tile_shape_doc.c_str());
  m.def("tile_variants", &tile_variants, nb::arg("stage"),
        "int: the tile variants a stage's kernels are instantiated in (the kernel_variant "
        "attribute's range; 1 for decode_vector and decode_combine, 0 for an unknown stage).");
  m.def(
      "kernel_variants",
      [](const std::string& stage, const std::string& dtype, int head_dim) {
        const int bytes = element_bytes(dtype);
        nb::list variants;
        TileShape shape;
        for (int v = 0; v < tile_variants(stage); ++v) {
          if (bytes == 0 || !tile_shape(stage, bytes, head_dim, v, &shape)) break;
          if (v > 0 && !tile_variant_differs(stage, bytes, head_dim, v)) continue;
          nb::dict d = tile_shape_dict(shape);
          d["variant"] = v;
          d["stage"] = variant_stage(stage, v);
          variants.append(d);
        }
        return variants;
      },
      nb::arg("stage"), nb::arg("dtype"), nb::arg("head_dim"),
      "list[dict]: the distinct tile variants of a stage's family (dtype, tile head dim), the "
      "choices an autotuner or JFM_KERNEL_VARIANT has: each tile_shape's dict with 'variant' "
      "(the kernel_variant attribute) and 'stage' (the stage part of its kernel names). "
      "Variant 0 first; [] for an unknown stage or dtype.");
}

}  // namespace
}  // namespace jfm

NB_MODULE(_ext, m) {
  nb::module_ emulator = m.def_submodule("emulator", "MSL-on-CPU emulator (tests)");
  jfm::bind_emulator(emulator);
  jfm::bind_contract(m);
  jfm::bind_ffi_targets(m);
  jfm::bind_availability(m);
  jfm::bind_device_state(m);
  jfm::bind_shader_sources(m);
  jfm::bind_emulator_controls(m);
  jfm::bind_planning(m);
  jfm::bind_working_memory(m);
  jfm::bind_tiles(m);
  nb::module_ testing = m.def_submodule(
      "testing", "Test hooks: fault injection, the submission budget, the plain C++ rules the "
                 "Metal device applies (GPU gate, core count) and mark_barriers.");
  jfm::bind_testing(testing);
}
