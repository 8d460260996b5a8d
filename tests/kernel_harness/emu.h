// Runtime of the kernel emulator: GPU threads as fibers on one CPU thread.
//
// A launch runs one threadgroup (Metal) or block (CUDA) at a time. Each of its
// threads is a fiber with its own stack that runs the kernel body
// until it returns or calls a collective (simd_sum, __shfl_xor_sync,
// __syncwarp, a barrier). A collective parks the fiber; once every fiber of
// the block is parked or done, the scheduler completes each collective whose
// participants have all arrived, then resumes them. A collective some of whose
// participants can never arrive (they returned, or wait elsewhere) aborts the
// run with a message naming the lanes and the source line: on a GPU that is a
// hang, undefined behaviour or a silently partial reduction.
#pragma once

#if defined(__APPLE__)
#define _XOPEN_SOURCE 700  // ucontext
#endif

#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <source_location>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
#endif

#ifndef MAP_NORESERVE
#define MAP_NORESERVE 0
#endif

namespace emu {

[[noreturn]] inline void fail(const char* fmt, ...) {
  std::va_list args;
  va_start(args, fmt);
  std::fputs("kernel emulator: ", stderr);
  std::vfprintf(stderr, fmt, args);
  std::fputc('\n', stderr);
  va_end(args);
  std::exit(3);
}

struct Dim3 {
  uint32_t x, y, z;
};

// bfloat16 (Metal `bfloat`, CUDA `__nv_bfloat16`): float's upper 16 bits.
// float -> bf16 rounds to nearest, ties to even, as Metal's conversion and
// CUDA's __float2bfloat16 do; NaN stays a (quiet) NaN.
struct BF16 {
  uint16_t bits;
  BF16() = default;
  BF16(float f) : bits(from_float(f)) {}
  operator float() const {
    return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
  }
  static uint16_t from_float(float f) {
    uint32_t u = std::bit_cast<uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      return static_cast<uint16_t>((u >> 16) | 0x40u);
    }
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
};

enum class Scope { none, simd, warp, block };

struct Thread;
// Completes one collective: reads the participants' `value`s, writes `result`s.
using Resolver = void (*)(Thread** lanes, int n);

constexpr int kLanes = 32;  // Apple SIMD-group width and NVIDIA warp size
constexpr size_t kStack = 128 * 1024;
constexpr uint32_t kMaxThreads = 1024;

// Switching between fibers: a few instructions on x86-64; ucontext elsewhere
// (slower: a system call per switch, and ASan's swapcontext interceptor
// clears the shadow of the whole stack each time).
#if defined(__x86_64__) && !defined(EMU_UCONTEXT)
extern "C" void emu_switch(void** save_sp, void* load_sp);
asm(R"(
.text
.globl emu_switch
.type emu_switch,@function
emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size emu_switch, .-emu_switch
)");

struct Context {
  void* sp;
};

// A fresh stack whose first switch "returns" into entry, aligned as a call.
inline void make_context(Context& c, char* stack, size_t size, void (*entry)()) {
  auto top = reinterpret_cast<uintptr_t>(stack + size) & ~uintptr_t(15);
  auto* p = reinterpret_cast<uint64_t*>(top);
  *--p = 0;  // entry's return address: it never returns
  *--p = reinterpret_cast<uint64_t>(entry);
  for (int i = 0; i < 6; ++i) {
    *--p = 0;  // rbp, rbx, r12-r15
  }
  *--p = 0x1f80ull | (0x037full << 32);  // default MXCSR and x87 control word
  c.sp = p;
}

inline void swap_context(Context& save, Context& load) {
  emu_switch(&save.sp, load.sp);
}
#else
struct Context {
  ucontext_t uc;
};

inline void make_context(Context& c, char* stack, size_t size, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = size;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}

inline void swap_context(Context& save, Context& load) {
  swapcontext(&save.uc, &load.uc);
}
#endif

struct Thread {
  Context ctx;
  char* stack;
  void* fake_stack;
  Dim3 local;       // position in the threadgroup / block
  uint32_t linear;  // x + y * dx + z * dx * dy
  uint32_t group;   // SIMD group / warp in the threadgroup
  uint32_t lane;
  bool live, waiting;
  // The collective this thread waits at.
  Scope scope;
  const char* op;
  std::source_location site;
  uint32_t mask;
  int arg;
  Resolver resolve;
  alignas(16) unsigned char value[16];
  alignas(16) unsigned char result[16];
};

enum class Backend { metal, cuda };

struct Launch {
  Backend backend;
  Dim3 grid;     // Metal: threads; CUDA: blocks
  Dim3 nominal;  // threadgroup size asked for / block size
  Dim3 pos;      // this threadgroup's / block's position
  Dim3 actual;   // Metal trims the last threadgroup; CUDA blocks are whole
  Dim3 groups;   // threadgroups / blocks per grid
  uint32_t n;    // threads in this block
};

struct State {
  Launch launch;
  std::vector<Thread> threads;
  Thread* cur = nullptr;
  void (*body)(Thread&) = nullptr;
  Context sched;
  void* sched_fake_stack = nullptr;
  const void* sched_bottom = nullptr;
  size_t sched_size = 0;
};

inline State g;

inline Thread& cur() {
  return *g.cur;
}

inline void to_scheduler(bool dying) {
  Thread& t = cur();
#ifdef EMU_ASAN
  __sanitizer_start_switch_fiber(
      dying ? nullptr : &t.fake_stack, g.sched_bottom, g.sched_size);
#else
  (void)dying;
#endif
  swap_context(t.ctx, g.sched);
#ifdef EMU_ASAN
  __sanitizer_finish_switch_fiber(t.fake_stack, nullptr, nullptr);
#endif
}

inline void fiber_entry() {
#ifdef EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &g.sched_bottom, &g.sched_size);
#endif
  Thread& t = cur();
  g.body(t);
  t.live = false;
  to_scheduler(true);
  fail("a finished fiber was resumed");
}

inline void run_fiber(Thread& t) {
  g.cur = &t;
#ifdef EMU_ASAN
  __sanitizer_start_switch_fiber(&g.sched_fake_stack, t.stack, kStack);
#endif
  swap_context(g.sched, t.ctx);
#ifdef EMU_ASAN
  __sanitizer_finish_switch_fiber(g.sched_fake_stack, nullptr, nullptr);
#endif
  g.cur = nullptr;
}

// Parks the calling thread at a collective; returns once it is complete.
template <class T>
T arrive(
    Scope scope,
    const char* op,
    const std::source_location& site,
    Resolver resolve,
    T value,
    uint32_t mask = 0,
    int arg = 0) {
  static_assert(sizeof(T) <= 16);
  Thread& t = cur();
  t.scope = scope;
  t.op = op;
  t.site = site;
  t.resolve = resolve;
  t.mask = mask;
  t.arg = arg;
  std::memcpy(t.value, &value, sizeof(T));
  t.waiting = true;
  to_scheduler(false);
  T out;
  std::memcpy(&out, t.result, sizeof(T));
  return out;
}

template <class T>
T value_of(const Thread* t) {
  T v;
  std::memcpy(&v, t->value, sizeof(T));
  return v;
}

template <class T>
void set_result(Thread* t, T v) {
  std::memcpy(t->result, &v, sizeof(T));
}

inline std::string where(const Thread& t) {
  return std::string(t.op) + " at line " + std::to_string(t.site.line()) +
      ":" + std::to_string(t.site.column());
}

inline bool same_site(const Thread& a, const Thread& b) {
  return a.op == b.op && a.site.line() == b.site.line() &&
      a.site.column() == b.site.column();
}

inline std::string block_name() {
  auto& l = g.launch;
  return std::string(l.backend == Backend::metal ? "threadgroup" : "block") +
      " (" + std::to_string(l.pos.x) + "," + std::to_string(l.pos.y) + "," +
      std::to_string(l.pos.z) + ")";
}

// Metal SIMD-group functions: every live lane of the group at the same call.
// Stricter than Metal, which reduces over whichever lanes are active: a lane
// that returned or branched away before the call is reported, not skipped.
inline bool resolve_simd(Thread** lanes, int n) {
  Thread* first = nullptr;
  int waiting = 0, done = 0;
  for (int i = 0; i < n; ++i) {
    if (!lanes[i]->live) {
      done++;
    } else if (lanes[i]->waiting && lanes[i]->scope == Scope::simd) {
      if (first && !same_site(*first, *lanes[i])) {
        fail("%s, SIMD group %u: lanes diverge: lane %u waits at %s, lane %u "
             "at %s",
             block_name().c_str(), first->group, first->lane,
             where(*first).c_str(), lanes[i]->lane, where(*lanes[i]).c_str());
      }
      first = first ? first : lanes[i];
      waiting++;
    }
  }
  if (!first) {
    return false;
  }
  if (done > 0) {
    fail("%s, SIMD group %u: %d lane(s) returned while %d wait at %s",
         block_name().c_str(), first->group, done, waiting,
         where(*first).c_str());
  }
  if (waiting != n) {
    return false;  // the others wait at a barrier: a deadlock, reported later
  }
  std::vector<Thread*> ordered(lanes, lanes + n);
  first->resolve(ordered.data(), n);
  for (int i = 0; i < n; ++i) {
    lanes[i]->waiting = false;
  }
  return true;
}

// CUDA *_sync warp functions: every lane named in the mask at the same
// intrinsic with the same mask (CUDA's rule; the call sites may differ).
inline bool resolve_warp(Thread** lanes, int n) {
  for (int i = 0; i < n; ++i) {
    Thread* t = lanes[i];
    if (!(t->live && t->waiting && t->scope == Scope::warp)) {
      continue;
    }
    std::vector<Thread*> members;
    for (int j = 0; j < kLanes; ++j) {
      if (!(t->mask >> j & 1u)) {
        continue;
      }
      if (j >= n) {
        fail("%s, warp %u: lane %u's %s names lane %d, which does not exist "
             "(a partial warp)",
             block_name().c_str(), t->group, t->lane, where(*t).c_str(), j);
      }
      Thread* m = lanes[j];
      if (!m->live) {
        fail("%s, warp %u: lane %u waits at %s with mask 0x%08x but lane %d "
             "has returned",
             block_name().c_str(), t->group, t->lane, where(*t).c_str(),
             t->mask, j);
      }
      if (!(m->waiting && m->scope == Scope::warp && m->op == t->op &&
            m->mask == t->mask)) {
        members.clear();
        break;
      }
      members.push_back(m);
    }
    if (members.empty()) {
      continue;
    }
    t->resolve(members.data(), static_cast<int>(members.size()));
    for (Thread* m : members) {
      m->waiting = false;
    }
    return true;
  }
  return false;
}

// threadgroup_barrier / __syncthreads: every live thread of the block.
inline bool resolve_block() {
  Thread* first = nullptr;
  int done = 0;
  for (auto& t : g.threads) {
    if (!t.live) {
      done++;
      continue;
    }
    if (!(t.waiting && t.scope == Scope::block)) {
      return false;
    }
    if (first && g.launch.backend == Backend::metal && !same_site(*first, t)) {
      fail("%s: threads wait at different barriers (%s, %s)",
           block_name().c_str(), where(*first).c_str(), where(t).c_str());
    }
    first = first ? first : &t;
  }
  if (!first) {
    return false;
  }
  if (done > 0) {
    fail("%s: %d thread(s) returned while the others wait at %s",
         block_name().c_str(), done, where(*first).c_str());
  }
  for (auto& t : g.threads) {
    t.waiting = false;
  }
  return true;
}

inline void run_block() {
  const uint32_t n = g.launch.n;
  if (n > kMaxThreads) {
    fail("%u threads in a threadgroup/block, more than %u", n, kMaxThreads);
  }
  if (g.threads.size() < n) {
    size_t old = g.threads.size();
    g.threads.resize(n);
    for (size_t i = old; i < n; ++i) {
      void* s = mmap(nullptr, kStack, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (s == MAP_FAILED) {
        fail("cannot map a fiber stack");
      }
      g.threads[i].stack = static_cast<char*>(s);
    }
  }
  const Dim3 d = g.launch.actual;
  for (uint32_t i = 0; i < n; ++i) {
    Thread& t = g.threads[i];
    t.local = {i % d.x, (i / d.x) % d.y, i / (d.x * d.y)};
    t.linear = i;
    t.group = i / kLanes;
    t.lane = i % kLanes;
    t.live = true;
    t.waiting = false;
    t.scope = Scope::none;
    t.fake_stack = nullptr;
    make_context(t.ctx, t.stack, kStack, fiber_entry);
  }
  std::vector<Thread*> lanes(kLanes);
  for (;;) {
    bool any_live = false;
    for (uint32_t i = 0; i < n; ++i) {
      Thread& t = g.threads[i];
      if (t.live && !t.waiting) {
        run_fiber(t);
      }
      any_live = any_live || t.live;
    }
    if (!any_live) {
      return;
    }
    bool progress = false;
    for (uint32_t first = 0; first < n; first += kLanes) {
      int m = static_cast<int>(std::min<uint32_t>(kLanes, n - first));
      for (int j = 0; j < m; ++j) {
        lanes[j] = &g.threads[first + j];
      }
      if (g.launch.backend == Backend::metal) {
        progress = resolve_simd(lanes.data(), m) || progress;
      } else {
        while (resolve_warp(lanes.data(), m)) {
          progress = true;
        }
      }
    }
    if (!progress) {
      progress = resolve_block();
    }
    if (!progress) {
      for (uint32_t i = 0; i < n; ++i) {
        Thread& t = g.threads[i];
        if (t.live) {
          fail("%s: deadlock: thread %u (SIMD group/warp %u, lane %u) waits "
               "at %s and nothing can complete it",
               block_name().c_str(), i, t.group, t.lane, where(t).c_str());
        }
      }
    }
  }
}

inline uint32_t ceil_div(uint32_t a, uint32_t b) {
  return (a + b - 1) / b;
}

// mx.fast.metal_kernel: dispatchThreads(grid, min(threadgroup, grid)); Metal
// runs ceil(grid / group) threadgroups and trims the last one in each
// dimension to the grid.
inline void launch_metal(void (*body)(Thread&), Dim3 grid, Dim3 tg) {
  Launch& l = g.launch;
  l.backend = Backend::metal;
  l.grid = grid;
  l.nominal = {std::min(tg.x, grid.x), std::min(tg.y, grid.y),
               std::min(tg.z, grid.z)};
  if (l.nominal.x * l.nominal.y * l.nominal.z > kMaxThreads) {
    fail("threadgroup of %u threads, more than %u",
         l.nominal.x * l.nominal.y * l.nominal.z, kMaxThreads);
  }
  l.groups = {ceil_div(grid.x, l.nominal.x), ceil_div(grid.y, l.nominal.y),
              ceil_div(grid.z, l.nominal.z)};
  g.body = body;
  for (uint32_t z = 0; z < l.groups.z; ++z)
    for (uint32_t y = 0; y < l.groups.y; ++y)
      for (uint32_t x = 0; x < l.groups.x; ++x) {
        l.pos = {x, y, z};
        l.actual = {std::min(l.nominal.x, grid.x - x * l.nominal.x),
                    std::min(l.nominal.y, grid.y - y * l.nominal.y),
                    std::min(l.nominal.z, grid.z - z * l.nominal.z)};
        l.n = l.actual.x * l.actual.y * l.actual.z;
        run_block();
      }
}

// mx.fast.cuda_kernel: block = min(threadgroup, grid), and
// ceil(grid / threadgroup) whole blocks, so threads past the grid run too.
inline void launch_cuda(void (*body)(Thread&), Dim3 grid, Dim3 tg) {
  Launch& l = g.launch;
  l.backend = Backend::cuda;
  l.nominal = {std::min(tg.x, grid.x), std::min(tg.y, grid.y),
               std::min(tg.z, grid.z)};
  l.grid = {ceil_div(grid.x, tg.x), ceil_div(grid.y, tg.y),
            ceil_div(grid.z, tg.z)};
  l.groups = l.grid;
  if (l.nominal.x * l.nominal.y * l.nominal.z > kMaxThreads) {
    fail("block of %u threads, more than %u",
         l.nominal.x * l.nominal.y * l.nominal.z, kMaxThreads);
  }
  g.body = body;
  l.actual = l.nominal;
  l.n = l.actual.x * l.actual.y * l.actual.z;
  for (uint32_t z = 0; z < l.grid.z; ++z)
    for (uint32_t y = 0; y < l.grid.y; ++y)
      for (uint32_t x = 0; x < l.grid.x; ++x) {
        l.pos = {x, y, z};
        run_block();
      }
}

// Butterfly sum over the participating lanes (absent lanes add nothing).
// Every lane gets the same value; the real hardware's order is unspecified.
template <class T>
void resolve_sum(Thread** lanes, int n) {
  T v[kLanes];
  bool has[kLanes] = {};
  for (int i = 0; i < n; ++i) {
    v[lanes[i]->lane] = value_of<T>(lanes[i]);
    has[lanes[i]->lane] = true;
  }
  for (int off = kLanes / 2; off > 0; off /= 2) {
    T next[kLanes];
    bool next_has[kLanes];
    for (int i = 0; i < kLanes; ++i) {
      int j = i ^ off;
      next_has[i] = has[i] || has[j];
      next[i] = has[i] && has[j] ? (i < j ? v[i] + v[j] : v[j] + v[i])
                                 : (has[i] ? v[i] : v[j]);
    }
    std::memcpy(v, next, sizeof(v));
    std::memcpy(has, next_has, sizeof(has));
  }
  for (int i = 0; i < n; ++i) {
    set_result<T>(lanes[i], v[lanes[i]->lane]);
  }
}

// Lane i gets the value of lane (i ^ arg) (xor) or lane arg (broadcast).
template <class T, bool Xor>
void resolve_shuffle(Thread** lanes, int n) {
  Thread* by_lane[kLanes] = {};
  for (int i = 0; i < n; ++i) {
    by_lane[lanes[i]->lane] = lanes[i];
  }
  for (int i = 0; i < n; ++i) {
    Thread* t = lanes[i];
    int src = Xor ? static_cast<int>(t->lane) ^ t->arg : t->arg;
    if (src < 0 || src >= kLanes || !by_lane[src]) {
      fail("%s: lane %u reads lane %d, which does not take part",
           where(*t).c_str(), t->lane, src);
    }
    set_result<T>(t, value_of<T>(by_lane[src]));
  }
}

inline void resolve_nothing(Thread**, int) {}

}  // namespace emu
