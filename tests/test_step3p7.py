"""Step-3.7 (``step3p7``): mlx-vlm's trunk, Step-3.5's MTP layers, rollback.

No public runtime runs Step-3.7's MTP layers (mlx-vlm 0.7.10 drops them), so
the head's reference is written here from Step-3.5's published wiring (vLLM
``step3p5_mtp.py``: Gemma-style ``x * (1 + w)`` norms, ``eh_proj(cat[enorm(e),
hnorm(h)])``, each layer's ``shared_head``): numpy for the fuse and the
output, around mlx-vlm's own Step-3.7 decoder layer at index ``N + j`` with
its weights through mlx-vlm's own sanitize. Greedy decoding is checked
against mlx-vlm's plain loop over its ``LanguageModel`` (its own rotating
caches on the sliding layers).
"""

import json
import re
import subprocess
import sys
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip(
    "mlx_vlm", reason="mlx-vlm is not installed (pip install '.[vision]')"
)

import tiny_step3p7  # noqa: E402
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from tiny import random_prompt

from vlm_greedy import mtp_greedy, vlm_greedy  # noqa: E402
import mlx_mtp
from mlx_mtp.cache import rollback, start_verify
from mlx_mtp.heads import MultiLayerHead

PROMPT = random_prompt(30, seed=3)  # well past the sliding window of 6
LAYERS = 3


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return tiny_step3p7.build_folder(tmp_path_factory.mktemp("step3p7") / "m")


@pytest.fixture(scope="module")
def model(folders):
    return mlx_mtp.load(folders[0])


@pytest.fixture(scope="module")
def reference(folders):
    from mlx_vlm.utils import load_model

    return load_model(folders[1]).language_model


def test_loads_mlx_vlm_trunk_with_three_step_layers(model, folders):
    from mlx_vlm.models.step3p7.language import DecoderLayer

    m, _ = model
    head = m.head
    assert isinstance(head, MultiLayerHead) and head.num_layers == LAYERS
    assert type(m.target).__name__ == "VLMTextTarget" and m.notice is None
    names = [k for k, _ in tree_flatten(m.target.model.parameters())]
    assert not any(k.startswith("model.layers.3.") for k in names)  # trunk: 0..2
    # Step-3.5's taps: the trunk's state before its norm, blocks chained pre-norm
    assert m.target.hidden_tap == "pre"
    assert all(head.layer(j).chain_hidden == "pre" for j in range(LAYERS))
    assert all(isinstance(head.layer(j).block, DecoderLayer) for j in range(LAYERS))
    # each layer holds its own tensors, its own output projection
    w = [np.array(head.layer(j).shared_head.output.weight) for j in range(LAYERS)]
    assert not np.allclose(w[0], w[1]) and not np.allclose(w[1], w[2])
    # layer types and MoE reach past the trunk: 3 full, 4 full+MoE, 5 sliding
    kinds = [(head.layer(j).block.is_sliding, head.layer(j).block.is_moe_layer)
             for j in range(LAYERS)]  # fmt: skip
    assert kinds == [(True, False), (False, True), (True, False)]
    # every trunk layer has a cache that drops tokens (sliding ones included)
    assert all(type(c) is KVCache for c in m.make_cache().trunk)


# --- the reference, from Step-3.5's published wiring -------------------------


def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def step_layer(reference, config, weights, j, hidden, tokens):
    """(logits, chained state) of MTP layer ``j``: numpy fuse and shared head
    with ``1 + w`` norms, the block mlx-vlm's own layer at ``N + j``."""
    from mlx_vlm.models.step3p7.language import DecoderLayer

    text = config["text_config"]
    n, eps = text["num_hidden_layers"], text["rms_norm_eps"]
    pre = f"model.layers.{n + j}."
    g = lambda k: np.array(weights[k])  # noqa: E731
    e = g("model.embed_tokens.weight")[tokens]
    fused = np.concatenate(
        [rms(e, 1 + g(pre + "enorm.weight"), eps),
         rms(hidden, 1 + g(pre + "hnorm.weight"), eps)], -1,
    ) @ g(pre + "eh_proj.weight").T  # fmt: skip
    args = replace(
        reference.args,
        num_hidden_layers=n + LAYERS,
        layer_types=text["layer_types"],
        swiglu_limits=text["swiglu_limits"],
    )
    layer = DecoderLayer(args, n + j)
    own = ("enorm", "hnorm", "eh_proj", "shared_head")
    block = {
        "model.layers.0." + k[len(pre) :]: v
        for k, v in weights.items()
        if k.startswith(pre) and k[len(pre) :].split(".")[0] not in own
    }
    # mlx-vlm's sanitize (MoE names, 1 + w norms), which adds the 1 where it
    # sees a checkpoint in Hugging Face names: the whole file's, here the
    # trunk's MoE layer 1 beside the block (a dense block alone has none)
    moe = {k: v for k, v in weights.items() if k.startswith("model.layers.1.moe.")}
    clean = reference.sanitize({**block, **moe})
    layer.load_weights(
        [(k[len("model.layers.0.") :], v) for k, v in clean.items()
         if k.startswith("model.layers.0.")]
    )  # fmt: skip
    x = mx.array(fused)[None]
    window = text["sliding_window"] if layer.is_sliding else None
    mask = create_attention_mask(x, None, window_size=window, return_array=True)
    y = np.array(layer(x, mask, KVCache()))[0]
    h = rms(y, 1 + g(pre + "shared_head.norm.weight"), eps)
    return h @ g(pre + "shared_head.output.weight").T, y


@pytest.mark.parametrize("j", range(LAYERS))
def test_each_layer_equals_the_step35_reference(model, reference, folders, j):
    m, _ = model
    config = json.loads((folders[0] / "config.json").read_text())
    weights = mx.load(str(folders[0] / "model.safetensors"))
    rng = np.random.default_rng(j)
    hidden = rng.standard_normal((12, 64)).astype(np.float32)  # past the window
    tokens = rng.integers(0, 256, 12)
    want, chained = step_layer(reference, config, weights, j, hidden, tokens)
    layer = m.head.layer(j)
    got, out = layer(mx.array(hidden)[None], mx.array(tokens)[None], layer.make_cache())
    got = np.array(got[0])
    assert (got.argmax(-1) == want.argmax(-1)).all()
    top5 = np.argsort(-want, axis=-1)[:, :5]
    np.testing.assert_allclose(
        np.take_along_axis(got, top5, -1), np.take_along_axis(want, top5, -1), atol=1e-4
    )
    np.testing.assert_allclose(np.array(out[0]), chained, atol=1e-4)


def test_the_head_reads_the_trunk_state_before_its_norm(model, reference):
    m, _ = model
    tokens = mx.array(PROMPT)[None]
    _, taps = m.target.forward(tokens, m.target.make_cache())
    captured = {}
    norm = reference.model.norm
    base = type(norm)

    class Capture(base):
        def __call__(self, x):
            captured["x"] = x
            return base.__call__(self, x)

    norm.__class__ = Capture
    try:
        reference(tokens, cache=reference.make_cache())
    finally:
        norm.__class__ = base
    want = np.array(captured["x"])
    np.testing.assert_allclose(np.array(taps.hidden), want, atol=1e-5)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_equals_mlx_vlm_with_drafts_accepted(model, reference, k):
    m, _ = model
    expected = vlm_greedy(reference, PROMPT, 40)
    got, stats = mtp_greedy(m, PROMPT, 40, k)
    assert got == expected
    assert 0 < stats.accepted < stats.drafted
    assert stats.generation_tokens == len(got) == stats.rounds + stats.accepted
    assert all(a > 0 for a in stats.accepted_at[:k])  # every depth's layer kept some


def test_stop_and_max_tokens_inside_a_draft(model, reference):
    m, _ = model
    free, stats = mtp_greedy(m, PROMPT, 40, 3)
    pos = 0
    for r in stats.trace:
        if r.accepted >= 2 and free[pos + 1] not in free[: pos + 1]:
            break
        pos += r.accepted + 1
    stop = free[pos + 1]  # drafted by layer 1, inside the round
    got, _ = mtp_greedy(m, PROMPT, 40, 3, stop={stop})
    assert got == vlm_greedy(reference, PROMPT, 40, stop={stop})
    assert got[-1] == stop and len(got) == pos + 2
    got, _ = mtp_greedy(m, PROMPT, pos + 2, 3)
    assert got == vlm_greedy(reference, PROMPT, pos + 2)


def _same(caches, refs):
    for c, r in zip(caches, refs):
        assert c.offset == r.offset
        n = c.offset
        for a, b in ((c.keys, r.keys), (c.values, r.values)):
            np.testing.assert_allclose(
                np.array(a[..., :n, :]), np.array(b[..., :n, :]), atol=1e-5
            )


@pytest.mark.parametrize("n, verified", [(0, 4), (1, 4), (3, 4), (2, 3)])
def test_rollback_equals_a_decode_that_never_saw_the_draft(model, n, verified):
    """Verify, reject the last ``n``: every layer's keys and values (the
    sliding layers' whole history) equal a decode of the kept tokens, and so
    does each MTP layer's cache."""
    m, _ = model
    t = m.target
    draft = [5, 77, 130, 9][:verified]
    cache = t.make_cache()
    t.forward(mx.array(PROMPT[:-1])[None], cache)
    start_verify(cache)
    t.forward(mx.array([PROMPT[-1], *draft[:-1]])[None], cache)
    rollback(cache, n)
    ref = t.make_cache()
    t.forward(mx.array(PROMPT[:-1])[None], ref)
    for tok in [PROMPT[-1], *draft[:-1]][: verified - n]:
        t.forward(mx.array([[tok]]), ref)
    _same(cache, ref)
    a, _ = t.forward(mx.array([[11]]), cache)
    b, _ = t.forward(mx.array([[11]]), ref)
    np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5)
    for j in range(LAYERS):
        layer = m.head.layer(j)
        h = mx.random.normal((1, 12, 64))
        toks = mx.array(PROMPT[:12])[None]
        hc = layer.make_cache()
        layer(h[:, :-3], toks[:, :-3], hc)
        layer(h[:, -3:], toks[:, -3:], hc)
        rollback(hc, n)
        hr = layer.make_cache()
        layer(h[:, : 12 - n], toks[:, : 12 - n], hr)
        _same(hc, hr)


def test_batch_generate_four_ragged_streams_greedy(model, reference):
    m, tok = model
    prompts = [random_prompt(20 + 3 * i, seed=10 + i) for i in range(4)]
    out = mlx_mtp.batch_generate(
        m, tok, prompts, max_tokens=12, return_token_ids=True, temp=0.0
    )
    for p, ids in zip(prompts, out.token_ids):
        assert list(ids) == vlm_greedy(reference, p, 12)
    assert sum(s.accepted for s in out.mtp_stats) > 0


class _Logits:
    """mlx-vlm's language model as mlx-lm's ``generate_step`` calls a model."""

    def __init__(self, lm):
        self.lm = lm

    def __call__(self, inputs, cache=None, **kwargs):
        return self.lm(inputs, cache=cache).logits


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """The same family with heads 32 wide, so 8-bit groups of 32 fit them."""
    from mlx_vlm.utils import load_model

    root = tmp_path_factory.mktemp("step3p7-wide")
    full, trunk = tiny_step3p7.build_folder(root / "m", head_dim=32)
    return mlx_mtp.load(full), load_model(trunk).language_model


def test_kv_bits_8_equals_mlx_lm_generate_step(wide):
    """``kv_bits=8`` quantizes every layer's cache (the sliding ones too:
    mlx-mtp keeps them plain, the window in their masks) and the tokens are
    mlx-lm's ``generate_step(kv_bits=8)`` over mlx-vlm's language model on the
    same caches, at each draft count, with drafts accepted."""
    from mlx_lm.generate import generate_step

    (m, tok), lm = wide
    kv = dict(kv_bits=8, kv_group_size=32, quantized_kv_start=0)
    cache = [KVCache() for _ in lm.layers]
    steps = generate_step(mx.array(PROMPT), _Logits(lm), prompt_cache=cache, **kv)
    want = [(int(t), lp) for (t, lp), _ in zip(steps, range(24))]
    cache = [KVCache() for _ in lm.layers]
    steps = generate_step(mx.array(PROMPT), _Logits(lm), prompt_cache=cache)
    full = [lp for (_, lp), _ in zip(steps, range(24))]
    # the quantized cache changes the model's distributions: the test sees it
    assert any(not mx.array_equal(a[1], b) for a, b in zip(want, full))
    for k in (1, 2, 3):
        got = list(mlx_mtp.stream_generate(
            m, tok, PROMPT, 24, draft_max=k, adaptive_draft=False, **kv
        ))  # fmt: skip
        assert [r.token for r in got] == [t for t, _ in want]
        for r, (_, lp) in zip(got, want):
            np.testing.assert_allclose(np.array(r.logprobs), np.array(lp), atol=1e-4)
        assert got[-1].stats.accepted > 0
    quantized = m.make_cache()
    list(mlx_mtp.stream_generate(m, tok, PROMPT, 4, prompt_cache=quantized, **kv))
    assert all(getattr(c, "bits", None) == 8 for c in quantized.trunk)


def _bits(module):
    return {x.bits for _, x in module.named_modules() if hasattr(x, "bits")}


def test_convert_quantized_keeps_the_mtp_layers_at_8_bits(folders, tmp_path):
    from mlx_vlm.utils import load_model

    from mlx_mtp.convert import convert

    out = convert(folders[0], tmp_path / "q4", quantize=True, q_group_size=32)
    quant = json.loads((out / "config.json").read_text())["quantization"]
    assert quant["bits"] == 4
    mtp_q = {k: v for k, v in quant.items() if k.startswith("model.layers.")}
    assert mtp_q and all(v["bits"] == 8 for v in mtp_q.values())
    assert {k.split(".")[2] for k in mtp_q} == {"3", "4", "5"}  # the MTP layers
    # every trunk module listed where mlx-vlm's loader looks for it, at 4 bits
    trunk_q = {k: v for k, v in quant.items() if k.startswith("language_model.")}
    assert trunk_q and all(v["bits"] == 4 for v in trunk_q.values())
    head_names = list(mx.load(str(out / "mtp.safetensors")))
    assert {k.split(".")[2] for k in head_names} == {"3", "4", "5"}
    m, _ = mlx_mtp.load(out)
    assert m.head.num_layers == LAYERS
    assert _bits(m.head) == {8} and 4 in _bits(m.target.model)
    got, stats = mtp_greedy(m, PROMPT, 30, 3)
    assert got == vlm_greedy(load_model(out).language_model, PROMPT, 30)
    assert stats.accepted > 0


def test_the_vlm_names_of_the_layers_load_the_same(model, folders, tmp_path):
    """A checkpoint under ``model.language_model.`` (mlx-vlm's sanitize reads
    both names and drops layers past the trunk under each): the same head."""
    from tiny import save_folder

    config = json.loads((folders[0] / "config.json").read_text())
    weights = mx.load(str(folders[0] / "model.safetensors"))
    vlm = "model.language_model."
    renamed = {
        (vlm + k[len("model.") :] if k.startswith("model.") else k): v
        for k, v in weights.items()
    }
    m2, _ = mlx_mtp.load(save_folder(tmp_path / "vlm-names", config, renamed))
    m, _ = model
    h = mx.random.normal((1, 9, 64))
    toks = mx.array(PROMPT[:9])[None]
    for j in range(LAYERS):
        a, _ = m.head.layer(j)(h, toks, m.head.layer(j).make_cache())
        b, _ = m2.head.layer(j)(h, toks, m2.head.layer(j).make_cache())
        np.testing.assert_array_equal(np.array(a), np.array(b))


def test_info_lists_the_family_its_layers_and_source(folders):
    from mlx_mtp import families

    (found,) = [f for f in families.families() if f["model_type"] == "step3p7"]
    assert found["models"].startswith("Step-3.7") and "unverified" in found["models"]
    assert found["mtp_layers"] == 3 and found["layer_per_depth"]
    r = subprocess.run(
        [sys.executable, "-m", "mlx_mtp", "info"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0 and "step3p7" in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "mlx_mtp", "info", str(folders[0])],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0 and re.search(r"MTP layers\s+3\n", r.stdout)
    assert re.search(r"architecture\s+step3p7\n", r.stdout)


def test_served_batch_answers_as_alone(model):
    """Four requests at once through ``mlx-mtp serve``: one batch (its caches
    mlx-lm's, merged ragged), each answer the one it gets alone."""
    import threading

    from live_server import LiveServer

    from mlx_mtp.draft_settings import DraftSettings
    from mlx_mtp.serve import ServeConfig

    m, tok = model
    config = ServeConfig(
        max_batch=4, prompt_cache_entries=0, lookup_memory_bytes=0,
        drafts=DraftSettings(adaptive=False),
    )  # fmt: skip
    server = LiveServer(m, tok, "step3p7", config)
    try:
        client = server.client()

        def ask(i):
            r = client.completions.create(
                model="step3p7", prompt=f"Q{i}: " + "abcd"[: i + 1] * (i + 2),
                max_tokens=16 + 4 * i, extra_body={"draft_max": [3, 2, 1, 3][i]},
            )  # fmt: skip
            return r.choices[0].text, r.usage

        alone = [ask(i) for i in range(4)]
        together = [None] * 4
        threads = [
            threading.Thread(target=lambda i=i: together.__setitem__(i, ask(i)))
            for i in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert [t for t, _ in together] == [t for t, _ in alone]
        assert server.get("/health")[1]["peak_batch"] == 4
        assert sum(u.mtp["accepted"] for _, u in together) > 0
    finally:
        server.close()
