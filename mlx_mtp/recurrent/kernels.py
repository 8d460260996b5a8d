"""What the keep-intermediates kernels share: sources, backend, first-use check.

Each op (``gated_delta.py``, ``ssm_keep.py``) has a pure-MLX reference, a Metal
kernel and its CUDA twin (``metal/``). Its module provides ``kernel_spec``
(the builder's arguments) and ``kernel_call`` (a call's), which the dispatch
and the CPU emulator in the tests share, and the seams this module reads from
it, so that a test can replace any of them on the module:

- ``_backend()``: "metal", "cuda" or None (``gpu_backend`` here);
- ``_build_kernel(*variant)``: the kernel of a variant, ``variant[0]`` the
  backend;
- ``check_inputs(*args)`` and ``kernel_disagreement(outputs, inputs)``:
  random inputs shaped as a call's, and what the kernel's outputs on them
  get wrong against the reference (None when nothing);
- ``_verdicts`` (a dict) and ``_warned`` (a bool): the process's verdicts.

The kernels are tested on the CPU through an emulator (tests/kernel_harness),
which cannot prove that a Metal compiler accepts them or that a GPU runs them
as emulated. So each kernel instance (variant, input shapes and dtypes) is
checked against the reference on random inputs the first time a process uses
it (``kernel_trusted``); one that fails or disagrees is replaced by the
reference, with one line on stderr per op.
"""

import importlib.resources
import sys
from pathlib import Path
from types import ModuleType
from typing import Optional, Sequence

import mlx.core as mx

# CUDA has no simd_sum builtin; this butterfly is its warp-wide equivalent.
CUDA_SIMD_SUM = """
__device__ __forceinline__ float {name}(float x) {{
  for (int offset = 16; offset > 0; offset /= 2) {{
    x += __shfl_xor_sync(0xffffffff, x, offset);
  }}
  return x;
}}
"""


def source(name: str) -> str:
    """The text of ``metal/<name>``."""
    # Installed, metal/ is the package mlx_mtp.metal; in a checkout it sits
    # beside mlx_mtp/.
    try:
        return importlib.resources.files("mlx_mtp.metal").joinpath(name).read_text()
    except (ImportError, OSError):
        return (Path(__file__).parents[2] / "metal" / name).read_text()


def gpu_backend() -> Optional[str]:
    """The GPU backend whose kernels the dispatch runs: "metal", "cuda" or None."""
    if mx.default_device() != mx.gpu:
        return None
    if mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return None


def kernel_trusted(op: ModuleType, variant: tuple, args: tuple) -> bool:
    """Whether ``op``'s kernel of ``variant`` passed its check for ``args``' shapes."""
    key = (variant, tuple((a.shape, a.dtype) for a in args if a is not None))
    if key not in op._verdicts:
        problem = self_check(op, variant, args)
        op._verdicts[key] = problem is None
        if problem is not None and not op._warned:
            op._warned = True
            name = op.kernel_spec(*variant)["name"]
            print(
                f"warning: mlx-mtp: the {variant[0]} kernel {name} {problem}; using "
                "the pure-MLX reference instead (slower). Please report this.",
                file=sys.stderr,
                flush=True,
            )
    return op._verdicts[key]


def self_check(op: ModuleType, variant: tuple, args: tuple) -> Optional[str]:
    """Run the kernel on random inputs shaped as ``args``; None when it agrees."""
    inputs = op.check_inputs(*args)
    try:
        outputs = op._build_kernel(*variant)(**op.kernel_call(*inputs))
        mx.eval(outputs)
    except Exception as e:  # a Metal compile error, a launch failure
        return f"failed ({(str(e).strip() or type(e).__name__).splitlines()[0]})"
    return op.kernel_disagreement(outputs, inputs)


def disagreement(
    names: Sequence[str],
    outputs: Sequence[mx.array],
    want: Sequence[mx.array],
    keep: Sequence,
    atol: float,
) -> Optional[str]:
    """None when every kernel output matches its float32 reference, else what differs.

    A float32 output may differ by ``atol`` (sums in another order, fused
    multiply-adds); a bfloat16 one also by its rounding, at most half a unit
    in the last place (2**-8 relative). ``keep`` weighs each output's error
    (1, or a mask where the kernels write 0 instead of a value).
    """
    for name, got, ref, k in zip(names, outputs, want, keep):
        rtol = 2.0**-8 if got.dtype == mx.bfloat16 else 0.0
        if got.shape != ref.shape:
            return f"gives {name} of shape {got.shape}, not {ref.shape}"
        err = mx.abs(got.astype(mx.float32) - ref) * k
        bound = atol + rtol * mx.abs(ref)
        if not mx.all(err <= bound).item():  # NaN fails too
            worst = mx.max(err).item()
            return f"disagrees with the reference (max |diff| in {name} {worst:.3g})"
    return None
