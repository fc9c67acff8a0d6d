// The kernel traits: per kernel family, the tile constants its kernels are written with, in one
// type (as FlashAttention-2's Flash_fwd_kernel_traits keeps configuration apart from the
// algorithm). The choices themselves are tile_shapes.h's, shared with the host; the traits add
// what only the kernels derive from them (tile strides, fragment counts). A kernel names its
// traits once (`typedef JfmFwdTraits<T, DK, DV, VARIANT> Traits;`) and reads `Traits::BK`. To
// add a tile constant: a member here, computed from tile_shapes.h (or a new choice there when
// the host's dispatch needs it too).
#ifndef JAX_FLASH_METAL_KERNEL_TRAITS_H_
#define JAX_FLASH_METAL_KERNEL_TRAITS_H_

#include "flash_attention_tiles.h"

// A compile-time member: Metal wants static data members in the constant address space.
#define JFM_TRAIT static constant constexpr

// The forward's tiles, which the tiled forward and pass 1 of the split-KV decode share (the
// key-block loop, flash_attention_key_blocks.h): BQ query rows per threadgroup, 8 per
// simdgroup, and key blocks of BK. DK is the head dim of Q and K, DV that of V and O; the tile
// choices are made for the wider (jfm_tile_head_dim), and each tile row is as wide as its operand.
// VARIANT: the index of the tile/register strategy (tile_shapes.h, JFM_TILE_VARIANTS).
template <typename T, int DK, int DV, int VARIANT>
struct JfmFwdTraits {
  JFM_TRAIT int EB = int(sizeof(T));  // bytes per element
  JFM_TRAIT int D = jfm_tile_head_dim(DK, DV);
  JFM_TRAIT int BQ = jfm_fwd_block_q(EB, D, VARIANT);
  JFM_TRAIT int BK = jfm_fwd_block_k(EB, D, VARIANT);
  JFM_TRAIT int THREADS = jfm_tile_threads(JFM_KERNEL_FWD, EB, D, VARIANT);
  // else reloaded per block
  JFM_TRAIT bool Q_IN_REGISTERS = jfm_fwd_q_in_registers(EB, D, VARIANT);
  JFM_TRAIT bool ONE_KV_BUFFER = jfm_fwd_kv_one_buffer(EB, D, VARIANT);  // K, then V, in one
  JFM_TRAIT int LDK = jfm_tile_stride<T>(DK);  // elements per Q or K tile row (padded)
  JFM_TRAIT int LDV = jfm_tile_stride<T>(DV);  // elements per V tile row (padded)
  JFM_TRAIT int ROW_WORDS_K = LDK * EB / 16;   // 16-byte words per tile row
  JFM_TRAIT int ROW_WORDS_V = LDV * EB / 16;
  // 16-byte words of the K/V tiles (one buffer: the wider of K and V) ...
  JFM_TRAIT int KV_WORDS =
      ONE_KV_BUFFER ? BK * (ROW_WORDS_K > ROW_WORDS_V ? ROW_WORDS_K : ROW_WORDS_V)
                    : BK * (ROW_WORDS_K + ROW_WORDS_V);
  // ... and of all the threadgroup tiles: the K/V tiles hold the staged Q first where Q lives in
  // registers, else Q has its own tile before them.
  JFM_TRAIT int TILE_WORDS = Q_IN_REGISTERS
                                 ? (BQ * ROW_WORDS_K > KV_WORDS ? BQ * ROW_WORDS_K : KV_WORDS)
                                 : BQ * ROW_WORDS_K + KV_WORDS;
  JFM_TRAIT int DKF = DK / 8;  // fragments along the key head dim
  JFM_TRAIT int DVF = DV / 8;  // fragments along the value head dim
  JFM_TRAIT int KF = BK / 8;   // fragments along a key block
  static_assert(DK % 8 == 0 && DV % 8 == 0, "head dims are multiples of 8");
  static_assert(TILE_WORDS * 16 <= 32768, "the tiles fit 32 KiB of threadgroup memory");
};

// The backward's tiles of kernel FAMILY (JFM_KERNEL_BWD_DQ, _DKDV, _DK or _DV): OWNED rows per
// threadgroup (query rows for dQ, key rows for dK/dV), 8 per simdgroup, and streamed blocks of
// STREAMED rows of the other side. DK is the head dim of Q, K, dQ and dK, DV that of V, O, dO
// and dV; the tile choices are made for the wider (jfm_tile_head_dim).
template <typename T, int DK, int DV, int FAMILY, int VARIANT>
struct JfmBwdTraits {
  JFM_TRAIT int EB = int(sizeof(T));  // bytes per element
  JFM_TRAIT int D = jfm_tile_head_dim(DK, DV);
  JFM_TRAIT int OWNED = jfm_tile_rows(FAMILY, EB, D, VARIANT);
  JFM_TRAIT int STREAMED = jfm_tile_cols(FAMILY, EB, D, VARIANT);
  JFM_TRAIT int THREADS = jfm_tile_threads(FAMILY, EB, D, VARIANT);
  JFM_TRAIT bool ONE_STREAM_BUFFER = jfm_bwd_shared_stream(EB, D);  // both streamed operands
  JFM_TRAIT int LDK = jfm_tile_stride<T>(DK);  // elements per Q or K tile row (padded)
  JFM_TRAIT int LDV = jfm_tile_stride<T>(DV);  // elements per V or dO tile row (padded)
  JFM_TRAIT int ROW_WORDS_K = LDK * EB / 16;   // 16-byte words per tile row
  JFM_TRAIT int ROW_WORDS_V = LDV * EB / 16;
  // 16-byte words of the streamed tiles: both, or one holding the wider in turn.
  JFM_TRAIT int STREAM_WORDS =
      ONE_STREAM_BUFFER ? STREAMED * (ROW_WORDS_K > ROW_WORDS_V ? ROW_WORDS_K : ROW_WORDS_V)
                        : STREAMED * (ROW_WORDS_K + ROW_WORDS_V);
  JFM_TRAIT int DKF = DK / 8;       // fragments along the key head dim
  JFM_TRAIT int DVF = DV / 8;       // fragments along the value head dim
  JFM_TRAIT int SF = STREAMED / 8;  // fragments along a streamed block
  static_assert(DK % 8 == 0 && DV % 8 == 0, "head dims are multiples of 8");
};

#endif  // JAX_FLASH_METAL_KERNEL_TRAITS_H_
