// What the Metal Shading Language adds to C++, for the parts our kernels use.
// It stands where mx.fast.metal_kernel puts MLX's metal utilities (headers
// with <metal_stdlib>) before the generated kernel.
#pragma once

#include "emu.h"

// Address spaces: plain memory here. Threadgroup memory is shared between a
// threadgroup's threads, which a per-fiber variable would not be: refuse it.
#define device
#define constant
#define thread
#define threadgroup threadgroup_memory_is_not_emulated

using uint = unsigned int;
using ushort = unsigned short;
struct uint3 {
  uint x, y, z;
};
using bfloat = emu::BF16;
using bfloat16_t = emu::BF16;  // MLX's name for Metal's bfloat

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2 };

template <class T>
T simd_sum(T x, std::source_location s = std::source_location::current()) {
  return emu::arrive<T>(emu::Scope::simd, "simd_sum", s, emu::resolve_sum<T>,
                        x);
}

template <class T>
T simd_shuffle_xor(
    T x, ushort mask, std::source_location s = std::source_location::current()) {
  return emu::arrive<T>(emu::Scope::simd, "simd_shuffle_xor", s,
                        emu::resolve_shuffle<T, true>, x, 0, mask);
}

template <class T>
T simd_broadcast(
    T x, ushort lane, std::source_location s = std::source_location::current()) {
  return emu::arrive<T>(emu::Scope::simd, "simd_broadcast", s,
                        emu::resolve_shuffle<T, false>, x, 0, lane);
}

inline void threadgroup_barrier(
    mem_flags, std::source_location s = std::source_location::current()) {
  emu::arrive<int>(emu::Scope::block, "threadgroup_barrier", s,
                   emu::resolve_nothing, 0);
}

// metal::fast::exp trades accuracy for speed on a GPU (a few ulp); here it is
// the exact float exp, so the emulated kernel reads as the CUDA twin's expf.
namespace fast {
inline float exp(float x) { return std::exp(x); }
}  // namespace fast

namespace metal {
using ::simd_broadcast;
using ::simd_shuffle_xor;
using ::simd_sum;
using ::threadgroup_barrier;
namespace fast = ::fast;
}  // namespace metal

namespace emu {
// Values of the thread-position attributes MLX may pass (metal_kernel.cpp).
struct MetalIds {
  uint3 thread_position_in_grid, thread_position_in_threadgroup,
      threadgroup_position_in_grid, threads_per_threadgroup,
      dispatch_threads_per_threadgroup, threads_per_grid, grid_size,
      grid_origin, threadgroups_per_grid;
  uint thread_index_in_threadgroup, simdgroup_index_in_threadgroup,
      thread_index_in_simdgroup, simdgroups_per_threadgroup,
      dispatch_simdgroups_per_threadgroup, threads_per_simdgroup,
      thread_execution_width, quadgroup_index_in_threadgroup,
      thread_index_in_quadgroup, quadgroups_per_threadgroup,
      dispatch_quadgroups_per_threadgroup;
};

inline MetalIds metal_ids(const Thread& t) {
  const Launch& l = g.launch;
  auto u3 = [](Dim3 d) { return uint3{d.x, d.y, d.z}; };
  uint nominal = l.nominal.x * l.nominal.y * l.nominal.z;
  MetalIds m;
  m.thread_position_in_grid = {l.pos.x * l.nominal.x + t.local.x,
                               l.pos.y * l.nominal.y + t.local.y,
                               l.pos.z * l.nominal.z + t.local.z};
  m.thread_position_in_threadgroup = u3(t.local);
  m.threadgroup_position_in_grid = u3(l.pos);
  m.threads_per_threadgroup = u3(l.actual);
  m.dispatch_threads_per_threadgroup = u3(l.nominal);
  m.threads_per_grid = u3(l.grid);
  m.grid_size = u3(l.grid);
  m.grid_origin = {0, 0, 0};
  m.threadgroups_per_grid = u3(l.groups);
  m.thread_index_in_threadgroup = t.linear;
  m.simdgroup_index_in_threadgroup = t.group;
  m.thread_index_in_simdgroup = t.lane;
  m.simdgroups_per_threadgroup = ceil_div(l.n, kLanes);
  m.dispatch_simdgroups_per_threadgroup = ceil_div(nominal, kLanes);
  m.threads_per_simdgroup = kLanes;
  m.thread_execution_width = kLanes;
  m.quadgroup_index_in_threadgroup = t.linear / 4;
  m.thread_index_in_quadgroup = t.linear % 4;
  m.quadgroups_per_threadgroup = ceil_div(l.n, 4);
  m.dispatch_quadgroups_per_threadgroup = ceil_div(nominal, 4);
  return m;
}

inline void launch(void (*body)(Thread&), Dim3 grid, Dim3 tg) {
  launch_metal(body, grid, tg);
}
}  // namespace emu
