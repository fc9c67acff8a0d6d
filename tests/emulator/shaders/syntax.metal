// Unit kernels for tests/emulator/test_emulator_syntax.py: the MSL forms the translator accepts.
#include <metal_stdlib>
#include "syntax_helpers.h"
using namespace metal;

namespace helpers {
inline float twice(float x) { return 2.0f * x; }
}  // namespace helpers

constant float kTable[4] = {1.0f, 2.0f, 4.0f, 8.0f};
constexpr constant int kLanes = 32;
static_assert(kLanes == 32, "simd width");

// [[kernel]] spelling, the decltype instantiation form, static threadgroup declarations, vector
// constructors from vectors, half literals, numeric_limits, simd_all/any, small integer types.
template <typename T, int N>
[[kernel]] void emu_syntax(device const T* in [[buffer(0)]],
                           device float* out [[buffer(1)]],
                           uint3 tid3 [[thread_position_in_threadgroup]],
                           ushort lane [[thread_index_in_simdgroup]]) {
  static threadgroup float shared_vals[N];
  const uint tid = tid3.x;
  shared_vals[tid] = float(in[tid]);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float2 p = float2(shared_vals[tid], 1.0f);
  float4 v = float4(p, float2(3.0f, kTable[tid % 4]));
  half h = 1.5h;
  uchar small = uchar(tid + 250u);  // wraps past 255
  short neg = short(-3);
  bool all_pos = simd_all(shared_vals[tid] >= 0.0f);
  bool any_big = simd_any(shared_vals[tid] > 30.0f);
  device float* o = out + tid * 8;
  o[0] = helpers::twice(v.x) + v.y;
  o[1] = v.z * v.w;
  o[2] = float(h) + jfm_helper_offset();
  o[3] = float(small) + float(neg);
  o[4] = float(all_pos) + 2.0f * float(any_big);
  o[5] = numeric_limits<float>::max() == FLT_MAX ? 1.0f : 0.0f;
  o[6] = isinf(numeric_limits<float>::infinity()) ? float(lane) : -1.0f;
  o[7] = float(N);
}
template [[host_name("emu_syntax_f32")]] [[kernel]] decltype(emu_syntax<float, 64>) emu_syntax<float, 64>;

[[max_total_threads_per_threadgroup(64)]]
kernel void emu_max_threads(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  out[i] = 1.0f;
}

// A bound that depends on the template parameters (one per instantiation).
template <int SIMDGROUPS>
[[max_total_threads_per_threadgroup(SIMDGROUPS * 32)]] kernel void emu_max_threads_t(
    device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  out[i] = float(SIMDGROUPS);
}
template [[host_name("emu_max_threads_t2")]] kernel void emu_max_threads_t<2>(
    device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]);

// Swizzles: read, write-back, compound assignment, as operands, constructor parts, simd and
// as_type arguments. 8 floats per thread.
kernel void emu_swizzle(device const float4* in [[buffer(0)]],
                        device float* out [[buffer(1)]],
                        uint i [[thread_position_in_grid]]) {
  float4 v = in[i];
  float2 a = v.xy;
  float3 b = v.zyx;
  v.xy = v.wz;          // writes back: (w, z, z, w)
  v.zw += float2(10.0f, 20.0f);
  float4 c = float4(a.yx, b.xy);
  half4 h = half4(v);
  device float* o = out + i * 8;
  o[0] = v.x + v.y * 100.0f;
  o[1] = v.z + v.w * 100.0f;
  o[2] = dot(c.xy, c.zw);
  o[3] = simd_sum(v.xy).x;
  o[4] = float(as_type<uint>(h.xy) & 0xffffu) - float(as_type<ushort>(h.x));
  o[5] = max(a, b.xy).y;
  float2 d = v.yx * 2.0f;
  o[6] = d.x - d.y;
  o[7] = float(h.wzyx.x);
}
