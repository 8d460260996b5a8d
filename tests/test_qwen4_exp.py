"""Qwen3.8-Flash-Next (``qwen4_exp``): a target mlx-lm does not load, rollback, head.

The references are mlx-vlm 0.7.10's own: its loader and language model for
greedy decoding (a plain loop over ``LanguageModel``, which decodes single
tokens with its batch-invariant path), and its drafter module
(``Qwen4ExpMTPDraftModel``) for the head's logits on the same weights and
hidden states. A numpy reference of QSA (indexer, block pooling, sparse
selection) would be larger than the head; mlx-vlm's drafter is the check.
"""

import json
import subprocess
import sys
import threading

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm", reason="mlx-vlm is not installed (pip install '.[vision]')")

import tiny_qwen4  # noqa: E402
from tiny import random_prompt
from mlx.utils import tree_flatten

from live_server import LiveServer  # noqa: E402
from vlm_greedy import batched_greedy, mtp_greedy, streamed_text, vlm_greedy  # noqa: E402
import mlx_mtp
from mlx_mtp import batch_cache
from mlx_mtp.draft_settings import DraftSettings
from mlx_mtp.serve import ServeConfig
from mlx_mtp.cache import rollback, start_verify
from mlx_mtp.recurrent.vlm_cache import (
    BatchArraysCache,
    RaggedQSACache,
    RollbackQSACache,
    VerifyArraysCache,
)

PROMPT = random_prompt(30, seed=3)  # past the QSA budget: sparse attention


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return tiny_qwen4.build_folder(tmp_path_factory.mktemp("qwen4") / "m")


@pytest.fixture(scope="module")
def model(folders):
    return mlx_mtp.load(folders[0])


@pytest.fixture(scope="module")
def reference(folders):
    from mlx_vlm.utils import load_model

    return load_model(folders[1]).language_model


def test_loads_through_mlx_vlm_with_its_head(model):
    m, _ = model
    assert m.head is not None and m.notice is None
    assert type(m.target).__name__ == "VLMTextTarget"
    assert m.target.hidden_tap == "pre"
    # the trunk holds no MTP tensor; the head holds all of them
    names = [k for k, _ in tree_flatten(m.target.model.parameters())]
    assert names and not any("mtp" in k for k in names)
    caches = m.make_cache().trunk
    assert [type(c) for c in caches] == [
        VerifyArraysCache, RollbackQSACache, VerifyArraysCache, RollbackQSACache
    ]
    assert len(caches[0].cache) == 4  # GDN conv + state, PLE conv + n-gram history


def test_head_logits_equal_mlx_vlm_drafter(model, reference, folders):
    """Teacher-forced: the same pre-mixer streams and tokens through mlx-vlm's
    drafter (its weights from the same ``mtp.*`` tensors) and through the head."""
    from mlx_vlm.speculative.drafters.qwen4_exp_mtp import Model, ModelConfig
    from mlx_mtp.weights import read_safetensors

    m, _ = model
    config = json.loads((folders[0] / "config.json").read_text())
    drafter = Model(ModelConfig.from_dict(config))
    tensors = read_safetensors([folders[0] / "model.safetensors"])
    drafter.load_weights(list(drafter.sanitize(
        {k: v for k, v in tensors.items() if k.startswith("mtp.")}
    ).items()))
    drafter.bind(reference)

    tokens = mx.array(PROMPT)[None]
    out = reference(tokens, cache=reference.make_cache(), return_hidden=True)
    streams = out.hidden_states[0]  # mlx-vlm's own pre-mixer capture
    _, taps = m.target.forward(tokens, m.target.make_cache())
    np.testing.assert_allclose(np.array(taps.hidden), np.array(streams), atol=1e-5)
    assert streams.shape[-1] == 2 * 32  # hc_count streams of hidden_size

    nxt = tokens[:, 1:]
    h = streams[:, :-1]
    want_hidden, want_pre = drafter._forward_hidden(
        drafter._input_embed(nxt), h, nxt, drafter.make_cache()
    )
    want = np.array(reference.lm_head(want_hidden))[0]
    got_logits, got_pre = m.head(h, nxt, m.head.make_cache())
    got = np.array(got_logits)[0]
    assert (got.argmax(-1) == want.argmax(-1)).all()
    top5 = np.argsort(-want, axis=-1)[:, :5]
    np.testing.assert_allclose(
        np.take_along_axis(got, top5, -1), np.take_along_axis(want, top5, -1), atol=1e-4
    )
    np.testing.assert_allclose(np.array(got_pre), np.array(want_pre), atol=1e-5)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_equals_mlx_vlm_with_drafts_accepted(model, reference, k):
    m, _ = model
    expected = vlm_greedy(reference, PROMPT, 40)
    got, stats = mtp_greedy(m, PROMPT, 40, k)
    assert got == expected
    assert 0 < stats.accepted < stats.drafted  # kept and rejected drafts both ran
    assert stats.generation_tokens == len(got) == stats.rounds + stats.accepted


def _accepted_draft(out, trace):
    pos = 0
    for r in trace:
        if r.accepted >= 1 and out[pos] not in out[:pos]:
            return pos, out[pos]
        pos += r.accepted + 1
    return None


@pytest.mark.parametrize("k", [2, 3])
def test_stop_and_max_tokens_inside_a_draft(model, reference, k):
    m, _ = model
    free, stats = mtp_greedy(m, PROMPT, 40, k)
    pos, stop = _accepted_draft(free, stats.trace)
    got, _ = mtp_greedy(m, PROMPT, 40, k, stop={stop})
    assert got == vlm_greedy(reference, PROMPT, 40, stop={stop})
    assert got[-1] == stop and len(got) == pos + 1
    got, _ = mtp_greedy(m, PROMPT, pos + 1, k)
    assert got == vlm_greedy(reference, PROMPT, pos + 1)


def _state(c):
    """Every array a layer's cache holds (None where it holds none)."""
    if isinstance(c, VerifyArraysCache):
        assert not c.verifying  # nothing kept after a rollback
        return list(c.cache)
    out = [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
    return out + [c.index_keys, c.index_position_ids, c.index_block_keys]


def _same(a, b):
    assert (a is None) == (b is None)
    if a is not None:
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5)


@pytest.mark.parametrize("n, verified", [(0, 4), (1, 4), (3, 4), (2, 3), (1, 2)])
def test_rollback_equals_a_decode_that_never_saw_the_draft(model, n, verified):
    """Verify ``verified`` tokens, reject the last ``n``: every array of every
    cache (GDN conv and state, the n-gram history and PLE conv, QSA keys,
    values, indexer keys, positions and block summaries) equals that of a
    decode of the kept tokens alone; the head's QSA cache too."""
    m, _ = model
    t = m.target
    draft = [5, 77, 130, 9][:verified]
    cache = t.make_cache()
    t.forward(mx.array(PROMPT[:-1])[None], cache)  # blocks completed before
    start_verify(cache)
    t.forward(mx.array([PROMPT[-1], *draft[:-1]])[None], cache)
    rollback(cache, n)
    ref = t.make_cache()
    t.forward(mx.array(PROMPT[:-1])[None], ref)
    for tok in [PROMPT[-1], *draft[:-1]][: verified - n]:
        t.forward(mx.array([[tok]]), ref)
    for c, r in zip(cache, ref):
        for a, b in zip(_state(c), _state(r)):
            _same(a, b)
    # and the decode goes on as if the rejected tokens were never read
    a, _ = t.forward(mx.array([[11]]), cache)
    b, _ = t.forward(mx.array([[11]]), ref)
    np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5)

    head = m.head
    h = mx.random.normal((1, len(PROMPT) + 3, 64))
    toks = mx.array(PROMPT + [1, 2, 3])[None]
    hc = head.make_cache()
    head(h[:, :-3], toks[:, :-3], hc)
    head(h[:, -3:], toks[:, -3:], hc)
    rollback(hc, n)
    hr = head.make_cache()
    head(h[:, : h.shape[1] - n], toks[:, : h.shape[1] - n], hr)
    for a, b in zip(_state(hc[0]), _state(hr[0])):
        _same(a, b)


def test_rollback_of_every_verified_token_is_refused(model):
    m, _ = model
    cache = m.target.make_cache()
    m.target.forward(mx.array(PROMPT)[None], cache)
    start_verify(cache)
    m.target.forward(mx.array([[1, 2, 3]]), cache)
    with pytest.raises(ValueError, match="cannot roll back 3 of 3"):
        rollback(cache, 3)


def test_batch_generate_four_streams_greedy(model, reference):
    m, tok = model
    prompts = [random_prompt(20 + 3 * i, seed=10 + i) for i in range(4)]
    out = mlx_mtp.batch_generate(
        m, tok, prompts, max_tokens=12, return_token_ids=True, temp=0.0
    )
    for p, ids in zip(prompts, out.token_ids):
        assert list(ids) == vlm_greedy(reference, p, 12)
    assert sum(s.accepted for s in out.mtp_stats) > 0
    # the streams shared their rounds: fewer batched rounds than theirs
    assert out.stats.generation_steps < sum(s.rounds for s in out.mtp_stats)


# prompt lengths on both sides of the QSA budget (8 tokens: 4 blocks of 2)
RAGGED = [20, 31, 9, 26, 14, 35, 5, 23]
LIMITS = [12, 7, 15, 9, 11, 6, 13, 10]


@pytest.mark.parametrize("streams", [4, 8])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_ragged_streams_decode_batched_as_mlx_vlm_alone(model, reference, streams, k):
    """4 or 8 streams at different lengths, each leaving at its own limit (and
    with 8, three joining the running batch) decode in one trunk forward a
    round, each stream's greedy tokens mlx-vlm's plain ones."""
    m, _ = model
    prompts = [random_prompt(n, seed=10 + i) for i, n in enumerate(RAGGED[:streams])]
    limits = LIMITS[:streams]
    join = (5, 6, 7) if streams == 8 else ()
    got, ss, decoder, rounds, forwards = batched_greedy(
        m, prompts, limits, [k] * streams, join=join
    )
    assert decoder.batched and decoder.peak == streams
    assert forwards == rounds < sum(s.stats.rounds for s in ss)
    for i, p in enumerate(prompts):
        assert got[i] == vlm_greedy(reference, p, limits[i]), f"stream {i}"
    assert sum(s.stats.accepted for s in ss) > 0
    assert len({s.stats.accepted for s in ss}) > 1  # ragged acceptance


@pytest.mark.parametrize("kept", [[4, 1, 3, 2], [2, 4, 1, 4]])
def test_batch_rollback_per_stream_equals_decodes_that_never_saw_the_drafts(
    model, kept
):
    """Four streams at different lengths verify 4 tokens each in one forward
    and keep ``kept[b]`` of them: each stream's extracted caches (GDN conv and
    state, the n-gram history and PLE conv, QSA keys, values, indexer keys,
    positions, block summaries) equal those of decoding its kept tokens alone,
    and the batch decodes on as those do; the head's batch cache likewise."""
    m, _ = model
    t = m.target
    prompts = [random_prompt(n, seed=20 + i) for i, n in enumerate([30, 12, 21, 17])]
    rows = [[p[-1], 5 + i, 77, 130 - i] for i, p in enumerate(prompts)]
    singles = []
    for p in prompts:
        c = t.make_cache()
        t.forward(mx.array(p[:-1])[None], c)
        singles.append(c)
    kinds = [type(c) for c in singles[0]]
    batch = [batch_cache.merge(layer) for layer in zip(*singles)]
    assert [type(c) for c in batch] == [
        BatchArraysCache, RaggedQSACache, BatchArraysCache, RaggedQSACache
    ]  # fmt: skip
    start_verify(batch)
    t.forward(mx.array(rows), batch)
    batch_cache.rollback(batch, [4 - n for n in kept])
    refs = []
    for p, row, n in zip(prompts, rows, kept):
        ref = t.make_cache()
        t.forward(mx.array(p[:-1])[None], ref)
        for tok in row[:n]:
            t.forward(mx.array([[tok]]), ref)
        refs.append(ref)
    for b, ref in enumerate(refs):
        got = [c.extract(b, kind) for c, kind in zip(batch, kinds)]
        assert [type(c) for c in got] == kinds
        for c, r in zip(got, ref):
            for x, y in zip(_state(c), _state(r)):
                _same(x, y)
    # the batch reads on from each stream's kept tokens
    a, _ = t.forward(mx.array([[11]] * 4), batch)
    for b, ref in enumerate(refs):
        r, _ = t.forward(mx.array([[11]]), ref)
        np.testing.assert_allclose(np.array(a[b]), np.array(r[0]), atol=1e-5)

    head = m.head
    L = [len(p) for p in prompts]
    hs = [mx.random.normal((1, n + 3, 64), key=mx.random.key(b)) for b, n in enumerate(L)]
    toks = [mx.array(p + [1, 2, 3])[None] for p in prompts]
    singles = []
    for h, tk, n in zip(hs, toks, L):
        hc = head.make_cache()
        head(h[:, :n], tk[:, :n], hc)
        singles.append(hc)
    hb = [batch_cache.merge(layer) for layer in zip(*singles)]
    head(mx.concatenate([h[:, -3:] for h in hs]), mx.concatenate([tk[:, -3:] for tk in toks]), hb)
    drop = [3 - min(n, 3) for n in kept]
    batch_cache.rollback(hb, drop)
    for b, (h, tk, n) in enumerate(zip(hs, toks, L)):
        hr = head.make_cache()
        keep = n + 3 - drop[b]
        head(h[:, :keep], tk[:, :keep], hr)
        for x, y in zip(_state(hb[0].extract(b)), _state(hr[0])):
            _same(x, y)


def test_served_batch_answers_concurrent_requests_as_plain_decoding(model, reference):
    """Four clients at once, each with its own prompt length, draft count and
    limit: the server decodes them in one batch, and each gets the answer it
    gets alone without drafts, mlx-vlm's plain greedy tokens."""
    m, tok = model
    config = ServeConfig(max_batch=4, prompt_cache_entries=0, lookup_memory_bytes=0,
                         drafts=DraftSettings(adaptive=False))  # fmt: skip
    server = LiveServer(m, tok, "qwen4", config)
    prompts = [random_prompt(n, seed=40 + i) for i, n in enumerate([22, 9, 30, 15])]
    limits = [20, 16, 24, 18]
    stop = set(tok.eos_token_ids)
    try:
        client = server.client()

        def ask(i, drafts):
            r = client.completions.create(
                model="qwen4", prompt=prompts[i], max_tokens=limits[i],
                temperature=0.0, extra_body={"draft_max": drafts},
            )  # fmt: skip
            return r.choices[0].text, r.usage

        plain = [ask(i, 0)[0] for i in range(4)]
        together = [None] * 4
        threads = [
            threading.Thread(
                target=lambda i=i: together.__setitem__(i, ask(i, [1, 2, 3, 2][i]))
            )
            for i in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        health = server.get("/health")[1]
    finally:
        server.close()
    assert health["batched"] and health["peak_batch"] > 1
    assert [t for t, _ in together] == plain
    assert sum(u.mtp["accepted"] for _, u in together) > 0
    for i, p in enumerate(prompts):
        ids = vlm_greedy(reference, p, limits[i], stop=stop)
        assert plain[i] == streamed_text(tok, [t for t in ids if t not in stop])


def test_kv_bits_is_refused_in_one_line(folders):
    r = subprocess.run(
        [sys.executable, "-m", "mlx_mtp", "generate", "--model", str(folders[0]),
         "--prompt", "hi", "--max-tokens", "4", "--kv-bits", "8"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "qwen4_exp" in lines[0] and "kv_bits" in lines[0]
    assert "Traceback" not in r.stderr


def test_without_mlx_vlm_the_error_is_one_line(folders, tmp_path):
    hide = tmp_path / "mlx_vlm"
    hide.mkdir()
    (hide / "__init__.py").write_text("raise ImportError('mlx_vlm hidden')\n")
    env = dict(__import__("os").environ)
    env["PYTHONPATH"] = f"{tmp_path}:{env.get('PYTHONPATH', '')}"
    r = subprocess.run(
        [sys.executable, "-m", "mlx_mtp", "generate", "--model", str(folders[0]),
         "--prompt", "hi", "--max-tokens", "4"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "mlx-vlm" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_info_lists_the_family_its_layers_and_source():
    from mlx_mtp import families

    (found,) = [f for f in families.families() if f["model_type"] == "qwen4_exp"]
    assert found["models"].startswith("Qwen3.8-Flash-Next")
    assert "mlx-vlm 0.7.10" in found["models"]
    assert found["mtp_layers"] == 1 and not found["layer_per_depth"]


def test_convert_quantized_keeps_the_head_at_8_bits(model, folders, tmp_path):
    """``convert -q`` builds the trunk with mlx-vlm's classes, writes it under
    mlx-vlm's names (every quantized module listed) and the head at 8 bits."""
    from mlx_vlm.utils import load_model

    from mlx_mtp.convert import convert

    out = convert(folders[0], tmp_path / "q4", quantize=True, q_group_size=32)
    quant = json.loads((out / "config.json").read_text())["quantization"]
    head_q = {k: v for k, v in quant.items() if k.startswith("mtp.")}
    assert head_q and all(v["bits"] == 8 for v in head_q.values())
    m, _ = mlx_mtp.load(out)
    assert {x.bits for _, x in m.head.named_modules() if hasattr(x, "bits")} == {8}
    got, stats = mtp_greedy(m, PROMPT, 24, 2)
    assert got == vlm_greedy(load_model(out).language_model, PROMPT, 24)
    assert stats.accepted > 0
