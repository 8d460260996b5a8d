"""Gemma 4 assistant drafters through the speculative loop: the same output as
mlx-lm's model alone (greedy, stops and limits inside drafts, sampling), the
draft step against a reference written here from the pinned rules, and the
assistant kept beside a converted model."""

import json
import shutil
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
import tiny_gemma4
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache
from mlx_lm.utils import load_model as mlx_lm_load_model
from test_sampling import first_two_tokens, seeded_first_two

import mlx_mtp
from mlx_mtp.adaptive import CostAwareDraft, FixedDraft, prior_costs
from mlx_mtp.errors import MTPError
from mlx_mtp.heads.gemma4_assistant import Gemma4Assistant, SharedKV, kv_layers
from mlx_mtp.draft_settings import DraftSettings
from mlx_mtp.sampling import SamplingConfig, make_verifier
from mlx_mtp.speculative import speculative_generate_step
from mlx_mtp.stats import MTPStats

PROMPT = list(range(20, 44)) * 2  # longer than the sliding window (8)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4")
    target = tiny_gemma4.build_target(root / "target")
    return {
        "target": target,
        # random: drafts are rarely kept; the centroid output head
        "random": tiny_gemma4.build_assistant(root / "random"),
        # drafts the token it is given: the repeating target keeps most
        "agreeable": tiny_gemma4.build_assistant(
            root / "agreeable",
            config=tiny_gemma4.PLAIN_ASSISTANT,
            agree_with=tiny_gemma4.target_weights(),
        ),
    }


@pytest.fixture(scope="module")
def reference(folders):
    return mlx_lm_load_model(folders["target"])[0]


def greedy(reference, prompt, max_tokens, stop=()):
    out = []
    steps = generate_step(
        mx.array(prompt), reference, max_tokens=max_tokens,
        sampler=lambda x: mx.argmax(x, -1),
    )  # fmt: skip
    for tok, _ in steps:
        out.append(int(tok))
        if out[-1] in stop:
            break
    return out


def run(model, prompt, max_tokens, policy, stop=(), config=None):
    stats = MTPStats()
    verifier = make_verifier(config) if config is not None else None
    steps = speculative_generate_step(
        prompt, model, max_tokens=max_tokens, drafts=policy,
        stop_tokens=stop, stats=stats, verifier=verifier,
    )  # fmt: skip
    return [t for t, _ in steps], stats


@pytest.mark.parametrize("assistant", ["random", "agreeable"])
def test_greedy_identical_to_mlx_lm(folders, reference, assistant):
    model = mlx_mtp.load_model(folders["target"], mtp=folders[assistant])
    assert isinstance(model.head, Gemma4Assistant) and model.notice is None
    expected = greedy(reference, PROMPT, 40)
    for policy in (
        FixedDraft(1),
        FixedDraft(3),
        CostAwareDraft(4, prior_costs(), prior=[0.6]),
    ):
        got, stats = run(model, PROMPT, 40, policy)
        assert got == expected, policy
        assert stats.drafted > 0
        if assistant == "agreeable":
            assert stats.accepted > stats.drafted / 2


def test_stops_and_limits_inside_drafts(folders, reference):
    model = mlx_mtp.load_model(folders["target"], mtp=folders["agreeable"])
    free, stats = run(model, PROMPT, 30, FixedDraft(3))
    assert stats.accepted > 0
    for max_tokens in range(1, 14):
        got, _ = run(model, PROMPT, max_tokens, FixedDraft(3))
        assert got == free[:max_tokens], max_tokens
    for stop in sorted(set(free[:20])):
        got, _ = run(model, PROMPT, 30, FixedDraft(3), stop={stop})
        assert got == greedy(reference, PROMPT, 30, {stop}) and got[-1] == stop


def test_sampling_is_exact(folders, reference):
    """The first two tokens of seeded generations whose first round drafts
    follow mlx-lm's model sampled alone (total variation bound as for MTP
    heads), for both ways of drafting."""
    model = mlx_mtp.load_model(folders["target"], mtp=folders["agreeable"])
    prompt, temp, top_k, n = PROMPT[:30], 1.0, 4, 300
    p = first_two_tokens(reference, prompt, temp, top_k)
    for draft_sampling in ("greedy", "sample"):

        def generate(seed):
            config = SamplingConfig(
                temp=temp, top_k=top_k, seed=seed, draft_sampling=draft_sampling
            )
            return run(model, prompt, 2, FixedDraft(2), config=config)

        stats = seeded_first_two(p, n, generate)
        assert sum(s.drafted for s in stats) >= n


# -- the draft step against a reference written from the pinned rules ----------


def _rms(x, w=None, eps=1e-6):
    y = x / mx.sqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w


def reference_step(head, kv, embed_row, hidden, position):
    """One assistant step: [embed * sqrt(backbone), hidden] -> pre_projection ->
    query-only Gemma 4 layers over the target's K/V at one position (a
    sliding layer sees keys less than the window before it) -> norm; logits
    from the tied table over the top clusters' tokens only, -inf elsewhere."""
    args = head.args
    x = (
        mx.concatenate([embed_row * 64**0.5, hidden])[None]
        @ head.pre_projection.weight.T
    )
    for layer in head.model.layers:
        attn = layer.self_attn
        keys, values = kv[layer.layer_type]  # [1, kv_heads, S, D], positions 0..S-1
        first = 0
        if layer.layer_type == "sliding_attention":
            first = max(0, position - args.sliding_window + 1)
        keys, values = keys[0, :, first:position], values[0, :, first:position]
        h = _rms(x, layer.input_layernorm.weight)
        q = (h @ attn.q_proj.weight.T).reshape(attn.n_heads, attn.head_dim)
        q = _rms(q, attn.q_norm.weight)
        q = attn.rope(q[None, :, None, :], offset=position)[0, :, 0]  # mlx-lm's RoPE
        group = attn.n_heads // keys.shape[0]
        keys, values = mx.repeat(keys, group, 0), mx.repeat(values, group, 0)
        scores = mx.softmax((keys @ q[:, :, None])[..., 0], axis=-1)  # scale 1
        out = (scores[:, None, :] @ values)[:, 0].reshape(1, -1) @ attn.o_proj.weight.T
        x = x + _rms(out, layer.post_attention_layernorm.weight)
        mlp = layer.mlp
        f = _rms(x, layer.pre_feedforward_layernorm.weight)
        gate = f @ mlp.gate_proj.weight.T
        f = 0.5 * gate * (1 + mx.tanh(0.7978845608 * (gate + 0.044715 * gate**3)))
        f = f * (_rms(x, layer.pre_feedforward_layernorm.weight) @ mlp.up_proj.weight.T)
        f = f @ mlp.down_proj.weight.T
        x = (x + _rms(f, layer.post_feedforward_layernorm.weight)) * layer.layer_scalar
    h = _rms(x, head.model.norm.weight)[0]
    table = head.model.embed_tokens.weight
    m = head.masked_embedding
    scores = m.centroids.weight @ h
    best = np.argsort(-np.array(scores))[: m.top_k]
    clusters = np.array(m.token_ordering).reshape(scores.shape[0], -1)
    logits = np.full(table.shape[0], -np.inf)
    ids = clusters[best].reshape(-1)
    logits[ids] = np.array(table[mx.array(ids)] @ h)
    return logits, np.array(head.post_projection.weight @ h)


def test_a_draft_step_matches_the_reference(folders):
    model = mlx_mtp.load_model(folders["target"], mtp=folders["random"])
    head, cache = model.head, model.make_cache()
    n = len(PROMPT) - 1  # the trunk reads all but the last token
    logits, hidden = model.target(mx.array(PROMPT[:n])[None], cache.trunk)
    kinds = kv_layers(model.target.backbone)
    # plain caches: every key of every layer, in order (the trunk's are swapped)
    assert all(type(cache.trunk[i]) is KVCache for i in kinds.values())
    kv = {
        t: (cache.trunk[i].keys[..., :n, :], cache.trunk[i].values[..., :n, :])
        for t, i in kinds.items()
    }
    got_logits, got_hidden = head(hidden[:, -1:], mx.array([[PROMPT[n]]]), cache.head)
    embed = model.target.embed_tokens.weight[PROMPT[n]]
    want_logits, want_hidden = reference_step(head, kv, embed, hidden[0, -1], n)
    got = np.array(got_logits[0, 0])
    assert np.array_equal(np.isinf(got), np.isinf(want_logits))
    keep = ~np.isinf(want_logits)
    assert keep.sum() == head.masked_embedding.top_k * 36
    np.testing.assert_allclose(got[keep], want_logits[keep], rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(
        np.array(got_hidden[0, 0]), want_hidden, rtol=2e-4, atol=2e-4
    )
    # a chained step reads at the same position and writes nothing to the trunk
    assert cache.head[0].offset == 1
    head(got_hidden, mx.array([[5]]), cache.head)
    assert cache.offset == n and cache.head[0].offset == 2


def test_the_head_cache_counts_positions_and_copies_to_its_own_trunk(folders):
    model = mlx_mtp.load_model(folders["target"], mtp=folders["random"])
    cache = model.make_cache()
    assert cache.head[0].trunk is cache.trunk
    copy = cache.copy()
    assert copy.head[0].trunk is copy.trunk and copy.head[0].trunk is not cache.trunk
    shared = SharedKV(5)
    assert shared.trim(2) == 2 and shared.offset == 3 and shared.is_trimmable()


# -- kept beside a converted model, and refused where it does not fit -----------


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "mlx_mtp", *map(str, args)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_convert_keeps_the_assistant_beside_the_model(folders, reference, tmp_path):
    into = tmp_path / "gemma4"
    shutil.copytree(folders["target"], into)
    out = _cli("convert", folders["agreeable"], "--mtp-only", "--into", into)
    assert out.returncode == 0, out.stderr
    head_config = json.loads((into / "mtp_config.json").read_text())
    assert head_config["family"] == "gemma4_assistant"
    model = mlx_mtp.load_model(into)
    assert isinstance(model.head, Gemma4Assistant)
    got, stats = run(model, PROMPT, 24, FixedDraft(2))
    assert got == greedy(reference, PROMPT, 24) and stats.accepted > 0
    tuned = _cli("tune", "--model", into)  # no draft vocabulary trial for it
    assert tuned.returncode == 0, tuned.stderr
    head_config = json.loads((into / "mtp_config.json").read_text())
    assert head_config["family"] == "gemma4_assistant" and head_config["tuned"]
    assert isinstance(mlx_mtp.load_model(into).head, Gemma4Assistant)
    again = _cli("convert", folders["agreeable"], "--mtp-only", "--into", into)
    assert again.returncode != 0 and "--force" in again.stderr
    assert "Traceback" not in again.stderr


def test_an_assistant_that_does_not_fit_is_one_line(folders, tiny_folders, tmp_path):
    _, llama = tiny_folders("deepseek_v3")
    with pytest.raises(MTPError, match="drafts for Gemma 4"):
        mlx_mtp.load_model(llama, mtp=folders["agreeable"])
    wide = dict(tiny_gemma4.PLAIN_ASSISTANT, backbone_hidden_size=128)
    other = tmp_path / "wide"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(wide))
    shutil.copy(folders["agreeable"] / "model.safetensors", other)
    with pytest.raises(MTPError, match="128-wide"):
        mlx_mtp.load_model(folders["target"], mtp=other)
    out = _cli("convert", folders["agreeable"], "--mtp-only", "--into", llama)
    assert out.returncode != 0 and "drafts for Gemma 4" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_served_through_the_single_stream_loop(folders, reference):
    """The server decodes a Gemma 4 with its assistant (no batch form: each
    stream runs the single-stream loop in the engine thread), several
    requests at once, each as it decodes without drafts."""
    import concurrent.futures

    from live_server import LiveServer

    from mlx_mtp.serve import ServeConfig

    model, tokenizer = mlx_mtp.load(folders["target"], mtp=folders["agreeable"])
    live = LiveServer(model, tokenizer, "g4", ServeConfig(drafts=DraftSettings(adaptive=False)))
    try:
        prompts = ["abcabcabc", "hello hello hello", "xyz"]

        def ask(prompt, draft_max=3):
            return live.client().completions.create(
                model="g4", prompt=prompt, max_tokens=20, temperature=0.0,
                extra_body={"draft_max": draft_max, "draft_source": "mtp"},
            )  # fmt: skip

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(ask, prompts))
        plain = [ask(p, draft_max=0) for p in prompts]
        assert [r.choices[0].text for r in answers] == [
            r.choices[0].text for r in plain
        ]
        assert sum(r.usage.mtp["accepted"] for r in answers) > 0
        assert all(r.usage.completion_tokens == 20 for r in answers)
    finally:
        live.close()
