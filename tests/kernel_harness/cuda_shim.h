// What CUDA adds to C++, for the parts our kernels use. It stands where
// mx.fast.cuda_kernel's default header includes MLX's device utilities and
// <cooperative_groups.h>.
#pragma once

#include "emu.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __grid_constant__
#define __restrict__ __restrict
// Shared memory is shared between a block's threads, which a per-fiber
// variable would not be: refuse it.
#define __shared__ shared_memory_is_not_emulated

namespace cooperative_groups {}

using __nv_bfloat16 = emu::BF16;

namespace emu {
inline Dim3 cuda_thread_idx() {
  return cur().local;
}
inline Dim3 cuda_block_idx() {
  return g.launch.pos;
}
inline Dim3 cuda_block_dim() {
  return g.launch.nominal;
}
inline Dim3 cuda_grid_dim() {
  return g.launch.grid;
}
inline void launch(void (*body)(Thread&), Dim3 grid, Dim3 tg) {
  launch_cuda(body, grid, tg);
}
}  // namespace emu

#define threadIdx (::emu::cuda_thread_idx())
#define blockIdx (::emu::cuda_block_idx())
#define blockDim (::emu::cuda_block_dim())
#define gridDim (::emu::cuda_grid_dim())
constexpr int warpSize = emu::kLanes;

template <class T>
T __shfl_xor_sync(
    unsigned mask,
    T var,
    int lane_mask,
    int width = warpSize,
    std::source_location s = std::source_location::current()) {
  if (width != warpSize) {
    emu::fail("__shfl_xor_sync with width %d is not emulated", width);
  }
  return emu::arrive<T>(emu::Scope::warp, "__shfl_xor_sync", s,
                        emu::resolve_shuffle<T, true>, var, mask, lane_mask);
}

template <class T>
T __shfl_sync(
    unsigned mask,
    T var,
    int src_lane,
    int width = warpSize,
    std::source_location s = std::source_location::current()) {
  if (width != warpSize) {
    emu::fail("__shfl_sync with width %d is not emulated", width);
  }
  return emu::arrive<T>(emu::Scope::warp, "__shfl_sync", s,
                        emu::resolve_shuffle<T, false>, var, mask, src_lane);
}

inline void __syncwarp(
    unsigned mask = 0xffffffffu,
    std::source_location s = std::source_location::current()) {
  emu::arrive<int>(emu::Scope::warp, "__syncwarp", s, emu::resolve_nothing, 0,
                   mask);
}

inline void __syncthreads(
    std::source_location s = std::source_location::current()) {
  emu::arrive<int>(emu::Scope::block, "__syncthreads", s, emu::resolve_nothing,
                   0);
}
