// See dispatch_plan.h.
#include "dispatch_plan.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>

#include "device.h"

namespace jfm {
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
  return *a.kernel != *b.kernel && a.begin < b.end && b.begin < a.end && (a.written || b.written);
}

}  // namespace

void mark_barriers(std::vector<Dispatch>* submission) {
  std::vector<Access> since_barrier;
  for (Dispatch& d : *submission) {
    std::vector<Access> mine;
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

std::vector<ChunkedSubmission> plan_for(Device& device, const std::vector<StageShape>& stages) {
  return plan_submissions(stages, submission_budget_seconds() * device.multiply_adds_per_second());
}

double set_submission_budget_seconds(double seconds) {
  return g_budget_seconds.exchange(std::max(seconds, 0.0));
}

double submission_budget_seconds() { return g_budget_seconds.load(); }

}  // namespace jfm
