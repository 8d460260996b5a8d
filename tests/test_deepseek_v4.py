"""DeepSeek-V4-Flash (``deepseek_v4``): a target mlx-lm does not load, rollback, head.

The references are mlx-vlm 0.7.10's own: its loader and ``generate_step`` for
greedy decoding (no drafter: single tokens through its rotating window and
pooling caches), and its drafter module
(``DeepseekV4MTPDraftModel``, built from the same ``mtp.0.*`` tensors by its
own sanitize) for the head's logits on the same hidden streams.
"""

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip(
    "mlx_vlm", reason="mlx-vlm is not installed (pip install '.[vision]')"
)

import tiny_dsv4  # noqa: E402
from tiny import random_prompt
from mlx.utils import tree_flatten

from vlm_greedy import mtp_greedy  # noqa: E402
import mlx_mtp
from mlx_mtp.cache import rollback, start_verify
from mlx_mtp.recurrent.compressed_cache import (
    RollbackCacheList,
    RollbackPoolingCache,
    RollbackWindowCache,
)

PROMPT = random_prompt(30, seed=3)  # past the window (8) and the index top-k (4)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return tiny_dsv4.build_folder(tmp_path_factory.mktemp("dsv4") / "m")


@pytest.fixture(scope="module")
def model(folders):
    return mlx_mtp.load(folders[0])


@pytest.fixture(scope="module")
def vlm_model(folders):
    from mlx_vlm.utils import load_model

    return load_model(folders[1])


@pytest.fixture(scope="module")
def reference(vlm_model):
    return vlm_model.language_model


def vlm_greedy(model, prompt, n, stop=()):
    """mlx-vlm's own ``generate_step`` at temperature 0, up to a stop token.
    (It prefills all but the last prompt token: mlx-vlm's compressor pools a
    group that a prefill closes among others from the group before it, and
    one a decode closes alone, so the split changes the numbers.)"""
    from mlx_vlm.generate import generate_step

    out = []
    steps = generate_step(
        mx.array(prompt)[None], model, None, None, max_tokens=n, temperature=0.0
    )
    for t, _ in steps:
        out.append(int(t))
        if out[-1] in stop:
            break
    return out


def test_loads_through_mlx_vlm_with_its_head(model):
    m, _ = model
    assert m.head is not None and m.notice is None
    assert type(m.target).__name__ == "VLMTextTarget"
    # the trunk holds no MTP tensor; the head holds all of them
    names = [k for k, _ in tree_flatten(m.target.model.parameters())]
    assert names and not any("mtp" in k for k in names)
    caches = m.make_cache().trunk
    assert [type(c) for c in caches] == [
        RollbackWindowCache, RollbackCacheList, RollbackCacheList, RollbackCacheList
    ]
    # a sparse layer: window, compressor, indexer's compressor; a 128 one: two
    assert [len(c.caches) for c in caches[1:]] == [3, 2, 3]
    assert all(isinstance(p, RollbackPoolingCache) for p in caches[1].caches[1:])
    assert m.target.tapped == (3,)  # the last layer's streams, before hc_head


def test_head_logits_equal_mlx_vlm_drafter(model, reference, folders):
    """Teacher-forced: the same streams and tokens through mlx-vlm's drafter
    (its weights from the same ``mtp.0.*`` tensors) and through the head."""
    from mlx_vlm.speculative.drafters.deepseek_v4_mtp import Model, ModelConfig
    from mlx_mtp.weights import read_safetensors

    m, _ = model
    config = json.loads((folders[0] / "config.json").read_text())
    drafter = Model(ModelConfig.from_dict({"text_config": config}))
    tensors = read_safetensors([folders[0] / "model.safetensors"])
    drafter.load_weights(list(drafter.sanitize(
        {k: v for k, v in tensors.items() if k.startswith("mtp.")}
    ).items()))
    drafter.bind(reference)

    tokens = mx.array(PROMPT)[None]
    out = reference(tokens, cache=reference.make_cache(), return_hidden=True)
    streams = out.hidden_states[0]  # mlx-vlm's own capture: before hc_head
    assert streams.shape[2:] == (4, 32)
    _, taps = m.target.forward(tokens, m.target.make_cache())
    flat = streams.reshape(1, len(PROMPT), -1)
    tapped = np.array(taps.layers[3]).reshape(flat.shape)
    np.testing.assert_allclose(tapped, np.array(flat), atol=1e-5)

    nxt = tokens[:, 1:]
    h = flat[:, :-1]
    want_hidden, want_pre = drafter._forward_hidden(
        drafter._input_embed(nxt), streams[:, :-1], nxt, drafter.make_cache()
    )
    want = np.array(reference.lm_head(want_hidden))[0]
    got_logits, got_pre = m.head(h, nxt, m.head.make_cache())
    got = np.array(got_logits)[0]
    assert (got.argmax(-1) == want.argmax(-1)).all()
    top5 = np.argsort(-want, axis=-1)[:, :5]
    np.testing.assert_allclose(
        np.take_along_axis(got, top5, -1), np.take_along_axis(want, top5, -1), atol=1e-4
    )
    np.testing.assert_allclose(
        np.array(got_pre), np.array(want_pre).reshape(got_pre.shape), atol=1e-5
    )


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_equals_mlx_vlm_with_drafts_accepted(model, vlm_model, k):
    m, _ = model
    expected = vlm_greedy(vlm_model, PROMPT, 40)
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
def test_stop_and_max_tokens_inside_a_draft(model, vlm_model, k):
    m, _ = model
    free, stats = mtp_greedy(m, PROMPT, 40, k)
    pos, stop = _accepted_draft(free, stats.trace)
    got, _ = mtp_greedy(m, PROMPT, 40, k, stop={stop})
    assert got == vlm_greedy(vlm_model, PROMPT, 40, stop={stop})
    assert got[-1] == stop and len(got) == pos + 1
    got, _ = mtp_greedy(m, PROMPT, pos + 1, k)
    assert got == vlm_greedy(vlm_model, PROMPT, pos + 1)


def _state(c):
    """Every array and count a layer's cache holds, as its kind lays them out."""
    assert not c.verifying  # nothing kept after a rollback
    if isinstance(c, RollbackCacheList):
        return [x for part in c.caches for x in _state(part)]
    if isinstance(c, RollbackWindowCache):
        return [*c.state, c.offset, c._idx]
    return [*c.state, c.remainder]  # open rows (kv, gate), pooled groups


def _same(a, b, atol=0.0):
    """Equal arrays (``atol``: rows a batched forward computed, which round
    apart from a single stream's by float32's last bits)."""
    if not isinstance(a, mx.array):
        assert a == b
        return
    assert b is not None and a.shape == b.shape and a.dtype == b.dtype
    if atol:
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=0, atol=atol)
    else:
        np.testing.assert_array_equal(np.array(a), np.array(b))


@pytest.mark.parametrize("length", [30, 127])  # groups of 4 close; of 128 too
@pytest.mark.parametrize(
    "n, verified", [(0, 4), (1, 4), (3, 4), (2, 3), (1, 2), (4, 4)]
)
def test_rollback_equals_a_decode_that_never_saw_the_draft(model, length, n, verified):
    """Verify ``verified`` tokens, reject the last ``n``: every array of every
    cache (the window's rows, its rotation, each compressor's open rows and
    pooled groups) equals that of a decode of the kept tokens alone; the
    head's cache too. The pass closes a group of 4 (and, from 127 tokens, the
    group of 128) and rolls the window over."""
    m, _ = model
    t = m.target
    prompt = random_prompt(length, seed=5)
    draft = [5, 77, 130, 9][:verified]
    cache = t.make_cache()
    t.forward(mx.array(prompt[:-1])[None], cache)
    start_verify(cache)
    t.forward(mx.array([prompt[-1], *draft[:-1]])[None], cache)
    rollback(cache, n)
    ref = t.make_cache()
    t.forward(mx.array(prompt[:-1])[None], ref)
    for tok in [prompt[-1], *draft[:-1]][: verified - n]:
        t.forward(mx.array([[tok]]), ref)
    for c, r in zip(cache, ref):
        a, b = _state(c), _state(r)
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    if length == 127:  # the kept tokens close the first group of 128, or not
        pooled = cache[2].caches[1].pooled
        assert (pooled is not None) == (verified - n >= 2)
    # and the decode goes on as if the rejected tokens were never read
    a, _ = t.forward(mx.array([[11]]), cache)
    b, _ = t.forward(mx.array([[11]]), ref)
    np.testing.assert_array_equal(np.array(a), np.array(b))

    head = m.head
    h = mx.random.normal((1, length + 3, 128))
    toks = mx.array(prompt + [1, 2, 3])[None]
    hc = head.make_cache()
    head(h[:, :-3], toks[:, :-3], hc)
    head(h[:, -3:], toks[:, -3:], hc)
    rollback(hc, min(n, 3))
    keep = h.shape[1] - min(n, 3)
    hr = head.make_cache()
    head(h[:, :keep], toks[:, :keep], hr)
    assert hc[0].offset == hr[0].offset == keep
    np.testing.assert_allclose(
        np.array(hc[0].state[0]), np.array(hr[0].state[0]), atol=1e-5
    )


def test_rollback_past_the_pass_is_refused(model):
    m, _ = model
    cache = m.target.make_cache()
    m.target.forward(mx.array(PROMPT)[None], cache)
    start_verify(cache)
    m.target.forward(mx.array([[1, 2, 3]]), cache)
    with pytest.raises(ValueError, match="cannot roll back 4 of 3"):
        rollback(cache, 4)


def test_a_snapshot_brings_every_cache_back(model):
    """``mark`` / ``restore`` copy what the caches write into: a snapshot taken
    before more tokens, restored twice, gives the same next logits each time."""
    m, _ = model
    cache = m.make_cache()
    t = m.target
    t.forward(mx.array(PROMPT)[None], cache.trunk)
    snap = cache.snapshot(trunk_only=True)
    assert snap is not None
    want, _ = t.forward(mx.array([[7]]), cache.trunk)
    for _ in range(2):
        cache.restore(snap)
        # past a group of 4 and the window's oldest rows
        t.forward(mx.array([[3, 4, 5, 6, 8, 9]]), cache.trunk)
        cache.restore(snap)
        got, _ = t.forward(mx.array([[7]]), cache.trunk)
        np.testing.assert_array_equal(np.array(got), np.array(want))


def test_batch_generate_four_streams_greedy(model, vlm_model):
    m, tok = model
    prompts = [random_prompt(20 + 3 * i, seed=10 + i) for i in range(4)]
    out = mlx_mtp.batch_generate(
        m, tok, prompts, max_tokens=12, return_token_ids=True, temp=0.0
    )
    for p, ids in zip(prompts, out.token_ids):
        assert list(ids) == vlm_greedy(vlm_model, p, 12)
    assert sum(s.accepted for s in out.mtp_stats) > 0


_GREEDY: dict = {}


def _greedy(vlm_model, prompt, n):
    key = (tuple(prompt), n)
    if key not in _GREEDY:
        _GREEDY[key] = vlm_greedy(vlm_model, prompt, n)
    return _GREEDY[key]


@pytest.mark.parametrize("streams", [4, 8])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_ragged_streams_decode_in_one_forward_a_round(model, vlm_model, streams, k):
    """Streams of different prompt lengths and limits (they leave mid-batch)
    at a fixed draft count: each gets mlx-vlm's plain greedy tokens, and
    every round's drafts of all its streams are verified in one trunk
    forward (fewer forwards than the streams' rounds together, as wide as
    the batch)."""
    m, tok = model
    prompts = [random_prompt(9 + 4 * i, seed=20 + i) for i in range(streams)]
    limits = [6 + (5 * i) % 11 for i in range(streams)]
    widths = []
    forward = m.target.forward

    def counting(inputs, caches, **kw):
        widths.append(inputs.shape[0])
        return forward(inputs, caches, **kw)

    m.target.forward = counting
    try:
        out = mlx_mtp.batch_generate(
            m, tok, prompts, max_tokens=limits, return_token_ids=True,
            temp=0.0, draft_max=k, adaptive_draft=False,
        )  # fmt: skip
    finally:
        m.target.forward = forward
    for p, ids, n in zip(prompts, out.token_ids, limits):
        assert list(ids) == _greedy(vlm_model, p, n)
    assert sum(s.accepted for s in out.mtp_stats) > 0
    assert max(widths) == streams
    assert len(widths) < sum(s.rounds for s in out.mtp_stats)


def _decoded(t, prompt, tokens):
    """A single-stream cache that read ``prompt`` and then ``tokens`` one at a time."""
    cache = t.make_cache()
    t.forward(mx.array(prompt[:-1])[None], cache)
    logits = None
    for tok in [prompt[-1], *tokens]:
        logits, _ = t.forward(mx.array([[tok]]), cache)
    return cache, logits


def test_batch_rollback_per_stream_equals_a_decode_without_the_drafts(model):
    """Three streams at their own lengths verify 4 tokens in one forward and
    keep 4, 3 and 1 of them: each stream's extracted caches (the window's
    slots and rotation, each compressor's pools and open rows) equal those of
    a decode that read the kept tokens alone; then one stream leaves, a new
    one joins, and the next forward gives each the logits it gets alone."""
    from mlx_mtp.batch_cache import merge
    from mlx_mtp.batch_cache import rollback as batch_rollback

    m, _ = model
    t = m.target
    prompts = [random_prompt(n, seed=40 + n) for n in (13, 30, 22)]
    verified = [[5, 77, 130, 9], [9, 8, 7, 6], [60, 61, 62, 63]]
    keep = [4, 3, 1]
    singles = [_decoded(t, p, [])[0] for p in prompts]
    kinds = [type(c) for c in singles[0]]
    batch = [merge(layer) for layer in zip(*singles)]
    start_verify(batch)
    t.forward(mx.array(verified), batch)
    batch_rollback(batch, [4 - n for n in keep])
    for b, (p, v, n) in enumerate(zip(prompts, verified, keep)):
        mine = [c.extract(b, kind) for c, kind in zip(batch, kinds)]
        ref, _ = _decoded(t, p, v[:n])
        for c, r in zip(mine, ref):
            a, want = _state(c), _state(r)
            assert len(a) == len(want)
            for x, y in zip(a, want):
                _same(x, y, atol=1e-5)
    # stream 1 leaves, a fresh one joins; one more token each
    for c in batch:
        c.filter([2, 0])
    new = random_prompt(17, seed=77)
    for c, x in zip(batch, _decoded(t, new, [])[0]):
        c.extend(merge([x]))
    got, _ = t.forward(mx.array([[3], [4], [5]]), batch)
    alone = [
        (prompts[2], verified[2][:1] + [3]),
        (prompts[0], verified[0][:4] + [4]),
        (new, [5]),
    ]
    for row, (p, toks) in enumerate(alone):
        _, want = _decoded(t, p, toks)
        np.testing.assert_allclose(np.array(got[row]), np.array(want[0]), atol=1e-5)


def test_kv_bits_is_refused_in_one_line(folders):
    r = subprocess.run(
        [sys.executable, "-m", "mlx_mtp", "generate", "--model", str(folders[0]),
         "--prompt", "hi", "--max-tokens", "4", "--kv-bits", "8"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "deepseek_v4" in lines[0] and "kv_bits" in lines[0]
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
    # convert needs mlx-vlm's classes: one line; describing the folder does not
    r = subprocess.run(
        [sys.executable, "-m", "mlx_mtp", "convert", str(folders[0]),
         str(tmp_path / "out"), "-q"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "mlx-vlm" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = subprocess.run(
        [sys.executable, "-m", "mlx_mtp", "info", str(folders[0]), "--json"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["architecture"] == "deepseek_v4" and info["mtp_layers"] == 1


def test_a_head_under_another_index_is_one_line(tmp_path):
    config, trunk, mtp = tiny_dsv4.build_weights(agreeable=False)
    moved = {k.replace("mtp.0.", "mtp.1.", 1): v for k, v in mtp.items()}
    folder = tiny_dsv4.save_folder(tmp_path / "m", config, trunk, moved)
    r = subprocess.run(
        [sys.executable, "-m", "mlx_mtp", "generate", "--model", str(folder),
         "--prompt", "hi", "--max-tokens", "4"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode != 0 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "mtp.{1}." in lines[0] and "mtp.0." in lines[0]


def test_info_lists_the_family_its_layers_and_source():
    from mlx_mtp import families

    (found,) = [f for f in families.families() if f["model_type"] == "deepseek_v4"]
    assert found["models"].startswith("DeepSeek-V4-Flash")
    assert "mlx-vlm 0.7.10" in found["models"]
    assert found["mtp_layers"] == 1 and not found["layer_per_depth"]
    r = subprocess.run(
        [sys.executable, "-m", "mlx_mtp", "info"], capture_output=True, text=True
    )
    assert r.returncode == 0
    (line,) = [x for x in r.stdout.splitlines() if x.split()[:1] == ["deepseek_v4"]]
    assert "DeepSeek-V4-Flash" in line and "MTP layers: 1" in line


def test_convert_q4_keeps_the_head_at_8_bits_and_info_says_so(folders, tmp_path):
    """``convert -q``: the trunk at 4 bits through mlx-vlm's own classes, the
    head's linear layers at 8; the folder loads, its head drafts, ``info``
    lists both precisions."""
    out = tmp_path / "q4"
    r = subprocess.run(
        [sys.executable, "-m", "mlx_mtp", "convert", str(folders[0]), str(out),
         "-q", "--q-bits", "4", "--q-group-size", "32"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    quant = json.loads((out / "config.json").read_text())["quantization"]
    assert (quant["group_size"], quant["bits"]) == (32, 4)
    listed = {k: v for k, v in quant.items() if isinstance(v, dict)}
    head = {k: v for k, v in listed.items() if k.startswith("mtp.")}
    # the trunk's modules are listed under mlx-vlm's names, for its loader
    trunk_listed = {k: v for k, v in listed.items() if k not in head}
    assert head and all(k.startswith("mtp.0.") for k in head)
    assert all(v["bits"] == 8 for v in head.values())
    assert all(k.startswith("language_model.") for k in trunk_listed)
    assert all(v["bits"] == 4 for v in trunk_listed.values())
    stored = mx.load(str(out / "mtp.safetensors"))
    assert {k[: -len(".scales")] for k in stored if k.endswith(".scales")} == set(head)
    trunk = mx.load(str(out / "model.safetensors"))
    assert not any("mtp" in k for k in trunk)
    assert any(k.startswith("language_model.") and k.endswith(".scales") for k in trunk)

    r = subprocess.run(
        [sys.executable, "-m", "mlx_mtp", "info", str(out), "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    info = json.loads(r.stdout)
    assert info["architecture"] == "deepseek_v4" and info["mtp_layers"] == 1
    assert "4-bit/g32" in info["trunk_precision"]
    assert "8-bit/g32" in info["mtp_precision"]
    assert "4-bit/g32" not in info["mtp_precision"]

    q, _ = mlx_mtp.load(out)
    assert q.head is not None and q.notice is None
    plain, _ = mtp_greedy(q, PROMPT, 20, 0)
    got, stats = mtp_greedy(q, PROMPT, 20, 2)
    assert got == plain and stats.accepted > 0
    # loaded as written: the head's layers at 8 bits, the trunk's at 4
    assert q.head.e_proj.bits == q.head.block.attn.wq_a.bits == 8
    assert q.target.backbone.layers[0].attn.wq_a.bits == 4


def test_served_batch_answers_as_alone(folders):
    """Through the server: three clients at once, decoded in one batch, get
    the answers each gets alone, with drafts accepted; a follow-up request
    reuses the prompt cache the first turn left and answers as a fresh
    decode does."""
    import threading

    from live_server import LiveServer

    from mlx_mtp.draft_settings import DraftSettings
    from mlx_mtp.generate import stream_generate
    from mlx_mtp.serve import ServeConfig

    m, tok = mlx_mtp.load(folders[0])
    config = ServeConfig(drafts=DraftSettings(adaptive=False))
    server = LiveServer(m, tok, "deepseek_v4", config)
    try:
        client = server.client()
        assert server.get("/health")[1]["batched"] is True

        def ask(prompt, n=16):
            r = client.completions.create(
                model="deepseek_v4", prompt=prompt, max_tokens=n,
                extra_body={"draft_max": 3},
            )  # fmt: skip
            return r.choices[0].text, r.usage

        prompts = [f"Q{i}: " + "abcdefgh"[: i + 2] * (i + 2) for i in range(3)]
        alone = [ask(p) for p in prompts]
        together = [None] * 3
        threads = [
            threading.Thread(
                target=lambda i=i: together.__setitem__(i, ask(prompts[i]))
            )
            for i in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert [t for t, _ in together] == [t for t, _ in alone]
        assert sum(u.mtp["accepted"] for _, u in together) > 0
        first = tok.encode(prompts[0])
        answer = [r.token for r in stream_generate(m, tok, first, 16)]
        longer = first + answer[:8]
        again, usage = ask(longer)
        # caches that cannot be cut back keep the prompt as its turn prefilled
        # it (all but its last token)
        assert usage.prompt_tokens_details.cached_tokens >= len(first) - 1
        expected = list(stream_generate(m, tok, longer, 16))
        assert again == "".join(r.text for r in expected)
    finally:
        server.close()
