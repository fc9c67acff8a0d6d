// Unit kernels for tests/emulator/test_emulator_simd.py: simd reductions, shuffles, prefix sums.
#include <metal_stdlib>
using namespace metal;

// Per thread, 12 results: sum, max, min, shuffle(lane 5), xor(3), up(2), down(4), broadcast(7),
// inclusive prefix, exclusive prefix, rotate_down(1), broadcast_first.
kernel void emu_simd_ops(device const float* x [[buffer(0)]],
                         device float* out [[buffer(1)]],
                         uint i [[thread_position_in_grid]]) {
  float v = x[i];
  device float* o = out + i * 12;
  o[0] = simd_sum(v);
  o[1] = simd_max(v);
  o[2] = simd_min(v);
  o[3] = simd_shuffle(v, 5);
  o[4] = simd_shuffle_xor(v, 3);
  o[5] = simd_shuffle_up(v, 2);
  o[6] = simd_shuffle_down(v, 4);
  o[7] = simd_broadcast(v, 7);
  o[8] = simd_prefix_inclusive_sum(v);
  o[9] = simd_prefix_exclusive_sum(v);
  o[10] = simd_shuffle_rotate_down(v, 1);
  o[11] = simd_broadcast_first(v);
}

// Integer and half forms, and a butterfly all-reduce built from simd_shuffle_xor.
kernel void emu_simd_types(device const int* xi [[buffer(0)]],
                           device const half* xh [[buffer(1)]],
                           device int* oi [[buffer(2)]],
                           device half* oh [[buffer(3)]],
                           uint i [[thread_position_in_grid]]) {
  oi[i * 2] = simd_sum(xi[i]);
  oi[i * 2 + 1] = simd_max(xi[i]);
  half h = xh[i];
  for (ushort m = 16; m > 0; m /= 2) h = max(h, simd_shuffle_xor(h, m));
  oh[i] = h;
}

// simd_sum in a branch that only some lanes of a simdgroup take: divergence is reported.
kernel void emu_simd_divergent(device float* out [[buffer(0)]],
                               uint lane [[thread_index_in_simdgroup]]) {
  if (lane < 16) {
    out[lane] = simd_sum(1.0f);
  } else {
    out[lane] = simd_max(2.0f);
  }
}

// Lanes that returned are inactive: simd_sum covers the remaining lanes only.
kernel void emu_simd_after_return(device float* out [[buffer(0)]],
                                  uint i [[thread_position_in_grid]],
                                  uint lane [[thread_index_in_simdgroup]]) {
  if (lane >= 20) return;
  out[i] = simd_sum(float(lane));
}

// Some lanes wait at a simd operation, the others of the same simdgroup at a threadgroup barrier:
// neither can complete (a deadlock on hardware), reported as divergence.
kernel void emu_simd_vs_barrier(device float* out [[buffer(0)]],
                                uint lane [[thread_index_in_simdgroup]]) {
  if (lane < 8) {
    out[lane] = simd_sum(1.0f);
  } else {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[lane] = 0.0f;
  }
}
