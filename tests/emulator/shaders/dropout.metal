// Dropout's generator for tests/api/test_dropout.py: Philox-4x32-10 of
// shaders/flash_attention_dropout.h (the kernels' one definition) and MSL's mulhi, one thread per
// input.
#include "../../../shaders/flash_attention_dropout.h"

// words[4 t ..] = Philox-4x32-10(counters[4 t ..], key (keys[2 t], keys[2 t + 1])).
kernel void emu_philox(device const uint* counters [[buffer(0)]],
                       device const uint* keys [[buffer(1)]], device uint* words [[buffer(2)]],
                       uint t [[thread_position_in_grid]]) {
  const uint4 c = uint4(counters[4 * t], counters[4 * t + 1], counters[4 * t + 2],
                        counters[4 * t + 3]);
  const uint4 w = jfm_philox4x32(c, keys[2 * t], keys[2 * t + 1]);
  for (uint e = 0; e < 4; ++e) {
    words[4 * t + e] = w[e];
  }
}

// highs[t] = mulhi(x[t], y[t]) as uint and as int (the same bits read signed).
kernel void emu_mulhi(device const uint* x [[buffer(0)]], device const uint* y [[buffer(1)]],
                      device uint* unsigned_high [[buffer(2)]],
                      device int* signed_high [[buffer(3)]], uint t [[thread_position_in_grid]]) {
  unsigned_high[t] = mulhi(x[t], y[t]);
  signed_high[t] = mulhi(as_type<int>(x[t]), as_type<int>(y[t]));
}
