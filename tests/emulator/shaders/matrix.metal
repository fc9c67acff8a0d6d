// Unit kernels for tests/emulator/test_emulator_matrix.py: simdgroup_matrix load/store/multiply.
#include <metal_stdlib>
using namespace metal;

// C = A * B for 8x8 matrices, one simdgroup.
template <typename T>
kernel void emu_gemm8(device const T* a [[buffer(0)]],
                      device const T* b [[buffer(1)]],
                      device T* c [[buffer(2)]]) {
  simdgroup_matrix<T, 8, 8> ma, mb, mc;
  simdgroup_load(ma, a);
  simdgroup_load(mb, b);
  simdgroup_multiply(mc, ma, mb);
  simdgroup_store(mc, c);
}
template [[host_name("emu_gemm8_f32")]] kernel void emu_gemm8<float>(device const float*, device const float*, device float*);
template [[host_name("emu_gemm8_f16")]] kernel void emu_gemm8<half>(device const half*, device const half*, device half*);

// C (16x16, float) = A (16xK) * B (Kx16) + C through threadgroup tiles: 4 simdgroups, one 8x8
// output tile each, K a multiple of 8.
template <typename T>
kernel void emu_gemm16(device const T* a [[buffer(0)]],
                       device const T* b [[buffer(1)]],
                       device float* c [[buffer(2)]],
                       constant uint& k_total [[buffer(3)]],
                       uint tid [[thread_index_in_threadgroup]],
                       uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup T ta[16 * 8];
  threadgroup T tb[8 * 16];
  const uint row = (sg / 2) * 8, col = (sg % 2) * 8;
  simdgroup_matrix<float, 8, 8> acc;
  simdgroup_load(acc, c, 16, ulong2(col, row));
  for (uint k0 = 0; k0 < k_total; k0 += 8) {
    ta[tid] = a[(tid / 8) * k_total + k0 + tid % 8];
    tb[tid] = b[(k0 + tid / 16) * 16 + tid % 16];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_matrix<T, 8, 8> ma, mb;
    simdgroup_load(ma, ta, 8, ulong2(0, row));
    simdgroup_load(mb, tb, 16, ulong2(col, 0));
    simdgroup_multiply_accumulate(acc, ma, mb, acc);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  simdgroup_store(acc, c, 16, ulong2(col, row));
}
template [[host_name("emu_gemm16_f32")]] kernel void emu_gemm16<float>(device const float*, device const float*, device float*, constant uint&, uint, uint);
template [[host_name("emu_gemm16_f16")]] kernel void emu_gemm16<half>(device const half*, device const half*, device float*, constant uint&, uint, uint);

// Each lane writes (row * 8 + col) of its two thread_elements() after loading 0..63, and the
// matrix loaded transposed; then a filled and a diagonal matrix stored.
kernel void emu_thread_elements(device const float* m [[buffer(0)]],
                                device float* elems [[buffer(1)]],
                                device float* filled [[buffer(2)]],
                                uint lane [[thread_index_in_simdgroup]]) {
  simdgroup_float8x8 x, xt;
  simdgroup_load(x, m);
  simdgroup_load(xt, m, 8, ulong2(0, 0), true);
  elems[lane * 4 + 0] = x.thread_elements()[0];
  elems[lane * 4 + 1] = x.thread_elements()[1];
  elems[lane * 4 + 2] = xt.thread_elements()[0];
  elems[lane * 4 + 3] = xt.thread_elements()[1];
  simdgroup_float8x8 f = make_filled_simdgroup_matrix<float, 8, 8>(2.5f);
  simdgroup_float8x8 d = simdgroup_float8x8(3.0f);
  f.thread_elements()[1] = 1.0f;
  simdgroup_store(f, filled);
  simdgroup_store(d, filled + 64);
}

// Lanes pass different source pointers to one simdgroup_load: reported, not guessed.
kernel void emu_nonuniform_load(device const float* a [[buffer(0)]],
                                device float* c [[buffer(1)]],
                                uint lane [[thread_index_in_simdgroup]]) {
  simdgroup_float8x8 m;
  simdgroup_load(m, a + (lane % 2));
  simdgroup_store(m, c);
}
