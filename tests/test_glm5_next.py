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

from vlm_greedy import mtp_greedy, vlm_greedy  # noqa: E402
import mlx_mtp
from mlx_mtp.adaptive import FixedDraft
from mlx_mtp.cache import rollback, start_verify
from mlx_mtp.recurrent.vlm_cache import (
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
        VerifyArraysCache, VerifyCacheList, VerifyArraysCache, VerifyCacheList
    ]
    # layer 1 has its own indexer (latent, validity, pools, projected keys);
    # layer 3 shares its selection (latent, projected keys)
    assert [type(c) for c in caches[1].caches][2] is RollbackPoolingCache
    assert len(caches[3].caches) == 2
    (head_cache,) = m.head.make_cache()
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


def _streamed(tok, ids):
    """The text a stream of ``ids`` reads as (what the server sends)."""
    d = tok.detokenizer
    d.reset()
    for t in ids:
        d.add_token(t)
    d.finalize()
    return d.text


def test_a_served_batch_answers_each_client_as_alone(model, reference):
    from live_server import LiveServer

    from mlx_mtp.serve import ServeConfig

    m, tok = model
    server = LiveServer(m, tok, "glm5_next", ServeConfig(max_batch=4))
    prompts = [f"Q{i}: " + "abcdefgh"[: i + 2] * (i + 2) for i in range(4)]
    try:
        client = server.client()
        # its caches have no batch form: the engine takes the streams in turn
        assert server.get("/health")[1]["batched"] is False

        def ask(prompt):
            r = client.completions.create(
                model="glm5_next", prompt=prompt, max_tokens=12,
                extra_body={"draft_max": 2},
            )  # fmt: skip
            return r.choices[0].text, r.usage

        alone = [ask(p) for p in prompts]
        together = [None] * len(prompts)
        threads = [
            threading.Thread(target=lambda i=i, p=p: together.__setitem__(i, ask(p)))
            for i, p in enumerate(prompts)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert [t for t, _ in together] == [t for t, _ in alone]
        for (text, _), p in zip(alone, prompts):
            assert text == _streamed(tok, vlm_greedy(reference, tok.encode(p), 12))
        assert sum(u.mtp["accepted"] for _, u in together) > 0
    finally:
        server.close()


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
