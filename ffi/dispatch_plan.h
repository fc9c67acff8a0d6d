// The dispatch plan shared by both devices, in two steps. Stage planning: the kernels a call
// runs, in order, with their grids and estimated work (attention_stages, from the tile shapes of
// shaders/tile_shapes.h; the decode's key splits). Submissions: each stage's grid of threadgroups
// is cut into chunks (batch, head and row-block offsets in AttentionParams) and the chunks, stage
// by stage, are packed into submissions (command buffers) whose estimated GPU time stays within
// a budget, so that no command buffer runs long enough to trip the GPU watchdog.
#ifndef JAX_FLASH_METAL_DISPATCH_PLAN_H_
#define JAX_FLASH_METAL_DISPATCH_PLAN_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace jfm {

// One kernel of a call: a grid of (ceil(rows / rows_per_group), heads, batch) threadgroups of
// `threads` threads each.
struct StageShape {
  std::string kernel;
  int64_t rows = 0;   // q_len, or kv_len for dK/dV
  int64_t heads = 0;  // num_heads, or num_kv_heads for dK/dV
  int64_t batch = 0;
  uint32_t rows_per_group = 1;
  uint32_t threads = 1;
  double multiply_adds_per_group = 0;  // estimated work of one threadgroup (an upper bound)
  // The function constants its kernel reads (stage_function_constants): a call's constant set
  // is masked by it, so no two pipelines of a kernel differ in a constant it ignores.
  uint32_t function_constant_mask = 0;

  int64_t blocks() const { return (rows + rows_per_group - 1) / rows_per_group; }
};

// A box of one stage's grid: `groups` threadgroups starting at (block, head, batch) `offset`.
struct Chunk {
  size_t stage = 0;  // index into the stages
  std::array<uint32_t, 3> groups{1, 1, 1};
  std::array<uint32_t, 3> offset{0, 0, 0};  // block_offset, head_offset, batch_offset
  double multiply_adds = 0;
};

using ChunkedSubmission = std::vector<Chunk>;

// Every threadgroup of every stage exactly once, in stage order: all chunks of stage s come
// before any chunk of stage s + 1, so a stage sees everything the stages before it wrote (the
// backward's dK/dV needs D of every query row of its batch and head group). Chunks are whole
// batch elements when they fit the budget, else whole heads of one batch element, else runs of
// row blocks of one head; one threadgroup is the smallest chunk. Consecutive chunks share a
// submission while their sum stays within `budget_multiply_adds`.
std::vector<ChunkedSubmission> plan_submissions(const std::vector<StageShape>& stages,
                                                double budget_multiply_adds);

class Device;
struct Dispatch;

// Sets barrier_before on each dispatch of a submission that must see the effects of, or must not
// overwrite what is read by, an earlier dispatch since the last barrier: it reads or writes a
// host range (Binding data and size) that such a dispatch wrote, or writes one that such a
// dispatch read. Chunks of one stage write disjoint parts of the same results, so barriers are
// only set between dispatches of different kernels (the backward's dK/dV kernels read the D
// that dQ's wrote; the decode's combine reads the partial results).
void mark_barriers(std::vector<Dispatch>* submission);

// The submission budget of `device` in multiply-adds: submission_budget_seconds() times the
// device's estimated throughput (Device::multiply_adds_per_second).
double submission_budget(Device& device);

// plan_submissions with the budget of `device` (submission_budget).
std::vector<ChunkedSubmission> plan_for(Device& device, const std::vector<StageShape>& stages);

// Estimated GPU time per submission, in seconds (default 0.1: well within the watchdog's
// limit of a few seconds, and long enough that submission overhead is negligible). Returns the
// previous value; tests set a tiny budget to force splits.
double set_submission_budget_seconds(double seconds);
double submission_budget_seconds();

// The kernels a call runs, in order, with their grids and estimated work, for query/key head dim
// `head_dim` and value head dim `value_head_dim` (one family of shaders/kernel_families.h):
// forward the fwd
// kernel, or for a decode call (decode_splits > 0; never with dropout) its pass 1 (decode_vector where
// decode_is_vector, else decode_partial) then decode_combine; backward
// bwd_stages: bwd_dq (and D), bwd_dkdv or bwd_dk, bwd_dv. The handlers cut these into
// submissions with plan_submissions (dispatch_plan.h); tests read them through _ext.
std::vector<StageShape> attention_stages(bool backward, const char* dtype_suffix, int64_t batch,
                                         int64_t q_len, int64_t kv_len, int64_t heads,
                                         int64_t kv_heads, int64_t head_dim,
                                         int64_t value_head_dim, int gpu_cores,
                                         bool dropout = false, int variant = 0);

// The kernel name of a stage ("fwd", "bwd_dq", ...) for a dtype suffix and head dims:
// "flash_attention_STAGE_SUFFIX_dNAME" with NAME = family_name(head_dim, value_head_dim), the
// tag shaders/kernel_families.h gives the family: "64" where the value head dim is the key's,
// "128_v64" otherwise.
std::string family_name(int64_t head_dim, int64_t value_head_dim);
std::string kernel_name(const std::string& stage, const std::string& dtype_suffix,
                        int64_t head_dim, int64_t value_head_dim);

// The head dim a family's tiles are chosen by (jfm_tile_head_dim of tile_shapes.h): the wider
// of the key and value head dims. tile_shape, bwd_stages, decode_is_vector and decode_splits
// take it.
int tile_head_dim(int64_t head_dim, int64_t value_head_dim);

// Whether a decode call's pass 1 is the vector kernel: its (heads / kv_heads) * q_len rows of
// one KV head are at most jfm_decode_vector_rows (tile_shapes.h).
bool decode_is_vector(int64_t q_len, int64_t heads, int64_t kv_heads, int64_t head_dim);

// The decode's key splits per (batch, kv head) on a GPU of `gpu_cores` cores, or 0 when the
// forward runs the tiled kernel: decode needs 1 <= q_len <= JFM_DECODE_MAX_Q_LEN and the
// (heads / kv_heads) * q_len rows of one KV head within one pass-1 tile (tile_shapes.h); the
// vector pass 1 has its own split rule. Always 0 for a call with dropout: only the tiled
// forward implements it (ffi/attention_ffi.h). The lowering sizes the forward's workspace result with
// it (through _ext), the handler checks it.
int64_t decode_splits(const char* dtype_suffix, int64_t batch, int64_t q_len, int64_t kv_len,
                      int64_t heads, int64_t kv_heads, int64_t head_dim, int gpu_cores,
                      bool dropout = false);

// float32 elements of the decode workspace: [batch, kv_heads, splits, G * q_len,
// value_head_dim + 2] (partial O, then m and l, per row; kv_heads * G = heads); 0 when splits
// is 0.
int64_t decode_workspace_elements(int64_t batch, int64_t q_len, int64_t heads,
                                  int64_t value_head_dim, int64_t splits);

// One kernel family's dispatch shape from shaders/tile_shapes.h: rows per threadgroup, block size
// of the traversed dimension, simdgroups and threads per threadgroup, (forward only) whether
// Q stays in registers and whether K and V share one threadgroup buffer, and the estimated live
// 32-bit registers per thread (jfm_tile_registers).
struct TileShape {
  int rows, cols, simdgroups, threads;
  bool q_in_registers, kv_one_buffer;
  int registers;
};

// The shape for stage "fwd", "bwd_dq", "bwd_dkdv", "bwd_dk", "bwd_dv", "decode_partial",
// "decode_combine" or "decode_vector" (the stage part of a kernel name, without a variant
// suffix), element size in bytes (4 or 2), head dim and tile variant (tile_shapes.h); false for
// an unknown stage or a variant outside 0 .. tile_variants - 1.
bool tile_shape(const std::string& stage, int element_bytes, int head_dim, int variant,
                TileShape* shape);

// The tile variants the kernels of a stage are instantiated in (JFM_TILE_VARIANTS, 1 for
// decode_vector and decode_combine), 0 for an unknown stage. A variant may have variant 0's
// shape where the family has no second strategy (jfm_variant_differs).
int tile_variants(const std::string& stage);

// Whether variant `variant` of a stage's family differs from its variant 0 (jfm_variant_differs).
bool tile_variant_differs(const std::string& stage, int element_bytes, int head_dim, int variant);

// The stage part of a variant's kernel names: `stage` for variant 0, "STAGE_var<v>" otherwise
// (the host names of the .metal files' instantiation grids).
std::string variant_stage(const std::string& stage, int variant);

// The function constants (bits JFM_FC_* of shaders/function_constants.h) the kernels of a stage
// ("fwd", "bwd_dq", ..., the stage part of a kernel name) read; 0 for an unknown stage. The
// constant sets the host may pick for the stage are the subsets of it.
uint32_t stage_function_constants(const std::string& stage);

// Bytes per element of a dtype suffix: 4 for "f32", 2 for "f16" / "bf16", 0 for anything else.
int element_bytes(const std::string& dtype_suffix);

// The backward stages in dispatch order: bwd_dq (which also writes delta), then bwd_dkdv, or
// bwd_dk and bwd_dv for the widest heads (tile_shapes.h).
std::vector<std::string> bwd_stages(int head_dim);

}  // namespace jfm

#endif  // JAX_FLASH_METAL_DISPATCH_PLAN_H_
