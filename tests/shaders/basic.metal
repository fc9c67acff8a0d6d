// Unit kernels for tests/test_emulator.py: ids, barriers, threadgroup memory.
#include <metal_stdlib>
using namespace metal;

// out[i] = a[i] * scale + i, one thread per element.
kernel void emu_axpy(device const float* a [[buffer(0)]],
                     device float* out [[buffer(1)]],
                     constant float& scale [[buffer(2)]],
                     uint i [[thread_position_in_grid]]) {
  out[i] = a[i] * scale + float(i);
}
