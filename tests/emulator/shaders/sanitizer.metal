// Fixtures of the emulator's sanitizer (tests/emulator/test_sanitizer.py): one kernel per fault
// class, each caught with its report, and legal kernels it must not flag. Launched with 64
// threads per threadgroup (two simdgroups); `in` and `out` hold 64 floats per threadgroup.
#include <metal_stdlib>
using namespace metal;

// racecheck: thread t writes t[tid] after a barrier and reads its neighbour's element with no
// barrier in between (a read-after-write or write-after-read race, whatever the schedule).
kernel void racecheck_missing_barrier(device const float* in [[buffer(0)]],
                                      device float* out [[buffer(1)]],
                                      uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float tile[64];
  tile[tid] = in[tid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  tile[tid] = tile[tid] + 1.0f;
  out[tid] = tile[(tid + 1) % 64];
}

// racecheck: every thread writes one element with no barrier.
kernel void racecheck_write_write(device float* out [[buffer(1)]],
                                  uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float shared_value[1];
  shared_value[0] = float(tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = shared_value[0];
}

// Legal: lanes exchange values through threadgroup memory within their simdgroup, ordered by
// simdgroup_barrier(mem_threadgroup); then, after a threadgroup barrier, across simdgroups.
kernel void racecheck_simdgroup_ordered(device const float* in [[buffer(0)]],
                                        device float* out [[buffer(1)]],
                                        uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float tile[64];
  tile[tid] = in[tid];
  simdgroup_barrier(mem_flags::mem_threadgroup);
  const float neighbour = tile[tid ^ 1];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = neighbour + tile[63 - tid];
}

// racecheck: a simd shuffle exchanges registers but orders no memory: the read of the
// neighbour's element races with its write.
kernel void racecheck_shuffle_unordered(device const float* in [[buffer(0)]],
                                        device float* out [[buffer(1)]],
                                        uint tid [[thread_index_in_threadgroup]],
                                        uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float tile[64];
  tile[tid] = in[tid];
  const float x = simd_shuffle(in[tid], ushort(lane ^ 1));
  out[tid] = x + tile[tid ^ 1];
}

// initcheck: the second simdgroup never writes its half of the tile; everyone reads the
// mirrored element after the barrier.
kernel void initcheck_threadgroup(device const float* in [[buffer(0)]],
                                  device float* out [[buffer(1)]],
                                  uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float tile[64];
  if (tid < 32) tile[tid] = in[tid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = tile[63 - tid];
}

// initcheck: the last element of the output is never written.
kernel void initcheck_unwritten_output(device const float* in [[buffer(0)]],
                                       device float* out [[buffer(1)]],
                                       uint tid [[thread_index_in_threadgroup]]) {
  if (tid < 63) out[tid] = in[tid];
}

// initcheck: accumulates into an output nobody initialised.
kernel void initcheck_output_read(device const float* in [[buffer(0)]],
                                  device float* out [[buffer(1)]],
                                  uint tid [[thread_index_in_threadgroup]]) {
  out[tid] += in[tid];
}

// racecheck: every threadgroup writes element 0 of the output.
kernel void racecheck_cross_threadgroup(device float* out [[buffer(1)]],
                                        uint gid [[threadgroup_position_in_grid]],
                                        uint tid [[thread_index_in_threadgroup]]) {
  if (tid == 0) out[0] = float(gid);
}

// memcheck: reads one element past the end of `in` (64 floats), memory a GPU may well have
// mapped for a neighbouring buffer.
kernel void memcheck_device_past_end(device const float* in [[buffer(0)]],
                                     device float* out [[buffer(1)]],
                                     uint tid [[thread_index_in_threadgroup]]) {
  out[tid] = in[tid + 1];
}

// memcheck: writes one element past the end of a threadgroup array.
kernel void memcheck_threadgroup_past_end(device const float* in [[buffer(0)]],
                                          device float* out [[buffer(1)]],
                                          uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float tile[64];
  threadgroup float other[64];
  tile[tid + 1] = in[tid];
  other[tid] = in[tid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = other[tid];
}

// Two dispatches of one plan: the first writes `mid`, the second reads it (legal only with a
// memory barrier of the plan between them).
kernel void sanitizer_produce(device const float* in [[buffer(0)]],
                              device float* mid [[buffer(1)]],
                              uint i [[thread_position_in_grid]]) {
  mid[i] = in[i] * 2.0f;
}

kernel void sanitizer_consume(device const float* mid [[buffer(1)]],
                              device float* out [[buffer(2)]],
                              uint i [[thread_position_in_grid]]) {
  out[i] = mid[i] + 1.0f;
}

// Legal: threadgroup reduction with barriers, each group writing its own outputs; constants
// read by every thread.
kernel void sanitizer_legal_reduce(device const float* in [[buffer(0)]],
                                   device float* out [[buffer(1)]],
                                   constant float& scale [[buffer(2)]],
                                   uint gid [[threadgroup_position_in_grid]],
                                   uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float partial[64];
  partial[tid] = in[gid * 64 + tid] * scale;
  for (uint stride = 32; stride > 0; stride /= 2) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid < stride) partial[tid] += partial[tid + stride];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[gid * 64 + tid] = partial[0];
}

// initcheck (output contract): the output is zeroed, then, after a barrier that orders the two
// stores (no race), written again by the mirrored thread; the contract writes it once.
kernel void initcheck_output_written_twice(device const float* in [[buffer(0)]],
                                           device float* out [[buffer(1)]],
                                           uint tid [[thread_index_in_threadgroup]]) {
  out[tid] = 0.0f;
  threadgroup_barrier(mem_flags::mem_device);
  out[63 - tid] = in[tid];
}

// A step of a plan that accumulates into `mid` (buffer 1): legal after a plan barrier when the
// output's contract is accumulation, one store per dispatch.
kernel void sanitizer_accumulate(device float* mid [[buffer(1)]],
                                 uint i [[thread_position_in_grid]]) {
  mid[i] += 1.0f;
}

// initcheck (output contract): two stores of one dispatch into an accumulated output (the
// barrier keeps them two stores).
kernel void initcheck_accumulate_twice(device float* mid [[buffer(1)]],
                                       uint i [[thread_position_in_grid]]) {
  mid[i] += 1.0f;
  threadgroup_barrier(mem_flags::mem_device);
  mid[i] *= 2.0f;
}
