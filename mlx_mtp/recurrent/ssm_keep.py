"""Mamba2 SSM recurrence that keeps the state after every token.

A verify pass runs ``k + 1`` tokens through each Mamba2 layer, then keeps only
the first ``a + 1``; writing the state after token ``t`` into
``intermediates[:, t]`` lets the cache roll back by picking a slot.

Three implementations of one op, all matching mlx-lm's ``ssm_update``
(``mlx_lm/models/ssm.py``): a pure-MLX reference (CPU and the fallback
everywhere) with the arithmetic of mlx-lm's one-token kernel, that kernel
looped over the tokens with one more output (``metal/ssm_keep.metal``), and
its CUDA twin (``metal/ssm_keep.cu``). Per token the state is
``exp(dt A) state + (x dt) B`` and the output ``C . state + D x``, with
``dt = clip(softplus(dt + dt_bias))`` as mlx-lm computes it. ``kernel_spec``
and ``kernel_call`` give the kernel builder's and a call's arguments (shared
by the dispatch and the CPU emulator in the tests); a kernel is checked
against the reference the first time a process uses it (``kernels.py``).
"""

import sys
from functools import cache
from typing import Any, Dict, Optional, Tuple

import mlx.core as mx
from mlx_lm.models.ssm import compute_dt

from . import kernels
from .kernels import gpu_backend as _backend

Arrays3 = Tuple[mx.array, mx.array, mx.array]

_INPUTS = ["X", "A_log", "B", "C", "D", "dt", "state_in"]
_OUTPUTS = ["out", "state_out", "inter"]


def kernel_spec(backend: str) -> Dict[str, Any]:
    """Arguments of ``mx.fast.metal_kernel`` (backend "metal") or
    ``mx.fast.cuda_kernel`` ("cuda")."""
    metal = backend == "metal"
    return dict(
        name="ssm_keep",
        input_names=_INPUTS + ["T" if metal else "n_tokens"],
        output_names=_OUTPUTS,
        source=kernels.source("ssm_keep.metal" if metal else "ssm_keep.cu"),
        header="" if metal else kernels.CUDA_SIMD_SUM.format(name="ssm_simd_sum"),
    )


def kernel_call(x, A_log, B, C, D, dt, state) -> Dict[str, Any]:
    """Keyword arguments of one kernel call, the same for both backends:
    inputs, template, grid and threadgroup (in threads: one SIMD group per
    state row), output shapes and dtypes. ``dt`` is through ``compute_dt``."""
    b, T, H, Dh = x.shape
    G, Ds = B.shape[2:]
    return dict(
        inputs=[x, A_log, B, C, D, dt, state, T],
        template=[
            ("InT", x.dtype),
            ("StT", state.dtype),
            ("Dh", Dh),
            ("Ds", Ds),
            ("H", H),
            ("G", H // G),  # heads per group, as in mlx-lm's kernel
        ],
        grid=(32, Dh, b * H),
        threadgroup=(32, 8, 1),
        output_shapes=[x.shape, state.shape, (b, T, H, Dh, Ds)],
        output_dtypes=[x.dtype, state.dtype, state.dtype],
    )


@cache
def _build_kernel(backend: str):
    build = mx.fast.metal_kernel if backend == "metal" else mx.fast.cuda_kernel
    return build(**kernel_spec(backend))


@mx.compile
def _step(x, dt, dA, B, C, D, state):
    # The kernel's order of operations: state = dA * state + (x * dt) * B.
    state = dA[..., None, None] * state + (x * dt[..., None])[..., None] * B[:, :, None]
    y = (state * C[:, :, None]).sum(axis=-1) + x * D[:, None]
    return y, state


def ssm_keep_ops(x, A_log, B, C, D, dt, state, mask=None) -> Arrays3:
    """Pure-MLX reference, token by token; ``dt`` already through ``compute_dt``.

    A masked token (``mask`` false) leaves the state as it was.
    """
    H = x.shape[2]
    B = mx.repeat(B, H // B.shape[2], axis=2).astype(mx.float32)
    C = mx.repeat(C, H // C.shape[2], axis=2).astype(mx.float32)
    dA = mx.exp(dt * -mx.exp(A_log.astype(mx.float32)))
    xf, D = x.astype(mx.float32), D.astype(mx.float32)
    ys, states = [], []
    for t in range(x.shape[1]):
        y, new = _step(xf[:, t], dt[:, t], dA[:, t], B[:, t], C[:, t], D, state)
        new = new.astype(state.dtype)
        if mask is not None:
            new = mx.where(mask[:, t, None, None, None], new, state)
        state = new
        ys.append(y.astype(x.dtype))
        states.append(state)
    return mx.stack(ys, axis=1), state, mx.stack(states, axis=1)


def ssm_update_keep(
    hidden_states: mx.array,
    A_log: mx.array,
    B: mx.array,
    C: mx.array,
    D: mx.array,
    dt: mx.array,
    dt_bias: mx.array,
    state: Optional[mx.array] = None,
    time_step_limit: Tuple[float, float] = (0.001, 100.0),
    mask: Optional[mx.array] = None,
    use_kernel: bool = True,
) -> Arrays3:
    """Drop-in for mlx-lm's ``ssm_update`` that also keeps every state.

    Arguments as there: ``hidden_states`` ``[b, T, H, Dh]``, ``B``, ``C``
    ``[b, T, G, Ds]``, ``dt`` ``[b, T, H]`` (before softplus), ``state``
    ``[b, H, Dh, Ds]`` or None for zeros, ``mask`` ``[b, T]`` bool.

    Returns ``(y, final_state, intermediates)``: ``intermediates[:, t]``
    (``[b, T, H, Dh, Ds]``) is the state after token ``t``. Runs the Metal or
    CUDA kernel on a GPU (no mask, ``Ds`` a multiple of 32) and the reference
    elsewhere or with ``use_kernel=False``.
    """
    b, _, H, Dh = hidden_states.shape
    Ds = B.shape[-1]
    if state is None:
        state = mx.zeros((b, H, Dh, Ds), dtype=mx.float32)
    dt = compute_dt(dt, dt_bias, time_step_limit)
    args = (hidden_states, A_log, B, C, D, dt, state)
    # Each of a SIMD group's 32 lanes holds Ds / 32 state floats.
    backend = _backend() if use_kernel and mask is None and Ds % 32 == 0 else None
    if backend is not None and _kernel_trusted((backend,), args):
        return tuple(_build_kernel(backend)(**kernel_call(*args)))
    return ssm_keep_ops(*args, mask)


# Self-check on first use (see kernels.py): this process's verdicts.
_verdicts: Dict[tuple, bool] = {}
_warned = False


def _kernel_trusted(variant: tuple, args: tuple) -> bool:
    return kernels.kernel_trusted(sys.modules[__name__], variant, args)


def check_inputs(x, A_log, B, C, D, dt, state):
    """Random inputs with the shapes and dtypes of the given ones, scaled as a
    model's (``dt`` after softplus, decays ``exp(dt A)`` in (0, 1)). Drawn
    from a fixed key: the global random state is left alone."""
    keys = mx.random.split(mx.random.key(0), 7)
    x_ = mx.random.normal(x.shape, key=keys[0])
    a_ = mx.log(mx.random.uniform(0.5, 4.0, A_log.shape, key=keys[1]))
    b_ = 0.5 * mx.random.normal(B.shape, key=keys[2])
    c_ = 0.5 * mx.random.normal(C.shape, key=keys[3])
    d_ = mx.random.normal(D.shape, key=keys[4])
    dt_ = mx.random.uniform(0.01, 1.0, dt.shape, key=keys[5])
    s_ = 0.3 * mx.random.normal(state.shape, key=keys[6])
    like = (x, A_log, B, C, D, dt, state)
    return tuple(r.astype(a.dtype) for r, a in zip((x_, a_, b_, c_, d_, dt_, s_), like))


def kernel_disagreement(outputs, inputs, atol: float = 1e-4) -> Optional[str]:
    """None when kernel ``outputs`` (y, state, intermediates) match the
    reference run in float32 on ``inputs``, else what differs (tolerances as
    in ``kernels.disagreement``)."""
    want = ssm_keep_ops(*[a.astype(mx.float32) for a in inputs])
    names = ("y", "state", "intermediates")
    return kernels.disagreement(names, outputs, want, (1, 1, 1), atol)
