// Unit kernels for tests/emulator/test_emulator.py: ids, barriers, threadgroup memory, schedules.
#include <metal_stdlib>
using namespace metal;

// out[i] = a[i] * scale + i, one thread per element.
kernel void emu_axpy(device const float* a [[buffer(0)]],
                     device float* out [[buffer(1)]],
                     constant float& scale [[buffer(2)]],
                     uint i [[thread_position_in_grid]]) {
  out[i] = a[i] * scale + float(i);
}

// Every builtin id, in several declared types; 16 uints per thread.
kernel void emu_ids(device uint* out [[buffer(0)]],
                    uint3 tpig [[thread_position_in_grid]],
                    ushort2 tptg [[thread_position_in_threadgroup]],
                    uint3 tgpig [[threadgroup_position_in_grid]],
                    uint3 tptg_n [[threads_per_threadgroup]],
                    uint2 tgpg [[threadgroups_per_grid]],
                    uint tiitg [[thread_index_in_threadgroup]],
                    ushort lane [[thread_index_in_simdgroup]],
                    uint sgid [[simdgroup_index_in_threadgroup]],
                    uint width [[threads_per_simdgroup]],
                    uint3 tpg [[threads_per_grid]]) {
  uint linear = (tpig.z * tpg.y + tpig.y) * tpg.x + tpig.x;
  device uint* o = out + linear * 16;
  o[0] = tpig.x; o[1] = tpig.y; o[2] = tpig.z;
  o[3] = tptg.x; o[4] = tptg.y;
  o[5] = tgpig.x; o[6] = tgpig.y; o[7] = tgpig.z;
  o[8] = tptg_n.x * tptg_n.y * tptg_n.z;
  o[9] = tgpg.x * tgpg.y;
  o[10] = tiitg; o[11] = lane; o[12] = sgid; o[13] = width;
  o[14] = tpg.x; o[15] = 7u;
}

// Sum of 256 floats per threadgroup with a threadgroup-memory tree and barriers.
kernel void emu_reduce(device const float* in [[buffer(0)]],
                       device float* out [[buffer(1)]],
                       uint gid [[threadgroup_position_in_grid]],
                       uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float partial[256];
  partial[tid] = in[gid * 256 + tid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint stride = 128; stride > 0; stride /= 2) {
    if (tid < stride) partial[tid] += partial[tid + stride];
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (tid == 0) out[gid] = partial[0];
}

// Racy: reads a neighbour's slot without a barrier; the result depends on the resume order.
kernel void emu_racy(device float* out [[buffer(0)]],
                     uint tid [[thread_index_in_threadgroup]],
                     uint n [[threads_per_threadgroup]]) {
  threadgroup float slot[64];
  slot[tid] = float(tid);
  out[tid] = slot[(tid + 1) % n];
}

// The same with the missing barrier: identical under every schedule.
kernel void emu_racy_fixed(device float* out [[buffer(0)]],
                           uint tid [[thread_index_in_threadgroup]],
                           uint n [[threads_per_threadgroup]]) {
  threadgroup float slot[64];
  slot[tid] = float(tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = slot[(tid + 1) % n];
}

// Barrier inside a branch taken by half the group: divergence.
kernel void emu_divergent_barrier(device float* out [[buffer(0)]],
                                  uint tid [[thread_index_in_threadgroup]]) {
  if (tid < 32) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[tid] = 1.0f;
  } else {
    threadgroup_barrier(mem_flags::mem_device);
    out[tid] = 2.0f;
  }
}

// Threads 0-7 return before the barrier the others wait at.
kernel void emu_early_exit(device float* out [[buffer(0)]],
                           uint tid [[thread_index_in_threadgroup]]) {
  if (tid < 8) return;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = 1.0f;
}

// Reads threadgroup memory nobody wrote: the emulator fills it with NaN.
kernel void emu_uninitialized(device float* out [[buffer(0)]],
                              uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float scratch[32];
  threadgroup int counts[2][4];
  out[tid] = scratch[tid] + float(counts[1][tid % 4]);
}

// Two threadgroup arrays, a 2-D one and a helper taking a threadgroup pointer.
inline float sum_slots(threadgroup const float* s, uint n) {
  float acc = 0.0f;
  for (uint i = 0; i < n; ++i) acc += s[i];
  return acc;
}

kernel void emu_threadgroup_2d(device float* out [[buffer(0)]],
                               uint2 tid [[thread_position_in_threadgroup]],
                               uint2 gid [[threadgroup_position_in_grid]]) {
  threadgroup float tile[4][8], column[8];
  tile[tid.y][tid.x] = float(tid.y * 8 + tid.x) + 100.0f * float(gid.x);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid.y == 0) {
    float s = 0.0f;
    for (uint r = 0; r < 4; ++r) s += tile[r][tid.x];
    column[tid.x] = s;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid.x == 0 && tid.y == 0) out[gid.x] = sum_slots(column, 8);
}

// Device atomics across threadgroups: counts[i % 4] += 1, fsum += x[i].
kernel void emu_atomics(device const float* x [[buffer(0)]],
                        device atomic_int* counts [[buffer(1)]],
                        device atomic_float* fsum [[buffer(2)]],
                        device atomic_uint* maxv [[buffer(3)]],
                        uint i [[thread_position_in_grid]]) {
  atomic_fetch_add_explicit(&counts[i % 4], 1, memory_order_relaxed);
  atomic_fetch_add_explicit(fsum, x[i], memory_order_relaxed);
  atomic_fetch_max_explicit(maxv, i * 3u, memory_order_relaxed);
}

// A kernel whose threadgroup memory exceeds Apple's 32 KiB.
kernel void emu_too_much_threadgroup(device float* out [[buffer(0)]],
                                     uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float big[9000];
  big[tid] = 1.0f;
  out[tid] = big[tid];
}

// Function constants (bound per launch): out[i] = first + 2 * second, read in a helper and in
// the kernel; a false constant's branch is never taken.
constant bool emu_first [[function_constant(0)]];
constant bool emu_second [[function_constant(5)]];

inline uint emu_second_value() { return emu_second ? 2u : 0u; }

kernel void emu_function_constants(device uint* out [[buffer(0)]],
                                   uint i [[thread_position_in_grid]]) {
  out[i] = (emu_first ? 1u : 0u) + emu_second_value();
}
