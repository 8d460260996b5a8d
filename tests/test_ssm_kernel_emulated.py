"""The Mamba2 keep-intermediates kernels (metal/ssm_keep.*), run on the CPU.

As tests/test_kernel_emulated.py does for the gated delta net: each kernel
body runs unchanged in the emulator (``kernel_harness``) with the grid and
threadgroup of our dispatch (``ssm_keep.kernel_call``), over a grid of
shapes, token counts and dtypes, against the pure-MLX reference. Then the
dispatch with its GPU path faked on the CPU: a wrong kernel is caught by the
self-check, and a Nemotron-H generation through the emulated kernels equals
mlx-lm's.

Tolerance: a lane sums Ds/32 products and the 32 lanes are summed in a tree,
the reference sums in MLX's order; y reaches 17 in magnitude here (C . state
over up to 128 terms), so float32 y differs by a few ulps of that (measured
over this grid: at most 5.7e-6 in y, 2.4e-7 in the states); ``ATOL`` = 2e-5
leaves room. A bfloat16 output may also differ by its rounding
(``kernels.disagreement``); over this grid 99.998% of bfloat16 outputs equal
the reference rounded to bfloat16 bit for bit.
"""

import itertools
import os
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import pytest
import tiny_recurrent
from kernel_harness import EmulatedKernel, KernelRunError, compiler_problem
from mlx_lm.utils import load_model as mlx_lm_load_model
from test_speculative import mtp_greedy, reference_greedy

import mlx_mtp
from mlx_mtp.recurrent import ssm_keep as sk

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        compiler_problem() is not None, reason=f"kernel emulator: {compiler_problem()}"
    ),
]

ATOL = 2e-5
BACKENDS = ["metal", "cuda"]
# (b, H, Dh, G, Ds): heads per group 2, 1, 4 and 4. Dh = 12 is no multiple of
# the threadgroup's 8 rows: Metal trims the last threadgroup, CUDA runs it
# whole behind a guard. The last is a Nemotron-H head (head dim 64, state 128).
SHAPES = {
    "one-group": (1, 2, 8, 1, 32),
    "group-per-head": (2, 4, 8, 4, 32),
    "grouped-dh12": (2, 8, 12, 2, 64),
    "nemotron-head": (1, 4, 64, 1, 128),
}
DTYPES = {  # (x, B, C, D dtype; state dtype); A_log and dt float32
    "f32": (mx.float32, mx.float32),
    "bf16-f32state": (mx.bfloat16, mx.float32),
    "bf16": (mx.bfloat16, mx.bfloat16),
}
TOKENS = {s: (1, 2, 3, 5, 8) if s == "nemotron-head" else range(1, 9) for s in SHAPES}


def make_inputs(shape, T, dtypes, seed=0):
    """A call's arguments as the dispatch passes them (dt through compute_dt)."""
    b, H, Dh, G, Ds = shape
    mx.random.seed(seed)
    x = mx.random.normal((b, T, H, Dh))
    B, C = 0.5 * mx.random.normal((2, b, T, G, Ds))
    D = mx.random.normal((H,))
    A_log = mx.log(mx.random.uniform(0.5, 4.0, (H,)))
    dt = mx.random.uniform(0.01, 1.0, (b, T, H))
    state = 0.3 * mx.random.normal((b, H, Dh, Ds))
    dt_in, st = dtypes
    x, B, C, D = (a.astype(dt_in) for a in (x, B, C, D))
    return x, A_log, B, C, D, dt, state.astype(st)


def cases():
    for s, shape in SHAPES.items():
        for (d, dtypes), T in itertools.product(DTYPES.items(), TOKENS[s]):
            yield (s, d, T), make_inputs(shape, T, dtypes)


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """{backend: {(shape, dtypes, T): (inputs, outputs)}}: one binary and one
    process per backend, built in parallel."""
    workdir = tmp_path_factory.mktemp("ssm_kernels")
    named = dict(cases())
    plans = {
        b: EmulatedKernel(b, **sk.kernel_spec(b), workdir=workdir).plan(
            [sk.kernel_call(*x) for x in named.values()]
        )
        for b in BACKENDS
    }
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(lambda p: p.compile(), plans.values()))
    return {
        b: {n: (x, o) for (n, x), o in zip(named.items(), p.kernel.run(p))}
        for b, p in plans.items()
    }


@pytest.mark.parametrize("dtypes", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_matches_reference(emulated, backend, shape, dtypes):
    for T in TOKENS[shape]:
        inputs, (y, state, inter) = emulated[backend][shape, dtypes, T]
        problem = sk.kernel_disagreement((y, state, inter), inputs, atol=ATOL)
        assert problem is None, f"T={T}: {problem}"
        assert mx.array_equal(inter[:, -1], state), T  # the last slot is the state


def test_metal_and_cuda_kernels_agree_bit_for_bit(emulated):
    # The twins run the same arithmetic: CUDA's butterfly is the emulator's
    # simd_sum order, so any difference is a difference in the kernel text.
    for name, (_, metal) in emulated["metal"].items():
        for a, b in zip(metal, emulated["cuda"][name][1]):
            assert mx.array_equal(a, b), name


def _mutated(backend, old, new):
    spec = sk.kernel_spec(backend)
    assert spec["source"].count(old) == 1, "the kernel text changed: update the test"
    spec["source"] = spec["source"].replace(old, new)
    return spec


_STORE = "o_inter[s_idx] = static_cast<StT>(state[i]);"
# Token t writes slot t - 1 (token 0 writes slot 0): all in bounds, wrong slots.
_SLOT_MINUS_ONE = (
    "(o_inter - (t > 0 ? H * Dh * Ds : 0))[s_idx] = static_cast<StT>(state[i]);"
)
_INTER_BASE = "auto o_inter = inter + ((b_idx * T * H + h_idx) * Dh + d_idx) * Ds;"
# Token t writes slot t + 1: the last token of the last sequence writes past `inter`.
_SLOT_PLUS_ONE = (
    "auto o_inter = inter + (((b_idx * T + 1) * H + h_idx) * Dh + d_idx) * Ds;"
)


@pytest.mark.parametrize("backend", BACKENDS)
def test_slot_off_by_one_fails_the_comparison(emulated, backend, tmp_path):
    inputs, good = emulated[backend]["grouped-dh12", "f32", 3]
    assert sk.kernel_disagreement(good, inputs, atol=ATOL) is None
    spec = _mutated(backend, _STORE, _SLOT_MINUS_ONE)
    outputs = EmulatedKernel(backend, **spec, workdir=tmp_path)(
        **sk.kernel_call(*inputs)
    )
    problem = sk.kernel_disagreement(outputs, inputs, atol=ATOL)
    assert problem is not None and "intermediates" in problem
    # y and the final state do not read the slots: only the slot check sees it
    assert mx.array_equal(outputs[0], good[0]) and mx.array_equal(outputs[1], good[1])


def test_slot_past_the_end_is_caught_by_the_sanitizer(tmp_path):
    inputs = make_inputs(SHAPES["one-group"], 3, DTYPES["f32"])
    spec = _mutated("metal", _INTER_BASE, _SLOT_PLUS_ONE)
    kernel = EmulatedKernel("metal", **spec, workdir=tmp_path)
    with pytest.raises(KernelRunError, match="heap-buffer-overflow"):
        kernel(**sk.kernel_call(*inputs))


def test_cuda_whole_blocks_need_the_guard(tmp_path):
    # Dh = 12 in blocks of 8 rows: the second block's last 4 rows lie past Dh.
    inputs = make_inputs(SHAPES["grouped-dh12"], 2, DTYPES["f32"])
    spec = _mutated("cuda", "if (d_idx >= Dh) {", "if (d_idx > Dh) {")
    kernel = EmulatedKernel("cuda", **spec, workdir=tmp_path)
    with pytest.raises(KernelRunError, match="heap-buffer-overflow"):
        kernel(**sk.kernel_call(*inputs))


# -- the dispatch, with its GPU path faked on the CPU -------------------------

PROMPT = list(range(100, 130))
MAX_TOKENS = 24  # the slot-shifted kernel first changes token 11
EMULATED_TOKENS = 12  # a process per kernel call: fewer tokens


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    root = tmp_path_factory.mktemp("ssm_selfcheck")
    full, trunk_only = tiny_recurrent.build_folder(root / "nemotron_h", "nemotron_h")
    reference, _ = mlx_lm_load_model(trunk_only)
    model = mlx_mtp.load_model(full)
    return model, reference, reference_greedy(reference, PROMPT, MAX_TOKENS)


@pytest.fixture
def fake_gpu(monkeypatch):
    """The dispatch takes the GPU path with kernels from ``make_kernel``;
    returns the calls they get. A fresh process's self-check state."""
    monkeypatch.setattr(sk, "_verdicts", {})
    monkeypatch.setattr(sk, "_warned", False)

    def use(make_kernel, backend="metal"):
        calls = []

        def build(backend):
            kernel = make_kernel(backend)

            def counted(**call):
                calls.append(call)
                return kernel(**call)

            return counted

        monkeypatch.setattr(sk, "_backend", lambda: backend)
        monkeypatch.setattr(sk, "_build_kernel", build)
        return calls

    return use


def slot_shifted_kernel(backend):
    """A kernel with an off-by-one slot: slot t holds the state before token t."""

    def kernel(*, inputs, **_):
        x, A_log, B, C, D, dt, state, _ = inputs
        y, final, inter = sk.ssm_keep_ops(x, A_log, B, C, D, dt, state)
        return [y, final, mx.concatenate([state[:, None], inter[:, :-1]], axis=1)]

    return kernel


def test_wrong_kernel_warns_once_and_greedy_output_is_kept(nemotron, fake_gpu, capfd):
    model, _, expected = nemotron
    calls = fake_gpu(slot_shifted_kernel)
    got, stats, _ = mtp_greedy(model, PROMPT, MAX_TOKENS, draft_max=3)
    assert got == expected
    assert stats.accepted > 0  # rollbacks to slots past 0 happened
    lines = capfd.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("warning: mlx-mtp: the metal kernel ssm_keep ")
    assert "intermediates" in lines[0] and "pure-MLX reference" in lines[0]
    # only the self-checks (one per verify shape) ran the kernel
    assert len(calls) == len(sk._verdicts) and not any(sk._verdicts.values())


def test_the_wrong_kernel_would_change_the_output(nemotron, fake_gpu, monkeypatch):
    # Without the self-check the same kernel reaches the rollback.
    model, _, expected = nemotron
    calls = fake_gpu(slot_shifted_kernel)
    monkeypatch.setattr(sk, "_kernel_trusted", lambda *a: True)
    got, _, _ = mtp_greedy(model, PROMPT, MAX_TOKENS, draft_max=3)
    assert len(calls) > 1 and got != expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_emulated_kernel_keeps_greedy_output(
    nemotron, fake_gpu, backend, tmp_path, capfd
):
    # Every verify pass of the model runs the real kernel text, emulated.
    model, _, expected = nemotron

    def emulated(backend):
        return EmulatedKernel(backend, **sk.kernel_spec(backend), workdir=tmp_path)

    calls = fake_gpu(emulated, backend)
    got, stats, _ = mtp_greedy(model, PROMPT, EMULATED_TOKENS, draft_max=3)
    assert got == expected[:EMULATED_TOKENS]
    assert capfd.readouterr().err == ""  # the self-checks passed
    assert all(sk._verdicts.values()) and stats.accepted > 0
    # a check per verify shape, and the 2 Mamba2 layers of every verify pass
    # (a round without drafts is a plain step: no per-token states, no kernel)
    verifies = sum(1 for r in stats.trace if r.drafted)
    assert len(calls) == len(sk._verdicts) + 2 * verifies
