"""The late-2026 families over several processes (``mlx.launch``).

DeepSeek-V4.1's head reads the last trunk layer's streams, which mlx-lm's
pipeline split keeps on one process (rank 0 runs the last layers and hands
the others only the collapsed output): it is tensor-sharded (``auto``), and
``--sharding pipeline`` is refused in one line. LongCat-Flash-Ngram has
mlx-lm's tensor sharding only. Both generate over 2 processes on 127.0.0.1
(ring backend) exactly as mlx-lm does on one, drafts accepted, and serve
there as one process serves. A language
model only mlx-vlm loads (``vlm_text.FAMILIES``, every one of them: checked
on Qwen3.8-Flash-Next's tiny checkpoint) is refused in one line before any
weights load.
"""

import json
import sys
import tempfile
from pathlib import Path

import pytest
import tiny
import tiny_ngram
import tiny_v41
from test_distributed import (
    WORKER,
    launch,
    launcher_problems,
    mtp_cli,
    plain_greedy,
    run_ranks,
)

import mlx_mtp
from mlx_mtp import distributed, vlm_text
from mlx_mtp.errors import MTPError

PROMPT = tiny.random_prompt(27, seed=1)
MAX_TOKENS = 16
# test_distributed's worker at fixed draft counts (the tiny heads agree often
# enough to be accepted, not often enough for the cost model to keep drafting)
FIXED = WORKER.replace("mtp=k > 0)", "mtp=k > 0, adaptive_draft=False)")
assert FIXED != WORKER


class Group:
    """What ``_plan`` asks of a group: its size."""

    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {
        "deepseek_v41": tiny_v41.build_folder(root / "v41"),
        "longcat_flash_ngram": tiny_ngram.build_folder(root / "ngram"),
    }


def _plan(folders, family, sharding, size=2):
    model = mlx_mtp.load_model(folders[family][0], lazy=True)
    trunk = model.target.model
    return distributed._plan(trunk, model.config, Group(size), sharding, model.head)


def test_v41_is_tensor_sharded_and_refuses_a_pipeline_split(folders):
    assert _plan(folders, "deepseek_v41", "auto") == ("tensor", None)
    with pytest.raises(MTPError) as e:
        _plan(folders, "deepseek_v41", "pipeline")
    assert str(e.value) == (
        "deepseek_v41: its MTP head reads trunk layer 4's output, which a "
        "pipeline split keeps on one process; use --sharding tensor"
    )
    # 4 heads in 2 output groups do not split over 4 processes: replicated
    mode, notice = _plan(folders, "deepseek_v41", "auto", size=4)
    assert mode == "replicated" and "[4, 2] do not split over 4" in notice


def test_ngram_has_tensor_sharding_only(folders):
    assert _plan(folders, "longcat_flash_ngram", "auto") == ("tensor", None)
    with pytest.raises(MTPError, match="no pipeline split"):
        _plan(folders, "longcat_flash_ngram", "pipeline")


@pytest.mark.slow  # one mlx.launch of two processes: about 50 s on 2 busy cores
def test_both_generate_over_two_processes_as_on_one(folders):
    specs = [f"{folders[f][0]}@auto" for f in folders]
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(FIXED)
        code, _, err = launch(
            sys.executable, script, tmp, json.dumps(PROMPT), MAX_TOKENS, *specs
        )
        assert code == 0 and not launcher_problems(err), err
        runs = [
            json.loads(line)
            for f in sorted(Path(tmp).glob("rank*.jsonl"))
            for line in f.read_text().splitlines()
        ]
    for family, (full, trunk) in folders.items():
        expected = plain_greedy(trunk, PROMPT, MAX_TOKENS)
        mine = [r for r in runs if r["spec"] == f"{full}@auto"]
        assert sorted((r["rank"], r["k"]) for r in mine) == [
            (rank, k) for rank in (0, 1) for k in range(4)
        ], family
        for r in mine:
            assert r["mode"] == "tensor", family
            assert r["tokens"] == expected, (family, r["rank"], r["k"])
            stats = r["stats"]
            assert stats["syncs"] == stats["rounds"]
            if r["k"] > 0:
                assert stats["drafted"] > 0 and stats["accepted"] > 0, family


def test_every_mlx_vlm_family_is_refused_before_loading(tmp_path):
    pytest.importorskip("mlx_vlm", reason="mlx-vlm is not installed")
    import tiny_qwen4

    full, _ = tiny_qwen4.build_folder(tmp_path / "qwen4")
    assert set(vlm_text.FAMILIES) >= {"qwen4_exp"}
    for model_type in vlm_text.FAMILIES:  # the check reads the config alone
        config = json.loads((full / "config.json").read_text())
        folder = tmp_path / model_type
        folder.mkdir()
        (folder / "config.json").write_text(
            json.dumps({**config, "model_type": model_type})
        )
        assert distributed.unsplittable(folder) == (
            f"{model_type}: its language model loads through mlx-vlm, whose "
            "models mlx-mtp does not split over processes; run it in one process"
        )
    assert distributed.unsplittable(tmp_path / "missing") is None


@pytest.mark.slow  # two processes that stop before loading: about 10 s
def test_a_vlm_family_under_launch_ends_every_rank_with_one_line(tmp_path):
    pytest.importorskip("mlx_vlm", reason="mlx-vlm is not installed")
    import tiny_qwen4

    full, _ = tiny_qwen4.build_folder(tmp_path / "qwen4")
    args = ("generate", "-m", full, "-p", "hi", "-n", 4)
    results = run_ranks([mtp_cli(*args)] * 2)
    assert [code for code, _, _ in results] == [1, 1], results
    err = "".join(e for _, _, e in results)
    assert err.strip().splitlines() == [
        "error: rank 0: qwen4_exp: its language model loads through mlx-vlm, whose "
        "models mlx-mtp does not split over processes; run it in one process"
    ]
    assert all(out == "" for _, out, _ in results)


def _few_answers(url: str) -> dict:
    """A chat request with and without drafts, then four streams at once."""
    import openai
    from test_distributed_serve import PROMPTS, together

    oa = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    chat = [{"role": "user", "content": PROMPTS[0]}]
    out = {}
    for k in (0, 2):
        r = oa.chat.completions.create(
            model="m", messages=chat, temperature=0, extra_body={"draft_max": k}
        )
        out["chat", k] = r.choices[0].message.content
    out["together"] = together(oa, {"draft_max": 2})
    return out


@pytest.mark.slow  # a server alone, then one over two processes: about 20 s
@pytest.mark.parametrize("family", ["deepseek_v41", "longcat_flash_ngram"])
def test_served_over_two_processes_answers_as_one(folders, family):
    import os
    import signal
    import time

    from live_server import LiveServer
    from test_distributed_serve import (
        MAX_TOKENS as SERVED_TOKENS,
        _free_port,
        health,
        serve_cmd,
        wait_up,
    )
    from test_distributed_serve import start_ranks as serve_ranks

    from mlx_mtp.serve import ServeConfig

    folder = folders[family][0]
    model, tokenizer = mlx_mtp.load(folder)
    config = ServeConfig(max_tokens=SERVED_TOKENS)
    server = LiveServer(model, tokenizer, folder.name, config)
    try:
        alone = _few_answers(server.url)
    finally:
        server.close()
    port = _free_port()
    procs = serve_ranks([serve_cmd(folder, port)] * 2)
    wait_up(port, procs)
    try:
        got = _few_answers(f"http://127.0.0.1:{port}")
        info = health(port)
    finally:
        os.killpg(procs[0].proc.pid, signal.SIGINT)
    results = [p.finish(time.monotonic() + 60) for p in procs]
    assert [code for code, _, _ in results] == [0, 0], results
    assert got == alone and all(got["together"])
    c = info["cluster"]
    assert c["processes"] == 2 and c["sharding"] == "tensor" and c["rounds"] > 0
