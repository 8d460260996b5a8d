"""Gated delta net recurrence that keeps the state after every token.

A verify pass runs ``k + 1`` tokens through each gated-delta-net layer, then
keeps only the first ``a + 1``. Writing the state after every token into
``intermediates[:, t]`` lets the cache roll back by picking a slot, with no
recomputation (docs/design.md section 6).

Three implementations of one op, all matching mlx-lm's ``gated_delta_ops``:
a pure-MLX reference (CPU and the fallback everywhere), a Metal kernel that is
mlx-lm's shipped kernel plus one output, and its CUDA twin. Like mlx-lm's op,
this one takes q and k already normalized and scaled (``normalize_qk``).
``kernel_spec`` and ``kernel_call`` give the kernel builder's and a call's
arguments: the dispatch and the CPU emulator in the tests share them. A
kernel is checked against the reference the first time a process uses it
(``kernels.py``).
"""

import sys
from functools import cache
from typing import Any, Dict, Optional, Tuple, Union

import mlx.core as mx
from mlx_lm.models.gated_delta import compute_g, compute_lower_bound_g

from . import kernels
from .kernels import gpu_backend as _backend
from .kernels import source as _source

Arrays3 = Tuple[mx.array, mx.array, mx.array]


def _variant_header(has_mask: bool, vectorized: bool) -> str:
    """Macros that pick the mask and gate layout inside the shared body."""
    keep = "mask[b_idx * T + t]" if has_mask else "true"
    if vectorized:  # g: [B, T, Hv, Dk]
        offset, gate, step = "((b_idx * T * Hv + hv_idx) * Dk)", "g_[s_idx]", "Hv * Dk"
    else:  # g: [B, T, Hv]
        offset, gate, step = "(b_idx * T * Hv)", "g_[hv_idx]", "Hv"
    return (
        f"#define GDN_KEEP(t) ({keep})\n#define GDN_G_OFFSET {offset}\n"
        f"#define GDN_G {gate}\n#define GDN_G_STEP {step}\n"
    )


_CUDA_HEADER = kernels.CUDA_SIMD_SUM.format(name="gdn_simd_sum")

_INPUTS = ["q", "k", "v", "g", "beta", "state_in"]
_OUTPUTS = ["y", "state_out", "inter"]


def kernel_spec(backend: str, has_mask: bool, vectorized: bool) -> Dict[str, Any]:
    """Arguments of ``mx.fast.metal_kernel`` (backend "metal") or
    ``mx.fast.cuda_kernel`` ("cuda") for one mask and gate variant."""
    suffix = ("_vec" if vectorized else "") + ("_mask" if has_mask else "")
    header = _variant_header(has_mask, vectorized)
    metal = backend == "metal"
    return dict(
        name="gated_delta_keep" + suffix,
        input_names=_INPUTS + ["T" if metal else "n_tokens"] + ["mask"] * has_mask,
        output_names=_OUTPUTS,
        source=_source("gated_delta_keep.metal" if metal else "gated_delta_keep.cu"),
        header=header if metal else _CUDA_HEADER + header,
    )


def kernel_call(q, k, v, g, beta, state, mask=None) -> Dict[str, Any]:
    """Keyword arguments of one kernel call, the same for both backends:
    inputs, template, grid and threadgroup (in threads: one SIMD group per
    state row), output shapes and dtypes."""
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    return dict(
        inputs=[q, k, v, g, beta, state, T] + ([] if mask is None else [mask]),
        template=[
            ("InT", q.dtype),
            ("StT", state.dtype),
            ("Dk", Dk),
            ("Dv", Dv),
            ("Hk", Hk),
            ("Hv", Hv),
        ],
        grid=(32, Dv, B * Hv),
        threadgroup=(32, 4, 1),
        output_shapes=[(B, T, Hv, Dv), state.shape, (B, T, Hv, Dv, Dk)],
        output_dtypes=[q.dtype, state.dtype, state.dtype],
    )


@cache
def _build_kernel(backend: str, has_mask: bool, vectorized: bool):
    build = mx.fast.metal_kernel if backend == "metal" else mx.fast.cuda_kernel
    return build(**kernel_spec(backend, has_mask, vectorized))


@mx.compile
def _step(q, k, v, g, beta, state):
    # Same order of operations as mlx-lm's _gated_delta_step_ops.
    decay = g[..., None, None] if g.ndim == 2 else g[..., None, :]
    state = state * decay
    kv_mem = (state * k[..., None, :]).sum(axis=-1)
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., None, :] * delta[..., None]
    y = (state * q[..., None, :]).sum(axis=-1)
    return y.astype(q.dtype), state


def gated_delta_keep_ops(q, k, v, g, beta, state, mask=None) -> Arrays3:
    """Pure-MLX reference: token by token, keeping every state.

    Like mlx-lm's ``gated_delta_ops``, a masked token still gets an output
    (the kernels write 0 there) but leaves the state unchanged.
    """
    if (repeat := v.shape[-2] // q.shape[-2]) > 1:
        q = mx.repeat(q, repeat, -2)
        k = mx.repeat(k, repeat, -2)
    ys, states = [], []
    for t in range(q.shape[1]):
        y, new_state = _step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        if mask is not None:
            new_state = mx.where(mask[:, t, None, None, None], new_state, state)
        state = new_state
        ys.append(y)
        states.append(state)
    return mx.stack(ys, axis=1), state, mx.stack(states, axis=1)


def gated_delta_keep(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: Optional[mx.array],
    mask: Optional[mx.array] = None,
    use_kernel: bool = True,
) -> Arrays3:
    """Gated delta rule over T tokens, also returning the state after each.

    Arguments as in mlx-lm's ``gated_delta_ops``: q, k ``[B, T, Hk, Dk]``
    (normalized and scaled by the caller), v ``[B, T, Hv, Dv]``, g
    ``[B, T, Hv]`` or ``[B, T, Hv, Dk]``, beta ``[B, T, Hv]``, state
    ``[B, Hv, Dv, Dk]`` or None for zeros, mask ``[B, T]`` bool.

    Returns ``(y, final_state, intermediates)`` where ``y`` is
    ``[B, T, Hv, Dv]`` and ``intermediates[:, t]`` (``[B, T, Hv, Dv, Dk]``)
    is the state after token ``t``; slot ``T - 1`` equals ``final_state``.
    Runs a Metal or CUDA kernel on a GPU and the pure-MLX reference
    elsewhere or with ``use_kernel=False``.
    """
    B, _, _, Dk = k.shape
    if state is None:
        state = mx.zeros((B, v.shape[2], v.shape[3], Dk), dtype=mx.float32)
    # Each of a SIMD group's 32 lanes holds Dk / 32 state floats.
    backend = _backend() if use_kernel and Dk >= 32 and Dk % 32 == 0 else None
    if backend is not None:
        variant = (backend, mask is not None, g.ndim == 4)
        if _kernel_trusted(variant, (q, k, v, g, beta, state, mask)):
            call = kernel_call(q, k, v, g, beta, state, mask)
            return tuple(_build_kernel(*variant)(**call))
    return gated_delta_keep_ops(q, k, v, g, beta, state, mask)


# Self-check on first use (see kernels.py): this process's verdicts.
_verdicts: Dict[tuple, bool] = {}
_warned = False


def _kernel_trusted(variant: tuple, args: tuple) -> bool:
    return kernels.kernel_trusted(sys.modules[__name__], variant, args)


def check_inputs(q, k, v, g, beta, state, mask=None):
    """Random inputs with the shapes and dtypes of the given ones, scaled as a
    model's (unit-norm keys, decays in (0.5, 1)); with a mask, sequence 0's
    first token is masked. Drawn from a fixed key: the global random state
    is left alone."""
    B, T, _, Dk = k.shape
    kq, kk, kv, kg, kb, ks = mx.random.split(mx.random.key(0), 6)
    q_ = mx.random.normal(q.shape, key=kq) * Dk**-0.5
    k_ = mx.random.normal(k.shape, key=kk)
    k_ = k_ / mx.linalg.norm(k_, axis=-1, keepdims=True)  # as normalize_qk does
    v_ = mx.random.normal(v.shape, key=kv)
    g_ = mx.random.uniform(0.5, 1.0, g.shape, key=kg)
    b_ = mx.random.uniform(0.0, 1.0, beta.shape, key=kb)
    s_ = 0.1 * mx.random.normal(state.shape, key=ks)
    like = (q, k, v, g, beta, state)
    out = [x.astype(a.dtype) for x, a in zip((q_, k_, v_, g_, b_, s_), like)]
    if mask is not None:
        start = mx.array([1 if T > 1 else 0] + [0] * (B - 1))
        mask = mx.arange(T)[None] >= start[:, None]
    return (*out, mask)


def kernel_disagreement(outputs, inputs, atol: float = 1e-4) -> Optional[str]:
    """None when kernel ``outputs`` (y, state, intermediates) match the
    reference run in float32 on ``inputs``, else what differs.

    A float32 output may differ by ``atol`` (sums of Dk products in another
    order, fused multiply-adds); a bfloat16 one also by its rounding, at most
    half a unit in the last place (2**-8 relative). y is compared where the
    mask keeps the token (the kernels write 0 elsewhere).
    """
    *arrays, mask = inputs
    want = gated_delta_keep_ops(*[a.astype(mx.float32) for a in arrays], mask)
    valid = 1 if mask is None else mask[..., None, None]
    names = ("y", "state", "intermediates")
    return kernels.disagreement(names, outputs, want, (valid, 1, 1), atol)


def gated_delta_update_keep(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state: Optional[mx.array] = None,
    mask: Optional[mx.array] = None,
    *,
    use_kernel: bool = True,
    lower_bound: Optional[float] = None,
    allow_neg_eigval: bool = False,
) -> Arrays3:
    """Drop-in for mlx-lm's ``gated_delta_update`` that also keeps states.

    Computes beta and g from ``a, b, A_log, dt_bias`` exactly as mlx-lm does;
    q and k come normalized (``normalize_qk``), as there.
    """
    beta = mx.sigmoid(b)
    if allow_neg_eigval:
        beta = beta * 2.0
    if lower_bound is None:
        g = compute_g(A_log, a, dt_bias)
    else:
        g = compute_lower_bound_g(A_log, a, dt_bias, lower_bound)
    return gated_delta_keep(q, k, v, g, beta, state, mask, use_kernel)


def select_state(intermediates: mx.array, index: Union[int, mx.array]) -> mx.array:
    """The state after token ``index``: an int, or one index per sequence."""
    if isinstance(index, int):
        return intermediates[:, index]
    index = index.reshape(-1, 1, 1, 1, 1).astype(mx.int32)
    return mx.take_along_axis(intermediates, index, axis=1).squeeze(1)
