// Kernels timed by benchmarks/emulator_speed.py (and checked by tests/emulator/test_emulator_matrix.py).
#include <metal_stdlib>
using namespace metal;

struct GemmDims {
  uint m, n, k;
};

// C[m, n] = A[m, k] * B[k, n] (row-major, all multiples of 8): each simdgroup computes one 8x8
// tile of C straight from device memory; 4 simdgroups (128 threads) per threadgroup.
template <typename T>
kernel void emu_gemm_tiled(device const T* a [[buffer(0)]],
                           device const T* b [[buffer(1)]],
                           device float* c [[buffer(2)]],
                           constant GemmDims& dims [[buffer(3)]],
                           uint group [[threadgroup_position_in_grid]],
                           uint sg [[simdgroup_index_in_threadgroup]]) {
  const uint tile = group * 4 + sg;
  const uint tiles_n = dims.n / 8;
  if (tile >= (dims.m / 8) * tiles_n) return;  // whole simdgroups leave together
  const uint row = (tile / tiles_n) * 8, col = (tile % tiles_n) * 8;
  simdgroup_matrix<float, 8, 8> acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  for (uint k0 = 0; k0 < dims.k; k0 += 8) {
    simdgroup_matrix<T, 8, 8> ma, mb;
    simdgroup_load(ma, a, dims.k, ulong2(k0, row));
    simdgroup_load(mb, b, dims.n, ulong2(col, k0));
    simdgroup_multiply_accumulate(acc, ma, mb, acc);
  }
  simdgroup_store(acc, c, dims.n, ulong2(col, row));
}
template [[host_name("emu_gemm_tiled_f32")]] kernel void emu_gemm_tiled<float>(device const float*, device const float*, device float*, constant GemmDims&, uint, uint);
template [[host_name("emu_gemm_tiled_f16")]] kernel void emu_gemm_tiled<half>(device const half*, device const half*, device float*, constant GemmDims&, uint, uint);

// `rounds` times: every thread adds its right neighbour's value, two barriers per round.
kernel void emu_barrier_heavy(device float* out [[buffer(0)]],
                              constant uint& rounds [[buffer(1)]],
                              uint tid [[thread_index_in_threadgroup]],
                              uint n [[threads_per_threadgroup]],
                              uint gid [[threadgroup_position_in_grid]]) {
  threadgroup float cur[1024];
  cur[tid] = float(tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint r = 0; r < rounds; ++r) {
    float next = cur[(tid + 1) % n] + 1.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    cur[tid] = next;
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[gid * n + tid] = cur[tid];
}
