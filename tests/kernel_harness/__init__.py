"""Run mx.fast.metal_kernel / cuda_kernel bodies on the CPU (see emulator.py).

To emulate a kernel, give ``EmulatedKernel`` the backend and the builder's
keyword arguments, then call it with the kernel call's keyword arguments::

    kernel = EmulatedKernel("metal", **kernel_spec(...), workdir=tmp_path)
    outputs = kernel(**kernel_call(...))       # one call, one process
    many = kernel.run([kernel_call(...), ...])  # one binary for them all
"""

from .emulator import EmulatedKernel, KernelRunError, compiler_problem

__all__ = ["EmulatedKernel", "KernelRunError", "compiler_problem"]
