// Deliberately broken (not part of the build): a threadgroup pointer assigned device memory.
// The strict pass must reject it, as the Metal compiler would.
#include <metal_stdlib>
using namespace metal;

kernel void bad_address_space(device float* out [[buffer(0)]],
                              uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float tile[32];
  threadgroup float* p = out;
  p[tid] = tile[tid];
}
