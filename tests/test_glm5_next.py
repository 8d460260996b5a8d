"""GLM-5.3-Flash (``glm5_next``): a target mlx-lm does not load, its delta
attention and DSA caches rolled back, its MTP layer.

The references are mlx-vlm 0.7.10's own: its loader and language model for
greedy decoding (a plain loop over ``LanguageModel``), and its drafter module
(``Glm5NextMTPDraftModel``, its tensors renamed by mlx-vlm's own
``Glm5NextMTPSplitter``) for the head's logits on the same weights and
hidden states.
"""

import json
import subprocess
import sys
import threading

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip(
    "mlx_vlm", reason="mlx-vlm is not installed (pip install '.[vision]')"
)

import tiny_glm5  # noqa: E402
from tiny import random_prompt
from mlx.utils import tree_flatten

from vlm_greedy import batched_greedy, mtp_greedy, streamed_text, vlm_greedy  # noqa: E402
import mlx_mtp
from mlx_mtp import batch_cache
from mlx_mtp.adaptive import FixedDraft
from mlx_mtp.cache import rollback, start_verify
from mlx_mtp.draft_settings import DraftSettings
from mlx_mtp.recurrent.glm5_cache import BatchDSACache, DSACacheList
from mlx_mtp.recurrent.vlm_cache import (
    BatchArraysCache,
    RollbackPoolingCache,
    TrimmablePoolingCache,
    VerifyArraysCache,
    VerifyCacheList,
)
from mlx_mtp.speculative import speculative_generate_step
from mlx_mtp.stats import MTPStats

PROMPT = random_prompt(30, seed=3)  # past the indexer's 8 keys: sparse attention


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return tiny_glm5.build_folder(tmp_path_factory.mktemp("glm5") / "m")


@pytest.fixture(scope="module")
def model(folders):
    return mlx_mtp.load(folders[0])


def _vlm_lm(folder):
    from mlx_vlm.utils import load_model

    return load_model(folder).language_model


@pytest.fixture(scope="module")
def reference(folders):
    return _vlm_lm(folders[1])


def test_loads_through_mlx_vlm_with_its_head(model):
    m, _ = model
    assert m.head is not None and m.notice is None
    assert type(m.target).__name__ == "VLMTextTarget"
    assert m.target.hidden_tap == "post"  # norm(mean over the streams)
    # the trunk holds no tensor of layer 4 (the MTP layer); the head holds them
    names = [k for k, _ in tree_flatten(m.target.model.parameters())]
    assert names and not any(".layers.4." in k for k in names)
    caches = m.make_cache().trunk
    assert [type(c) for c in caches] == [
        VerifyArraysCache, DSACacheList, VerifyArraysCache, DSACacheList
    ]
    # layer 1 has its own indexer (latent, validity, pools, projected keys);
    # layer 3 shares its selection (latent, projected keys)
    assert [type(c) for c in caches[1].caches][2] is RollbackPoolingCache
    assert len(caches[3].caches) == 2
    (head_cache,) = m.head.make_cache()
    assert isinstance(head_cache, DSACacheList)
    assert isinstance(head_cache.caches[2], TrimmablePoolingCache)


def _drafter(folder, reference):
    """mlx-vlm's drafter on the checkpoint's layer-4 tensors, as its splitter
    renames them."""
    from mlx_vlm.speculative.drafters.glm5_next_mtp import Model, ModelConfig
    from mlx_vlm.speculative.drafters.glm5_next_mtp.split import Glm5NextMTPSplitter
    from mlx_mtp.weights import read_safetensors

    config = json.loads((folder / "config.json").read_text())
    drafter = Model(ModelConfig.from_dict(config))
    tensors = read_safetensors([folder / "model.safetensors"])
    splitter = Glm5NextMTPSplitter()
    text = config["text_config"]
    mine = {k: v for k, v in tensors.items() if splitter.select_keys(k, text)}
    drafter.load_weights(list(drafter.sanitize(splitter.rename(mine, text)).items()))
    drafter.bind(reference)
    return drafter


def test_head_logits_equal_mlx_vlm_drafter(model, reference, folders):
    """Teacher-forced: the trunk's normed hidden states and the tokens through
    mlx-vlm's drafter (position 0's embedding zeroed there too) and the head."""
    m, _ = model
    drafter = _drafter(folders[0], reference)

    tokens = mx.array(PROMPT)[None]
    out = reference(tokens, cache=reference.make_cache(), return_hidden=True)
    hidden = out.hidden_states[0]  # mlx-vlm's own capture: norm(mean of streams)
    _, taps = m.target.forward(tokens, m.target.make_cache())
    np.testing.assert_allclose(np.array(taps.hidden), np.array(hidden), atol=1e-5)
    assert hidden.shape[-1] == 32

    nxt = tokens[:, 1:]
    h = hidden[:, :-1]
    want_hidden, want_next = drafter._forward_hidden(
        drafter._input_embed(nxt), h, nxt, drafter.make_cache()
    )
    want = np.array(reference.lm_head(want_hidden))[0]
    got_logits, got_next = m.head(h, nxt, m.head.make_cache())
    got = np.array(got_logits)[0]
    assert (got.argmax(-1) == want.argmax(-1)).all()
    top5 = np.argsort(-want, axis=-1)[:, :5]
    np.testing.assert_allclose(
        np.take_along_axis(got, top5, -1), np.take_along_axis(want, top5, -1), atol=1e-4
    )
    np.testing.assert_allclose(np.array(got_next), np.array(want_next), atol=1e-5)
    # without the zeroing, position 0 would differ: the check has teeth
    m.head.zero_first_embedding = False
    try:
        plain = np.array(m.head(h, nxt, m.head.make_cache())[0])[0]
    finally:
        m.head.zero_first_embedding = True
    assert np.abs(plain[0] - want[0]).max() > 1e-3


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_equals_mlx_vlm_with_drafts_accepted(model, reference, k):
    m, _ = model
    expected = vlm_greedy(reference, PROMPT, 40)
    got, stats = mtp_greedy(m, PROMPT, 40, k)
    assert got == expected
    assert 0 < stats.accepted < stats.drafted  # kept and rejected drafts both ran
    assert stats.generation_tokens == len(got) == stats.rounds + stats.accepted


def _arrays(c):
    """Every array one cache holds (its tokens', not its spare room)."""
    if isinstance(c, VerifyArraysCache):
        assert not c.verifying  # nothing kept after a rollback
        return list(c.cache)
    if isinstance(c, VerifyCacheList):
        return [a for m in c.caches for a in _arrays(m)]
    if isinstance(c, (RollbackPoolingCache, TrimmablePoolingCache)):
        assert not getattr(c, "verifying", False)
        return [*c.state, mx.array(c.remainder)]
    if c.keys is None:  # (projected keys a stream never wrote)
        return [None, None]
    return [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]


def _same(a, b):
    assert (a is None) == (b is None)
    if a is not None:
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5)


@pytest.mark.parametrize("n, verified", [(0, 4), (1, 4), (3, 4), (2, 3), (1, 2)])
def test_rollback_equals_a_decode_that_never_saw_the_draft(model, n, verified):
    """Verify ``verified`` tokens, reject the last ``n``: every array of every
    cache (delta attention's conv windows and state; DSA's latent, indexer
    validity, pooled keys, the window under way and projected keys) equals
    that of a decode of the kept tokens alone; the head's caches too. The
    prompt leaves 1 key in the indexer's window of 4: 4 verified tokens
    complete a pool, which a rollback of 1 or 3 keeps or drops."""
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
    for c, r in zip(cache, ref):
        for a, b in zip(_arrays(c), _arrays(r), strict=True):
            _same(a, b)
    # and the decode goes on as if the rejected tokens were never read
    for tok in (11, 12, 13, 14):
        a, _ = t.forward(mx.array([[tok]]), cache)
        b, _ = t.forward(mx.array([[tok]]), ref)
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5)

    # the head drops tentative drafts outside a verify pass: trim
    head = m.head
    h = mx.random.normal((1, len(PROMPT) + 3, 32))
    toks = mx.array(PROMPT + [1, 2, 3])[None]
    hc = head.make_cache()
    head(h[:, :-3], toks[:, :-3], hc)
    head(h[:, -3:], toks[:, -3:], hc)
    rollback(hc, n)
    hr = head.make_cache()
    head(h[:, :-3], toks[:, :-3], hr)
    if n < 3:
        head(h[:, -3 : h.shape[1] - n], toks[:, -3 : h.shape[1] - n], hr)
    for a, b in zip(_arrays(hc[0]), _arrays(hr[0]), strict=True):
        _same(a, b)
    a, _ = head(h[:, -1:], toks[:, -1:], hc)
    b, _ = head(h[:, -1:], toks[:, -1:], hr)
    np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5)


def test_rollback_of_every_verified_token_is_refused(model):
    m, _ = model
    cache = m.target.make_cache()
    m.target.forward(mx.array(PROMPT)[None], cache)
    start_verify(cache)
    m.target.forward(mx.array([[1, 2, 3]]), cache)
    with pytest.raises(ValueError, match="cannot roll back 3 of 3"):
        rollback(cache, 3)


def test_batch_generate_eight_ragged_streams_greedy(model, reference):
    m, tok = model
    prompts = [random_prompt(12 + 3 * i, seed=10 + i) for i in range(8)]
    out = mlx_mtp.batch_generate(
        m, tok, prompts, max_tokens=10, return_token_ids=True, temp=0.0
    )
    for p, ids in zip(prompts, out.token_ids):
        assert list(ids) == vlm_greedy(reference, p, 10)
    assert sum(s.accepted for s in out.mtp_stats) > 0


def _cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "mlx_mtp", *map(str, args)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip


def test_kv_bits_is_refused_in_one_line(folders):
    r = _cli("generate", "--model", folders[0], "--prompt", "hi",
             "--max-tokens", "4", "--kv-bits", "8")  # fmt: skip
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "glm5_next" in lines[0] and "kv_bits" in lines[0]
    assert "Traceback" not in r.stderr


def test_convert_keeps_the_head_at_higher_precision(folders, tmp_path):
    """``convert -q``: the trunk at 4 bits, the MTP layer at 8 (``info`` says
    so); the folder loads through mlx-vlm alone and through mlx-mtp, which
    decodes its greedy tokens with drafts accepted."""
    out = tmp_path / "q4"
    r = _cli("convert", folders[0], out, "-q", "--q-group-size", "32")
    assert r.returncode == 0, r.stderr
    r = _cli("info", out)
    assert r.returncode == 0, r.stderr
    lines = {ln.split()[0]: ln for ln in r.stdout.splitlines() if ln.strip()}
    assert "4-bit/g32" in lines["trunk"] and "8-bit" not in lines["trunk"]
    assert "8-bit/g32" in lines["MTP"] and "4-bit" not in lines["MTP"]
    assert "glm5_next" in lines["architecture"]
    m, _ = mlx_mtp.load(out)
    assert m.head is not None
    got, stats = mtp_greedy(m, PROMPT, 20, 2)
    assert got == vlm_greedy(_vlm_lm(out), PROMPT, 20)
    assert stats.accepted > 0


def test_without_mlx_vlm_the_error_is_one_line(folders, tmp_path):
    hide = tmp_path / "mlx_vlm"
    hide.mkdir()
    (hide / "__init__.py").write_text("raise ImportError('mlx_vlm hidden')\n")
    env = dict(__import__("os").environ)
    env["PYTHONPATH"] = f"{tmp_path}:{env.get('PYTHONPATH', '')}"
    r = _cli("generate", "--model", folders[0], "--prompt", "hi",
             "--max-tokens", "4", env=env)  # fmt: skip
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "mlx-vlm" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_info_lists_the_family_its_layers_and_source():
    from mlx_mtp import families

    (found,) = [f for f in families.families() if f["model_type"] == "glm5_next"]
    assert found["models"].startswith("GLM-5.3-Flash")
    assert "mlx-vlm 0.7.10" in found["models"]
    assert found["mtp_layers"] == 1 and not found["layer_per_depth"]
    r = _cli("info")
    assert r.returncode == 0 and "glm5_next" in r.stdout


# prompt lengths on both sides of the indexer's 8 keys (2 pools of 4) and of
# DECODE_BLOCK_SIZE (a prompt chunk past 8 tokens takes the projected keys)
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
    assert [type(c) for c in decoder.trunk] == [
        BatchArraysCache, BatchDSACache, BatchArraysCache, BatchDSACache
    ]  # fmt: skip
    assert forwards == rounds < sum(s.stats.rounds for s in ss)
    for i, p in enumerate(prompts):
        assert got[i] == vlm_greedy(reference, p, limits[i]), f"stream {i}"
    assert sum(s.stats.accepted for s in ss) > 0
    assert len({s.stats.accepted for s in ss}) > 1  # ragged acceptance


def _exact(a, b):
    """``_same``, and whether ``a`` and ``b`` agree to the last bit."""
    _same(a, b)
    return a is None or bool(np.array_equal(np.array(a), np.array(b)))


@pytest.mark.parametrize("kept", [[4, 1, 3, 2], [2, 4, 1, 4]])
def test_batch_rollback_per_stream_equals_decodes_that_never_saw_the_drafts(
    model, kept
):
    """Four streams at different lengths verify 4 tokens each in one forward
    and keep ``kept[b]`` of them: each stream's extracted caches (delta
    attention's conv window and state; DSA's latent, indexer validity, pooled
    keys, the window under way, projected keys) equal those of decoding its
    kept tokens alone, and the batch decodes on as those do; the head's batch
    cache likewise. The prompts leave 2, 3, 0 and 1 keys in the indexer's
    window of 4: the verified tokens close a pool, which the kept ones keep or
    drop. Float32, within 1e-5 (on MLX's CPU backend every array agrees to
    the last bit): the batch's projections and MoE are matmuls over 4 rows
    where a decode's are over 1, which a backend may sum in another order;
    the pooling caches' rows, copied, are checked to the last bit."""
    m, t = model[0], model[0].target
    prompts = [random_prompt(n, seed=20 + i) for i, n in enumerate([31, 12, 21, 18])]
    rows = [[p[-1], 5 + i, 77, 130 - i] for i, p in enumerate(prompts)]
    singles = []
    for p in prompts:
        c = t.make_cache()
        t.forward(mx.array(p[:-1])[None], c)
        singles.append(c)
    kinds = [type(c) for c in singles[0]]
    batch = [batch_cache.merge(layer) for layer in zip(*singles)]
    assert [type(c) for c in batch] == [
        BatchArraysCache, BatchDSACache, BatchArraysCache, BatchDSACache
    ]  # fmt: skip
    start_verify(batch)
    t.forward(mx.array(rows), batch)
    batch_cache.rollback(batch, [4 - n for n in kept])
    assert batch[1].lengths == [len(p) - 1 + n for p, n in zip(prompts, kept)]
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
            for x, y in zip(_arrays(c), _arrays(r), strict=True):
                _exact(x, y)
        # the pools and the window under way: copied rows, to the last bit
        pools, want = got[1].caches[2], ref[1].caches[2]
        assert pools.remainder == want.remainder
        assert all(_exact(x, y) for x, y in zip(pools.state, want.state))
    # the batch reads on from each stream's kept tokens
    a, _ = t.forward(mx.array([[11]] * 4), batch)
    for b, ref in enumerate(refs):
        r, _ = t.forward(mx.array([[11]]), ref)
        np.testing.assert_allclose(np.array(a[b]), np.array(r[0]), atol=1e-5)

    head = m.head
    L = [len(p) for p in prompts]
    hs = [mx.random.normal((1, n + 3, 32), key=mx.random.key(b)) for b, n in enumerate(L)]
    toks = [mx.array(p + [1, 2, 3])[None] for p in prompts]
    singles = []
    for h, tk, n in zip(hs, toks, L):
        hc = head.make_cache()
        head(h[:, :n], tk[:, :n], hc)
        singles.append(hc)
    hb = [batch_cache.merge(layer) for layer in zip(*singles)]
    assert type(hb[0]) is BatchDSACache
    head(
        mx.concatenate([h[:, -3:] for h in hs]),
        mx.concatenate([tk[:, -3:] for tk in toks]),
        hb,
    )
    drop = [3 - min(n, 3) for n in kept]
    batch_cache.rollback(hb, drop)
    for b, (h, tk, n) in enumerate(zip(hs, toks, L)):
        hr = head.make_cache()
        keep = n + 3 - drop[b]
        head(h[:, :keep], tk[:, :keep], hr)
        for x, y in zip(_arrays(hb[0].extract(b)), _arrays(hr[0]), strict=True):
            _same(x, y)


def test_a_padded_prompt_chunk_in_a_batch_reads_as_each_stream_alone(model):
    """Four streams read prompt chunks of 12, 9, 5 and 10 tokens in one forward,
    right-padded to 12 and the padding rolled back (as the decoder reads
    ragged prompts: ``exact_chunks``): chunks past ``DECODE_BLOCK_SIZE`` take
    the projected keys stream by stream. Each stream's caches equal those of
    reading its chunk alone (the projected keys a padded stream of 5 tokens
    would not write alone taken back), and its logits at its chunk's tokens
    match. Not to the last bit for that stream (its logits within about
    2e-7, the next layer's latent 1e-7 on MLX's CPU backend): the batch's
    width of 12 takes it through mlx-vlm's projected-keys attention where
    its 5 tokens alone take the latent's, the same sums in another order
    (the forward cannot tell its padding from its tokens)."""
    t = model[0].target
    heads = [random_prompt(n, seed=60 + i) for i, n in enumerate([7, 14, 10, 3])]
    chunks = [random_prompt(n, seed=70 + i) for i, n in enumerate([12, 9, 5, 10])]
    singles, refs, want = [], [], []
    for h, c in zip(heads, chunks):
        a, r = t.make_cache(), t.make_cache()
        t.forward(mx.array(h)[None], a)
        t.forward(mx.array(h)[None], r)
        logits, _ = t.forward(mx.array(c)[None], r)
        singles.append(a)
        refs.append(r)
        want.append(logits)
    kinds = [type(c) for c in singles[0]]
    batch = [batch_cache.merge(layer) for layer in zip(*singles)]
    width = max(map(len, chunks))
    pads = [width - len(c) for c in chunks]
    start_verify(batch)
    got, _ = t.forward(mx.array([c + [0] * p for c, p in zip(chunks, pads)]), batch)
    batch_cache.rollback(batch, pads)
    for b, (ref, c) in enumerate(zip(refs, chunks)):
        np.testing.assert_allclose(
            np.array(got[b, : len(c)]), np.array(want[b][0]), atol=1e-4
        )
        mine = [x.extract(b, kind) for x, kind in zip(batch, kinds)]
        for x, y in zip(mine, ref):
            for u, v in zip(_arrays(x), _arrays(y), strict=True):
                _same(u, v)


def test_served_batch_answers_concurrent_requests_as_plain_decoding(model, reference):
    """Four clients at once, each with its own prompt length, draft count and
    limit: the server decodes them in one batch, and each gets the answer it
    gets alone without drafts, mlx-vlm's plain greedy tokens."""
    from live_server import LiveServer

    from mlx_mtp.serve import ServeConfig

    m, tok = model
    config = ServeConfig(max_batch=4, prompt_cache_entries=0, lookup_memory_bytes=0,
                         drafts=DraftSettings(adaptive=False))  # fmt: skip
    server = LiveServer(m, tok, "glm5_next", config)
    prompts = [random_prompt(n, seed=40 + i) for i, n in enumerate([22, 9, 30, 15])]
    limits = [14, 10, 16, 12]
    stop = set(tok.eos_token_ids)
    try:
        client = server.client()

        def ask(i, drafts):
            r = client.completions.create(
                model="glm5_next", prompt=prompts[i], max_tokens=limits[i],
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
            t.join(timeout=300)
        health = server.get("/health")[1]
    finally:
        server.close()
    assert health["batched"] and health["peak_batch"] > 1
    assert [t for t, _ in together] == plain
    assert sum(u.mtp["accepted"] for _, u in together) > 0
    for i, p in enumerate(prompts):
        ids = vlm_greedy(reference, p, limits[i], stop=stop)
        assert plain[i] == streamed_text(tok, [t for t in ids if t not in stop])


@pytest.fixture(scope="module")
def dflash_pair(tmp_path_factory):
    """A GLM-5.3 trunk (no head) whose mask token embeds to zero, and a DFlash 2
    drafter (block 8) in z-lab's layout reading its layers 1 and 3."""
    import tiny_dflash

    root = tmp_path_factory.mktemp("glm5-dflash")
    _, trunk = tiny_glm5.build_folder(root / "m", silent=[tiny_dflash.MASK])
    drafter = tiny_dflash.build_drafter(
        root / "dflash2", [1, 3], 4, agreeable=True, kind="dflash2",
        layout="nested", block_size=8, hidden_size=32,
    )  # fmt: skip
    return trunk, drafter


def test_a_dflash2_drafter_drafts_greedy_tokens_unchanged(dflash_pair):
    from mlx_mtp.drafts import ModelDrafts

    trunk, drafter = dflash_pair
    m, _ = mlx_mtp.load(trunk, draft=drafter)
    assert [d.name for d in m.drafters] == ["dflash2"]
    # a layer's streams [B, L, hc, H] reach the drafter as their mean
    m.target.tap_layers([1])
    _, taps = m.target.forward(mx.array(PROMPT)[None], m.target.make_cache())
    assert taps.layers[1].shape == (1, len(PROMPT), 32)
    expected = vlm_greedy(_vlm_lm(trunk), PROMPT, 24)
    for k in (1, 3, 7):
        stats = MTPStats(trace=[])
        steps = speculative_generate_step(
            PROMPT, m, max_tokens=24, stats=stats,
            drafts=ModelDrafts(FixedDraft(k), "dflash2"),
        )  # fmt: skip
        assert [int(t) for t, _ in steps] == expected
        assert 0 < stats.accepted < stats.drafted


def test_a_drafter_of_other_shapes_is_refused_in_one_line(dflash_pair, tmp_path):
    import tiny_dflash

    trunk, _ = dflash_pair
    wide = tiny_dflash.build_drafter(
        tmp_path / "wide", [1, 3], 4, kind="dflash2", layout="nested"
    )  # hidden size 64, the target's is 32
    r = _cli("generate", "--model", trunk, "--draft", wide, "--prompt", "hi",
             "--max-tokens", "4")  # fmt: skip
    assert r.returncode != 0 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "hidden size 64" in lines[0]
