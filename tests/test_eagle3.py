"""EAGLE-3 heads (speculators' ``Eagle3Speculator`` and the original
``LlamaForCausalLMEagle3`` layout) as drafters: the head's logits against a
numpy head written from vLLM's ``llama_eagle3.py``, greedy output identical
to plain, exact sampling, one-line refusals, convert and info."""

import json

import mlx.core as mx
import numpy as np
import pytest
import tiny
import tiny_dflash as td
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import apply_top_k
from mlx_lm.utils import load_model as mlx_lm_load_model
from safetensors.numpy import load_file
from test_dflash_rounds import chi2_passes

import mlx_mtp
from mlx_mtp.adaptive import FixedDraft
from mlx_mtp.drafts import ModelDrafts
from mlx_mtp.errors import MTPError
from mlx_mtp.sampling import SamplingConfig, make_verifier
from mlx_mtp.speculative import speculative_generate_step

D, HEADS, HD, INTER = 64, 4, 16, 96
DRAFT_VOCAB = list(range(0, 256, 1)) + [tiny.VOCAB - 1]  # bytes and the eos


def eagle_config(layout: str, aux=None, theta=80_000.0) -> dict:
    layer = dict(
        model_type="llama", hidden_size=D, num_attention_heads=HEADS,
        num_key_value_heads=HEADS, head_dim=HD, intermediate_size=INTER,
        rms_norm_eps=1e-6, rope_theta=theta, vocab_size=tiny.VOCAB,
        max_position_embeddings=4096, num_hidden_layers=1,
    )  # fmt: skip
    extra = {"draft_vocab_size": len(DRAFT_VOCAB), "target_hidden_size": D}
    if aux is not None:
        extra["eagle_aux_hidden_state_layer_ids"] = aux
    if layout == "speculators":
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": layer,
            "norm_before_residual": False,
            **extra,
        }
    return {"architectures": ["LlamaForCausalLMEagle3"], **layer, **extra}


def eagle_weights(layout, target_head, agreeable: bool, seed: int = 0) -> dict:
    """Random weights, or an agreeable head: its attention picks the current
    position, its values the embedding, the fused state is near silent, and
    its output head is the target's rows: it drafts the target's near-bigram
    guess after the token it reads, and chains on."""
    rng = np.random.default_rng(seed)

    def mat(r, c, s=1.0):
        return (rng.normal(size=(r, c)) * s / np.sqrt(c)).astype(np.float32)

    pre = "midlayer." if layout == "original" else "layers.0."
    eye = np.eye(D, 2 * D, dtype=np.float32)  # the embedding half
    w = {
        "fc.weight": mat(D, 3 * D, 1e-3 if agreeable else 1.0),
        "norm.weight": np.ones(D, np.float32),
        "lm_head.weight": target_head[DRAFT_VOCAB].astype(np.float32)
        if agreeable
        else mat(len(DRAFT_VOCAB), D),
        "d2t": (np.array(DRAFT_VOCAB) - np.arange(len(DRAFT_VOCAB))).astype(np.int64),
        "t2d": np.isin(np.arange(tiny.VOCAB), DRAFT_VOCAB),
        pre + "input_layernorm.weight": np.ones(D, np.float32),
        pre + "hidden_norm.weight": (1 + 0.1 * rng.normal(size=D)).astype(np.float32),
        pre + "post_attention_layernorm.weight": np.ones(D, np.float32),
        pre + "self_attn.q_proj.weight": 3 * eye if agreeable else mat(D, 2 * D),
        pre + "self_attn.k_proj.weight": 3 * eye if agreeable else mat(D, 2 * D),
        pre + "self_attn.v_proj.weight": eye if agreeable else mat(D, 2 * D),
        pre + "self_attn.o_proj.weight": np.eye(D, dtype=np.float32)
        if agreeable
        else mat(D, D),
        pre + "mlp.gate_proj.weight": mat(INTER, D),
        pre + "mlp.up_proj.weight": mat(INTER, D),
        pre + "mlp.down_proj.weight": mat(D, INTER, 0.0 if agreeable else 1.0),
    }
    return w


def save(path, config, weights):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    arrays = {k: mx.array(v) for k, v in weights.items()}
    mx.save_safetensors(str(path / "model.safetensors"), arrays)
    return path


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    folder = td.build_target(root / "target", "qwen3", 6)
    head = np.array(mx.load(str(folder / "model.safetensors"))["lm_head.weight"])
    return folder, head, root


def build(target, layout="speculators", agreeable=False, aux=None, name="e"):
    folder, head, root = target
    return save(
        root / f"{name}-{layout}-{agreeable}",
        eagle_config(layout, aux),
        eagle_weights(layout, head, agreeable),
    )


# -- the numpy head ------------------------------------------------------------


def numpy_logits(folder, embed, fused_in, tokens):
    """vLLM's llama_eagle3 layer 0 over positions ``0..L-1`` (causal, RoPE
    at those positions): ``fused_in [L, 3D]`` the target's aux states,
    ``tokens`` the successors. Logits over the target's vocabulary."""
    cfg = json.loads((folder / "config.json").read_text())
    c = {**cfg, **cfg.get("transformer_layer_config", {})}
    w = {
        k: v.astype(np.float64)
        for k, v in load_file(str(folder / "model.safetensors")).items()
    }
    p = (
        "midlayer."
        if "midlayer.fc" in w or any(k.startswith("midlayer.") for k in w)
        else "layers.0."
    )

    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + c["rms_norm_eps"]) * g

    def rope(x, pos):
        inv = c["rope_theta"] ** (-np.arange(0, HD, 2) / HD)
        ang = pos[:, None] * inv
        cos, sin = (
            np.cos(np.concatenate([ang] * 2, -1)),
            np.sin(np.concatenate([ang] * 2, -1)),
        )
        return (
            x * cos + np.concatenate([-x[..., HD // 2 :], x[..., : HD // 2]], -1) * sin
        )

    L = len(tokens)
    h = fused_in @ w["fc.weight"].T
    e = embed[np.array(tokens)]
    x = np.concatenate(
        [rms(e, w[p + "input_layernorm.weight"]), rms(h, w[p + "hidden_norm.weight"])],
        -1,
    )
    q = (
        (x @ w[p + "self_attn.q_proj.weight"].T)
        .reshape(L, HEADS, HD)
        .transpose(1, 0, 2)
    )
    k = (
        (x @ w[p + "self_attn.k_proj.weight"].T)
        .reshape(L, HEADS, HD)
        .transpose(1, 0, 2)
    )
    v = (
        (x @ w[p + "self_attn.v_proj.weight"].T)
        .reshape(L, HEADS, HD)
        .transpose(1, 0, 2)
    )
    pos = np.arange(L, dtype=np.float64)
    q, k = rope(q, pos), rope(k, pos)
    s = q @ k.transpose(0, 2, 1) / np.sqrt(HD)
    s = np.where(np.tril(np.ones((L, L), bool)), s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    o = (a @ v).transpose(1, 0, 2).reshape(L, D) @ w[p + "self_attn.o_proj.weight"].T
    r = h + o
    m = rms(r, w[p + "post_attention_layernorm.weight"])
    g = m @ w[p + "mlp.gate_proj.weight"].T
    out = (
        r
        + (g / (1 + np.exp(-g)) * (m @ w[p + "mlp.up_proj.weight"].T))
        @ w[p + "mlp.down_proj.weight"].T
    )
    small = rms(out, w["norm.weight"]) @ w["lm_head.weight"].T
    full = np.full((L, tiny.VOCAB), -np.inf)
    full[:, np.arange(small.shape[1]) + w["d2t"].astype(int)] = small
    return full


@pytest.mark.parametrize("layout", ["speculators", "original"])
def test_the_heads_logits_match_numpy(target, layout):
    folder = build(target, layout, aux=[1, 3, 5])
    model = mlx_mtp.load_model(target[0], draft=folder)
    drafter = model.drafters[-1]
    assert drafter.name == "eagle3" and drafter.reads.layers == (0, 2, 4)
    tokens = tiny.random_prompt(13, seed=2)
    _, taps = model.target.forward(mx.array([tokens]), model.target.make_cache())
    aux = np.concatenate([np.array(taps.layers[i][0]) for i in (0, 2, 4)], -1)
    hidden = drafter.features(taps)[:, :-1]
    layer = drafter.head.layer(0)
    states, _ = layer.states(hidden, mx.array([tokens[1:]]), drafter.make_caches())
    got = np.array(layer.logits(states)[0])
    embed = np.array(model.target.embed_tokens.weight)
    want = numpy_logits(folder, embed, aux[:-1], tokens[1:])
    inside = np.isfinite(want)
    assert (np.isfinite(got) == inside).all()
    np.testing.assert_allclose(got[inside], want[inside], atol=1e-4)


def test_the_default_aux_layers_are_vllms(target):
    model = mlx_mtp.load_model(target[0], draft=build(target, name="default"))
    # the inputs of layers 2, 3 and 3 of 6: the outputs of layers 1, 2, 2
    assert model.drafters[-1].reads.layers == (1, 2, 2)


def run(model, prompt, k, n=24, verifier=None):
    stats = mlx_mtp.MTPStats()
    steps = speculative_generate_step(
        prompt, model, max_tokens=n, verifier=verifier, stats=stats,
        drafts=ModelDrafts(FixedDraft(k), "eagle3"),
    )  # fmt: skip
    return [t for t, _ in steps], stats


@pytest.mark.parametrize("layout", ["speculators", "original"])
def test_greedy_is_plain_and_drafts_are_kept(target, layout):
    model = mlx_mtp.load_model(target[0], draft=build(target, layout, agreeable=True))
    reference = mlx_lm_load_model(target[0])[0]
    total = mlx_mtp.MTPStats()
    for k in (1, 3):
        for seed in range(3):
            prompt = tiny.random_prompt(12 + 7 * seed, seed=seed)
            got, stats = run(model, prompt, k)
            want = generate_step(
                mx.array(prompt), reference, max_tokens=24,
                sampler=lambda x: mx.argmax(x, -1),
            )  # fmt: skip
            assert got == [int(t) for t, _ in want]
            total.add(stats)
    assert 0 < total.accepted < total.drafted
    assert total.accepted_at[1] > 0  # chained drafts are kept too


def test_sampling_is_exact(target):
    model = mlx_mtp.load_model(target[0], draft=build(target, agreeable=True))
    reference = mlx_lm_load_model(target[0])[0]
    prompt, temp, top_k, n = tiny.random_prompt(15, seed=5), 0.5, 4, 300

    def p_next(tokens):
        logits = reference(mx.array(tokens)[None])[0, -1:]
        logp = apply_top_k(logits - mx.logsumexp(logits, keepdims=True), top_k)
        return np.array(mx.softmax(logp / temp, axis=-1))[0].astype(np.float64)

    p0 = p_next(prompt)
    p1 = sum(p0[t] * p_next(prompt + [int(t)]) for t in np.flatnonzero(p0))
    runs = [
        run(model, prompt, 2, 2, make_verifier(SamplingConfig(
            temp=temp, top_k=top_k, seed=seed, draft_sampling="sample")))
        for seed in range(n)
    ]  # fmt: skip
    for i, p in enumerate([p0, p1]):
        assert chi2_passes(np.array([tokens[i] for tokens, _ in runs]), p, n)
    assert sum(s.accepted for _, s in runs) > n / 4


@pytest.mark.parametrize(
    "aux, says",
    [([1, 3, 9], r"aux hidden state layers \[1, 3, 9\]"), ([0, 2, 4], r"\[0, 2, 4\]")],
)
def test_a_head_that_does_not_fit_is_one_line(target, aux, says):
    folder = build(target, aux=aux, name=f"bad{aux[-1]}")
    with pytest.raises(MTPError, match=says) as e:
        mlx_mtp.load_model(target[0], draft=folder)
    assert "\n" not in str(e.value)


def test_convert_and_info(target, tmp_path):
    from mlx_mtp.convert import convert
    from mlx_mtp.convert.describe import describe

    folder = build(target, "original", agreeable=True, name="conv")
    out = convert(folder, tmp_path / "q8", quantize=True, q_bits=8)
    info = describe(out)
    assert info.drafter["kind"] == "eagle3" and "8-bit/g64" in info.trunk_precision
    model = mlx_mtp.load_model(target[0], draft=out)
    got, stats = run(model, tiny.random_prompt(20, seed=1), 2)
    assert stats.accepted > 0
