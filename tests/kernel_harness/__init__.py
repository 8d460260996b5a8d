"""Run mx.fast.metal_kernel / cuda_kernel bodies on the CPU (see emulator.py).

To emulate a kernel, give ``EmulatedKernel`` the backend and the keyword
arguments of MLX's builder, then call it as MLX's kernel object is called::

    kernel = EmulatedKernel("metal", **kernel_spec(...), workdir=tmp_path)
    outputs = kernel(**kernel_call(...))       # one call, one process
    many = kernel.run([kernel_call(...), ...])  # one binary for them all

so a new kernel plugs in with the two functions its dispatch already needs:
one returning the builder's arguments (name, input and output names, body,
header), one returning a call's (inputs, template, grid, threadgroup, output
shapes and dtypes); see ``mlx_mtp.recurrent.gated_delta.kernel_spec`` / ``kernel_call``
and tests/test_kernel_emulated.py.

Emulated: float32, bfloat16, bool, int32 and uint32 arrays and scalars; the
thread-position attributes; Metal's simd_sum, simd_shuffle_xor,
simd_broadcast, threadgroup_barrier and fast::exp (as the exact exp); CUDA's threadIdx/blockIdx/blockDim/
gridDim, __shfl_xor_sync, __shfl_sync, __syncwarp and __syncthreads. Not
emulated (refused with a clear error): threadgroup / __shared__ memory,
atomic outputs, ``*_shape``/``*_strides``/``*_ndim`` arguments, headers with
#include. Extend the shims (metal_shim.h, cuda_shim.h) as kernels need more.
"""

from .emulator import EmulatedKernel, KernelRunError, compiler_problem

__all__ = ["EmulatedKernel", "KernelRunError", "compiler_problem"]
