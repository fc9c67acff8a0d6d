// Deliberately broken (not part of the build): `if constexpr` is C++17; MSL 3.0 is C++14.
#include <metal_stdlib>
using namespace metal;

template <int N>
kernel void bad_cxx17(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  if constexpr (N > 1) {
    out[i] = 1.0f;
  }
}
template [[host_name("bad_cxx17_2")]] kernel void bad_cxx17<2>(device float*, uint);
