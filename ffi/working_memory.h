// The FFI handlers' own working memory, which XLA's memory analysis does not see (its
// temporaries are the buffers a custom call declares, e.g. the decode's workspace): per call,
// the host memory the handler allocates for the kernels' arguments (one AttentionParams block
// per dispatch and the copied q/kv lengths) and, on Metal, the staging buffers of the host
// ranges it could not wrap in place. Process-wide totals of the calls since the last take, read
// by the benchmark and the profile (_ext.take_working_memory).
#ifndef JAX_FLASH_METAL_WORKING_MEMORY_H_
#define JAX_FLASH_METAL_WORKING_MEMORY_H_

#include <cstddef>
#include <cstdint>

namespace jfm {

// The fields of WorkingMemory, once (the struct and _ext.take_working_memory's dict): handler
// calls that ran kernels; the handler's argument memory per call, last and peak; Metal calls
// that finished; their staging bytes per call, last and peak.
#define JFM_WORKING_MEMORY_FIELDS(X) \
  X(calls) X(last_bytes) X(peak_bytes) X(staging_calls) X(last_staging_bytes) X(peak_staging_bytes)

struct WorkingMemory {
#define JFM_WORKING_MEMORY_FIELD(name) uint64_t name = 0;
  JFM_WORKING_MEMORY_FIELDS(JFM_WORKING_MEMORY_FIELD)
#undef JFM_WORKING_MEMORY_FIELD
};

// The argument memory of a call of `dispatches` dispatches over `batch` batch elements: the
// formula the handler's measured figure is tested against (tests/fused/test_working_memory.py).
uint64_t argument_bytes(size_t dispatches, int64_t batch);

// The handler (attention_ffi.cc) records each call that runs kernels, the Metal device each
// call's staging bytes once its command buffers have finished.
void record_argument_bytes(uint64_t bytes);
void record_staging_bytes(uint64_t bytes);
// The figures since the last take; then zeroes them.
WorkingMemory take_working_memory();

}  // namespace jfm

#endif  // JAX_FLASH_METAL_WORKING_MEMORY_H_
