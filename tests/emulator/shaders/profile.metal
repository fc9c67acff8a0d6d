// Kernels for tests/tools/test_profile.py whose counts (bytes, MMAs, barriers, simd operations) are
// known by construction; the closed forms are in the test.
#include <metal_stdlib>
using namespace metal;

// dst[i] = src[i] for i < n: 1 element read and 1 written per thread below n.
template <typename T>
kernel void profile_copy(device const T* src [[buffer(0)]],
                         device T* dst [[buffer(1)]],
                         constant uint& n [[buffer(2)]],
                         uint i [[thread_position_in_grid]]) {
  if (i < n) {
    dst[i] = src[i];
  }
}
template [[host_name("profile_copy_f32")]] kernel void profile_copy<float>(device const float*, device float*, constant uint&, uint);
template [[host_name("profile_copy_f16")]] kernel void profile_copy<half>(device const half*, device half*, constant uint&, uint);
template [[host_name("profile_copy_f32x4")]] kernel void profile_copy<float4>(device const float4*, device float4*, constant uint&, uint);

struct StridedParams {
  uint stride;
  uint count;
};

// out[i] = sqrt of the sum over c < count of src[i + c * stride]^2, with fma and max: count
// 4-byte reads, count fmas, count + 1 other math calls (max, fast::sqrt) and one 4-byte write
// per thread.
kernel void profile_strided(device const float* src [[buffer(0)]],
                            device float* out [[buffer(1)]],
                            constant StridedParams& p [[buffer(2)]],
                            uint i [[thread_position_in_grid]]) {
  float acc = 0.0f;
  for (uint c = 0; c < p.count; ++c) {
    const float x = src[i + c * p.stride];
    acc = max(fma(x, x, acc), 0.0f);
  }
  out[i] = fast::sqrt(acc);
}

// C (M x N, float) = A (M x K) * B (K x N), half inputs, row-major. A threadgroup of 4 simdgroups
// computes one 16 x 16 block of C: per step of 8 along K every thread stages one element of A's
// 16 x 8 and one of B's 8 x 16 block into threadgroup memory, and each simdgroup multiplies its
// 8 x 8 tiles once. Grid (N / 16, M / 16).
kernel void profile_gemm(device const half* a [[buffer(0)]],
                         device const half* b [[buffer(1)]],
                         device float* c [[buffer(2)]],
                         constant uint3& mnk [[buffer(3)]],
                         uint2 group [[threadgroup_position_in_grid]],
                         uint tid [[thread_index_in_threadgroup]],
                         uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup half ta[16 * 8];
  threadgroup half tb[8 * 16];
  const uint n = mnk.y, k_total = mnk.z;
  const uint row0 = group.y * 16, col0 = group.x * 16;
  const uint row = (sg / 2) * 8, col = (sg % 2) * 8;
  simdgroup_matrix<float, 8, 8> acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  for (uint k0 = 0; k0 < k_total; k0 += 8) {
    ta[tid] = a[(row0 + tid / 8) * k_total + k0 + tid % 8];
    tb[tid] = b[(k0 + tid / 16) * n + col0 + tid % 16];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_matrix<half, 8, 8> ma, mb;
    simdgroup_load(ma, ta, 8, ulong2(0, row));
    simdgroup_load(mb, tb, 16, ulong2(col, 0));
    simdgroup_multiply_accumulate(acc, ma, mb, acc);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  simdgroup_store(acc, c, n, ulong2(col0 + col, row0 + row));
}

// Per round: every thread writes its threadgroup slot, meets the group at a barrier, reads its
// neighbour's slot, adds simd_sum and simd_shuffle_xor of it (2 simd operations per simdgroup),
// and meets at a second barrier. Then one 4-byte write per thread. Threadgroups of 64 threads.
kernel void profile_barrier_loop(device float* out [[buffer(0)]],
                                 constant uint& rounds [[buffer(1)]],
                                 uint tid [[thread_index_in_threadgroup]],
                                 uint gid [[thread_position_in_grid]]) {
  threadgroup float slots[64];
  float acc = 0.0f;
  for (uint r = 0; r < rounds; ++r) {
    slots[tid] = float(r + tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const float x = slots[(tid + 1) % 64];
    acc += simd_sum(x) + simd_shuffle_xor(x, 1);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[gid] = acc;
}
