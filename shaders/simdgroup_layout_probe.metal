// The self-check's lane-layout probe (python -m jax_flash_metal.selfcheck): whether this GPU's
// simdgroup_matrix holds each element where the attention kernels assume (jfm_frag_coord), and
// whether a product of fragments written in that layout is the matrix product. One simdgroup.
// MSL 3.0 (C++14 base).
#include "flash_attention_tiles.h"

// iota: the 8x8 row-major matrix 0..63. Lane L writes lanes[4L .. 4L + 3]: the two
// thread_elements() of iota loaded by simdgroup_load (where the GPU puts elements), then the
// two elements jfm_frag_coord says it holds (row * 8 + col, row * 8 + col + 1). product: A * B
// stored by simdgroup_store, A = iota and B = iota transposed written element by element in the
// jfm_frag_coord layout.
kernel void jfm_simdgroup_layout_probe(device const float* iota [[buffer(0)]],
                                       device float* lanes [[buffer(1)]],
                                       device float* product [[buffer(2)]],
                                       uint lane [[thread_index_in_simdgroup]]) {
  simdgroup_float8x8 loaded;
  simdgroup_load(loaded, iota);
  const JfmFragCoord at = jfm_frag_coord(lane);
  const uint first = at.row * 8 + at.col;
  lanes[lane * 4 + 0] = loaded.thread_elements()[0];
  lanes[lane * 4 + 1] = loaded.thread_elements()[1];
  lanes[lane * 4 + 2] = float(first);
  lanes[lane * 4 + 3] = float(first + 1);

  JfmFrag a = jfm_frag_zero();
  JfmFrag b = jfm_frag_zero();
  JfmFrag c = jfm_frag_zero();
  a.thread_elements()[0] = iota[first];
  a.thread_elements()[1] = iota[first + 1];
  b.thread_elements()[0] = iota[at.col * 8 + at.row];
  b.thread_elements()[1] = iota[(at.col + 1) * 8 + at.row];
  simdgroup_multiply_accumulate(c, a, b, c);
  simdgroup_store(c, product);
}
