"""gated_delta_keep against mlx-lm's gated delta ops, and its kernels against it."""

import mlx.core as mx
import pytest
from mlx_lm.models.gated_delta import gated_delta_ops, gated_delta_update

from mlx_mtp.recurrent.gated_delta import (
    _backend,
    _build_kernel,
    _source,
    gated_delta_keep,
    gated_delta_update_keep,
    kernel_call,
    select_state,
)

# float32 sums of Dk products in another order: a few ulps of values near 1.
ATOL = 1e-5

# (B, T, Hk, Hv, Dk, Dv): non-GQA and GQA, Dk a multiple of 32 as the kernels need.
SHAPES = [(1, 5, 2, 2, 32, 16), (2, 4, 2, 4, 64, 8)]


def make_inputs(B, T, Hk, Hv, Dk, Dv, vectorized=False, masked=False, seed=0):
    mx.random.seed(seed)
    q, k = mx.random.normal((2, B, T, Hk, Dk))
    # Unit-norm keys keep the recurrence stable, as normalize_qk does.
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    q = q * Dk**-0.5
    v = mx.random.normal((B, T, Hv, Dv))
    g_shape = (B, T, Hv, Dk) if vectorized else (B, T, Hv)
    g = mx.random.uniform(0.5, 1.0, g_shape)
    beta = mx.random.uniform(0.0, 1.0, (B, T, Hv))
    state = 0.1 * mx.random.normal((B, Hv, Dv, Dk))
    mask = None
    if masked:  # left padding: sequence 0 starts at token 2
        mask = mx.arange(T)[None] >= mx.array([2] + [0] * (B - 1))[:, None]
    return q, k, v, g, beta, state, mask


def close(a, b):
    return mx.allclose(a, b, atol=ATOL, rtol=0).item()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("vectorized", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_reference_matches_mlx_lm_ops(shape, vectorized, masked):
    args = make_inputs(*shape, vectorized=vectorized, masked=masked)
    y, state, inter = gated_delta_keep(*args, use_kernel=False)
    y_ref, state_ref = gated_delta_ops(*args)
    assert close(y, y_ref) and close(state, state_ref)
    assert inter.shape == (*y.shape, shape[4])
    assert mx.array_equal(inter[:, -1], state)


@pytest.mark.parametrize("shape", SHAPES)
def test_intermediate_t_is_state_of_prefix(shape):
    q, k, v, g, beta, state, mask = make_inputs(*shape, masked=True)
    _, _, inter = gated_delta_keep(q, k, v, g, beta, state, mask, use_kernel=False)
    for t in range(q.shape[1]):
        p = slice(0, t + 1)
        _, prefix = gated_delta_ops(
            q[:, p], k[:, p], v[:, p], g[:, p], beta[:, p], state, mask[:, p]
        )
        assert close(inter[:, t], prefix), t
        assert close(select_state(inter, t), prefix)


def test_select_state_per_sequence():
    _, _, inter = gated_delta_keep(*make_inputs(*SHAPES[1]), use_kernel=False)
    picked = select_state(inter, mx.array([3, 1]))
    assert mx.array_equal(picked[0], inter[0, 3])
    assert mx.array_equal(picked[1], inter[1, 1])


def test_update_keep_swaps_for_mlx_lm_update():
    # Same call as GatedDeltaNet makes, with mlx-lm's own dispatch on both sides.
    q, k, v, _, _, state, mask = make_inputs(*SHAPES[1], masked=True)
    B, T, Hv = v.shape[:3]
    a, b = mx.random.normal((2, B, T, Hv))
    A_log, dt_bias = mx.random.normal((2, Hv))
    args = (q, k, v, a, b, A_log, dt_bias, state, mask)
    y, state_keep, inter = gated_delta_update_keep(*args)
    y_ref, state_ref = gated_delta_update(*args)
    valid = mask[..., None, None]  # the kernels write 0 at masked tokens
    assert close(y * valid, y_ref * valid) and close(state_keep, state_ref)
    assert close(inter[:, -1], state_ref)


def test_no_state_starts_from_zeros():
    q, k, v, g, beta, _, _ = make_inputs(*SHAPES[0])
    y, state, _ = gated_delta_keep(q, k, v, g, beta, None)
    y_ref, state_ref = gated_delta_ops(q, k, v, g, beta)
    assert close(y, y_ref) and close(state, state_ref)


def test_kernel_sources_are_found():
    # CPU runs never build the kernels; this catches a missing package data file.
    for name in ("gated_delta_keep.metal", "gated_delta_keep.cu"):
        assert "o_inter[s_idx] = static_cast<StT>(state[i]);" in _source(name)


def kernel_matches_reference():
    # The kernel itself (not through the self-check, which would fall back to
    # the reference) on every variant, a Qwen3-Next-like head size too.
    shapes = SHAPES + [(1, 4, 2, 4, 128, 128)]
    with mx.stream(mx.gpu):
        backend = _backend()
    assert backend is not None
    for shape in shapes:
        for vectorized in (False, True):
            for masked in (False, True):
                args = make_inputs(*shape, vectorized=vectorized, masked=masked)
                mask = args[-1]
                kernel = _build_kernel(backend, masked, vectorized)
                with mx.stream(mx.gpu):
                    y, state, inter = kernel(**kernel_call(*args))
                y_ref, state_ref, inter_ref = gated_delta_keep(*args, use_kernel=False)
                valid = 1 if mask is None else mask[..., None, None]
                assert close(y * valid, y_ref * valid), (shape, vectorized, masked)
                assert close(state, state_ref) and close(inter, inter_ref)
                assert mx.array_equal(inter[:, -1], state)


@pytest.mark.skipif(not mx.metal.is_available(), reason="needs Metal (Apple GPU)")
def test_metal_kernel_matches_reference():
    kernel_matches_reference()


@pytest.mark.skipif(
    not (hasattr(mx, "cuda") and mx.cuda.is_available()),
    reason="needs MLX's CUDA backend and an NVIDIA GPU",
)
def test_cuda_kernel_matches_reference():
    kernel_matches_reference()
