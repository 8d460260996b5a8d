"""The Metal and CUDA keep-intermediates kernels, run on the CPU.

No Apple or NVIDIA GPU here: ``kernel_harness`` compiles each kernel body
unchanged inside the signature MLX generates for it, with a C++ shim for
Metal / CUDA, under AddressSanitizer and UBSan, and launches it with the grid
and threadgroup of our dispatch (``gated_delta.kernel_call``).

Tolerance: the kernels sum Dk products per lane and then across 32 lanes,
the reference sums them in MLX's order, so float32 outputs differ by a few
ulps of values near 1 (measured over this grid: at most 2.4e-7 in y, 9e-8 in
the states); ``ATOL`` = 1e-5 leaves room. A bfloat16 output is the kernel's
float value rounded once, so it may also differ by half a unit in the last
place (2**-8 relative) from the float32 reference on the same inputs
(``kernel_disagreement``); over this grid 99.99% of bfloat16 outputs equal
the reference rounded to bfloat16 bit for bit, the rest sit on a rounding
boundary.
"""

import itertools
import os
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import pytest
from kernel_harness import EmulatedKernel, KernelRunError, compiler_problem

from mlx_mtp.recurrent import gated_delta as gd

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        compiler_problem() is not None, reason=f"kernel emulator: {compiler_problem()}"
    ),
]

ATOL = 1e-5
BACKENDS = ["metal", "cuda"]
VARIANTS = [(False, False), (True, False), (False, True), (True, True)]
# (B, Hk, Hv, Dk, Dv). Dv = 6 is no multiple of the threadgroup's 4 rows:
# Metal trims the last threadgroup, CUDA runs it whole behind a guard.
SHAPES = {"mha-dk64": (2, 2, 2, 64, 16), "gqa-dk128-dv6": (2, 2, 4, 128, 6)}
DTYPES = {  # (q, k, v, beta dtype; state dtype); g stays float32 as compute_g makes it
    "f32": (mx.float32, mx.float32),
    "bf16-f32state": (mx.bfloat16, mx.float32),
    "bf16": (mx.bfloat16, mx.bfloat16),
}
TOKENS = range(1, 9)


def make_inputs(shape, T, dtypes, has_mask, vectorized, seed=0):
    B, Hk, Hv, Dk, Dv = shape
    mx.random.seed(seed)
    q, k = mx.random.normal((2, B, T, Hk, Dk))
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)  # as normalize_qk leaves it
    q = q * Dk**-0.5
    v = mx.random.normal((B, T, Hv, Dv))
    g = mx.random.uniform(0.5, 1.0, (B, T, Hv, Dk) if vectorized else (B, T, Hv))
    beta = mx.random.uniform(0.0, 1.0, (B, T, Hv))
    state = 0.1 * mx.random.normal((B, Hv, Dv, Dk))
    mask = None
    if has_mask:  # left padding: sequence 0 starts at token 2, or 0 if T < 3
        start = mx.array([2 if T > 2 else 0] + [0] * (B - 1))
        mask = mx.arange(T)[None] >= start[:, None]
    dt, st = dtypes
    q, k, v, beta = (x.astype(dt) for x in (q, k, v, beta))
    return q, k, v, g, beta, state.astype(st), mask


def cases(backend, has_mask, vectorized):
    for (s, shape), (d, dtypes), T in itertools.product(
        SHAPES.items(), DTYPES.items(), TOKENS
    ):
        yield (s, d, T), make_inputs(shape, T, dtypes, has_mask, vectorized)


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """{(backend, has_mask, vectorized): {(shape, dtypes, T): (inputs, outputs)}}:
    one binary and one process per backend and variant, built in parallel."""
    workdir = tmp_path_factory.mktemp("kernels")
    keys = [(b, m, v) for b in BACKENDS for m, v in VARIANTS]
    named = {key: dict(cases(*key)) for key in keys}
    plans = {
        key: EmulatedKernel(key[0], **gd.kernel_spec(*key), workdir=workdir).plan(
            [gd.kernel_call(*x) for x in named[key].values()]
        )
        for key in keys
    }
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(lambda p: p.compile(), plans.values()))
    results = {}
    for key, plan in plans.items():
        outputs = plan.kernel.run(plan)
        results[key] = {n: (x, o) for (n, x), o in zip(named[key].items(), outputs)}
    return results


@pytest.mark.parametrize("dtypes", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("has_mask,vectorized", VARIANTS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_matches_reference(
    emulated, backend, has_mask, vectorized, shape, dtypes
):
    for T in TOKENS:
        inputs, (y, state, inter) = emulated[backend, has_mask, vectorized][
            shape, dtypes, T
        ]
        problem = gd.kernel_disagreement((y, state, inter), inputs, atol=ATOL)
        assert problem is None, f"T={T}: {problem}"
        assert mx.array_equal(inter[:, -1], state), T  # the last slot is the state
        mask = inputs[-1]
        if mask is not None:  # masked tokens: y is 0, as mlx-lm's kernel writes
            assert mx.all(mx.where(mask[..., None, None], 0, y) == 0).item(), T


def test_metal_and_cuda_kernels_agree_bit_for_bit(emulated):
    # The twins run the same arithmetic: CUDA's butterfly is the emulator's
    # simd_sum order, so any difference is a difference in the kernel text.
    for variant in VARIANTS:
        metal, cuda = emulated[("metal", *variant)], emulated[("cuda", *variant)]
        for name in metal:
            for a, b in zip(metal[name][1], cuda[name][1]):
                assert mx.array_equal(a, b), (variant, name)


def _mutated(backend, old, new, has_mask=False):
    spec = gd.kernel_spec(backend, has_mask, False)
    assert spec["source"].count(old) == 1, "the kernel text changed: update the test"
    spec["source"] = spec["source"].replace(old, new)
    return spec


_STORE = "o_inter[s_idx] = static_cast<StT>(state[i]);"
# Token t writes slot t - 1 (token 0 writes slot 0): all in bounds, wrong slots.
_SLOT_MINUS_ONE = (
    "(o_inter - (t > 0 ? Hv * Dv * Dk : 0))[s_idx] = static_cast<StT>(state[i]);"
)
_INTER_BASE = "auto o_inter = inter + ((b_idx * T * Hv + hv_idx) * Dv + dv_idx) * Dk;"
# Token t writes slot t + 1: the last token of the last sequence writes past `inter`.
_SLOT_PLUS_ONE = (
    "auto o_inter = inter + (((b_idx * T + 1) * Hv + hv_idx) * Dv + dv_idx) * Dk;"
)


@pytest.mark.parametrize("backend", BACKENDS)
def test_slot_off_by_one_fails_the_comparison(emulated, backend, tmp_path):
    inputs, good = emulated[backend, False, False]["gqa-dk128-dv6", "f32", 3]
    assert gd.kernel_disagreement(good, inputs, atol=ATOL) is None
    spec = _mutated(backend, _STORE, _SLOT_MINUS_ONE)
    outputs = EmulatedKernel(backend, **spec, workdir=tmp_path)(
        **gd.kernel_call(*inputs)
    )
    problem = gd.kernel_disagreement(outputs, inputs, atol=ATOL)
    assert problem is not None and "intermediates" in problem
    # y and the final state do not read the slots: only the slot check sees it
    assert mx.array_equal(outputs[0], good[0]) and mx.array_equal(outputs[1], good[1])


def test_slot_past_the_end_is_caught_by_the_sanitizer(tmp_path):
    inputs = make_inputs(SHAPES["mha-dk64"], 3, DTYPES["f32"], False, False)
    spec = _mutated("metal", _INTER_BASE, _SLOT_PLUS_ONE)
    kernel = EmulatedKernel("metal", **spec, workdir=tmp_path)
    with pytest.raises(KernelRunError, match="heap-buffer-overflow"):
        kernel(**gd.kernel_call(*inputs))


def test_cuda_whole_blocks_need_the_guard(tmp_path):
    # Dv = 6 in blocks of 4 rows: the second block's last 2 rows lie past Dv.
    inputs = make_inputs(SHAPES["gqa-dk128-dv6"], 2, DTYPES["f32"], False, False)
    spec = _mutated("cuda", "if (dv_idx >= Dv) {", "if (dv_idx > Dv) {")
    kernel = EmulatedKernel("cuda", **spec, workdir=tmp_path)
    with pytest.raises(KernelRunError, match="heap-buffer-overflow"):
        kernel(**gd.kernel_call(*inputs))
