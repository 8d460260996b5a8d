"""DeepSeek-V4.1 (``deepseek_v41``, mlx-lm 0.32.2): its MTP head drafts, losslessly.

The head's teacher-forced logits equal an independent numpy forward of the
checkpoint's ``mtp.0.`` tensors over the streams mlx-lm's trunk hands on;
greedy MTP output equals mlx-lm's greedy output at 1-3 drafts, over prompts
that roll the window over and close compressed groups, with stop tokens and
token limits inside a draft; after every round, and after a rollback of
every length, each layer's window, compressed groups, indexer keys and open
group equal those of a decode that never saw the rejected drafts (one trunk
forward per round: nothing is replayed); ``batch_generate`` of 4 prompts
gives each its greedy output; ``--kv-bits`` is refused in one line.
"""

import json

import mlx.core as mx
import numpy as np
import pytest
import tiny
import tiny_v41
from mlx_lm.utils import load_model as mlx_lm_load_model
from mlx_lm_rounds import assert_states_match, run_with_snapshots, verify_and_roll_back
from test_hybrid import _first_accepted_draft
from test_speculative import PREFILL, mtp_greedy, reference_greedy

import mlx_mtp
from mlx_mtp.cache import rollback, start_verify
from mlx_mtp.cli.app import run_app
from mlx_mtp.decoder import Decoder

FIELDS = ("window", "compress_kv", "index_k", "pending_kv", "pending_gate")
ATOL = 1e-5


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root, done = tmp_path_factory.mktemp("v41"), {}

    def get(hc_head=False):
        if hc_head not in done:
            path = root / ("hc-head" if hc_head else "plain")
            done[hc_head] = tiny_v41.build_folder(path, hc_head=hc_head)
        return done[hc_head]

    return get


@pytest.fixture(scope="module")
def models(folders):
    full, trunk = folders()
    reference, _ = mlx_lm_load_model(trunk)
    return mlx_mtp.load_model(full), reference


# -- an independent numpy forward of the head ------------------------------------


def _rms(x, w=None, eps=1e-6):
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _fp8(x, block=32):
    """Round-trip through FP8 e4m3 with a power-of-two scale per 32 values."""
    shape = x.shape
    b = x.reshape(*shape[:-1], -1, block)
    amax = np.maximum(np.abs(b).max(axis=-1, keepdims=True), 1e-4)
    scale = 2.0 ** np.ceil(np.log2(amax / 448.0))
    v = np.clip(b / scale, -448, 448)
    # e4m3: 3 mantissa bits, smallest normal exponent -6 (subnormals below)
    e = np.floor(np.log2(np.maximum(np.abs(v), 2.0**-6)))
    step = 2.0 ** (e - 3)
    return (np.round(v / step) * step * scale).reshape(shape)


def _rope(x, pos, dims, theta, inverse=False):
    """Interleaved (traditional) RoPE on the last ``dims`` features; x [L, ..., D]."""
    head, tail = x[..., :-dims], x[..., -dims:].copy()
    freqs = theta ** (-np.arange(0, dims, 2) / dims)
    ang = pos.reshape(-1, *([1] * (x.ndim - 1))) * freqs
    if inverse:
        ang = -ang
    a, b = tail[..., 0::2].copy(), tail[..., 1::2].copy()
    tail[..., 0::2] = a * np.cos(ang) - b * np.sin(ang)
    tail[..., 1::2] = a * np.sin(ang) + b * np.cos(ang)
    return np.concatenate([head, tail], axis=-1)


def _mixer(w, p, streams, cfg):
    """A hyper-connection's pre, post and comb mixes (Sinkhorn-normalized comb)."""
    hc = cfg["hc_mult"]
    flat = _rms(streams.reshape(streams.shape[0], -1), eps=cfg["rms_norm_eps"])
    scale = np.repeat(w[p + "scale"], [hc, hc, hc * hc])
    mix = flat @ w[p + "fn"].T * scale + w[p + "base"]
    pre = _sigmoid(mix[:, :hc]) + cfg["hc_eps"]
    post = 2 * _sigmoid(mix[:, hc : 2 * hc])
    comb = _softmax(mix[:, 2 * hc :].reshape(-1, hc, hc)) + cfg["hc_eps"]
    comb = comb / (comb.sum(-2, keepdims=True) + cfg["hc_eps"])
    for _ in range(cfg["hc_sinkhorn_iters"] - 1):
        comb = comb / (comb.sum(-1, keepdims=True) + cfg["hc_eps"])
        comb = comb / (comb.sum(-2, keepdims=True) + cfg["hc_eps"])
    return pre, post, comb


def _collapse(streams, mix):
    return (mix[..., None] * streams).sum(axis=1)


def _expand(x, streams, post, comb):
    # stream b: post_b * x + sum_a comb[a, b] * stream a
    return post[..., None] * x[:, None] + np.einsum("lab,lad->lbd", comb, streams)


def _attention(w, p, x, cfg):
    L, H, D, r = x.shape[0], cfg["num_attention_heads"], cfg["head_dim"], cfg["qk_rope_head_dim"]  # fmt: skip
    eps, pos, theta = cfg["rms_norm_eps"], np.arange(x.shape[0]), 10000.0
    q = _rms(x @ w[p + "wq_a.weight"].T, w[p + "q_norm.weight"], eps)
    q = _rope((q @ w[p + "wq_b.weight"].T).reshape(L, H, D), pos, r, theta)
    kv = _rms(x @ w[p + "wkv.weight"].T, w[p + "kv_norm.weight"], eps)
    kv = _fp8(_rope(kv, pos, r, theta))
    scores = np.einsum("lhd,md->lhm", q, kv) * D**-0.5
    window = cfg["sliding_window"]
    seen = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    scores = np.where(seen[:, None], scores, -np.inf)
    sink = np.broadcast_to(w[p + "attn_sink"][None, :, None], (L, H, 1))
    probs = _softmax(np.concatenate([scores, sink], axis=-1))[..., :-1]
    out = _rope(np.einsum("lhm,md->lhd", probs, kv), pos, r, theta, inverse=True)
    groups = cfg["o_groups"]
    wo_a = w[p + "wo_a.weight"].reshape(groups, cfg["o_lora_rank"], -1)
    out = np.einsum("lgi,goi->lgo", out.reshape(L, groups, -1), wo_a)
    return out.reshape(L, -1) @ w[p + "wo_b.weight"].T


def _glu(w, p, x, limit=10.0):
    gate = np.minimum(x @ w[p + "w1.weight"].T, limit)
    up = np.clip(x @ w[p + "w3.weight"].T, -limit, limit)
    return (gate * _sigmoid(gate) * up) @ w[p + "w2.weight"].T


def _moe(w, p, x, cfg):
    scores = np.sqrt(np.logaddexp(0, x @ w[p + "gate.weight"].T))
    k = cfg["num_experts_per_tok"]
    out = _glu(w, p + "shared_experts.", x)
    for t in range(x.shape[0]):
        chosen = np.argsort(-(scores[t] + w[p + "gate.bias"]))[:k]
        weights = scores[t, chosen] / scores[t, chosen].sum() * 1.5
        for e, g in zip(chosen, weights):
            out[t] += g * _glu(w, f"{p}experts.{e}.", x[t : t + 1])[0]
    return out


def numpy_head(w, cfg, trunk_streams, next_tokens, embed, lm_head):
    """Logits for ``t_{i+2}`` from the streams at ``i`` and ``t_{i+1}``."""
    p, eps, hc = "mtp.0.", cfg["rms_norm_eps"], cfg["hc_mult"]
    e = _rms(embed[next_tokens], w[p + "enorm.weight"], eps) @ w[p + "e_proj.weight"].T
    h = _rms(trunk_streams, w[p + "hnorm.weight"], eps) @ w[p + "h_proj.weight"].T
    streams = e[:, None] + h
    first = np.zeros((len(next_tokens), hc))
    first[:, 0] = 1
    attn_pre, post, comb = _mixer(w, p + "hc_attn_", streams, cfg)
    x = _rms(_collapse(streams, first), w[p + "attn_norm.weight"], eps)
    streams = _expand(_attention(w, p + "attn.", x, cfg), streams, post, comb)
    ffn_pre, post, comb = _mixer(w, p + "hc_ffn_", streams, cfg)
    x = _rms(_collapse(streams, attn_pre), w[p + "ffn_norm.weight"], eps)
    streams = _expand(_moe(w, p + "ffn.", x, cfg), streams, post, comb)
    mix = ffn_pre
    if p + "hc_head_fn" in w:  # V4's hyper-connection head
        flat = _rms(streams.reshape(len(streams), -1), eps=eps)
        mix = flat @ w[p + "hc_head_fn"].T * w[p + "hc_head_scale"]
        mix = _sigmoid(mix + w[p + "hc_head_base"]) + cfg["hc_eps"]
    return _rms(_collapse(streams, mix), w[p + "norm.weight"], eps) @ lm_head.T


def trunk_streams(reference, tokens):
    """The streams mlx-lm's trunk hands from its last layer to the collapse."""
    from mlx_lm.models.deepseek_v41 import _window_indices

    text = reference.model
    cache = reference.make_cache()
    x = text.embed_tokens(mx.array(tokens)[None])
    hc = reference.args.hc_mult
    streams = mx.broadcast_to(x[:, :, None], (1, len(tokens), hc, x.shape[-1]))
    mix = mx.zeros((1, len(tokens), hc))
    mix[..., 0] = 1.0
    idx = _window_indices(
        previous=0, length=len(tokens), window=reference.args.sliding_window
    )[None]
    shared = {}
    for layer, c in zip(text.layers, cache):
        streams, mix = layer(
            streams, mix, start_pos=0, window_idx=idx, cache=c, shared=shared
        )
    return np.array(streams[0])


@pytest.mark.parametrize("hc_head", [False, True])
def test_head_matches_numpy(folders, hc_head):
    full, trunk = folders(hc_head)
    model = mlx_mtp.load_model(full)
    reference, _ = mlx_lm_load_model(trunk)
    cfg = {**tiny_v41.CONFIG, "hc_eps": reference.args.hc_eps, "hc_mult": 4}
    w = {k: np.array(v) for k, v in mx.load(str(full / "model.safetensors")).items()}
    tokens = tiny.random_prompt(24, seed=3)
    got = np.array(mlx_mtp.mtp_logits(model, tokens))
    streams = trunk_streams(reference, tokens)[:-1]
    want = numpy_head(w, cfg, streams, np.array(tokens[1:]), w["embed.weight"], w["head.weight"])  # fmt: skip
    assert got.shape == want.shape == (len(tokens) - 1, tiny.VOCAB)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    top = np.argsort(-want, axis=-1)[:, :5]
    np.testing.assert_allclose(
        np.take_along_axis(got, top, -1), np.take_along_axis(want, top, -1), atol=1e-4
    )


# -- greedy identity, states after every round -----------------------------------


def _state(c):
    return [getattr(c, f) for f in FIELDS] + [c.offset]


def assert_same_state(got, ref):
    for a, b, name in zip(got, ref, FIELDS + ("offset",)):
        if b is None or isinstance(b, int):
            assert a is None if b is None else a == b, name
            continue
        assert a is not None and a.shape == b.shape and a.dtype == b.dtype, name
        np.testing.assert_allclose(np.array(a), np.array(b), atol=ATOL, err_msg=name)


def _states(trunk):
    return [_state(c) for c in trunk]


def check_states(states, ref):
    for got, r in zip(states, ref):
        assert_same_state(got, _state(r))


@pytest.mark.parametrize("draft_max", [1, 2, 3])
def test_greedy_identical_and_states_after_every_round(models, draft_max):
    model, reference = models
    prompt = tiny.random_prompt(3 * PREFILL + 5, seed=1)  # several prefill chunks
    expected = reference_greedy(reference, prompt, 40)
    got, stats, snapshots, forwards = run_with_snapshots(
        model, prompt, 40, draft_max, _states
    )
    assert got == expected
    assert 0 < stats.accepted < stats.drafted  # accepted and rejected drafts
    assert stats.generation_tokens == len(got) == stats.rounds + stats.accepted
    assert forwards == stats.rounds == len(snapshots)  # no replay for a rollback
    assert_states_match(reference, prompt, got, snapshots, check_states)


@pytest.mark.parametrize("draft_max", [1, 2, 3])
def test_stop_and_max_tokens_inside_a_draft(models, draft_max):
    model, reference = models
    prompt = tiny.random_prompt(30, seed=2)
    free, stats, _ = mtp_greedy(model, prompt, 48, draft_max)
    found = _first_accepted_draft(free, stats.trace)
    assert found is not None
    pos, stop = found
    expected = reference_greedy(reference, prompt, 48, stop={stop})
    got, st, snapshots, _ = run_with_snapshots(
        model, prompt, 48, draft_max, _states, {stop}
    )
    assert got == expected and got[-1] == stop and len(got) == pos + 1
    assert st.generation_tokens == len(got) == st.rounds + st.accepted
    assert_states_match(reference, prompt, got, snapshots, check_states)
    expected = reference_greedy(reference, prompt, pos + 1)
    got, st, snapshots, _ = run_with_snapshots(
        model, prompt, pos + 1, draft_max, _states
    )
    assert got == expected and len(got) == pos + 1
    assert_states_match(reference, prompt, got, snapshots, check_states)


# -- rollback --------------------------------------------------------------------


def check_rollback(model, reference, prompt, n, split):
    """Verify 6 tokens (one forward, or two), roll back ``n``: every state is
    that of mlx-lm's decode of the prompt and the ``6 - n`` kept tokens."""
    cache, ref = verify_and_roll_back(model, reference, prompt, n, split)
    for c, r in zip(cache, ref):
        assert not c.verifying
        assert_same_state(_state(c), _state(r))
    return cache


def test_rollback_of_every_length(models):
    model, reference = models
    # 30 tokens: the window (8) has rolled over, 4-token groups have 2 rows open;
    # verifying 6 closes two more groups, which rolling back 3 or more reopens
    prompt = tiny.random_prompt(30, seed=4)
    for n, split in [(0, 6), (1, 6), (2, 6), (3, 6), (5, 6), (6, 6), (4, 2), (2, 3)]:
        check_rollback(model, reference, prompt, n, split)
    cache = check_rollback(model, reference, prompt[:2], 5, 6)  # a short history
    assert cache[1].compress_kv is None  # no group was ever closed
    cache = model.make_cache().trunk
    start_verify(cache)
    model.target(mx.array([[7, 8]]), cache)
    with pytest.raises(ValueError, match="cannot roll back 3 of 2"):
        rollback(cache, 3)
    with pytest.raises(RuntimeError, match="outside a verify pass"):
        rollback(cache, 1)


def test_a_snapshot_brings_the_caches_back(models):
    model, reference = models
    cache = model.make_cache()
    model.target(mx.array([tiny.random_prompt(21, seed=5)]), cache.trunk)
    before = [_state(c) for c in cache.trunk]
    snapshot = cache.snapshot(trunk_only=True)
    assert snapshot is not None
    model.target(mx.array([[3, 4, 5, 6, 7]]), cache.trunk)
    cache.restore(snapshot)
    for c, b in zip(cache.trunk, before):
        assert_same_state(_state(c), b)


def test_the_trunk_alone_generates_as_mlx_lm(folders):
    _, trunk = folders()
    model = mlx_mtp.load_model(trunk)
    assert model.head is None and "no MTP tensors" in model.notice
    reference, _ = mlx_lm_load_model(trunk)
    prompt = tiny.random_prompt(20, seed=6)
    got, stats, _ = mtp_greedy(model, prompt, 12, draft_max=3)
    assert got == reference_greedy(reference, prompt, 12) and stats.drafted == 0


# -- batches, quantized caches -----------------------------------------------------


def test_batch_generate_gives_each_prompt_its_greedy_output(folders, models):
    """Its caches have no batch form (mlx-lm's forward takes one position for
    every row: docs/design.md 3a), so a batch decodes its streams one at a
    time; each gets its greedy output."""
    _, reference = models
    model, tokenizer = mlx_mtp.load(folders()[0])
    assert not Decoder(model).batched
    prompts = [tiny.random_prompt(12 + 7 * i, seed=10 + i) for i in range(4)]
    got = mlx_mtp.batch_generate(
        model,
        tokenizer,
        prompts,
        max_tokens=16,
        return_token_ids=True,
        draft_max=2,
        adaptive_draft=False,
    )
    want = [reference_greedy(reference, p, 16) for p in prompts]
    eos = tiny.special_id("<|im_end|>")
    want = [w[: w.index(eos)] if eos in w else w for w in want]  # eos not kept
    assert got.token_ids == want
    assert sum(s.accepted for s in got.mtp_stats) > 0


def test_kv_bits_is_refused_in_one_line(folders, capsys):
    code = run_app(["generate", "-m", str(folders()[0]), "-p", "hi", "-n", "4",
                    "--no-chat-template", "--kv-bits", "8"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1
    assert "deepseek_v41" in err[0] and "kv_bits" in err[0]


def test_info_lists_the_family(capsys):
    assert run_app(["info", "--json"]) == 0
    rows = {r["model_type"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["deepseek_v41"]["mtp_layers"] == 1
    assert "DeepSeek-V4.1" in rows["deepseek_v41"]["models"]


def test_dspark_stages_under_mtp_generate_without_mtp(tmp_path, capsys):
    # V4.1 releases ship DSpark stages under mtp.* (vLLM's speculative.py): a
    # block drafter this head would misread; the trunk generates plainly
    config, trunk_w, mtp_w = tiny_v41.build_weights(0, True)
    h = config["hidden_size"]
    mtp_w["mtp.0.main_proj.weight"] = mx.zeros((h, 2 * h))
    folder = tiny_v41.save_folder(tmp_path / "dspark", config, trunk_w, mtp_w)
    model = mlx_mtp.load_model(folder)
    assert model.head is None and "DSpark" in model.notice
    reference, _ = mlx_lm_load_model(tiny_v41.save_folder(
        tmp_path / "trunk", config, trunk_w))  # fmt: skip
    prompt = tiny.random_prompt(12, seed=3)
    got, _, _ = mtp_greedy(model, prompt, 6, draft_max=2)
    assert got == reference_greedy(reference, prompt, 6)
    assert run_app(["generate", "-m", str(folder), "-p", "hi", "-n", "2",
                    "--no-chat-template"]) == 0  # fmt: skip
    assert "DSpark" in capsys.readouterr().err
