// Deliberately broken (not part of the build): the loop at line 13 indexes the fragment array
// `acc` with its variable but carries no JFM_PRAGMA_UNROLL, so a GPU compiler that keeps it
// rolled would put `acc` in stack memory.
#include <metal_stdlib>
using namespace metal;
#define JFM_PRAGMA_UNROLL _Pragma("clang loop unroll(full)")

kernel void rolled_fragment_loop(device float* out [[buffer(0)]],
                                 uint lane [[thread_index_in_simdgroup]]) {
  simdgroup_float8x8 acc[4];
  JFM_PRAGMA_UNROLL
  for (int f = 0; f < 4; ++f) acc[f] = make_filled_simdgroup_matrix<float, 8, 8>(float(f));
  for (int f = 0; f < 4; ++f) {
    simdgroup_multiply_accumulate(acc[f], acc[f], acc[f], acc[f]);
  }
  JFM_PRAGMA_UNROLL
  for (int f = 0; f < 4; ++f) {
    simdgroup_store(acc[f], out + f * 64, 8);
  }
}
