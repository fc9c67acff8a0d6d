// Tile shapes of the backward kernels, shared by the host (ffi/attention_ffi.cc) and the shaders
// (flash_attention_bwd.metal). Valid as MSL and as C++, like attention_params.h.
//
// Every backward kernel owns `8 * simdgroups` rows (query rows for dQ, key rows for dK/dV) and
// streams the other side in blocks of `block` rows. Threadgroup memory is four tiles of
// (head_dim * element_bytes + JFM_BWD_PAD_BYTES) bytes per row: two owner tiles and two streamed
// tiles (or one streamed tile used twice when `shared_stream`). It depends only on the bytes per
// row, so the families are chosen by row bytes; the register budget (two D-wide float
// accumulators in the dK/dV kernel) depends on head_dim, so the dK/dV split is chosen by head_dim.
// Sizes and register estimates per family: shaders/README.md.
#ifndef JAX_FLASH_METAL_BWD_TILE_SHAPES_H_
#define JAX_FLASH_METAL_BWD_TILE_SHAPES_H_

#ifndef __METAL_VERSION__
#include <cstdint>
namespace jfm {
typedef uint32_t uint;
#endif

// Row padding of threadgroup tiles: keeps 16-byte alignment and staggers rows across banks.
#define JFM_BWD_PAD_BYTES 16
// Largest threadgroup of any backward kernel (4 simdgroups).
#define JFM_BWD_MAX_THREADS 128

// Simdgroups per threadgroup (owner rows = 8 * simdgroups).
constexpr uint jfm_bwd_simdgroups(uint row_bytes) {
  return row_bytes <= 256 ? 4u : (row_bytes <= 512 ? 2u : 1u);
}

// Streamed rows per block (keys for dQ, queries for dK/dV).
constexpr uint jfm_bwd_block(uint row_bytes) {
  return row_bytes <= 128 ? 32u : (row_bytes <= 256 ? 16u : 8u);
}

// One streamed tile holds both streamed operands in turn (V then K for dQ; the single operand
// the split dK or dV kernel needs first, then the other): only for the widest rows.
constexpr bool jfm_bwd_shared_stream(uint row_bytes) { return row_bytes > 512; }

// dK and dV are computed by two kernels (one D-wide accumulator each) instead of one.
constexpr bool jfm_bwd_split_dkdv(uint head_dim) { return head_dim >= 160; }

#ifndef __METAL_VERSION__
}  // namespace jfm
#endif

#endif  // JAX_FLASH_METAL_BWD_TILE_SHAPES_H_
