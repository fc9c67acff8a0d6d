// The emulator's sanitizer (sanitizer.h): shadow state per byte of threadgroup memory and of the
// host memory of a call, updated at every load and store of the counting variant.
//
// Ordering model (docs/testing.md cites the MSL specification for each rule). Two accesses to a
// byte, at least one a write, by different GPU threads are ordered only by:
//   - a threadgroup_barrier whose mem_flags include mem_threadgroup (threadgroup memory) or
//     mem_device (device memory) that both threads of one threadgroup passed between them;
//   - a simdgroup_barrier with those flags, between accesses of one simdgroup;
//   - for device memory across dispatches: a memory barrier of the plan between the dispatches.
// Threadgroups of one dispatch are never ordered (atomics are not recorded). simd shuffles and
// reductions exchange registers and order no memory. A simdgroup_matrix load or store is one
// access of its whole simdgroup.
#include "sanitizer.h"

#include "../shaders/function_constants.h"

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <sstream>

namespace jfm {
namespace {

constexpr uint64_t kSiteBit = uint64_t(1) << 63;  // Access::where holds a collective's site
constexpr size_t kRedzone = 64 * 1024;           // poisoned bytes around each device buffer

// One recorded access of a byte. gen 0: none. For threadgroup memory gen numbers the run of a
// threadgroup; for device memory the dispatch of the call (1-based).
struct Access {
  uint64_t where = 0;  // code address of the access, or kSiteBit | index of a collective's site
  uint32_t gen = 0;
  uint32_t group = 0;      // linear threadgroup index
  uint32_t ep = 0;         // barriers (of this memory's kind) the threadgroup passed
  uint32_t sgep = 0;       // simdgroup barriers (of this kind) its simdgroup passed
  int16_t tid = 0;         // thread_index_in_threadgroup; -1: a simdgroup collective
  int16_t sg = 0, lane = 0;
};

struct Cell {
  Access w, r, r2;  // the last write; the last read and the last read by another thread
  uint32_t init = 0;  // threadgroup memory: gen of the run that wrote it; device: 1 once written
};

struct Range {  // host memory of the call
  uintptr_t lo = 0;
  size_t size = 0;
  emu::WriteRule rule = emu::WriteRule::kInput;
  std::vector<Cell> cells;
  std::string name;  // the first binding seen: "[[buffer(n)]] 'name' of kernel K"
  std::string output;  // the output's name in the contract ("O", "dQ", ...)
};

const char* rule_text(emu::WriteRule rule) {
  return rule == emu::WriteRule::kAccumulated ? "accumulates it, one store per dispatch"
                                              : "writes it once";
}

// "kernel K with function constants causal+lengths": the pipeline a report is about (the tile
// variant is part of the kernel's name). Bits beyond shaders/function_constants.h are numbered.
std::string pipeline_label(const char* kernel, uint32_t constants) {
  std::string s = std::string("kernel ") + kernel + " with function constants ";
  if (constants == ~0u) return s + "all true (unspecialised)";
  std::string names;
  for (int n = 0; n < 32; ++n) {
    if (!(constants >> n & 1u)) continue;
    const char* name = jfm_function_constant_name(n);
    names += (names.empty() ? "" : "+") + (name ? std::string(name) : "#" + std::to_string(n));
  }
  return s + (names.empty() ? "none" : names);
}

struct DispatchInfo {
  std::string kernel;
  uint32_t groups[3];
  uint64_t segment;
};

// A source path from shaders/ or tests/emulator/shaders/ on (the build's absolute path otherwise).
std::string shader_path(const std::string& path) {
  size_t p = path.rfind("/tests/emulator/shaders/");
  if (p == std::string::npos) p = path.rfind("/shaders/");
  return p == std::string::npos ? path : path.substr(p + 1);
}

std::string format_id(const uint32_t v[3]) {
  std::ostringstream s;
  s << "(" << v[0] << "," << v[1] << "," << v[2] << ")";
  return s.str();
}

// Shader lines of a code address of the counting variant: its line table (compiled with -g1,
// kept next to the stripped module as <module>.debug) read by addr2line, innermost first,
// keeping frames in shaders/ and tests/emulator/shaders/.
std::string code_lines(uint64_t pc) {
  static std::map<uint64_t, std::string> cache;
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(pc);
  if (it != cache.end()) return it->second;
  Dl_info info{};
  std::string result;
  if (dladdr(reinterpret_cast<void*>(pc), &info) && info.dli_fname) {
    const uint64_t offset = pc - reinterpret_cast<uint64_t>(info.dli_fbase) - 1;
    std::string object = info.dli_fname;
    if (access((object + ".debug").c_str(), R_OK) == 0) object += ".debug";
    char cmd[4096];
    std::snprintf(cmd, sizeof(cmd), "addr2line -i -e '%s' 0x%llx 2>/dev/null", object.c_str(),
                  static_cast<unsigned long long>(offset));
    if (FILE* f = popen(cmd, "r")) {
      char line[4096];
      while (std::fgets(line, sizeof(line), f)) {
        std::string l(line);
        while (!l.empty() && (l.back() == '\n' || l.back() == '\r')) l.pop_back();
        const size_t d = l.find(" (discriminator");
        if (d != std::string::npos) l.resize(d);
        if (l.find("/shaders/") == std::string::npos) continue;  // shim, launcher, runtime
        if (!result.empty()) result += " <- ";
        result += shader_path(l);
      }
      pclose(f);
    }
    if (result.empty()) {
      char buf[64];
      std::snprintf(buf, sizeof(buf), "+0x%llx", static_cast<unsigned long long>(offset));
      result = "code " + std::string(info.dli_fname) + buf + " (no shader line information)";
    }
  } else {
    result = "unknown code address";
  }
  cache[pc] = result;
  return result;
}

}  // namespace

namespace emu {

struct SanitizerCall::State {
  bool collect_all = false;
  std::vector<std::unique_ptr<Range>> ranges;  // sorted by lo, disjoint
  std::vector<DispatchInfo> dispatches;
  uint64_t segment = 0;
  std::vector<std::string> findings;
  std::set<std::string> seen;  // dedupe keys of findings (collect-all mode)
  std::vector<std::pair<const char*, int>> sites;  // collectives' source sites
  std::map<std::pair<const char*, int>, uint32_t> site_index;

  Range* range_of(uintptr_t a) {
    auto it = std::upper_bound(ranges.begin(), ranges.end(), a,
                               [](uintptr_t x, const std::unique_ptr<Range>& r) { return x < r->lo; });
    if (it == ranges.begin()) return nullptr;
    Range* r = (it - 1)->get();
    return a - r->lo < r->size ? r : nullptr;
  }

  // Declares [lo, lo + size); overlapping declarations merge (output if any is).
  void add(uintptr_t lo, size_t size, emu::WriteRule rule, bool poison, const std::string& name) {
    const bool output = rule != emu::WriteRule::kInput;
    uintptr_t hi = lo + size;
    std::vector<std::unique_ptr<Range>> keep, merged;
    for (auto& r : ranges) {
      if (r->lo < hi && lo < r->lo + r->size) {
        merged.push_back(std::move(r));
      } else {
        keep.push_back(std::move(r));
      }
    }
    auto n = std::make_unique<Range>();
    n->lo = lo;
    for (auto& r : merged) n->lo = std::min(n->lo, r->lo), hi = std::max(hi, r->lo + r->size);
    n->size = hi - n->lo;
    n->cells.resize(n->size);
    if (output && poison) std::memset(reinterpret_cast<void*>(lo), 0xFF, size);
    for (size_t i = 0; i < n->size; ++i) n->cells[i].init = 1;
    if (output)
      for (size_t i = lo - n->lo; i < lo - n->lo + size; ++i) n->cells[i].init = 0;
    n->rule = rule;
    n->output = name;
    for (auto& r : merged) {
      if (n->rule == emu::WriteRule::kInput) n->rule = r->rule, n->output = r->output;
      if (n->name.empty()) n->name = r->name;
      std::copy(r->cells.begin(), r->cells.end(), n->cells.begin() + (r->lo - n->lo));
    }
    keep.push_back(std::move(n));
    std::sort(keep.begin(), keep.end(), [](const auto& a, const auto& b) { return a->lo < b->lo; });
    ranges = std::move(keep);
  }
};

SanitizerCall::SanitizerCall(bool collect_all) : state(new State) {
  state->collect_all = collect_all;
}
SanitizerCall::~SanitizerCall() = default;

void SanitizerCall::add_range(void* data, size_t size, WriteRule rule, const std::string& name) {
  if (data && size) state->add(reinterpret_cast<uintptr_t>(data), size, rule, true, name);
}

void SanitizerCall::begin_dispatch(uint64_t segment) { state->segment = segment; }

bool SanitizerCall::collect_all() const { return state->collect_all; }

std::string SanitizerCall::finish() {
  State& s = *state;
  for (const auto& r : s.ranges) {
    if (r->rule == WriteRule::kInput) continue;
    size_t unwritten = 0, first = 0;
    for (size_t i = 0; i < r->size; ++i)
      if (!r->cells[i].init && !unwritten++) first = i;
    if (!unwritten || s.findings.size() >= kMaxFindings) continue;
    std::ostringstream m;
    m << "sanitizer: initcheck: " << unwritten << " of the " << r->size << " bytes of output "
      << (r->output.empty() ? "" : r->output + ", ") << (r->name.empty() ? "memory" : r->name)
      << ", were never written by the call (first: byte " << first << "); the contract "
      << rule_text(r->rule) << ", every element";
    s.findings.push_back(m.str());
  }
  std::string out;
  for (const std::string& f : s.findings) out += (out.empty() ? "" : "\n") + f;
  return out;
}

}  // namespace emu

namespace rt {

class Checker {
 public:
  struct Region {  // one device buffer's copy: [copy, copy + size) between redzones
    std::vector<unsigned char> storage;
    uintptr_t copy = 0, host = 0;
    size_t size = 0;
    Cell* cells = nullptr;
    int index = 0;
    bool constant_space = false;
    emu::WriteRule rule = emu::WriteRule::kInput;
    std::string name, output;
  };
  struct TgAlloc {
    size_t offset, size, element_size;
    const char* name;
    const char* file;
    int line;
  };

  emu::SanitizerCall::State* st;
  const KernelDef* def;
  std::string label;  // pipeline_label of the launch
  uint32_t gen = 0;  // this dispatch
  uint32_t groups[3];
  std::vector<Region> regions;
  int last_region = 0;
  // Threadgroup memory of the running group.
  uintptr_t arena = 0;
  size_t arena_size = 0;
  std::vector<Cell> tg;
  std::vector<int16_t> tg_owner;  // allocation of each byte, -1: none
  std::vector<TgAlloc> allocs;
  uint32_t tg_gen = 0, group = 0, gid[3] = {0, 0, 0};
  uint32_t ep_tg = 0, ep_dev = 0;
  uint32_t sgep_tg[32] = {}, sgep_dev[32] = {};
  // Current actor.
  int16_t tid = 0, sg = 0, lane = 0;
  uint64_t site = 0;  // kSiteBit | index while a collective runs, else 0
  std::string stop;  // the first finding (not collect-all): the launch ends with it

  Access actor(bool dev, uint64_t pc) const {
    Access a;
    a.where = site ? site : pc;
    a.gen = dev ? gen : tg_gen;
    a.group = group;
    a.ep = dev ? ep_dev : ep_tg;
    a.sgep = dev ? sgep_dev[sg] : sgep_tg[sg];
    a.tid = tid;
    a.sg = sg;
    a.lane = lane;
    return a;
  }

  static bool same_thread(const Access& x, const Access& a) {
    return x.gen == a.gen && x.group == a.group && x.tid == a.tid && x.sg == a.sg;
  }

  // Whether an earlier access x (gen != 0) is ordered before the current access a.
  bool ordered(const Access& x, const Access& a, bool dev) const {
    if (same_thread(x, a)) return true;
    if (x.gen != a.gen) {
      if (!dev) return true;  // threadgroup memory of an earlier threadgroup: gone
      // device memory, an earlier dispatch of the call
      return st->dispatches[x.gen - 1].segment != st->segment;
    }
    if (x.group != a.group) return false;
    if (x.ep != a.ep) return true;
    return x.sg == a.sg && x.sgep != a.sgep;
  }

  std::string where(uint64_t w) const {
    if (w & kSiteBit) {
      const auto& s = st->sites[w & ~kSiteBit];
      return shader_path(s.first ? s.first : "?") + ":" + std::to_string(s.second);
    }
    return code_lines(w);
  }

  std::string who(const Access& x, bool dev) const {
    std::ostringstream s;
    if (dev && x.gen != gen) {
      const DispatchInfo& d = st->dispatches[x.gen - 1];
      s << "dispatch " << x.gen << " (kernel " << d.kernel << ") ";
    }
    if (dev) {
      const uint32_t* g = x.gen == gen ? groups : st->dispatches[x.gen - 1].groups;
      const uint32_t id[3] = {x.group % g[0], (x.group / g[0]) % g[1], x.group / (g[0] * g[1])};
      s << "threadgroup " << format_id(id) << " ";
    }
    if (x.tid < 0) {
      s << "simdgroup " << x.sg << " (simdgroup_matrix operation)";
    } else {
      s << "thread " << x.tid << " (simdgroup " << x.sg << ", lane " << x.lane << ")";
    }
    return s.str() + " at " + where(x.where);
  }

  std::string location(uintptr_t a, uint64_t n, const Region* r) const {
    std::ostringstream s;
    if (!r) {
      const size_t off = a - arena;
      const int o = off < tg_owner.size() ? tg_owner[off] : -1;
      if (o < 0) return "threadgroup memory byte " + std::to_string(off);
      const TgAlloc& t = allocs[o];
      s << "threadgroup array '" << t.name << "' element " << (off - t.offset) / t.element_size
        << " (" << t.element_size << "-byte elements)";
      if (tg_gen) s << " of threadgroup " << format_id(gid);
      return s.str();
    }
    const int64_t off = int64_t(a) - int64_t(r->copy);
    s << "[[buffer(" << r->index << ")]] '" << r->name << "' element "
      << (off < 0 ? off / int64_t(n) - 1 : off / int64_t(n)) << " (" << n << "-byte access, "
      << r->size / n << " elements bound)";
    return s.str();
  }

  void report(const std::string& key, const std::string& text) {
    const std::string msg = "sanitizer: " + text;
    if (!st->collect_all) {
      if (stop.empty()) stop = msg;
      return;
    }
    if (st->findings.size() >= emu::SanitizerCall::kMaxFindings) return;
    if (!st->seen.insert(key).second) return;
    st->findings.push_back(msg);
  }

  void race(const Access& x, bool x_write, const Access& a, bool a_write, uintptr_t addr,
            uint64_t n, const Region* r) {
    const bool dev = r != nullptr;
    std::string why;
    if (dev && x.gen != a.gen) {
      why = "no memory barrier of the plan between the two dispatches";
    } else if (dev && x.group != a.group) {
      why = "threadgroups of one dispatch are unordered";
    } else {
      why = std::string("no threadgroup_barrier(mem_flags::") +
            (dev ? "mem_device" : "mem_threadgroup") + ") between them" +
            (x.sg == a.sg ? " nor a simdgroup_barrier of their simdgroup" : "");
    }
    std::ostringstream s;
    s << "racecheck (" << (dev ? "device" : "threadgroup") << " memory) in " << label
      << ": " << (x_write ? "write" : "read") << " by " << who(x, dev) << ", then "
      << (a_write ? "write" : "read") << " by " << who(a, dev) << ", of " << location(addr, n, r)
      << ": " << why;
    report("race" + std::to_string(x.where) + "/" + std::to_string(a.where), s.str());
  }

  // Checks one byte's cell; returns false after a finding (the access's other bytes are skipped).
  bool check(Cell& c, bool write, const Access& a, bool dev, uintptr_t addr, uint64_t n,
             const Region* r) {
    bool ok = true;
    if (c.w.gen && !ordered(c.w, a, dev)) {
      race(c.w, true, a, write, addr, n, r);
      ok = false;
    }
    if (ok && write) {
      for (const Access* x : {&c.r, &c.r2}) {
        if (x->gen && !ordered(*x, a, dev)) {
          race(*x, false, a, true, addr, n, r);
          ok = false;
          break;
        }
      }
    }
    if (write && ok && dev && r->rule != emu::WriteRule::kInput && c.w.gen &&
        (r->rule == emu::WriteRule::kOnce || c.w.gen == a.gen)) {
      std::ostringstream s;
      s << "initcheck (output contract) in " << label << ": write by " << who(a, dev) << " of "
        << location(addr, n, r) << ", which the write by " << who(c.w, dev)
        << " already stored; the contract of output " << r->output << " " << rule_text(r->rule);
      report("twice" + std::to_string(c.w.where) + "/" + std::to_string(a.where), s.str());
      ok = false;
    }
    if (write) {
      c.w = a;
      c.init = dev ? 1 : tg_gen;
    } else {
      if (ok && (dev ? c.init == 0 : c.init != tg_gen)) {
        std::ostringstream s;
        s << "initcheck in " << label << ": read by " << who(a, dev) << " of "
          << location(addr, n, r) << ", which "
          << (dev ? "no dispatch of this call has written (an output starts undefined)"
                  : "no thread of the threadgroup has written");
        report("init" + std::to_string(a.where), s.str());
        ok = false;
      }
      if (c.r.gen && !same_thread(c.r, a) &&
          (c.r.sg != a.sg || !c.r2.gen || c.r2.sg == a.sg)) {
        c.r2 = c.r;
      }
      c.r = a;
    }
    return ok;
  }

  void out_of_bounds(uintptr_t a, uint64_t n, bool write, uint64_t pc, const Region* r) {
    std::ostringstream s;
    const Access x = actor(r != nullptr, pc);
    s << "memcheck in " << label << ": " << (write ? "write" : "read") << " of " << n
      << " bytes by " << who(x, r != nullptr) << " outside ";
    if (r) {
      s << "its buffer: " << location(a, n, r);
    } else {
      s << "the declared threadgroup allocations: " << location(a, n, nullptr);
      // Name the allocation it ran past.
      const size_t off = a - arena;
      for (const TgAlloc& t : allocs)
        if (off >= t.offset + t.size && off < t.offset + t.size + 64)
          s << ", " << off - t.offset - t.size << " bytes past the end of '" << t.name << "' ("
            << shader_path(t.file) << ":" << t.line << ")";
    }
    report("oob" + std::to_string(x.where), s.str());
  }

  void access(uintptr_t a, uint64_t n, bool write, uint64_t pc) {
    if (a - arena < arena_size) {
      const size_t off = a - arena;
      const Access x = actor(false, pc);
      for (uint64_t i = 0; i < n && off + i < arena_size; ++i) {
        if (tg_owner[off + i] < 0) {
          out_of_bounds(a + i, n, write, pc, nullptr);
          return;
        }
        if (!check(tg[off + i], write, x, false, a, n, nullptr)) return;
      }
      return;
    }
    Region* r = nullptr;
    if (!regions.empty()) {
      Region& last = regions[last_region];
      if (a - (last.copy - kRedzone) < last.size + 2 * kRedzone) r = &last;
    }
    if (!r) {
      for (size_t i = 0; i < regions.size(); ++i) {
        Region& g = regions[i];
        if (a - (g.copy - kRedzone) < g.size + 2 * kRedzone) {
          r = &g;
          last_region = int(i);
          break;
        }
      }
    }
    if (!r) return;  // a thread's own stack (registers) or the emulator's memory
    if (a < r->copy || a + n > r->copy + r->size) {
      out_of_bounds(a, n, write, pc, r);
      return;
    }
    if (r->constant_space || !r->cells) return;
    const Access x = actor(true, pc);
    Cell* cells = r->cells + (a - r->copy);
    for (uint64_t i = 0; i < n; ++i)
      if (!check(cells[i], write, x, true, a, n, r)) return;
  }
};

__attribute__((tls_model("initial-exec"))) thread_local Checker* t_san_checker = nullptr;

Checker* sanitize_begin(emu::SanitizerCall* call, const KernelDef* def,
                        uint32_t function_constants, const uint32_t groups[3], void** buffers,
                        const size_t* sizes) {
  auto c = std::make_unique<Checker>();
  c->st = call->state.get();
  c->def = def;
  c->label = pipeline_label(def->name, function_constants);
  std::copy(groups, groups + 3, c->groups);
  emu::SanitizerCall::State& st = *c->st;
  st.dispatches.push_back(DispatchInfo{def->name, {groups[0], groups[1], groups[2]}, st.segment});
  c->gen = uint32_t(st.dispatches.size());
  const BufferUse* uses = def->buffers();
  c->regions.reserve(size_t(def->num_buffers));
  for (int b = 0; b < def->num_buffers; ++b) {
    const BufferUse& u = uses[b];
    const uintptr_t host = reinterpret_cast<uintptr_t>(buffers[u.index]);
    const size_t size = sizes[u.index];
    std::ostringstream name;
    name << "[[buffer(" << u.index << ")]] '" << u.name << "' of kernel " << def->name;
    if (!u.constant_space) {
      if (!st.range_of(host) || !st.range_of(host + size - 1))
        st.add(host, size, emu::WriteRule::kInput, false, "");
      Range* rg = st.range_of(host);
      if (rg->name.empty()) rg->name = name.str();
    }
    Checker::Region r;
    r.storage.assign(size + 2 * kRedzone, 0xFF);
    r.copy = reinterpret_cast<uintptr_t>(r.storage.data()) + kRedzone;
    r.host = host;
    r.size = size;
    r.index = u.index;
    r.constant_space = u.constant_space;
    r.name = u.name;
    std::memcpy(reinterpret_cast<void*>(r.copy), buffers[u.index], size);
    c->regions.push_back(std::move(r));
  }
  // Cell pointers after every range is declared (declaring may merge ranges).
  for (Checker::Region& r : c->regions) {
    if (r.constant_space) continue;
    Range* rg = st.range_of(r.host);
    r.cells = rg->cells.data() + (r.host - rg->lo);
    r.rule = rg->rule;
    r.output = rg->output.empty() ? "'" + r.name + "'" : rg->output;
    buffers[r.index] = reinterpret_cast<void*>(r.copy);
  }
  for (Checker::Region& r : c->regions)
    if (r.constant_space) buffers[r.index] = reinterpret_cast<void*>(r.copy);
  return c.release();
}

std::string sanitize_end(Checker* c) {
  for (const Checker::Region& r : c->regions)
    if (!r.constant_space)
      std::memcpy(reinterpret_cast<void*>(r.host), reinterpret_cast<void*>(r.copy), r.size);
  return c->stop;
}

void destroy_checker(Checker* c) { delete c; }

void san_begin_group(Checker* c, const uint32_t gid[3], const void* arena, size_t arena_size) {
  c->arena = reinterpret_cast<uintptr_t>(arena);
  if (c->arena_size != arena_size) {
    c->arena_size = arena_size;
    c->tg.assign(arena_size, Cell{});
    c->tg_owner.assign(arena_size, -1);
  }
  // Allocations of the previous group: their bytes are owned by none until declared again.
  for (const Checker::TgAlloc& t : c->allocs)
    std::fill(c->tg_owner.begin() + long(t.offset), c->tg_owner.begin() + long(t.offset + t.size),
              int16_t(-1));
  c->allocs.clear();
  ++c->tg_gen;
  std::copy(gid, gid + 3, c->gid);
  c->group = (gid[2] * c->groups[1] + gid[1]) * c->groups[0] + gid[0];
  c->ep_tg = c->ep_dev = 0;
  std::fill(c->sgep_tg, c->sgep_tg + 32, 0u);
  std::fill(c->sgep_dev, c->sgep_dev + 32, 0u);
}

void san_alloc(Checker* c, size_t offset, size_t size, size_t element_size, const char* name,
               const char* file, int line) {
  std::fill(c->tg_owner.begin() + long(offset), c->tg_owner.begin() + long(offset + size),
            int16_t(c->allocs.size()));
  c->allocs.push_back(Checker::TgAlloc{offset, size, element_size ? element_size : 1, name, file,
                                       line});
}

void san_set_actor(Checker* c, int tid, int sg, int lane, const char* file, int line) {
  c->tid = int16_t(tid);
  c->sg = int16_t(sg);
  c->lane = int16_t(lane);
  c->site = 0;
  if (tid < 0) {
    auto& st = *c->st;
    const auto key = std::make_pair(file, line);
    auto it = st.site_index.find(key);
    if (it == st.site_index.end()) {
      it = st.site_index.emplace(key, uint32_t(st.sites.size())).first;
      st.sites.push_back(key);
    }
    c->site = kSiteBit | it->second;
  }
}

// MSL mem_flags bits (metal_shim.h): mem_device = 1, mem_threadgroup = 2.
void san_threadgroup_barrier(Checker* c, unsigned flags) {
  if (flags & 2u) {
    ++c->ep_tg;
  }
  if (flags & 1u) ++c->ep_dev;
}

void san_simdgroup_barrier(Checker* c, int sg, unsigned flags) {
  if (flags & 2u) ++c->sgep_tg[sg];
  if (flags & 1u) ++c->sgep_dev[sg];
}

void san_access(Checker* c, const void* p, uint64_t n, bool write, const void* pc) {
  c->access(reinterpret_cast<uintptr_t>(p), n, write, reinterpret_cast<uint64_t>(pc));
}

const char* san_stop(Checker* c) { return c->stop.empty() ? nullptr : c->stop.c_str(); }

}  // namespace rt
}  // namespace jfm
