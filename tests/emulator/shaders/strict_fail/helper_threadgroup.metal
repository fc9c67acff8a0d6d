// Deliberately broken (not part of the build): threadgroup variables belong to kernel scope.
#include <metal_stdlib>
using namespace metal;

inline float helper(uint i) {
  threadgroup float scratch[32];
  return scratch[i];
}

kernel void bad_helper(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  out[i] = helper(i);
}
