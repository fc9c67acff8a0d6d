// Deliberately broken (not part of the build): an attribute the emulator does not support.
#include <metal_stdlib>
using namespace metal;

kernel void bad_attribute(device float* out [[buffer(0)]],
                          uint i [[thread_position_in_grid]],
                          uint q [[quadgroup_index_in_threadgroup]]) {
  out[i] = float(q);
}
