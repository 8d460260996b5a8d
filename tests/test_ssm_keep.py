"""ssm_update_keep against mlx-lm's Mamba2 ssm_update, and its kernels against it."""

import mlx.core as mx
import pytest
from mlx_lm.models.ssm import ssm_update

from mlx_mtp.recurrent.kernels import source
from mlx_mtp.recurrent.ssm_keep import _backend, ssm_update_keep

# float32 sums of Ds products in another order (mlx-lm's chunked path is
# matmuls): a few ulps of values near 1.
ATOL = 2e-5
# mlx-lm's matmul-based SSM path on a CUDA GPU runs reduced-precision matmuls
# (measured there: up to 5e-4 off on values near 1).
LOOSE = 2e-3
LIMIT = (0.0, float("inf"))  # nemotron_h's default time_step_limit

# (b, T, H, Dh, G, Ds): one group and grouped heads, Ds a multiple of 32.
SHAPES = [(1, 5, 2, 8, 1, 32), (2, 4, 4, 16, 2, 64)]


def make_inputs(b, T, H, Dh, G, Ds, seed=0):
    mx.random.seed(seed)
    x = mx.random.normal((b, T, H, Dh))
    B, C = 0.5 * mx.random.normal((2, b, T, G, Ds))
    D = mx.random.normal((H,))
    dt = mx.random.normal((b, T, H))
    A_log = mx.log(mx.random.uniform(0.5, 4.0, (H,)))
    dt_bias = mx.random.normal((H,))
    state = 0.3 * mx.random.normal((b, H, Dh, Ds))
    return x, A_log, B, C, D, dt, dt_bias, state


def close(a, b, tol=ATOL):
    return mx.allclose(a, b, atol=tol, rtol=tol).item()


@pytest.fixture
def cpu():
    """The reference against mlx-lm's own ops: exact arithmetic, so on the CPU."""
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(device)


@pytest.mark.parametrize("shape", SHAPES)
def test_each_state_and_output_match_mlx_lm_token_by_token(shape, cpu):
    x, A_log, B, C, D, dt, dt_bias, state = make_inputs(*shape)
    y, final, inter = ssm_update_keep(
        x, A_log, B, C, D, dt, dt_bias, state, LIMIT, use_kernel=False
    )
    ref = state
    for t in range(x.shape[1]):
        p = slice(t, t + 1)
        y_ref, ref = ssm_update(x[:, p], A_log, B[:, p], C[:, p], D, dt[:, p],
                                dt_bias, ref, LIMIT)  # fmt: skip
        assert close(y[:, p], y_ref), t
        assert inter[:, t].dtype == ref.dtype and close(inter[:, t], ref), t
    assert mx.array_equal(inter[:, -1], final)


@pytest.mark.parametrize("shape", SHAPES)
def test_matches_mlx_lm_over_the_whole_pass(shape, cpu):
    args = make_inputs(*shape)
    y, final, _ = ssm_update_keep(*args, LIMIT, use_kernel=False)
    y_ref, final_ref = ssm_update(*args, LIMIT)  # mlx-lm's chunked (SSD) path
    assert close(y, y_ref) and close(final, final_ref)


def test_no_state_starts_from_zeros_and_mask_holds_the_state(cpu):
    x, A_log, B, C, D, dt, dt_bias, _ = make_inputs(*SHAPES[1])
    y, final, inter = ssm_update_keep(x, A_log, B, C, D, dt, dt_bias, None, LIMIT)
    y_ref, final_ref = ssm_update(x, A_log, B, C, D, dt, dt_bias, None, LIMIT)
    assert close(y, y_ref) and close(final, final_ref)
    mask = mx.array([[True, False, True, True], [True, True, True, False]])
    _, _, kept = ssm_update_keep(x, A_log, B, C, D, dt, dt_bias, None, LIMIT, mask)
    assert mx.array_equal(kept[0, 1], kept[0, 0])
    assert mx.array_equal(kept[1, 3], kept[1, 2])
    assert not mx.array_equal(kept[0, 2], kept[0, 1])


def test_kernel_sources_are_found():
    # CPU runs never build the kernels; this catches a missing package data file.
    for name in ("ssm_keep.metal", "ssm_keep.cu"):
        assert "o_inter[s_idx] = static_cast<StT>(state[i]);" in source(name)


def kernel_matches_reference():
    # Kernel vs reference, a Nemotron-H-like head size too (Dh 64, Ds 128).
    shapes = SHAPES + [(1, 4, 8, 64, 2, 128)]
    with mx.stream(mx.gpu):
        assert _backend() is not None
    for shape in shapes:
        for dtype in (mx.float32, mx.bfloat16):
            x, A_log, B, C, D, dt, dt_bias, state = make_inputs(*shape)
            x, B, C, D = (t.astype(dtype) for t in (x, B, C, D))
            args = (x, A_log, B, C, D, dt, dt_bias, state, LIMIT)
            with mx.stream(mx.gpu):
                y, final, inter = ssm_update_keep(*args)
                y_lm, final_lm = ssm_update(*args)
                one = state  # mlx-lm's one-token path, token by token
                for t in range(x.shape[1]):
                    p = slice(t, t + 1)
                    _, one = ssm_update(x[:, p], A_log, B[:, p], C[:, p], D,
                                        dt[:, p], dt_bias, one, LIMIT)  # fmt: skip
                    assert close(inter[:, t], one, LOOSE), (shape, dtype, t)
            y_ref, final_ref, inter_ref = ssm_update_keep(*args, use_kernel=False)
            tol = 1e-2 if dtype == mx.bfloat16 else ATOL
            assert close(y, y_ref, tol), (shape, dtype)
            assert close(final, final_ref) and close(inter, inter_ref)
            assert mx.array_equal(inter[:, -1], final)
            if dtype == mx.float32:  # mlx-lm's chunked path rounds bf16 elsewhere
                assert close(y, y_lm, LOOSE) and close(final, final_lm, LOOSE)


@pytest.mark.skipif(not mx.metal.is_available(), reason="needs Metal (Apple GPU)")
def test_metal_kernel_matches_reference():
    kernel_matches_reference()


@pytest.mark.skipif(
    not (hasattr(mx, "cuda") and mx.cuda.is_available()),
    reason="needs MLX's CUDA backend and an NVIDIA GPU",
)
def test_cuda_kernel_matches_reference():
    kernel_matches_reference()
