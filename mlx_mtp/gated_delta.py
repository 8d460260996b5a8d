"""Gated delta net recurrence that keeps the state after every token.

A verify pass runs ``k + 1`` tokens through each gated-delta-net layer, then
keeps only the first ``a + 1``. Writing the state after every token into
``intermediates[:, t]`` lets the cache roll back by picking a slot, with no
recomputation (DESIGN.md section 6).

Three implementations of one op, all matching mlx-lm's ``gated_delta_ops``:
a pure-MLX reference (CPU and the fallback everywhere), a Metal kernel that is
mlx-lm's shipped kernel plus one output, and its CUDA twin. Like mlx-lm's op,
this one takes q and k already normalized and scaled (``normalize_qk``).
"""

import importlib.resources
from functools import cache
from pathlib import Path
from typing import Optional, Tuple, Union

import mlx.core as mx
from mlx_lm.models.gated_delta import compute_g, compute_lower_bound_g

Arrays3 = Tuple[mx.array, mx.array, mx.array]


def _source(name: str) -> str:
    # Installed, metal/ is the package mlx_mtp.metal; in a checkout it sits
    # beside mlx_mtp/.
    try:
        return importlib.resources.files("mlx_mtp.metal").joinpath(name).read_text()
    except (ImportError, OSError):
        return (Path(__file__).parent.parent / "metal" / name).read_text()


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


# CUDA has no simd_sum builtin; this butterfly is its warp-wide equivalent.
_CUDA_HEADER = """
__device__ __forceinline__ float gdn_simd_sum(float x) {
  for (int offset = 16; offset > 0; offset /= 2) {
    x += __shfl_xor_sync(0xffffffff, x, offset);
  }
  return x;
}
"""

_INPUTS = ["q", "k", "v", "g", "beta", "state_in"]
_OUTPUTS = ["y", "state_out", "inter"]


def _suffix(has_mask: bool, vectorized: bool) -> str:
    return ("_vec" if vectorized else "") + ("_mask" if has_mask else "")


@cache
def _metal_kernel(has_mask: bool, vectorized: bool):
    if not mx.metal.is_available():
        return None
    return mx.fast.metal_kernel(
        name="gated_delta_keep" + _suffix(has_mask, vectorized),
        input_names=_INPUTS + ["T"] + (["mask"] if has_mask else []),
        output_names=_OUTPUTS,
        source=_source("gated_delta_keep.metal"),
        header=_variant_header(has_mask, vectorized),
    )


def _cuda_available() -> bool:
    return hasattr(mx, "cuda") and mx.cuda.is_available()


@cache
def _cuda_kernel(has_mask: bool, vectorized: bool):
    if not _cuda_available():
        return None
    return mx.fast.cuda_kernel(
        name="gated_delta_keep" + _suffix(has_mask, vectorized),
        input_names=_INPUTS + ["n_tokens"] + (["mask"] if has_mask else []),
        output_names=_OUTPUTS,
        source=_source("gated_delta_keep.cu"),
        header=_CUDA_HEADER + _variant_header(has_mask, vectorized),
    )


def _gpu_kernel(has_mask: bool, vectorized: bool):
    """The kernel for the default device, or None where there is none."""
    if mx.default_device() != mx.gpu:
        return None
    if mx.metal.is_available():
        return _metal_kernel(has_mask, vectorized)
    return _cuda_kernel(has_mask, vectorized)


def _run_kernel(kernel, q, k, v, g, beta, state, mask) -> Arrays3:
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    inputs = [q, k, v, g, beta, state, T] + ([] if mask is None else [mask])
    return kernel(
        inputs=inputs,
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
    if use_kernel and Dk >= 32 and Dk % 32 == 0:
        kernel = _gpu_kernel(mask is not None, g.ndim == 4)
        if kernel is not None:
            return _run_kernel(kernel, q, k, v, g, beta, state, mask)
    return gated_delta_keep_ops(q, k, v, g, beta, state, mask)


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
