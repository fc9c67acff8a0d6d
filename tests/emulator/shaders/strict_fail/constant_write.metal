// Deliberately broken (not part of the build): writes through a `constant` pointer.
#include <metal_stdlib>
using namespace metal;

kernel void bad_constant_write(constant float* c [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  c[i] = 1.0f;
}
