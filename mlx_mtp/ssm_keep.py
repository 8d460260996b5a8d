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
``dt = clip(softplus(dt + dt_bias))`` as mlx-lm computes it.
"""

from functools import cache
from typing import Optional, Tuple

import mlx.core as mx
from mlx_lm.models.ssm import compute_dt

from .gated_delta import _source

Arrays3 = Tuple[mx.array, mx.array, mx.array]

# CUDA has no simd_sum builtin; this butterfly is its warp-wide equivalent.
_CUDA_HEADER = """
__device__ __forceinline__ float ssm_simd_sum(float x) {
  for (int offset = 16; offset > 0; offset /= 2) {
    x += __shfl_xor_sync(0xffffffff, x, offset);
  }
  return x;
}
"""

_INPUTS = ["X", "A_log", "B", "C", "D", "dt", "state_in"]
_OUTPUTS = ["out", "state_out", "inter"]


@cache
def _metal_kernel():
    if not mx.metal.is_available():
        return None
    return mx.fast.metal_kernel(
        name="ssm_keep",
        input_names=_INPUTS + ["T"],
        output_names=_OUTPUTS,
        source=_source("ssm_keep.metal"),
    )


@cache
def _cuda_kernel():
    if not (hasattr(mx, "cuda") and mx.cuda.is_available()):
        return None
    return mx.fast.cuda_kernel(
        name="ssm_keep",
        input_names=_INPUTS + ["n_tokens"],
        output_names=_OUTPUTS,
        source=_source("ssm_keep.cu"),
        header=_CUDA_HEADER,
    )


def _gpu_kernel():
    """The kernel for the default device, or None where there is none."""
    if mx.default_device() != mx.gpu:
        return None
    return _metal_kernel() if mx.metal.is_available() else _cuda_kernel()


def _run_kernel(kernel, x, A_log, B, C, D, dt, state) -> Arrays3:
    b, T, H, Dh = x.shape
    G, Ds = B.shape[2:]
    return kernel(
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
    if use_kernel and mask is None and Ds % 32 == 0:
        kernel = _gpu_kernel()
        if kernel is not None:
            return _run_kernel(kernel, hidden_states, A_log, B, C, D, dt, state)
    return ssm_keep_ops(hidden_states, A_log, B, C, D, dt, state, mask)
