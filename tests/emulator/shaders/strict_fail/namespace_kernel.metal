// Deliberately broken (not part of the build): the emulator cannot launch kernels in namespaces.
#include <metal_stdlib>
using namespace metal;

namespace inner {
kernel void bad_namespaced(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  out[i] = 1.0f;
}
}  // namespace inner
