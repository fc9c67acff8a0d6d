// The emulator runtime: threadgroups run as cooperative fibers, one per GPU thread.
//
// Each fiber's stack is set up once with makecontext; after that, switches use _setjmp/_longjmp,
// which (unlike swapcontext) make no signal-mask system call. A fiber runs one GPU thread after
// another (stacks are reused across threadgroups). The scheduler runs every ready fiber until it
// blocks at a collective point (barrier, simd operation) or returns, then resolves collectives
// whose participants all arrived, in rounds, resuming fibers in the chosen order.
// _FORTIFY_SOURCE turns longjmp into __longjmp_chk, which rejects jumps between stacks.
#undef _FORTIFY_SOURCE
#if defined(__APPLE__)
// macOS declares the (deprecated, still working) ucontext routines only for XSI sources.
#define _XOPEN_SOURCE 700
#define _DARWIN_C_SOURCE
#endif
#include "runtime.h"

#include <setjmp.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "emulator.h"
#include "sanitizer.h"

namespace jfm {
namespace rt {
namespace {

constexpr size_t kStackSize = 128 * 1024;  // kernels keep small local arrays; plus a guard page
// Under the sanitizer each threadgroup allocation follows a poisoned gap (memcheck), so the arena
// has room beyond the 32 KiB that the allocations themselves may take.
constexpr size_t kTgRedzone = 64;
constexpr size_t kArenaSize = kMaxThreadgroupMemory + 8192;

enum class State { kReady, kSimd, kBarrier, kDone };

struct Worker;

struct Fiber {
  jmp_buf jb;
  ucontext_t uc;
  char* mapping = nullptr;
  size_t mapping_size = 0;
  bool started = false;
  Worker* worker = nullptr;
  // Current GPU thread.
  ThreadCtx ctx;
  State state = State::kDone;
  // Collective this fiber waits at.
  Slot slot;
  ResolveFn fn = nullptr;
  bool full = false;
  const char* what = nullptr;
  const char* file = nullptr;
  int line = 0;

  ~Fiber() {
    if (mapping) munmap(mapping, mapping_size);
  }
};

struct Allocation {
  const void* site;
  size_t offset;
};

struct Worker {
  jmp_buf sched;
  std::vector<std::unique_ptr<Fiber>> fibers;
  Fiber* current = nullptr;
  void (*launch)(const ThreadCtx&) = nullptr;
  // Threadgroup memory of the running group.
  alignas(64) unsigned char arena[kArenaSize];
  size_t arena_used = 0;
  size_t arena_declared = 0;  // the allocations' bytes without the sanitizer's gaps
  std::vector<Allocation> allocations;
  std::string error;  // set by fail() inside a fiber
};

// Set when a worker is driving fibers on this OS thread.
thread_local Worker* t_worker = nullptr;

// Counts of one worker during a profiled launch (emu::Launch::profile). The counting variant of
// a kernel reports every memory access it makes (compiler instrumentation, see the __tsan_*
// callbacks below); tally_access classifies it by address: the worker's threadgroup memory, one
// of the bound buffers, or neither (a thread's own stack: registers on a GPU, not counted).
struct Counts {
  uint64_t read[kMaxBuffers] = {};  // by [[buffer(n)]] index
  uint64_t written[kMaxBuffers] = {};
  uint64_t threadgroup_read = 0, threadgroup_written = 0;
  uint64_t threadgroup_memory = 0;
  JFM_PROFILE_OPS(JFM_PROFILE_DECLARE_COUNT)

  void add(const Counts& o) {
    for (int b = 0; b < kMaxBuffers; ++b) {
      read[b] += o.read[b];
      written[b] += o.written[b];
    }
    threadgroup_read += o.threadgroup_read;
    threadgroup_written += o.threadgroup_written;
#define JFM_ADD_COUNT(name) name += o.name;
    JFM_PROFILE_OPS(JFM_ADD_COUNT)
#undef JFM_ADD_COUNT
    threadgroup_memory = std::max(threadgroup_memory, o.threadgroup_memory);
  }
};

struct Tally {
  uintptr_t arena = 0;  // the worker's threadgroup memory
  int num_ranges = 0;   // bound buffers: [lo, lo + size) is [[buffer(index)]]
  uintptr_t lo[kMaxBuffers] = {};
  uint64_t size[kMaxBuffers] = {};
  int index[kMaxBuffers] = {};
  int last = 0;  // the range of the previous access (size 0 when there is none)
  Counts counts;
};
// Initial-exec TLS: one load per access instead of a __tls_get_addr call.
__attribute__((tls_model("initial-exec"))) thread_local Tally* t_tally = nullptr;

// Sanitizer launches: checks the access (sanitizer.cc); the first finding ends the GPU thread's
// group (unless findings are collected). Accesses of a collective's resolve function (no current
// fiber) are stopped by the scheduler.
void sanitize_access(Checker* c, const void* p, uint64_t n, bool write, const void* pc) {
  san_access(c, p, n, write, pc);
  if (const char* stop = san_stop(c)) {
    Worker* w = t_worker;
    if (w && w->current) fail(stop);
  }
}

inline void tally_access(const void* p, uint64_t n, bool write, const void* pc) {
  if (Checker* c = t_san_checker) {
    sanitize_access(c, p, n, write, pc);
    return;
  }
  Tally* t = t_tally;
  if (!t) return;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (a - t->arena < kMaxThreadgroupMemory) {
    (write ? t->counts.threadgroup_written : t->counts.threadgroup_read) += n;
    return;
  }
  int i = t->last;  // consecutive accesses mostly hit the same buffer
  if (a - t->lo[i] >= t->size[i]) {
    for (i = 0; i < t->num_ranges && a - t->lo[i] >= t->size[i]; ++i) {
    }
    if (i == t->num_ranges) return;
    t->last = i;
  }
  (write ? t->counts.written : t->counts.read)[t->index[i]] += n;
}

// A resolved simd collective, by the operation name the shim passes.
void tally_collective(Counts* c, const char* what) {
  if (std::strncmp(what, "simdgroup_multiply", 18) == 0) {
    ++c->mma_ops;  // simdgroup_multiply and simdgroup_multiply_accumulate
  } else if (std::strncmp(what, "simdgroup_load", 14) != 0 &&
             std::strncmp(what, "simdgroup_store", 15) != 0) {
    ++c->simd_ops;  // loads/stores are counted as memory traffic instead
  }
}

// makecontext passes int arguments only; the fiber being started is handed over here.
thread_local Fiber* t_starting = nullptr;

void fiber_main() {
  Fiber* f = t_starting;
  // First entry only records the context; the scheduler resumes it when there is work.
  for (;;) {
    if (!_setjmp(f->jb)) _longjmp(f->worker->sched, 1);
    f->worker->launch(f->ctx);
    f->state = State::kDone;
  }
}

void start_fiber(Worker* w, Fiber* f) {
  if (!f->mapping) {
    long page = sysconf(_SC_PAGESIZE);
    f->mapping_size = kStackSize + page;
    void* m = mmap(nullptr, f->mapping_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
    if (m == MAP_FAILED) throw std::bad_alloc();
    f->mapping = static_cast<char*>(m);
    mprotect(f->mapping, page, PROT_NONE);  // stack overflow faults instead of corrupting memory
  }
  long page = sysconf(_SC_PAGESIZE);
  getcontext(&f->uc);
  f->uc.uc_stack.ss_sp = f->mapping + page;
  f->uc.uc_stack.ss_size = kStackSize;
  f->uc.uc_link = nullptr;
  makecontext(&f->uc, fiber_main, 0);
  f->worker = w;
  t_starting = f;
  if (!_setjmp(w->sched)) setcontext(&f->uc);
  f->started = true;
}

inline void resume(Worker* w, Fiber* f) {
  w->current = f;
  if (!_setjmp(w->sched)) _longjmp(f->jb, 1);
  w->current = nullptr;
}

inline void yield_to_scheduler(Fiber* f) {
  if (!_setjmp(f->jb)) _longjmp(f->worker->sched, 1);
}

Fiber* current_fiber() {
  Worker* w = t_worker;
  if (!w || !w->current) {
    // Only reachable if shader code is called outside a launch: a programming error in the host.
    std::fputs("jax_flash_metal emulator: Metal builtin called outside a kernel launch\n", stderr);
    std::abort();
  }
  return w->current;
}

void wait_collective(State s, ResolveFn fn, const void* in, void* out, uint64_t arg, bool full,
                     const char* what, const char* file, int line) {
  Fiber* f = current_fiber();
  f->state = s;
  f->slot = Slot{in, out, arg};
  f->fn = fn;
  f->full = full;
  f->what = what;
  f->file = file;
  f->line = line;
  yield_to_scheduler(f);
}

std::string format_id(const uint32_t v[3]) {
  std::ostringstream s;
  s << "(" << v[0] << "," << v[1] << "," << v[2] << ")";
  return s.str();
}

std::string site(const Fiber* f) {
  std::ostringstream s;
  s << f->what << " at " << (f->file ? f->file : "?") << ":" << f->line;
  return s.str();
}

// "threads 0-31, 40" style list of thread_index_in_threadgroup values.
std::string thread_list(const std::vector<const Fiber*>& fs) {
  std::vector<uint32_t> ids;
  for (const Fiber* f : fs) ids.push_back(f->ctx.thread_index_in_threadgroup);
  std::sort(ids.begin(), ids.end());
  std::ostringstream s;
  s << (ids.size() == 1 ? "thread " : "threads ");
  for (size_t i = 0; i < ids.size();) {
    size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
    if (i) s << ",";
    s << ids[i];
    if (j > i) s << "-" << ids[j];
    i = j + 1;
  }
  return s.str();
}

bool same_site(const Fiber* a, const Fiber* b) {
  return a->fn == b->fn && a->line == b->line &&
         (a->file == b->file || (a->file && b->file && std::strcmp(a->file, b->file) == 0));
}

struct Job {
  const KernelDef* def;
  void* const* buffers;
  uint32_t function_constants;
  std::array<uint32_t, 3> groups;
  std::array<uint32_t, 3> group_size;
  emu::Schedule schedule;
  uint64_t seed;
  std::atomic<uint64_t> next_group{0};
  std::atomic<bool> failed{false};
  std::mutex error_mutex;
  std::string error;
  Tally* tally = nullptr;  // profiled launch: buffer ranges in, every worker's counts summed
  Checker* checker = nullptr;  // sanitizer launch (one worker)

  void set_error(const std::string& e) {
    std::lock_guard<std::mutex> lock(error_mutex);
    if (error.empty()) error = e;
    failed.store(true);
  }
};

// Binds the first n fibers of `w` to the threads of threadgroup `gid` and makes them ready.
void prepare_group(Worker* w, const Job& job, const uint32_t gid[3], uint32_t n) {
  const uint32_t sx = job.group_size[0], sy = job.group_size[1];
  while (w->fibers.size() < n) w->fibers.emplace_back(new Fiber);
  w->launch = job.def->launch;
  w->arena_used = 0;
  w->arena_declared = 0;
  w->allocations.clear();
  if (job.checker) san_begin_group(job.checker, gid, w->arena, kArenaSize);
  w->error.clear();
  for (uint32_t i = 0; i < n; ++i) {
    Fiber* f = w->fibers[i].get();
    if (!f->started) start_fiber(w, f);
    ThreadCtx& c = f->ctx;
    c.buffers = job.buffers;
    c.function_constants = job.function_constants;
    const uint32_t local[3] = {i % sx, (i / sx) % sy, i / (sx * sy)};
    for (int d = 0; d < 3; ++d) {
      c.thread_position_in_threadgroup[d] = local[d];
      c.threadgroup_position_in_grid[d] = gid[d];
      c.threads_per_threadgroup[d] = job.group_size[d];
      c.threadgroups_per_grid[d] = job.groups[d];
      c.threads_per_grid[d] = job.groups[d] * job.group_size[d];
      c.thread_position_in_grid[d] = gid[d] * job.group_size[d] + local[d];
    }
    c.thread_index_in_threadgroup = i;
    c.thread_index_in_simdgroup = i % kSimdWidth;
    c.simdgroup_index_in_threadgroup = i / kSimdWidth;
    c.threads_per_simdgroup = kSimdWidth;
    c.simdgroups_per_threadgroup = (n + kSimdWidth - 1) / kSimdWidth;
    f->state = State::kReady;
  }
}

// Resumes every ready fiber of the group once, in the schedule's order, until each waits at a
// collective or returns. Returns "" or the first fiber's error.
std::string resume_ready(Worker* w, const Job& job, const uint32_t gid[3], uint32_t n,
                         std::mt19937_64& rng) {
  std::vector<uint32_t> order;
  for (uint32_t i = 0; i < n; ++i)
    if (w->fibers[i]->state == State::kReady) order.push_back(i);
  if (job.schedule == emu::Schedule::kReverse) {
    std::reverse(order.begin(), order.end());
  } else if (job.schedule == emu::Schedule::kRandom) {
    std::shuffle(order.begin(), order.end(), rng);
  }
  for (uint32_t i : order) {
    Fiber* f = w->fibers[i].get();
    if (job.checker) {
      san_set_actor(job.checker, int(i), int(i / kSimdWidth), int(i % kSimdWidth), nullptr, 0);
    }
    resume(w, f);
    if (!w->error.empty()) {
      return "kernel " + std::string(job.def->name) + ": " + w->error + " in threadgroup " +
             format_id(gid) + " (thread_position_in_threadgroup " +
             format_id(f->ctx.thread_position_in_threadgroup) + ")";
    }
  }
  return "";
}

// Why simdgroup `s` of a group of n threads, some of whose lanes wait at a simd collective
// (the first at `first`), cannot resolve it: "" when it can.
std::string simd_wait_error(Worker* w, const Job& job, const uint32_t gid[3], uint32_t s,
                            uint32_t n, const Fiber* first, bool at_barrier, bool mismatch,
                            bool done) {
  const uint32_t lo = s * kSimdWidth, hi = std::min(n, lo + kSimdWidth);
  auto select = [&](auto pred) {
    std::vector<const Fiber*> r;
    for (uint32_t i = lo; i < hi; ++i)
      if (pred(w->fibers[i].get())) r.push_back(w->fibers[i].get());
    return r;
  };
  const std::string kernel = "kernel " + std::string(job.def->name) + ": ";
  const std::string sg =
      " in simdgroup " + std::to_string(s) + " of threadgroup " + format_id(gid) + ": ";
  auto waiting = [](const Fiber* f) { return f->state == State::kSimd; };
  if (at_barrier) {
    auto a = select(waiting);
    auto b = select([](const Fiber* f) { return f->state == State::kBarrier; });
    return kernel + "barrier divergence" + sg + thread_list(a) + " wait at " + site(a[0]) +
           " while " + thread_list(b) + " wait at " + site(b[0]);
  }
  if (mismatch) {
    auto a = select([&](const Fiber* f) { return waiting(f) && same_site(f, first); });
    auto b = select([&](const Fiber* f) { return waiting(f) && !same_site(f, first); });
    return kernel + "simdgroup divergence" + sg + thread_list(a) + " wait at " + site(first) +
           " while " + thread_list(b) + " wait at " + site(b[0]);
  }
  if (first->full && done) {
    auto a = select(waiting);
    auto b = select([](const Fiber* f) { return f->state == State::kDone; });
    return kernel + thread_list(b) + sg + "returned while " + thread_list(a) + " wait at " +
           site(first) + ", which needs all 32 lanes";
  }
  if (first->full && hi - lo != uint32_t(kSimdWidth)) {
    return kernel + site(first) + " needs a full simdgroup of 32 threads (threadgroup size " +
           std::to_string(n) + " is not a multiple of 32)";
  }
  return "";
}

// Resolves simdgroup `s`'s simd collective when all its live lanes wait at one (the fast path
// only counts; lists of threads are built for error messages). Sets *live when some lane has
// not returned and *progressed when the collective ran. Returns "" or an error.
std::string resolve_simdgroup(Worker* w, const Job& job, const uint32_t gid[3], uint32_t s,
                              uint32_t n, bool* live, bool* progressed) {
  Slot* lanes[kSimdWidth] = {};
  const Fiber* first = nullptr;
  int at_simd = 0, at_barrier = 0, done = 0;
  bool mismatch = false;
  const uint32_t lo = s * kSimdWidth, hi = std::min(n, lo + kSimdWidth);
  for (uint32_t i = lo; i < hi; ++i) {
    Fiber* f = w->fibers[i].get();
    if (f->state == State::kSimd) {
      ++at_simd;
      if (!first) {
        first = f;
      } else if (!same_site(f, first)) {
        mismatch = true;
      }
      lanes[i - lo] = &f->slot;
    } else if (f->state == State::kBarrier) {
      ++at_barrier;
    } else {
      ++done;
    }
  }
  if (at_simd + at_barrier) *live = true;
  if (!at_simd) return "";
  std::string err = simd_wait_error(w, job, gid, s, n, first, at_barrier, mismatch, done);
  if (!err.empty()) return err;
  if (job.checker) {
    san_set_actor(job.checker, -1, int(s), -1, first->file, first->line);
    if (std::strcmp(first->what, "simdgroup_barrier") == 0) {
      san_simdgroup_barrier(job.checker, int(s), unsigned(first->slot.arg));
    }
  }
  const char* e = first->fn(lanes);
  if (!e && job.checker) e = san_stop(job.checker);
  if (e) {
    return "kernel " + std::string(job.def->name) + ": " + e + " (" + site(first) +
           ", simdgroup " + std::to_string(s) + " of threadgroup " + format_id(gid) + ")";
  }
  if (t_tally) tally_collective(&t_tally->counts, first->what);
  for (uint32_t i = lo; i < hi; ++i)
    if (lanes[i - lo]) w->fibers[i]->state = State::kReady;
  *progressed = true;
  return "";
}

// Releases a threadgroup barrier that every thread of the group waits at, at one site. Returns
// "" or why it cannot be released (a thread returned, or threads wait at different barriers).
std::string resolve_barrier(Worker* w, const Job& job, const uint32_t gid[3], uint32_t n) {
  const Fiber* first = nullptr;
  bool some_done = false, mismatch = false;
  for (uint32_t i = 0; i < n; ++i) {
    const Fiber* f = w->fibers[i].get();
    if (f->state != State::kBarrier) {
      some_done = true;
    } else if (!first) {
      first = f;
    } else if (!same_site(f, first)) {
      mismatch = true;
    }
  }
  if (some_done || mismatch) {
    std::vector<const Fiber*> a, b;
    for (uint32_t i = 0; i < n; ++i) {
      const Fiber* f = w->fibers[i].get();
      if (some_done) {
        (f->state == State::kBarrier ? a : b).push_back(f);
      } else {
        (same_site(f, first) ? a : b).push_back(f);
      }
    }
    const std::string kernel = "kernel " + std::string(job.def->name) + ": ";
    if (some_done) {
      return kernel + thread_list(b) + " of threadgroup " + format_id(gid) + " returned while " +
             thread_list(a) + " wait at " + site(first) + " (deadlock on real hardware)";
    }
    return kernel + "barrier divergence in threadgroup " + format_id(gid) + ": " +
           thread_list(a) + " wait at " + site(first) + " while " + thread_list(b) +
           " wait at " + site(b[0]);
  }
  for (uint32_t i = 0; i < n; ++i) w->fibers[i]->state = State::kReady;
  if (t_tally) ++t_tally->counts.barriers;
  if (job.checker) san_threadgroup_barrier(job.checker, unsigned(first->slot.arg));
  return "";
}

// Runs one threadgroup to completion; returns "" or an error message.
std::string run_group(Worker* w, Job& job, const uint32_t gid[3]) {
  const uint32_t n = job.group_size[0] * job.group_size[1] * job.group_size[2];
  const uint32_t nsimd = (n + kSimdWidth - 1) / kSimdWidth;
  prepare_group(w, job, gid, n);
  std::mt19937_64 rng(job.seed * 0x9E3779B97F4A7C15ull ^
                      ((uint64_t(gid[2]) * job.groups[1] + gid[1]) * job.groups[0] + gid[0]));
  std::string err;
  for (;;) {
    err = resume_ready(w, job, gid, n, rng);
    if (!err.empty()) break;
    bool any_live = false, progressed = false;
    // Simdgroups whose live lanes all wait at one simd collective resolve independently.
    for (uint32_t s = 0; s < nsimd && err.empty(); ++s)
      err = resolve_simdgroup(w, job, gid, s, n, &any_live, &progressed);
    if (!err.empty() || !any_live) break;  // an error, or every thread returned
    if (progressed) continue;
    // Only threadgroup barriers (and returned threads) remain.
    err = resolve_barrier(w, job, gid, n);
    if (!err.empty()) break;
  }
  if (t_tally) {
    uint64_t& m = t_tally->counts.threadgroup_memory;
    m = std::max<uint64_t>(m, w->arena_used);
  }
  if (!err.empty()) {
    // Abandoned fibers hold frames of the failed group: give them fresh stacks next time.
    for (uint32_t i = 0; i < n; ++i) {
      w->fibers[i]->started = false;
      w->fibers[i]->state = State::kDone;
    }
  }
  return err;
}

// Workers (with their fiber stacks) are kept between launches.
std::mutex g_pool_mutex;
std::vector<std::unique_ptr<Worker>> g_pool;

std::unique_ptr<Worker> take_worker() {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  if (g_pool.empty()) return std::unique_ptr<Worker>(new Worker);
  std::unique_ptr<Worker> w = std::move(g_pool.back());
  g_pool.pop_back();
  return w;
}

void give_worker(std::unique_ptr<Worker> w) {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  g_pool.push_back(std::move(w));
}

void work(Job& job) {
  std::unique_ptr<Worker> w;
  try {
    w = take_worker();
  } catch (const std::exception& x) {
    job.set_error(std::string("kernel ") + job.def->name + ": emulator failure: " + x.what());
    return;
  }
  t_worker = w.get();
  t_san_checker = job.checker;
  Tally tally;
  if (job.tally) {
    tally = *job.tally;
    tally.counts = Counts{};  // this worker's own counts, summed into the job's at the end
    tally.arena = reinterpret_cast<uintptr_t>(w->arena);
    t_tally = &tally;
  }
  const uint64_t total = uint64_t(job.groups[0]) * job.groups[1] * job.groups[2];
  for (;;) {
    if (job.failed.load(std::memory_order_relaxed)) break;
    uint64_t g = job.next_group.fetch_add(1);
    if (g >= total) break;
    const uint32_t gid[3] = {uint32_t(g % job.groups[0]),
                             uint32_t((g / job.groups[0]) % job.groups[1]),
                             uint32_t(g / (uint64_t(job.groups[0]) * job.groups[1]))};
    std::string e;
    try {
      e = run_group(w.get(), job, gid);
    } catch (const std::exception& x) {  // e.g. no memory for fiber stacks
      e = std::string("kernel ") + job.def->name + ": emulator failure: " + x.what();
    }
    if (!e.empty()) job.set_error(e);
  }
  t_worker = nullptr;
  t_san_checker = nullptr;
  if (job.tally) {
    t_tally = nullptr;
    std::lock_guard<std::mutex> lock(job.error_mutex);
    job.tally->counts.add(tally.counts);
  }
  give_worker(std::move(w));
}

using Registry = std::map<std::string, const KernelDef*>;

Registry make_registry(const KernelTable* (*all_tables)(int*)) {
  Registry m;
  int ntables = 0;
  const KernelTable* tables = all_tables(&ntables);
  for (int t = 0; t < ntables; ++t)
    for (int k = 0; k < tables[t].count; ++k) m[tables[t].defs[k].name] = &tables[t].defs[k];
  return m;
}

const Registry& registry() {
  static const Registry reg = make_registry(&all_kernel_tables);
  return reg;
}

const Registry& counting_registry() {
  static const Registry reg = make_registry(&all_counting_kernel_tables);
  return reg;
}

}  // namespace

void simd_collective(ResolveFn fn, const void* in, void* out, uint64_t arg, const char* what,
                     const char* file, int line) {
  wait_collective(State::kSimd, fn, in, out, arg, false, what, file, line);
}

void simd_collective_full(ResolveFn fn, const void* in, void* out, uint64_t arg, const char* what,
                          const char* file, int line) {
  wait_collective(State::kSimd, fn, in, out, arg, true, what, file, line);
}

void threadgroup_barrier(unsigned flags, const char* file, int line) {
  wait_collective(State::kBarrier, nullptr, nullptr, nullptr, flags, false, "threadgroup_barrier",
                  file, line);
}

void* threadgroup_alloc(const void* site_marker, size_t size, size_t align, size_t element_size,
                        const char* name, const char* file, int line) {
  Worker* w = current_fiber()->worker;
  for (const Allocation& a : w->allocations)
    if (a.site == site_marker) return w->arena + a.offset;
  Checker* checker = t_san_checker;
  const size_t declared = (w->arena_declared + align - 1) / align * align + size;
  size_t offset = (w->arena_used + (checker ? kTgRedzone : 0) + align - 1) / align * align;
  if (declared > kMaxThreadgroupMemory || offset + size > kArenaSize) {
    std::ostringstream msg;
    msg << "threadgroup memory exceeds 32768 bytes with '" << name << "' (" << size
        << " bytes, " << file << ":" << line << ")";
    const std::string text = msg.str();
    fail(text.c_str());  // copies the message before abandoning this fiber
  }
  std::memset(w->arena + offset, 0xFF, size);
  w->arena_used = offset + size;
  w->arena_declared = declared;
  if (checker) san_alloc(checker, offset, size, element_size, name, file, line);
  w->allocations.push_back(Allocation{site_marker, offset});
  return w->arena + offset;
}

bool fast_math_garbage() {
  static const bool garbage = [] {
    const char* mode = std::getenv("JFM_EMULATOR_FAST_MATH");
    return mode == nullptr || std::strcmp(mode, "precise") != 0;
  }();
  return garbage;
}

void count_fma() {
  if (t_tally) ++t_tally->counts.fma_ops;
}

void count_math() {
  if (t_tally) ++t_tally->counts.math_ops;
}

uint32_t current_lane() { return current_fiber()->ctx.thread_index_in_simdgroup; }

bool function_constant(int index) {
  return index >= 0 && index < 32 && ((current_fiber()->ctx.function_constants >> index) & 1u);
}

void fail(const char* message) {
  Fiber* f = current_fiber();
  f->worker->error = message;
  f->state = State::kDone;
  for (;;) yield_to_scheduler(f);  // never resumed: the group is abandoned
}

}  // namespace rt

namespace emu {

std::vector<std::string> kernel_names() {
  std::vector<std::string> names;
  for (const auto& kv : rt::registry()) names.push_back(kv.first);
  return names;  // std::map keeps them sorted
}

bool has_kernel(const std::string& name) { return rt::registry().count(name) != 0; }

bool has_counting_variant() { return !rt::counting_registry().empty(); }

namespace {

// The kernel `launch` runs: the plain one, or its counting variant for a profile or the
// sanitizer. Null with *error set when there is none.
const rt::KernelDef* launched_kernel(const std::string& kernel, const Launch& launch,
                                     std::string* error) {
  auto it = rt::registry().find(kernel);
  if (it == rt::registry().end()) {
    *error = "emulator: unknown kernel '" + kernel + "'";
    return nullptr;
  }
  if (launch.profile && launch.sanitizer) {
    *error = "emulator: a launch is either profiled or sanitized, not both";
    return nullptr;
  }
  if (!launch.profile && !launch.sanitizer) return it->second;
  auto c = rt::counting_registry().find(kernel);
  if (c == rt::counting_registry().end()) {
    *error = "emulator: no counting variant of kernel '" + kernel +
             "' (built with JFM_EMULATOR_COUNTING=OFF; the profile and the sanitizer need it)";
    return nullptr;
  }
  return c->second;
}

// Checks the threadgroup size and binds def's buffers from args into buffers[index]. Returns ""
// or the error, prefixed by `k`.
std::string bind_launch(const std::string& k, const rt::KernelDef* def,
                        const std::vector<Arg>& args, const Launch& launch,
                        void* buffers[rt::kMaxBuffers], uint64_t* threads) {
  *threads = 1;
  for (int d = 0; d < 3; ++d) {
    if (launch.group_size[d] == 0) return k + "threadgroup size has a zero dimension";
    *threads *= launch.group_size[d];
  }
  if (*threads > 1024)
    return k + "threadgroup of " + std::to_string(*threads) + " threads exceeds the limit of 1024";
  if (def->max_threads && *threads > def->max_threads)
    return k + "threadgroup of " + std::to_string(*threads) +
           " threads exceeds [[max_total_threads_per_threadgroup(" +
           std::to_string(def->max_threads) + ")]]";
  const rt::BufferUse* uses = def->buffers();
  for (int b = 0; b < def->num_buffers; ++b) {
    const rt::BufferUse& u = uses[b];
    if (size_t(u.index) >= args.size() || args[u.index].data == nullptr)
      return k + "[[buffer(" + std::to_string(u.index) + ")]] (" + u.name + ") is not bound";
    if (args[u.index].size < u.min_size)
      return k + "[[buffer(" + std::to_string(u.index) + ")]] (" + u.name + ") has " +
             std::to_string(args[u.index].size) + " bytes, needs " + std::to_string(u.min_size);
    buffers[u.index] = args[u.index].data;
  }
  return "";
}

// A profiled launch: clears *p, marks def's bound buffers in it and gives the tally their
// address ranges.
void begin_profile(const rt::KernelDef* def, const std::vector<Arg>& args, Profile* p,
                   rt::Tally* tally) {
  *p = Profile{};
  const rt::BufferUse* uses = def->buffers();
  for (int b = 0; b < def->num_buffers; ++b) {
    const rt::BufferUse& u = uses[b];
    tally->lo[b] = reinterpret_cast<uintptr_t>(args[u.index].data);
    tally->size[b] = args[u.index].size;
    tally->index[b] = u.index;
    p->buffer_bound[u.index] = true;
    p->constant_buffer[u.index] = u.constant_space;
  }
  tally->num_ranges = def->num_buffers;
}

// The profile of a launch from the workers' summed counts.
void finish_profile(const rt::Counts& c, uint64_t groups, uint64_t threads, Profile* p) {
  p->threadgroups = groups;
  p->threads_per_threadgroup = threads;
  p->threadgroup_memory_bytes = c.threadgroup_memory;
  for (int b = 0; b < rt::kMaxBuffers; ++b) {
    p->buffer_bytes_read[b] = c.read[b];
    p->buffer_bytes_written[b] = c.written[b];
    if (!p->constant_buffer[b]) {
      p->device_bytes_read += c.read[b];
      p->device_bytes_written += c.written[b];
    }
  }
  p->threadgroup_bytes_read = c.threadgroup_read;
  p->threadgroup_bytes_written = c.threadgroup_written;
#define JFM_COPY_COUNT(name) p->name = c.name;
  JFM_PROFILE_OPS(JFM_COPY_COUNT)
#undef JFM_COPY_COUNT
}

// Runs the job's threadgroups on `workers` threads, the calling one included.
void run_workers(rt::Job& job, int workers) {
  std::vector<std::thread> pool;
  try {
    for (int i = 1; i < workers; ++i) pool.emplace_back([&job] { rt::work(job); });
  } catch (const std::exception&) {  // fewer threads than asked: the others do the work
  }
  rt::work(job);
  for (std::thread& t : pool) t.join();
}

}  // namespace

std::string run(const std::string& kernel, const std::vector<Arg>& args, const Launch& launch) {
  std::string error;
  const rt::KernelDef* def = launched_kernel(kernel, launch, &error);
  if (!def) return error;
  void* buffers[rt::kMaxBuffers] = {};
  uint64_t threads = 0;
  error = bind_launch("kernel " + kernel + ": ", def, args, launch, buffers, &threads);
  if (!error.empty()) return error;
  rt::Tally tally;
  if (launch.profile) begin_profile(def, args, launch.profile, &tally);
  const uint64_t groups = uint64_t(launch.groups[0]) * launch.groups[1] * launch.groups[2];
  if (groups == 0) return "";
  std::unique_ptr<rt::Checker, void (*)(rt::Checker*)> checker(nullptr, &rt::destroy_checker);
  if (launch.sanitizer) {
    const rt::BufferUse* uses = def->buffers();
    size_t sizes[rt::kMaxBuffers] = {};
    for (int b = 0; b < def->num_buffers; ++b) sizes[uses[b].index] = args[uses[b].index].size;
    const uint32_t g[3] = {launch.groups[0], launch.groups[1], launch.groups[2]};
    checker.reset(rt::sanitize_begin(launch.sanitizer, def, launch.function_constants, g,
                                          buffers, sizes));
  }
  rt::Job job;
  job.def = def;
  job.buffers = buffers;
  job.function_constants = launch.function_constants;
  job.groups = launch.groups;
  job.group_size = launch.group_size;
  job.schedule = launch.schedule;
  job.seed = launch.seed;
  job.tally = launch.profile ? &tally : nullptr;
  job.checker = checker.get();
  int workers = launch.num_workers > 0 ? launch.num_workers
                                       : int(std::max(1u, std::thread::hardware_concurrency()));
  if (checker) workers = 1;  // the shadow state is updated without locks
  run_workers(job, int(std::min<uint64_t>(uint64_t(workers), groups)));
  if (checker) {
    const std::string findings = rt::sanitize_end(checker.get());
    if (job.error.empty() && !findings.empty()) return "kernel " + kernel + ": " + findings;
  }
  if (launch.profile) finish_profile(tally.counts, groups, threads, launch.profile);
  return job.error;
}

}  // namespace emu
}  // namespace jfm

// ---- callbacks of the counting variant ----------------------------------------------------------
// The counting variant of every translated shader is compiled with -fsanitize=thread, which makes
// the compiler call these functions at every memory access and atomic operation of the optimized
// code (GCC and clang share the interface; no sanitizer runtime is linked: these definitions are
// the whole runtime). Atomics perform the operation and count one successful read-modify-write.
extern "C" {
using jfm::rt::tally_access;
#define JFM_PC __builtin_return_address(0)
#define JFM_TSAN_ACCESS(N)                                                                        \
  void __tsan_read##N(void* p) { tally_access(p, N, false, JFM_PC); }                             \
  void __tsan_write##N(void* p) { tally_access(p, N, true, JFM_PC); }                             \
  void __tsan_unaligned_read##N(void* p) { tally_access(p, N, false, JFM_PC); }                   \
  void __tsan_unaligned_write##N(void* p) { tally_access(p, N, true, JFM_PC); }                   \
  void __tsan_volatile_read##N(void* p) { tally_access(p, N, false, JFM_PC); }                    \
  void __tsan_volatile_write##N(void* p) { tally_access(p, N, true, JFM_PC); }
JFM_TSAN_ACCESS(1)
JFM_TSAN_ACCESS(2)
JFM_TSAN_ACCESS(4)
JFM_TSAN_ACCESS(8)
JFM_TSAN_ACCESS(16)
#undef JFM_TSAN_ACCESS
void __tsan_read_range(void* p, unsigned long n) {
  tally_access(p, n, false, JFM_PC);
}
void __tsan_write_range(void* p, unsigned long n) {
  tally_access(p, n, true, JFM_PC);
}
void* __tsan_memcpy(void* d, const void* s, unsigned long n) {
  tally_access(s, n, false, JFM_PC);
  tally_access(d, n, true, JFM_PC);
  return std::memcpy(d, s, n);
}
void* __tsan_memmove(void* d, const void* s, unsigned long n) {
  tally_access(s, n, false, JFM_PC);
  tally_access(d, n, true, JFM_PC);
  return std::memmove(d, s, n);
}
void* __tsan_memset(void* d, int c, unsigned long n) {
  tally_access(d, n, true, JFM_PC);
  return std::memset(d, c, n);
}
void __tsan_init() {}
void __tsan_func_entry(void*) {}
void __tsan_func_exit() {}

typedef int32_t jfm_a32;
jfm_a32 __tsan_atomic32_load(const volatile jfm_a32* a, int) {
  return __atomic_load_n(a, __ATOMIC_RELAXED);  // counted with the read-modify-write that follows
}
int __tsan_atomic32_compare_exchange_strong(volatile jfm_a32* a, jfm_a32* c, jfm_a32 v, int, int) {
  const bool ok = __atomic_compare_exchange_n(a, c, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  if (ok && !jfm::rt::t_san_checker) {  // atomics are not races: the sanitizer skips them
    tally_access(const_cast<jfm_a32*>(a), 4, false, nullptr);
    tally_access(const_cast<jfm_a32*>(a), 4, true, nullptr);
  }
  return ok;
}
int __tsan_atomic32_compare_exchange_weak(volatile jfm_a32* a, jfm_a32* c, jfm_a32 v, int mo,
                                          int fmo) {
  return __tsan_atomic32_compare_exchange_strong(a, c, v, mo, fmo);
}
jfm_a32 __tsan_atomic32_compare_exchange_val(volatile jfm_a32* a, jfm_a32 c, jfm_a32 v, int mo,
                                             int fmo) {
  __tsan_atomic32_compare_exchange_strong(a, &c, v, mo, fmo);
  return c;
}
}  // extern "C"
