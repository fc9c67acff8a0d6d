// Deliberately broken (not part of the build): Metal has no double.
#include <metal_stdlib>
using namespace metal;

kernel void bad_double(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  double x = 1.0;
  out[i] = float(x);
}
