// The emulator's sanitizer: racecheck, initcheck and memcheck on the counting variant of the
// kernels, whose instrumentation reports every load and store (docs/testing.md says what each
// check guarantees and cannot see).
//
// A SanitizerCall holds the shadow state of the host memory of one call (every dispatch of its
// submissions); emu::run checks a launch against it when Launch::sanitizer is set. The runtime
// (runtime.cc) drives a per-launch Checker through the hooks below.
#ifndef JAX_FLASH_METAL_EMULATOR_SANITIZER_H_
#define JAX_FLASH_METAL_EMULATOR_SANITIZER_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime.h"

namespace jfm {
namespace emu {

// How the call writes an output (initcheck's end-of-call contract, docs/testing.md): kInput is
// memory the call only reads; every byte of an output is written by the call, kOnce by exactly
// one store, kAccumulated by at most one store per dispatch (the dispatches ordered by the plan's
// memory barriers, which racecheck checks, so in plan order).
enum class WriteRule { kInput, kOnce, kAccumulated };

class SanitizerCall {
 public:
  // collect_all: keep running after a finding and report them all when the call ends (at most
  // kMaxFindings); otherwise the first finding fails the launch.
  explicit SanitizerCall(bool collect_all);
  ~SanitizerCall();
  SanitizerCall(const SanitizerCall&) = delete;
  SanitizerCall& operator=(const SanitizerCall&) = delete;

  // Declares host memory of the call. An output's bytes are poisoned (0xFF: NaN, -1) and count
  // as unwritten until a dispatch writes them, as Metal leaves a new buffer's contents undefined;
  // an input's bytes count as written. Memory a launch binds without a declaration is an input.
  // `name` names an output in contract findings ("O", "dQ", ...).
  void add_range(void* data, size_t size, WriteRule rule, const std::string& name = "");
  // Before each launch: `segment` numbers the runs of dispatches between two memory barriers of
  // the plan (a new number after every barrier and for every submission); dispatches of one
  // segment may run concurrently on Metal.
  void begin_dispatch(uint64_t segment);
  // After the call: every output byte was written (its rule's other half is checked at each
  // store). Returns every finding of the call ("" if none).
  std::string finish();
  bool collect_all() const;

  static constexpr size_t kMaxFindings = 50;

  struct State;
  std::unique_ptr<State> state;
};

}  // namespace emu

namespace rt {

// One launch under the sanitizer (created by emu::run, used by the runtime on its one worker).
class Checker;

// Starts a launch of `def`, specialised with `function_constants` (emu::Launch), under the
// sanitizer: each bound buffers[n] (of sizes[n] bytes) is replaced by a copy between poisoned
// redzones.
Checker* sanitize_begin(emu::SanitizerCall* call, const KernelDef* def,
                        uint32_t function_constants, const uint32_t groups[3], void** buffers,
                        const size_t* sizes);
// Copies device buffers back to the host; returns the launch's findings ("" if none, or in
// collect-all mode, where SanitizerCall::finish reports them).
std::string sanitize_end(Checker* checker);
void destroy_checker(Checker* checker);

// The checker of the launch the calling worker runs (null: none; initial-exec TLS, read at
// every access of the counting variant).
extern __attribute__((tls_model("initial-exec"))) thread_local Checker* t_san_checker;

// Hooks of the runtime.
// A threadgroup starts; its threadgroup memory begins at `arena` (of `arena_size` bytes).
void san_begin_group(Checker* c, const uint32_t gid[3], const void* arena, size_t arena_size);
// A threadgroup allocation [offset, offset + size) of the arena.
void san_alloc(Checker* c, size_t offset, size_t size, size_t element_size, const char* name,
               const char* file, int line);
// The current GPU thread (tid < 0: the collective of simdgroup `sg` at file:line is running).
void san_set_actor(Checker* c, int tid, int sg, int lane, const char* file, int line);
void san_threadgroup_barrier(Checker* c, unsigned mem_flags);
void san_simdgroup_barrier(Checker* c, int sg, unsigned mem_flags);
// A load or store of n bytes at p by the current actor; pc is the instrumented code's address.
void san_access(Checker* c, const void* p, uint64_t n, bool write, const void* pc);
// The first finding of the launch when it must stop (not collect-all), else null.
const char* san_stop(Checker* c);

}  // namespace rt
}  // namespace jfm

#endif  // JAX_FLASH_METAL_EMULATOR_SANITIZER_H_
