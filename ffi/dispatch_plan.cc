// See dispatch_plan.h.
#include "dispatch_plan.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "device.h"
#include "function_constants.h"
#include "tile_shapes.h"

namespace jfm {

static_assert(kFunctionConstants == JFM_FUNCTION_CONSTANTS,
              "device.h's count of function constants is shaders/function_constants.h's");

namespace {

std::atomic<double> g_budget_seconds{0.1};

// Cuts one stage's grid into boxes of at most `per_chunk` threadgroups (at least one).
void chunk_stage(size_t index, const StageShape& s, int64_t per_chunk, std::vector<Chunk>* out) {
  const int64_t blocks = s.blocks(), heads = s.heads, batch = s.batch;
  auto add = [&](int64_t nblk, int64_t nh, int64_t nb, int64_t blk0, int64_t h0, int64_t b0) {
    Chunk c;
    c.stage = index;
    c.groups = {static_cast<uint32_t>(nblk), static_cast<uint32_t>(nh),
                static_cast<uint32_t>(nb)};
    c.offset = {static_cast<uint32_t>(blk0), static_cast<uint32_t>(h0),
                static_cast<uint32_t>(b0)};
    c.multiply_adds = static_cast<double>(nblk * nh * nb) * s.multiply_adds_per_group;
    out->push_back(c);
  };
  if (per_chunk >= blocks * heads) {  // whole batch elements
    const int64_t nb = std::min(batch, per_chunk / (blocks * heads));
    for (int64_t b0 = 0; b0 < batch; b0 += nb) {
      add(blocks, heads, std::min(nb, batch - b0), 0, 0, b0);
    }
  } else if (per_chunk >= blocks) {  // whole heads of one batch element
    const int64_t nh = per_chunk / blocks;
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t h0 = 0; h0 < heads; h0 += nh) {
        add(blocks, std::min(nh, heads - h0), 1, 0, h0, b);
      }
    }
  } else {  // runs of row blocks of one head
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t k0 = 0; k0 < blocks; k0 += per_chunk) {
          add(std::min(per_chunk, blocks - k0), 1, 1, k0, h, b);
        }
      }
    }
  }
}

// One dispatch's use of a host range, for mark_barriers.
struct Access {
  const std::string* kernel;
  uintptr_t begin, end;
  bool written;
};

bool conflicts(const Access& a, const Access& b) {
  // The kernel names last: most pairs of ranges do not overlap.
  return a.begin < b.end && b.begin < a.end && (a.written || b.written) && *a.kernel != *b.kernel;
}

}  // namespace

void mark_barriers(std::vector<Dispatch>* submission) {
  // Per thread and kept between calls: no allocation once they have grown.
  thread_local std::vector<Access> since_barrier, mine;
  since_barrier.clear();
  for (Dispatch& d : *submission) {
    mine.clear();
    for (const Binding& b : d.buffers) {
      if (b.copy || b.size == 0) continue;  // copied into the command when encoded
      const uintptr_t begin = reinterpret_cast<uintptr_t>(b.data);
      mine.push_back(Access{&d.kernel, begin, begin + b.size, b.written});
    }
    d.barrier_before = std::any_of(mine.begin(), mine.end(), [&](const Access& a) {
      return std::any_of(since_barrier.begin(), since_barrier.end(),
                         [&](const Access& earlier) { return conflicts(a, earlier); });
    });
    if (d.barrier_before) since_barrier.clear();
    since_barrier.insert(since_barrier.end(), mine.begin(), mine.end());
  }
}

std::vector<ChunkedSubmission> plan_submissions(const std::vector<StageShape>& stages,
                                                double budget_multiply_adds) {
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < stages.size(); ++i) {
    const StageShape& s = stages[i];
    if (s.blocks() == 0 || s.heads == 0 || s.batch == 0) continue;
    const double fit =
        std::floor(budget_multiply_adds / std::max(s.multiply_adds_per_group, 1.0));
    const double total = static_cast<double>(s.blocks() * s.heads * s.batch);
    chunk_stage(i, s, static_cast<int64_t>(std::clamp(fit, 1.0, total)), &chunks);
  }
  std::vector<ChunkedSubmission> submissions;
  double filled = 0;
  for (const Chunk& c : chunks) {
    if (submissions.empty() || filled + c.multiply_adds > budget_multiply_adds) {
      submissions.emplace_back();
      filled = 0;
    }
    submissions.back().push_back(c);
    filled += c.multiply_adds;
  }
  return submissions;
}

double submission_budget(Device& device) {
  return submission_budget_seconds() * device.multiply_adds_per_second();
}

std::vector<ChunkedSubmission> plan_for(Device& device, const std::vector<StageShape>& stages) {
  return plan_submissions(stages, submission_budget(device));
}

double set_submission_budget_seconds(double seconds) {
  return g_budget_seconds.exchange(std::max(seconds, 0.0));
}

double submission_budget_seconds() { return g_budget_seconds.load(); }

uint32_t stage_function_constants(const std::string& stage) {
  constexpr uint32_t causal = 1u << JFM_FC_CAUSAL, lengths = 1u << JFM_FC_LENGTHS,
                     score = 1u << JFM_FC_SCORE_FEATURES, sinks = 1u << JFM_FC_SINKS,
                     dropout = 1u << JFM_FC_DROPOUT, paged = 1u << JFM_FC_PAGED;
  if (stage == "fwd") return causal | lengths | score | sinks | dropout | paged;
  // Decode never has dropout (decode_splits); its pass 2 only folds the sinks in.
  if (stage == "decode_partial" || stage == "decode_vector") {
    return causal | lengths | score | paged;
  }
  if (stage == "decode_combine") return sinks;
  // The backward reads the forward's residuals, which hold the sinks, and no paged cache.
  if (stage == "bwd_dq" || stage == "bwd_dkdv" || stage == "bwd_dk" || stage == "bwd_dv") {
    return causal | lengths | score | dropout;
  }
  return 0;
}

std::vector<std::string> bwd_stages(int head_dim) {
  if (jfm_bwd_split_dkdv(head_dim)) return {"bwd_dq", "bwd_dk", "bwd_dv"};
  return {"bwd_dq", "bwd_dkdv"};
}

bool decode_is_vector(int64_t q_len, int64_t heads, int64_t kv_heads, int64_t head_dim) {
  return kv_heads > 0 &&
         heads / kv_heads * q_len <= jfm_decode_vector_rows(static_cast<int>(head_dim));
}

int64_t decode_splits(const char* dtype_suffix, int64_t batch, int64_t q_len, int64_t kv_len,
                      int64_t heads, int64_t kv_heads, int64_t head_dim, int gpu_cores,
                      bool dropout) {
  if (dropout) return 0;  // the tiled forward has dropout; the decode kernels do not
  const int rows = jfm_tile_rows(JFM_KERNEL_DECODE_PARTIAL, element_bytes(dtype_suffix),
                                 static_cast<int>(head_dim), 0);  // the same in every variant
  if (q_len < 1 || q_len > JFM_DECODE_MAX_Q_LEN || kv_heads < 1 || kv_len < 1 || batch < 1 ||
      heads / kv_heads * q_len > rows) {
    return 0;
  }
  return jfm_decode_splits(static_cast<long>(batch * kv_heads), static_cast<long>(kv_len),
                           gpu_cores, decode_is_vector(q_len, heads, kv_heads, head_dim));
}

int64_t decode_workspace_elements(int64_t batch, int64_t q_len, int64_t heads,
                                  int64_t value_head_dim, int64_t splits) {
  return splits * batch * heads * q_len * (value_head_dim + 2);  // kv_heads * G * q_len rows
}

std::string family_name(int64_t head_dim, int64_t value_head_dim) {
  return value_head_dim == head_dim
             ? std::to_string(head_dim)
             : std::to_string(head_dim) + "_v" + std::to_string(value_head_dim);
}

std::string kernel_name(const std::string& stage, const std::string& dtype_suffix,
                        int64_t head_dim, int64_t value_head_dim) {
  return "flash_attention_" + stage + "_" + dtype_suffix + "_d" +
         family_name(head_dim, value_head_dim);
}

int tile_head_dim(int64_t head_dim, int64_t value_head_dim) {
  return jfm_tile_head_dim(static_cast<int>(head_dim), static_cast<int>(value_head_dim));
}

std::vector<StageShape> attention_stages(bool backward, const char* dtype_suffix, int64_t batch,
                                         int64_t q_len, int64_t kv_len, int64_t heads,
                                         int64_t kv_heads, int64_t head_dim,
                                         int64_t value_head_dim, int gpu_cores, bool dropout,
                                         int variant) {
  const int bytes = element_bytes(dtype_suffix);
  const int tile_dim = tile_head_dim(head_dim, value_head_dim);
  auto stage = [&](const char* name, int64_t rows, int64_t stage_heads,
                   double multiply_adds_per_row) {
    // The call's variant for the stages with several (decode_vector and _combine have one).
    const int v = tile_variants(name) > 1 ? variant : 0;
    StageShape s;
    s.kernel = kernel_name(variant_stage(name, v), dtype_suffix, head_dim, value_head_dim);
    s.rows = rows;
    s.heads = stage_heads;
    s.batch = batch;
    TileShape shape{};
    tile_shape(name, bytes, tile_dim, v, &shape);
    s.rows_per_group = static_cast<uint32_t>(shape.rows);
    s.threads = static_cast<uint32_t>(shape.threads);
    s.multiply_adds_per_group = multiply_adds_per_row * s.rows_per_group;
    s.function_constant_mask = stage_function_constants(name);
    return s;
  };
  // Products over the key head dim (S, dQ, dK) and the value head dim (P V, dP, dV) alike: the
  // mean of the two per product pair.
  const double d = static_cast<double>(head_dim + value_head_dim) / 2,
               tq = static_cast<double>(q_len),
               tkv = static_cast<double>(kv_len),
               group = kv_heads > 0 ? static_cast<double>(heads / kv_heads) : 0.0;
  const int64_t splits = backward ? 0
                                  : decode_splits(dtype_suffix, batch, q_len, kv_len, heads,
                                                  kv_heads, tile_dim, gpu_cores, dropout);
  if (splits > 0) {
    // Pass 1: a split of the keys for one tile of rows (the vector kernel: the rows only);
    // pass 2: one row over every split.
    const bool vector = decode_is_vector(q_len, heads, kv_heads, tile_dim);
    const int family = vector ? JFM_KERNEL_DECODE_VECTOR : JFM_KERNEL_DECODE_PARTIAL;
    const double tile_rows =
        vector ? group * q_len : jfm_tile_rows(family, bytes, tile_dim, variant);
    const double chunk = std::ceil(tkv / static_cast<double>(splits)) +
                         jfm_tile_cols(family, bytes, tile_dim, variant);
    StageShape partial = stage(vector ? "decode_vector" : "decode_partial", splits, kv_heads, 0);
    partial.rows_per_group = 1;  // grid x: one split per threadgroup
    partial.multiply_adds_per_group = 2 * chunk * d * tile_rows;
    StageShape combine = stage("decode_combine", group * q_len, kv_heads, 2 * splits * d);
    return {partial, combine};
  }
  if (!backward) return {stage("fwd", q_len, heads, 2 * tkv * d)};  // Q·K^T and P·V
  const std::vector<std::string> names = bwd_stages(tile_dim);
  // D (the diagonal of an 8x8 dO·O^T per row band), S, dP and dS·K
  std::vector<StageShape> stages = {stage("bwd_dq", q_len, heads, (3 * tkv + 8) * d)};
  for (size_t n = 1; n < names.size(); ++n) {
    // S^T, then dP^T and dS^T·Q for dK, P^T·dO for dV
    const double products = names[n] == "bwd_dkdv" ? 4 : names[n] == "bwd_dk" ? 3 : 2;
    stages.push_back(stage(names[n].c_str(), kv_len, kv_heads, products * tq * group * d));
  }
  return stages;
}

namespace {

// The kernel families of tile_shapes.h by stage name.
constexpr std::pair<const char*, int> kStageKernels[] = {
    {"fwd", JFM_KERNEL_FWD},
    {"bwd_dq", JFM_KERNEL_BWD_DQ},
    {"bwd_dkdv", JFM_KERNEL_BWD_DKDV},
    {"bwd_dk", JFM_KERNEL_BWD_DK},
    {"bwd_dv", JFM_KERNEL_BWD_DV},
    {"decode_partial", JFM_KERNEL_DECODE_PARTIAL},
    {"decode_combine", JFM_KERNEL_DECODE_COMBINE},
    {"decode_vector", JFM_KERNEL_DECODE_VECTOR}};

int stage_family(const std::string& stage) {
  for (const auto& [name, family] : kStageKernels) {
    if (stage == name) return family;
  }
  return -1;
}

}  // namespace

int element_bytes(const std::string& dtype_suffix) {
  return dtype_suffix == "f32" ? 4 : dtype_suffix == "f16" || dtype_suffix == "bf16" ? 2 : 0;
}

bool tile_shape(const std::string& stage, int element_bytes, int head_dim, int variant,
                TileShape* shape) {
  const int family = stage_family(stage);
  if (family < 0 || variant < 0 || variant >= tile_variants(stage)) {
    return false;
  }
  const bool fwd = jfm_is_fwd_tile(family);
  *shape = TileShape{jfm_tile_rows(family, element_bytes, head_dim, variant),
                     jfm_tile_cols(family, element_bytes, head_dim, variant),
                     jfm_tile_simdgroups(family, element_bytes, head_dim, variant),
                     jfm_tile_threads(family, element_bytes, head_dim, variant),
                     fwd && jfm_fwd_q_in_registers(element_bytes, head_dim, variant),
                     fwd && jfm_fwd_kv_one_buffer(element_bytes, head_dim, variant),
                     jfm_tile_registers(family, element_bytes, head_dim, variant)};
  return true;
}

int tile_variants(const std::string& stage) {
  const int family = stage_family(stage);
  if (family < 0) return 0;
  // Every variant the kernels instantiate, where a stage has more than one.
  return jfm_is_one_simdgroup(family) ? 1 : JFM_TILE_VARIANTS;
}

bool tile_variant_differs(const std::string& stage, int element_bytes, int head_dim, int variant) {
  const int family = stage_family(stage);
  return family >= 0 && jfm_variant_differs(family, element_bytes, head_dim, variant);
}

std::string variant_stage(const std::string& stage, int variant) {
  return variant == 0 ? stage : stage + "_var" + std::to_string(variant);
}

}  // namespace jfm
