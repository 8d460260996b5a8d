"""The kernels in the model's verify path, with the GPU dispatch faked on the CPU.

``gated_delta._backend`` is the seam: it names the GPU backend whose kernel the
dispatch would use ("metal", "cuda" or None on the CPU), and
``_build_kernel`` builds that kernel. Here the first says "metal" (or "cuda")
and the second gives either a wrong kernel, to see the self-check catch it,
or the emulated real kernel, to run a whole greedy generation through it.
"""

import mlx.core as mx
import pytest
import tiny_hybrid
from kernel_harness import EmulatedKernel, compiler_problem
from mlx_lm.utils import load_model as mlx_lm_load_model
from test_speculative import mtp_greedy, reference_greedy

import mlx_mtp
from mlx_mtp.recurrent import gated_delta as gd

PROMPT = list(range(40, 70))
MAX_TOKENS = 48  # the slot-shifted kernel first changes token 32
EMULATED_TOKENS = 16  # a process per kernel call: fewer tokens


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("selfcheck")
    full, trunk_only = tiny_hybrid.build_folder(root / "qwen3_next", "qwen3_next")
    reference, _ = mlx_lm_load_model(trunk_only)
    return mlx_mtp.load_model(full), reference


@pytest.fixture(scope="module")
def expected(models):
    return reference_greedy(models[1], PROMPT, MAX_TOKENS)


@pytest.fixture
def fake_gpu(monkeypatch):
    """Makes the dispatch take the GPU path with kernels from ``make_kernel``;
    returns the list of calls they get. A fresh process's self-check state."""
    monkeypatch.setattr(gd, "_verdicts", {})
    monkeypatch.setattr(gd, "_warned", False)

    def use(make_kernel, backend="metal"):
        calls = []

        def build(backend, has_mask, vectorized):
            kernel = make_kernel(backend, has_mask, vectorized)

            def counted(**call):
                calls.append(call)
                return kernel(**call)

            return counted

        monkeypatch.setattr(gd, "_backend", lambda: backend)
        monkeypatch.setattr(gd, "_build_kernel", build)
        return calls

    return use


def slot_shifted_kernel(backend, has_mask, vectorized):
    """A kernel with an off-by-one slot: slot t holds the state before token t."""

    def kernel(*, inputs, **_):
        q, k, v, g, beta, state, _, *mask = inputs
        y, final, inter = gd.gated_delta_keep_ops(q, k, v, g, beta, state, *mask)
        return [y, final, mx.concatenate([state[:, None], inter[:, :-1]], axis=1)]

    return kernel


def test_wrong_kernel_warns_once_and_greedy_output_is_kept(
    models, expected, fake_gpu, capfd
):
    calls = fake_gpu(slot_shifted_kernel)
    got, stats, _ = mtp_greedy(models[0], PROMPT, MAX_TOKENS, draft_max=3)
    assert got == expected
    assert stats.accepted > 0  # rollbacks to slots past 0 happened
    lines = capfd.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("warning: mlx-mtp: the metal kernel gated_delta_keep ")
    assert "intermediates" in lines[0] and "pure-MLX reference" in lines[0]
    # Only self-checks (one per verify shape) ran the kernel; verify passes
    # ran the reference.
    assert len(calls) == len(gd._verdicts) and not any(gd._verdicts.values())


def test_the_wrong_kernel_would_change_the_output(
    models, expected, fake_gpu, monkeypatch
):
    # Without the self-check the same kernel reaches the rollback.
    calls = fake_gpu(slot_shifted_kernel)
    monkeypatch.setattr(gd, "_kernel_trusted", lambda *a: True)
    got, _, _ = mtp_greedy(models[0], PROMPT, MAX_TOKENS, draft_max=3)
    assert len(calls) > 1 and got != expected


def test_failing_kernel_falls_back_with_one_line(models, expected, fake_gpu, capfd):
    def failing(backend, has_mask, vectorized):
        def kernel(**_):
            raise RuntimeError("[metal::Device] Unable to build metal library\nmore")

        return kernel

    fake_gpu(failing)
    got, _, _ = mtp_greedy(models[0], PROMPT, MAX_TOKENS, draft_max=3)
    assert got == expected
    lines = capfd.readouterr().err.splitlines()
    assert len(lines) == 1 and "failed ([metal::Device] Unable to build" in lines[0]


@pytest.mark.skipif(compiler_problem() is not None, reason=str(compiler_problem()))
@pytest.mark.parametrize("backend", ["metal", "cuda"])
def test_emulated_kernel_keeps_greedy_output(
    models, expected, fake_gpu, backend, tmp_path, capfd
):
    # Every verify pass of the model runs the real kernel text, emulated.
    def emulated(backend, has_mask, vectorized):
        spec = gd.kernel_spec(backend, has_mask, vectorized)
        return EmulatedKernel(backend, **spec, workdir=tmp_path)

    calls = fake_gpu(emulated, backend)
    got, stats, _ = mtp_greedy(models[0], PROMPT, EMULATED_TOKENS, draft_max=3)
    assert got == expected[:EMULATED_TOKENS]
    assert capfd.readouterr().err == ""  # the self-checks passed
    # a check per verify shape, and the 3 GDN layers of every verify pass
    assert all(gd._verdicts.values())
    assert len(calls) == len(gd._verdicts) + 3 * stats.rounds and stats.accepted > 0
