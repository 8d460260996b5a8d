"""Hunyuan-V4 (``hy_v4``): a target mlx-lm does not load, its MTP head, rollback.

The references are mlx-vlm 0.7.10's own: its loader and language model for
greedy decoding (a plain loop over ``LanguageModel``), and its drafter module
(``HyV4MTPDraftModel``, weights renamed as its ``split.py`` renames them) for
the head's logits on the same weights and hidden states. mlx-vlm's indexer
top-k is wrong for every key count but the first it sees (shown below); the
reference's indexers get the family's fix (``exact_indexers``) as the
target's do, so both select the top-k keys the published scores define.
"""

import json
import re
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip(
    "mlx_vlm", reason="mlx-vlm is not installed (pip install '.[vision]')"
)

import tiny_hy_v4  # noqa: E402
from mlx.utils import tree_flatten
from tiny import random_prompt

from vlm_greedy import batched_greedy, mtp_greedy, vlm_greedy  # noqa: E402
import mlx_mtp
from mlx_mtp import batch_cache
from mlx_mtp.cache import rollback, start_verify
from mlx_mtp.recurrent.hy_v4_cache import BatchHyV4CacheList, HyV4CacheList

PROMPT = random_prompt(30, seed=3)  # past the indexer's top-k of 8: sparse


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return tiny_hy_v4.build_folder(tmp_path_factory.mktemp("hy_v4") / "m")


@pytest.fixture(scope="module")
def model(folders):
    return mlx_mtp.load(folders[0])


@pytest.fixture(scope="module")
def reference(folders):
    from mlx_vlm.utils import load_model

    from mlx_mtp.heads.hy_v4 import exact_indexers

    lm = load_model(folders[1]).language_model
    exact_indexers(lm)
    return lm


def test_mlx_vlm_top_k_holds_only_for_the_first_key_count():
    """Why the family swaps the indexer: mlx-vlm's compiled partition keeps
    the rank of its first call, so over more keys it misses some of the top-k
    that the family's ``ExactIndexer`` finds."""
    from mlx_vlm.models.hy_v4.indexer import _partition_scores

    top_k, missed = 3, 0
    partition = _partition_scores(top_k, False)
    rng = np.random.default_rng(0)
    for keys in (6, 11, 17, 23, 29):
        q = mx.array(rng.standard_normal((1, 2, 1, 8)), mx.float32)
        k = mx.array(rng.standard_normal((1, 1, keys, 8)), mx.float32)
        w = mx.array(rng.uniform(0.5, 1.0, (1, 1, 2)), mx.float32)
        got = set(np.array(partition(q, k, w)[..., -top_k:]).ravel().tolist())
        s = np.maximum(np.array(q @ k.swapaxes(-1, -2)), 0)
        s = (s * np.array(w).swapaxes(-1, -2)[..., None]).sum(1).ravel()
        missed += len(set(np.argsort(-s)[:top_k].tolist()) - got)
    assert missed > 0


def test_loads_through_mlx_vlm_with_its_head(model):
    m, _ = model
    assert m.head is not None and m.notice is None
    assert type(m.target).__name__ == "VLMTextTarget"
    assert m.target.hidden_tap == "post"  # after hc_head and the final norm
    names = [k for k, _ in tree_flatten(m.target.model.parameters())]
    assert names and not any("mtp" in k for k in names)
    caches = m.make_cache().trunk
    assert all(type(c) is HyV4CacheList for c in caches)
    # indexer kinds full, full, shared: a shared layer keeps the latent alone
    assert [len(c.caches) for c in caches] == [2, 2, 1]
    assert m.head.chain_hidden == "post" and not m.head.zero_first_embedding
    from mlx_mtp.heads.hy_v4 import ExactIndexer

    attns = [layer.self_attn for layer in m.target.backbone.layers]
    attns.append(m.head.block.self_attn)
    indexers = [type(a.indexer) for a in attns if a.indexer is not None]
    assert indexers == [ExactIndexer] * 3  # two trunk layers "full", the head's


def _drafter(folders, reference):
    """mlx-vlm's drafter holding the checkpoint's MTP tensors, renamed as its
    ``HyV4MTPSplitter.rename`` does, the experts stacked for its sanitize."""
    from mlx_vlm.speculative.drafters.hy_v4_mtp import Model, ModelConfig

    from mlx_mtp.weights import read_safetensors

    config = json.loads((folders[0] / "config.json").read_text())
    drafter = Model(ModelConfig.from_dict({"text_config": config}))
    tensors = read_safetensors([folders[0] / "model.safetensors"])
    pre = "model.mtp_layers.0."
    renamed, experts = {}, {}
    for k, v in tensors.items():
        if not k.startswith(pre):
            continue
        k = k[len(pre) :]
        if k.startswith(("input_layernorm.", "post_attention_layernorm.")) or k.split(
            "."
        )[0] in ("self_attn", "mlp"):
            k = f"decoder.{k}"
        elif k.startswith("final_layernorm."):
            k = "norm." + k[len("final_layernorm.") :]
        parts = k.split(".")
        if parts[:3] == ["decoder", "mlp", "experts"]:
            experts.setdefault(parts[4], {})[int(parts[3])] = v
            continue
        renamed[k] = v
    for name, rows in experts.items():
        stacked = mx.stack([rows[e] for e in sorted(rows)])
        renamed[f"decoder.mlp.switch_mlp.{name}.weight"] = stacked
    drafter.load_weights(list(drafter.sanitize(renamed).items()))
    drafter.bind(reference)
    return drafter


def test_head_logits_equal_mlx_vlm_drafter(model, reference, folders):
    """Teacher-forced: the same trunk states and tokens through mlx-vlm's
    drafter and through the head; argmax equal, top-5 within 1e-4."""
    m, _ = model
    drafter = _drafter(folders, reference)
    tokens = mx.array(PROMPT)[None]
    out = reference(tokens, cache=reference.make_cache(), return_hidden=True)
    hidden = out.hidden_states[0]  # mlx-vlm's own: norm(hc_head(streams))
    _, taps = m.target.forward(tokens, m.target.make_cache())
    np.testing.assert_allclose(np.array(taps.hidden), np.array(hidden), atol=1e-5)
    assert hidden.shape[-1] == 32  # one collapsed stream, not hc_mult of them

    nxt, h = tokens[:, 1:], hidden[:, :-1]
    want_hidden = drafter._forward_hidden(
        drafter._input_embed(nxt), h, drafter.make_cache(), None
    )
    want = np.array(reference.lm_head(want_hidden))[0]
    got_logits, got_chain = m.head(h, nxt, m.head.make_cache())
    got = np.array(got_logits)[0]
    assert (got.argmax(-1) == want.argmax(-1)).all()
    top5 = np.argsort(-want, axis=-1)[:, :5]
    np.testing.assert_allclose(
        np.take_along_axis(got, top5, -1), np.take_along_axis(want, top5, -1), atol=1e-4
    )
    # a chained draft feeds back what mlx-vlm's draft_block feeds back
    np.testing.assert_allclose(np.array(got_chain), np.array(want_hidden), atol=1e-5)


def test_head_chain_equals_mlx_vlm_draft_block(model, reference, folders):
    """mlx-vlm's own draft loop (prefill, then ``draft_block``) drafts the
    tokens the head drafts when chained on its own output."""
    m, _ = model
    drafter = _drafter(folders, reference)
    tokens = mx.array(PROMPT)[None]
    hidden = reference(
        tokens, cache=reference.make_cache(), return_hidden=True
    ).hidden_states[0]
    bonus = 7
    drafter.reset(reference)
    drafter.prefill_from_target_hidden(tokens, hidden, bonus, None, greedy=True)
    drafts = drafter.draft_block(bonus, hidden[:, -1:], None, 4, None, greedy=True)
    want = np.array(drafts)
    head, cache = m.head, m.head.make_cache()
    nxt = mx.concatenate([tokens[:, 1:], mx.array([[bonus]])], axis=1)
    logits, h = head(hidden, nxt, cache)
    got = [int(mx.argmax(logits[0, -1]))]
    h = h[:, -1:]
    while len(got) < 3:
        logits, h = head(h, mx.array([[got[-1]]]), cache)
        got.append(int(mx.argmax(logits[0, -1])))
    assert got == want[0].tolist()


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_equals_mlx_vlm_with_drafts_accepted(model, reference, k):
    m, _ = model
    expected = vlm_greedy(reference, PROMPT, 40)
    got, stats = mtp_greedy(m, PROMPT, 40, k)
    assert got == expected
    assert 0 < stats.accepted < stats.drafted  # kept and rejected drafts both ran
    assert stats.generation_tokens == len(got) == stats.rounds + stats.accepted


def test_stop_and_max_tokens_inside_a_draft(model, reference):
    m, _ = model
    free, stats = mtp_greedy(m, PROMPT, 40, 3)
    pos = 0
    for r in stats.trace:
        if r.accepted >= 1 and free[pos] not in free[:pos]:
            break
        pos += r.accepted + 1
    stop = free[pos]
    got, _ = mtp_greedy(m, PROMPT, 40, 3, stop={stop})
    assert got == vlm_greedy(reference, PROMPT, 40, stop={stop})
    assert got[-1] == stop and len(got) == pos + 1
    got, _ = mtp_greedy(m, PROMPT, pos + 1, 3)
    assert got == vlm_greedy(reference, PROMPT, pos + 1)


def _state(c):
    """Every array a layer's caches hold, up to their offsets."""
    out = []
    for member in c.caches:
        n = member.offset
        out += [member.keys[..., :n, :], member.values[..., :n, :]]
    return out


def _same(caches, refs):
    for c, r in zip(caches, refs):
        assert c.offset == r.offset
        for a, b in zip(_state(c), _state(r)):
            assert a.shape == b.shape and a.dtype == b.dtype
            np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5)


@pytest.mark.parametrize("n, verified", [(0, 4), (1, 4), (3, 4), (2, 3), (1, 2)])
def test_rollback_equals_a_decode_that_never_saw_the_draft(model, n, verified):
    """Verify ``verified`` tokens, reject the last ``n``: every layer's latent,
    rope keys and indexer keys equal those of a decode of the kept tokens
    alone, and the next forward's logits too; the head's caches likewise."""
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

    head = m.head
    h = mx.random.normal((1, len(PROMPT) + 3, 32))
    toks = mx.array(PROMPT + [1, 2, 3])[None]
    hc = head.make_cache()
    head(h[:, :-3], toks[:, :-3], hc)
    head(h[:, -3:], toks[:, -3:], hc)
    rollback(hc, n)
    hr = head.make_cache()
    head(h[:, : h.shape[1] - n], toks[:, : h.shape[1] - n], hr)
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
    # the streams shared their rounds: fewer batched rounds than theirs
    assert out.stats.generation_steps < sum(s.rounds for s in out.mtp_stats)


# prompt lengths on both sides of the indexer's top-k of 8
RAGGED = [20, 31, 9, 26, 14, 35, 5, 23]
LIMITS = [12, 7, 15, 9, 11, 6, 13, 10]


@pytest.mark.parametrize("streams", [4, 8])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_ragged_streams_decode_batched_as_mlx_vlm_alone(model, reference, streams, k):
    """4 or 8 streams at different lengths, each leaving at its own limit (and
    with 8, three joining the running batch) decode in one trunk forward a
    round, each stream's greedy tokens mlx-vlm's plain ones (exact top-k)."""
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
    """Four streams at different lengths (two below the top-k, two past it)
    verify 4 tokens each in one forward and keep ``kept[b]``: each stream's
    extracted latent, rope keys and indexer keys equal those of decoding its
    kept tokens alone, and the batch decodes on as those do; the head's batch
    cache likewise."""
    m, _ = model
    t = m.target
    prompts = [random_prompt(n, seed=20 + i) for i, n in enumerate([30, 4, 21, 6])]
    rows = [[p[-1], 5 + i, 77, 130 - i] for i, p in enumerate(prompts)]
    singles = []
    for p in prompts:
        c = t.make_cache()
        t.forward(mx.array(p[:-1])[None], c)
        singles.append(c)
    batch = [batch_cache.merge(layer) for layer in zip(*singles)]
    assert all(type(c) is BatchHyV4CacheList for c in batch)
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
        got = [c.extract(b, HyV4CacheList) for c in batch]
        assert all(type(c) is HyV4CacheList for c in got)
        _same(got, ref)
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
    head(mx.concatenate([h[:, -3:] for h in hs]), mx.concatenate([tk[:, -3:] for tk in toks]), hb)
    drop = [3 - min(n, 3) for n in kept]
    batch_cache.rollback(hb, drop)
    for b, (h, tk, n) in enumerate(zip(hs, toks, L)):
        hr = head.make_cache()
        keep = n + 3 - drop[b]
        head(h[:, :keep], tk[:, :keep], hr)
        _same([hb[0].extract(b)], hr)


def test_kv_bits_is_refused_in_one_line(folders):
    r = subprocess.run(
        [sys.executable, "-m", "mlx_mtp", "generate", "--model", str(folders[0]),
         "--prompt", "hi", "--max-tokens", "4", "--kv-bits", "8"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "hy_v4" in lines[0] and "kv_bits" in lines[0]
    assert "Traceback" not in r.stderr


def test_trunk_alone_generates_plainly_with_a_notice(folders, reference):
    m, tok = mlx_mtp.load(folders[1])
    assert m.head is None and "no MTP tensors" in m.notice
    from mlx_mtp.heads.hy_v4 import ExactIndexer

    attns = [layer.self_attn for layer in m.target.backbone.layers]
    assert [type(a.indexer) for a in attns if a.indexer is not None] == [
        ExactIndexer
    ] * 2  # verified chunks (prompt lookup, a drafter) read as decoding does
    got, stats = mtp_greedy(m, PROMPT, 8, 2)
    assert got == vlm_greedy(reference, PROMPT, 8) and stats.drafted == 0
    # prompt lookup drafts without a head: verified chunks, exact output
    repeated = random_prompt(12, seed=5) * 3
    rs = list(mlx_mtp.stream_generate(
        m, tok, repeated, 24, draft_source="ngram", draft_max=3
    ))  # fmt: skip
    assert [r.token for r in rs] == vlm_greedy(reference, repeated, 24)
    assert rs[-1].stats.drafted > 0


def test_info_lists_the_family_its_layers_and_source(folders):
    from mlx_mtp import families

    (found,) = [f for f in families.families() if f["model_type"] == "hy_v4"]
    assert found["models"].startswith("Hunyuan-V4")
    assert "mlx-vlm 0.7.10" in found["models"]
    assert found["mtp_layers"] == 1 and not found["layer_per_depth"]
    r = subprocess.run(
        [sys.executable, "-m", "mlx_mtp", "info"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0 and "hy_v4" in r.stdout and "Hunyuan-V4" in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "mlx_mtp", "info", str(folders[0])],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0 and re.search(r"MTP layers\s+1\n", r.stdout)
    assert re.search(r"architecture\s+hy_v4\n", r.stdout)


def _bits(module):
    return {x.bits for _, x in module.named_modules() if hasattr(x, "bits")}


def test_convert_quantized_keeps_the_head_at_8_bits(folders, tmp_path):
    """``mlx-mtp convert -q`` (4-bit trunk, groups of 32): the MTP layer's
    tensors go to ``mtp.safetensors`` at 8 bits, mlx-vlm reads the trunk it
    wrote, and greedy decoding with drafts is mlx-vlm's on that trunk."""
    from mlx_vlm.utils import load_model

    from mlx_mtp.convert import convert
    from mlx_mtp.heads.hy_v4 import exact_indexers

    out = convert(folders[0], tmp_path / "q4", quantize=True, q_group_size=32)
    quant = json.loads((out / "config.json").read_text())["quantization"]
    assert quant["bits"] == 4
    head_q = {k: v for k, v in quant.items() if k.startswith("model.mtp_layers.")}
    assert head_q and all(v["bits"] == 8 for v in head_q.values())
    trunk_names = mx.load(str(out / "model.safetensors")).keys()
    head_names = mx.load(str(out / "mtp.safetensors")).keys()
    assert not any(k.startswith("model.mtp_layers.") for k in trunk_names)
    assert all(k.startswith("model.mtp_layers.") for k in head_names)

    m, _ = mlx_mtp.load(out)
    assert _bits(m.head) == {8} and 4 in _bits(m.target.model)
    assert "eh_proj" in {p for p, x in m.head.named_modules() if hasattr(x, "bits")}

    reference = load_model(out).language_model
    exact_indexers(reference)
    got, stats = mtp_greedy(m, PROMPT, 30, 2)
    assert got == vlm_greedy(reference, PROMPT, 30) and stats.accepted > 0


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
