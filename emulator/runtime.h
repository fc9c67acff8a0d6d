// Interface between translated shaders (through the shim) and the emulator runtime (runtime.cc).
// Translated shader code never touches fibers directly: it calls these functions, which find the
// current GPU thread through the worker running it.
#ifndef JAX_FLASH_METAL_EMULATOR_RUNTIME_H_
#define JAX_FLASH_METAL_EMULATOR_RUNTIME_H_

#include <cstddef>
#include <cstdint>

namespace jfm {
namespace rt {

// Ids of one GPU thread; 3-component ids are (x, y, z).
struct ThreadCtx {
  void* const* buffers;                // [[buffer(n)]] -> buffers[n]
  uint32_t function_constants;         // bit n: bool [[function_constant(n)]] (emu::Launch)
  uint32_t thread_position_in_grid[3];
  uint32_t thread_position_in_threadgroup[3];
  uint32_t threadgroup_position_in_grid[3];
  uint32_t threads_per_threadgroup[3];
  uint32_t threadgroups_per_grid[3];
  uint32_t threads_per_grid[3];
  uint32_t thread_index_in_threadgroup;
  uint32_t thread_index_in_simdgroup;
  uint32_t simdgroup_index_in_threadgroup;
  uint32_t threads_per_simdgroup;
  uint32_t simdgroups_per_threadgroup;
};

constexpr int kSimdWidth = 32;
constexpr int kMaxBuffers = 31;                 // Metal's buffer argument table size
constexpr size_t kMaxThreadgroupMemory = 32768;  // Apple GPUs: 32 KiB per threadgroup

// One lane's part in a collective simdgroup operation: its operand, where its result goes, and a
// per-lane argument (shuffle lane, delta, ...). Slots live on the lane's fiber stack while it waits.
struct Slot {
  const void* in;
  void* out;
  uint64_t arg;
};
// Computes the results of a collective from all lanes' slots; lanes[i] is null for lanes that do
// not exist or have returned. Returns nullptr, or an error message (static storage).
using ResolveFn = const char* (*)(Slot* const* lanes);

// Blocks the calling GPU thread until every active lane of its simdgroup reached a collective
// with the same `fn` and source site; `fn` then runs once. `what` names the operation in errors.
void simd_collective(ResolveFn fn, const void* in, void* out, uint64_t arg, const char* what,
                     const char* file, int line);
// Like simd_collective, but every lane of the simdgroup must be active (simdgroup_matrix ops).
void simd_collective_full(ResolveFn fn, const void* in, void* out, uint64_t arg, const char* what,
                          const char* file, int line);
// threadgroup_barrier: blocks until every thread of the group arrived at the same barrier.
// `flags` are its mem_flags bits (the sanitizer orders memory by them).
void threadgroup_barrier(unsigned flags, const char* file, int line);
// Storage of a `threadgroup` variable declared in a kernel body: one block per declaration site
// (`site` is the address of a static marker) per threadgroup, filled with 0xFF bytes (NaN for
// floats) when the group starts using it. element_size is sizeof one array element (the
// sanitizer's reports index elements); name/file/line identify the declaration in errors.
void* threadgroup_alloc(const void* site, size_t size, size_t align, size_t element_size,
                        const char* name, const char* file, int line);
// Whether fast:: math functions return garbage for an Inf or NaN argument (fast math promises
// nothing there): true unless $JFM_EMULATOR_FAST_MATH is "precise" (read once).
bool fast_math_garbage();
// Counting variant only: one scalar fma, or one other scalar math-function call
// (metal_shim.h), executed by the calling GPU thread.
void count_fma();
void count_math();
// Lane id of the calling GPU thread (simdgroup_matrix diagonal constructor).
uint32_t current_lane();
// Value of the bool [[function_constant(index)]] in the calling GPU thread's launch (the
// translator replaces each use of a function constant by this call).
bool function_constant(int index);
// Ends the calling GPU thread's group with an error (e.g. a non-uniform simdgroup_load).
[[noreturn]] void fail(const char* message);

// What a kernel binds at one [[buffer(n)]]: min_size is sizeof the referenced type for
// reference parameters (`constant T&`), 0 for pointers.
struct BufferUse {
  int index;
  size_t min_size;
  bool constant_space;  // `constant` (not `device`) address space
  const char* name;
};

struct KernelDef {
  const char* name;
  void (*launch)(const ThreadCtx&);
  const BufferUse* (*buffers)();
  int num_buffers;
  uint32_t max_threads;  // [[max_total_threads_per_threadgroup(n)]], 0 if absent
  const char* file;
  int line;
};

// Every translated shader file contributes one table (generated registry.cc lists them).
struct KernelTable {
  const KernelDef* defs;
  int count;
};
const KernelTable* all_kernel_tables(int* count);
// The same kernels compiled with memory-access instrumentation (JFM_COUNTING); empty when the
// build has no counting variant (JFM_EMULATOR_COUNTING=OFF).
const KernelTable* all_counting_kernel_tables(int* count);

}  // namespace rt
}  // namespace jfm

#endif  // JAX_FLASH_METAL_EMULATOR_RUNTIME_H_
