// The kernel traits: per kernel family, the tile constants its kernels are written with, in one
// type (as FlashAttention-2's Flash_fwd_kernel_traits keeps configuration apart from the
// algorithm). The choices themselves are tile_shapes.h's, shared with the host; the traits add
// what only the kernels derive from them (tile strides, fragment counts). A kernel names its
// traits once (`typedef JfmFwdTraits<T, D> Traits;`) and reads `Traits::BK`. To add a tile
// constant: a member here, computed from tile_shapes.h (or a new choice there when the host's
// dispatch needs it too).
#ifndef JAX_FLASH_METAL_KERNEL_TRAITS_H_
#define JAX_FLASH_METAL_KERNEL_TRAITS_H_

#include "flash_attention_tiles.h"

// A compile-time member: Metal wants static data members in the constant address space.
#define JFM_TRAIT static constant constexpr

// The forward's tiles, which the tiled forward and pass 1 of the split-KV decode share (the
// key-block loop, flash_attention_key_blocks.h): BQ query rows per threadgroup, 8 per
// simdgroup, and key blocks of BK.
template <typename T, int D>
struct JfmFwdTraits {
  JFM_TRAIT int EB = int(sizeof(T));  // bytes per element
  JFM_TRAIT int BQ = jfm_fwd_block_q(EB, D);
  JFM_TRAIT int BK = jfm_fwd_block_k(EB, D);
  JFM_TRAIT int THREADS = jfm_tile_threads(JFM_KERNEL_FWD, EB, D);
  JFM_TRAIT bool Q_IN_REGISTERS = jfm_fwd_q_in_registers(EB, D);  // else reloaded per block
  JFM_TRAIT bool ONE_KV_BUFFER = jfm_fwd_kv_one_buffer(EB, D);    // K, then V, in one buffer
  JFM_TRAIT int TILE_ROWS = jfm_fwd_tile_rows(EB, D);  // rows of the Q and K/V tiles together
  JFM_TRAIT int LD = jfm_tile_stride<T>(D);  // elements per tile row (padded)
  JFM_TRAIT int ROW_WORDS = LD * EB / 16;    // 16-byte words per tile row
  JFM_TRAIT int DF = D / 8;                  // fragments along the head dim
  JFM_TRAIT int KF = BK / 8;                 // fragments along a key block
};

// The backward's tiles of kernel FAMILY (JFM_KERNEL_BWD_DQ, _DKDV, _DK or _DV): OWNED rows per
// threadgroup (query rows for dQ, key rows for dK/dV), 8 per simdgroup, and streamed blocks of
// STREAMED rows of the other side.
template <typename T, int D, int FAMILY>
struct JfmBwdTraits {
  JFM_TRAIT int EB = int(sizeof(T));  // bytes per element
  JFM_TRAIT int OWNED = jfm_tile_rows(FAMILY, EB, D);
  JFM_TRAIT int STREAMED = jfm_tile_cols(FAMILY, EB, D);
  JFM_TRAIT int THREADS = jfm_tile_threads(FAMILY, EB, D);
  JFM_TRAIT bool ONE_STREAM_BUFFER = jfm_bwd_shared_stream(EB, D);  // both streamed operands
  JFM_TRAIT int LD = jfm_tile_stride<T>(D);  // elements per tile row (padded)
  JFM_TRAIT int ROW_WORDS = LD * EB / 16;    // 16-byte words per tile row
  JFM_TRAIT int DF = D / 8;                  // fragments along the head dim
  JFM_TRAIT int SF = STREAMED / 8;           // fragments along a streamed block
};

#endif  // JAX_FLASH_METAL_KERNEL_TRAITS_H_
