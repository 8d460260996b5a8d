"""The late-2026 families over several processes (``mlx.launch``).

DeepSeek-V4.1's head reads the last trunk layer's streams, which mlx-lm's
pipeline split keeps on one process (rank 0 runs the last layers and hands
the others only the collapsed output): it is tensor-sharded (``auto``), and
``--sharding pipeline`` is refused in one line. LongCat-Flash-Ngram has
mlx-lm's tensor sharding only. DeepSeek-V4-Flash, Step-3.7 and Hunyuan-V4
load through mlx-vlm and are tensor-split by their families' own
``shard_trunk`` (DeepSeek-V4: whole output groups a process): each
process's attention and MoE/MLP, summed, equal the whole model's, where
mlx-vlm's own DeepSeek-V4 ``shard`` does not. All of them generate over 2
processes on 127.0.0.1 (ring backend) exactly as they do on one (mlx-lm's or
mlx-vlm's plain greedy), drafts accepted, and serve there as one process
serves. The other families only mlx-vlm loads are refused in one line,
each with its reason, before any weights load.
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


class FakeGroup(Group):
    """One rank of a group, for splitting weights without a collective."""

    def __init__(self, size: int, rank: int):
        super().__init__(size)
        self._rank = rank

    def rank(self) -> int:
        return self._rank


def _has_vlm() -> bool:
    import importlib.util

    return importlib.util.find_spec("mlx_vlm") is not None


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    out = {
        "deepseek_v41": tiny_v41.build_folder(root / "v41"),
        "longcat_flash_ngram": tiny_ngram.build_folder(root / "ngram"),
    }
    if _has_vlm():  # DeepSeek-V4-Flash's and Step-3.7's trunks are mlx-vlm's
        import tiny_dsv4
        import tiny_step3p7

        out["deepseek_v4"] = tiny_dsv4.build_folder(root / "v4")
        out["step3p7"] = tiny_step3p7.build_folder(root / "step3p7")
        import tiny_hy_v4

        out["hy_v4"] = tiny_hy_v4.build_folder(root / "hy_v4")
    return out


def greedy_alone(family, trunk, prompt, n):
    """The trunk's own plain greedy tokens on one process (mlx-lm's, or
    mlx-vlm's for a family it loads)."""
    if family not in vlm_text.FAMILIES:
        return plain_greedy(trunk, prompt, n)
    from mlx_vlm.utils import load_model

    if family == "deepseek_v4":  # mlx-vlm's generate_step (see its test)
        from test_deepseek_v4 import vlm_greedy

        return vlm_greedy(load_model(trunk), prompt, n)
    from vlm_greedy import vlm_greedy

    lm = load_model(trunk).language_model
    if family == "hy_v4":  # with the exact indexer top-k, as in its test
        from mlx_mtp.heads.hy_v4 import exact_indexers

        exact_indexers(lm)
    return vlm_greedy(lm, prompt, n)


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


def test_v4_is_tensor_split_by_its_family_and_refuses_a_pipeline(folders):
    if "deepseek_v4" not in folders:
        pytest.skip("mlx-vlm is not installed")
    assert _plan(folders, "deepseek_v4", "auto") == ("tensor", None)
    assert _plan(folders, "deepseek_v4", "tensor") == ("tensor", None)
    with pytest.raises(MTPError) as e:
        _plan(folders, "deepseek_v4", "pipeline")
    assert str(e.value) == (
        "deepseek_v4: its MTP head reads trunk layer 3's output, which a "
        "pipeline split keeps on one process; use --sharding tensor"
    )
    # 4 heads in 2 output groups: whole groups do not split over 4 processes
    mode, notice = _plan(folders, "deepseek_v4", "auto", size=4)
    assert mode == "replicated" and "[4, 2] do not split over 4" in notice
    with pytest.raises(MTPError, match=r"\[4, 2\] do not split over 4"):
        _plan(folders, "deepseek_v4", "tensor", size=4)
    assert distributed.unsplittable(folders["deepseek_v4"][0]) is None


def test_step3p7_is_tensor_split_by_its_family_only(folders):
    if "step3p7" not in folders:
        pytest.skip("mlx-vlm is not installed")
    assert _plan(folders, "step3p7", "auto") == ("tensor", None)
    with pytest.raises(MTPError) as e:
        _plan(folders, "step3p7", "pipeline")
    assert str(e.value) == (
        "step3p7: mlx-mtp splits its mlx-vlm model by tensors only; "
        "use --sharding tensor"
    )
    # full layers: 4 heads, 2 KV heads; sliding layers: 2 and 2
    mode, notice = _plan(folders, "step3p7", "auto", size=4)
    assert mode == "replicated" and "[4, 2, 2, 2] do not split over 4" in notice


# each split family's branches that end in an ``all_sum``: (name, call)
BRANCHES = {
    "deepseek_v4": lambda b, x, ids: (
        ("attn", lambda: b.attn(x)),
        ("ffn", lambda: b.ffn(x, ids)),
    ),
    "step3p7": lambda b, x, ids: (
        ("attn", lambda: b.self_attn(x)),
        ("mlp", lambda: b.mlp(x)),
    ),
    "hy_v4": lambda b, x, ids: (
        ("attn", lambda: b.self_attn(x)[0]),  # (and its top-k)
        ("mlp", lambda: b.mlp(x)),
    ),
}


def _blocks(m):
    """The trunk's layers, then the head's blocks the sharder splits with
    them (those of the trunk layers' class)."""
    layers = list(m.target.model.model.layers)
    head = [m.head.layer(j).block for j in range(m.head.num_layers)]
    return layers + [b for b in head if type(b) is type(layers[0])]


def _split_blocks(family, folder, split):
    """Each rank's blocks, split by ``split(model, head, config, group)`` on a
    group of 2 without collectives, their sums switched off."""
    out = []
    for rank in (0, 1):
        group = FakeGroup(2, rank)
        m = mlx_mtp.load_model(
            folder, shard=lambda model, head, config: split(model, head, config, group)
        )
        blocks = _blocks(m)
        for b in blocks:  # each rank's part alone: the sums are taken below
            for module in b.modules():
                if hasattr(module, "sharding_group"):
                    module.sharding_group = None
        out.append(blocks)
    return out


def _ours(model, head, config, group):
    distributed._Sharder(group, "tensor")(model, head, config)


@pytest.mark.parametrize("family", sorted(BRANCHES))
def test_split_parts_sum_to_the_whole_model(folders, family):
    """Rank 0's and rank 1's attention and MoE/MLP outputs (before the
    ``all_sum``), added, are the whole model's, for every trunk layer and the
    head's blocks of the trunk's class."""
    if family not in folders:
        pytest.skip("mlx-vlm is not installed")
    import mlx.core as mx

    folder = folders[family][0]
    whole = mlx_mtp.load_model(folder)
    blocks = _blocks(whole)
    if family != "hy_v4":  # (its head's block is a class of its own: whole)
        assert len(blocks) > len(whole.target.model.model.layers)
    mx.random.seed(3)
    x = mx.random.normal((1, 6, whole.target.model.args.hidden_size))
    ids = mx.array([[5, 9, 2, 7, 11, 3]])
    parts = _split_blocks(family, folder, _ours)
    for i, block in enumerate(blocks):
        for (name, want), (_, p0), (_, p1) in zip(*[
            BRANCHES[family](b, x, ids) for b in (block, parts[0][i], parts[1][i])
        ]):
            assert mx.allclose(p0() + p1(), want(), atol=1e-5).item(), (i, name)
    if family == "deepseek_v4":
        attn = parts[0][0].attn
        assert (attn.n_heads, attn.o_groups) == (2, 1)


def test_mlx_vlm_v4_shard_misplaces_the_sinks(folders):
    """Why DeepSeek-V4's split is mlx-mtp's: mlx-vlm 0.7.10's own ``shard``
    gives each process part of every output group's heads but a contiguous
    run of ``attn_sink`` (other heads' sinks), so the parts' attention no
    longer sums to the whole model's."""
    if "deepseek_v4" not in folders:
        pytest.skip("mlx-vlm is not installed")
    import mlx.core as mx

    def theirs(model, head, config, group):
        model.shard(group)  # the trunk's layers only

    folder = folders["deepseek_v4"][0]
    layers = mlx_mtp.load_model(folder).target.model.model.layers
    parts = _split_blocks("deepseek_v4", folder, theirs)
    mx.random.seed(3)
    x = mx.random.normal((1, 6, 32))
    worst = max(
        mx.abs(p0.attn(x) + p1.attn(x) - b.attn(x)).max().item()
        for b, p0, p1 in zip(layers, *parts)
    )
    assert worst > 1e-4  # (the split above: within 1e-5)


def test_ngram_has_tensor_sharding_only(folders):
    assert _plan(folders, "longcat_flash_ngram", "auto") == ("tensor", None)
    with pytest.raises(MTPError, match="no pipeline split"):
        _plan(folders, "longcat_flash_ngram", "pipeline")


@pytest.mark.slow  # one mlx.launch of two processes: a few minutes on 2 busy cores
def test_each_generates_over_two_processes_as_on_one(folders):
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
        expected = greedy_alone(family, trunk, PROMPT, MAX_TOKENS)
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


SPLIT = {"deepseek_v4", "step3p7", "hy_v4"}  # the mlx-vlm families with a split here
QWEN4_REFUSED = (
    "qwen4_exp: mlx-mtp has no tensor split written for its mlx-vlm layers "
    "(gated delta nets, QSA sparse attention with its indexer cache, per-layer "
    "embeddings), and mlx-vlm has none; run it in one process"
)


def test_the_other_mlx_vlm_families_are_refused_before_loading(tmp_path):
    pytest.importorskip("mlx_vlm", reason="mlx-vlm is not installed")
    import tiny_qwen4

    from mlx_mtp.heads import family_for

    full, _ = tiny_qwen4.build_folder(tmp_path / "qwen4")
    assert set(vlm_text.FAMILIES) >= SPLIT | {"qwen4_exp", "glm5_next"}
    for model_type in vlm_text.FAMILIES:  # the check reads the config alone
        config = json.loads((full / "config.json").read_text())
        folder = tmp_path / model_type
        folder.mkdir()
        (folder / "config.json").write_text(
            json.dumps({**config, "model_type": model_type})
        )
        why = distributed.unsplittable(folder)
        if model_type in SPLIT:
            assert why is None, model_type
            continue
        reason = family_for(model_type).NO_SPLIT
        assert why == f"{model_type}: {reason}; run it in one process"
        assert "\n" not in why and len(why) < 240
    assert distributed.unsplittable(full) == QWEN4_REFUSED
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
    assert err.strip().splitlines() == [f"error: rank 0: {QWEN4_REFUSED}"]
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
@pytest.mark.parametrize(
    "family",
    ["deepseek_v41", "longcat_flash_ngram", "deepseek_v4", "step3p7", "hy_v4"],
)
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

    if family not in folders:
        pytest.skip("mlx-vlm is not installed")
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
