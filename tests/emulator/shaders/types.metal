// Unit kernels for tests/emulator/test_emulator_types.py: half/bfloat conversions, NaN rules, bit casts.
#include <metal_stdlib>
using namespace metal;

// float -> half -> float and float -> bfloat -> float (bits), one per thread.
kernel void emu_round(device const float* x [[buffer(0)]],
                      device ushort* h_bits [[buffer(1)]],
                      device ushort* b_bits [[buffer(2)]],
                      device float* back [[buffer(3)]],
                      uint i [[thread_position_in_grid]]) {
  half h = half(x[i]);
  bfloat b = bfloat(x[i]);
  h_bits[i] = as_type<ushort>(h);
  b_bits[i] = as_type<ushort>(b);
  back[i * 2] = float(h);
  back[i * 2 + 1] = float(b);
}

// Arithmetic in half rounds every operation; mixed half/float promotes to float.
kernel void emu_half_math(device const half* a [[buffer(0)]],
                          device const half* b [[buffer(1)]],
                          device half* sum [[buffer(2)]],
                          device half* prod [[buffer(3)]],
                          device float* mixed [[buffer(4)]],
                          uint i [[thread_position_in_grid]]) {
  sum[i] = a[i] + b[i];
  prod[i] = a[i] * b[i];
  mixed[i] = a[i] * 3.0f + 0.1f;
}

// max/min/fmax/fmin with NaN return the other operand; clamp, select, fma, isnan/isinf.
kernel void emu_nan_rules(device const float* a [[buffer(0)]],
                          device const float* b [[buffer(1)]],
                          device float* out [[buffer(2)]],
                          uint i [[thread_position_in_grid]]) {
  float x = a[i], y = b[i];
  device float* o = out + i * 10;
  o[0] = max(x, y);
  o[1] = min(x, y);
  o[2] = fmax(x, y);
  o[3] = fmin(x, y);
  o[4] = float(max(half(x), half(y)));
  o[5] = select(x, y, x < y);
  o[6] = fma(x, y, 1.0f);
  o[7] = float(isnan(x)) + 2.0f * float(isinf(y));
  o[8] = metal::fast::exp2(y) + metal::precise::log(2.0f);
  o[9] = clamp(x, -1.0f, 1.0f);
}

// bf16 stored as ushort bits, converted like the attention kernels do (MSL 3.0 has no bfloat).
kernel void emu_bf16_bits(device const ushort* in [[buffer(0)]],
                          device ushort* out [[buffer(1)]],
                          uint i [[thread_position_in_grid]]) {
  float f = as_type<float>(uint(in[i]) << 16) * 3.0f;
  uint u = as_type<uint>(f);
  out[i] = ushort((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Vectors: float4 load/arithmetic, half4 conversion, uint2 math, int/long widths.
struct Pair {
  float4 a;
  int2 b;
};

kernel void emu_vectors(device const float4* v [[buffer(0)]],
                        device float4* out [[buffer(1)]],
                        device half4* hout [[buffer(2)]],
                        device long* lout [[buffer(3)]],
                        constant Pair& pair [[buffer(4)]],
                        uint i [[thread_position_in_grid]]) {
  float4 x = v[i];
  float4 y = x * 2.0f + float4(1.0f, 2.0f, 3.0f, 4.0f) + pair.a;
  y.w = y.x + float(pair.b.y);
  out[i] = y;
  hout[i] = half4(y);
  lout[i] = long(i) * 4294967296L + long(sizeof(float3));
}
