"""LongCat-Flash-Ngram (``longcat_flash_ngram``, mlx-lm 0.32): its MTP head drafts,
losslessly.

The head embeds its token with its own plain table, as vLLM drafts for this
model type (``heads/longcat_flash_ngram.py`` pins the sources): its
teacher-forced logits equal a numpy forward of the checkpoint's ``model.mtp.``
tensors over mlx-lm's final-norm hidden states, and differ from those of a
head fed the n-gram embedding. Greedy MTP output equals mlx-lm's greedy output
at 1-3 drafts, with drafts accepted and rejected; after every round, and after
a rollback of every length, the trunk's n-gram window and its caches' offsets
equal those of a decode that never saw the rejected drafts (one trunk forward
per round: nothing is replayed); ``batch_generate`` of 4 prompts gives each
its greedy output; a chat reuses its cache; ``--kv-bits`` is refused in one
line; ``info`` counts its layers and ``convert -q`` keeps the head at 8 bits.
"""

import json

import mlx.core as mx
import numpy as np
import pytest
import tiny
import tiny_ngram
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.utils import load_model as mlx_lm_load_model
from test_chat import answer, fresh_answer
from mlx_lm_rounds import assert_states_match, run_with_snapshots, verify_and_roll_back
from test_speculative import PREFILL, mtp_greedy, reference_greedy

import mlx_mtp
from mlx_mtp import families
from mlx_mtp.batch_cache import BatchCacheList
from mlx_mtp.cache import cache_offset, rollback, start_verify
from mlx_mtp.chat import ChatSession
from mlx_mtp.decoder import Decoder
from mlx_mtp.sampling import ExactMatchVerifier
from mlx_mtp.speculative import prefill
from mlx_mtp.stream import Stream


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return tiny_ngram.build_folder(tmp_path_factory.mktemp("ngram") / "longcat")


@pytest.fixture(scope="module")
def models(folders):
    full, trunk = folders
    reference, _ = mlx_lm_load_model(trunk)
    return mlx_mtp.load_model(full), reference


def test_listed_as_a_family_not_as_not_yet():
    assert families.module_for("longcat_flash_ngram") == "longcat_flash_ngram"
    assert "longcat_flash_ngram" not in families.NOT_YET
    rows = {f["model_type"]: f for f in families.families()}
    assert rows["longcat_flash_ngram"]["mtp_layers"] == 1


# -- an independent numpy forward of the head ------------------------------------


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def numpy_head(reference, w, hidden, embedded):
    """vLLM ``longcat_flash_mtp.py``: ``eh_proj([enorm(e), hnorm(h)])``, the block
    (mlx-lm's MLA and MLP classes from the checkpoint tensors), ``norm``, then
    the trunk's ``lm_head``."""
    from mlx_lm.models.longcat_flash import LongcatFlashMLA, LongcatFlashMLP

    args, g = reference.args, lambda k: np.array(w[k])  # noqa: E731
    eps, pre = args.rms_norm_eps, "model.mtp.layers.0."
    x = (
        np.concatenate(
            [
                _rms(embedded, g(pre + "enorm.m.weight"), eps),
                _rms(hidden, g(pre + "hnorm.m.weight"), eps),
            ],
            -1,
        )
        @ g(pre + "eh_proj.weight").T
    )
    kv_b = g(pre + "self_attn.kv_b_proj.weight").reshape(
        args.num_attention_heads, -1, args.kv_lora_rank
    )
    nope = args.qk_nope_head_dim
    attn_w = {
        k[len(pre + "self_attn.") :]: v
        for k, v in w.items()
        if k.startswith(pre + "self_attn.") and "kv_b_proj" not in k
    }
    attn_w["embed_q.weight"] = mx.array(kv_b[:, :nope].swapaxes(1, 2).copy())
    attn_w["unembed_out.weight"] = mx.array(kv_b[:, nope:].copy())
    attn = LongcatFlashMLA(args)
    attn.load_weights(list(attn_w.items()))
    mlp = LongcatFlashMLP(args)
    mlp_pre = pre + "transformer_layer.mlp."
    mlp.load_weights(
        [(k[len(mlp_pre) :], v) for k, v in w.items() if k.startswith(mlp_pre)]
    )

    xm = mx.array(x)[None]
    mask = create_attention_mask(xm, None, return_array=True)
    norm = lambda x, name: mx.fast.rms_norm(x, w[pre + name], eps)  # noqa: E731
    h = xm + attn(norm(xm, "input_layernorm.weight"), mask, KVCache())
    h = h + mlp(norm(h, "post_attention_layernorm.weight"))
    y = np.array(h[0])
    return _rms(y, g("model.mtp.norm.weight"), eps) @ g("lm_head.weight").T


def test_head_matches_numpy_and_reads_the_plain_embedding(folders, models):
    full, _ = folders
    model, reference = models
    w = mx.load(str(full / "model.safetensors"))
    tokens = tiny.random_prompt(24, seed=3)
    got = np.array(mlx_mtp.mtp_logits(model, tokens))
    hidden = np.array(reference.model(mx.array(tokens)[None])[0])[:-1]  # final norm
    plain = np.array(w["model.mtp.embed_tokens.weight"])[tokens[1:]]
    want = numpy_head(reference, w, hidden, plain)
    assert got.shape == want.shape == (len(tokens) - 1, tiny.VOCAB)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    top = np.argsort(-want, axis=-1)[:, :5]
    np.testing.assert_allclose(
        np.take_along_axis(got, top, -1), np.take_along_axis(want, top, -1), atol=1e-4
    )
    # the n-gram embedding of the same tokens (with their context) would be read
    # otherwise: a head wired that way predicts differently
    ngram = np.array(reference.model.ngram_embeddings(mx.array(tokens)[None])[0])[1:]
    other = numpy_head(reference, w, hidden, ngram)
    assert (other.argmax(-1) != want.argmax(-1)).any()


def test_the_head_keeps_no_ngram_state(models):
    model, _ = models
    assert all(isinstance(c, KVCache) for c in model.head.make_cache())


# -- greedy identity, states after every round -----------------------------------


def _state(caches):
    """The n-gram window, then each layer's offset."""
    window = caches[0][0]
    return (None if window is None else np.array(window)), [
        cache_offset(c) for c in caches[1:]
    ]


def assert_same_state(got, ref):
    (window, offsets), (ref_window, ref_offsets) = got, ref
    assert offsets == ref_offsets
    if ref_window is None:
        assert window is None or not window.any()
        return
    # ours holds the full window, zeros before the first token (mlx-lm: shorter)
    assert window.shape == (1, tiny_ngram.WINDOW)
    lead = tiny_ngram.WINDOW - ref_window.shape[-1]
    assert not window[:, :lead].any()
    np.testing.assert_array_equal(window[:, lead:], ref_window)


def check_state(state, ref):
    assert_same_state(state, _state(ref))


@pytest.mark.parametrize("draft_max", [1, 2, 3])
def test_greedy_identical_and_states_after_every_round(models, draft_max):
    model, reference = models
    prompt = tiny.random_prompt(2 * PREFILL + 5, seed=1)  # several prefill chunks
    expected = reference_greedy(reference, prompt, 40)
    got, stats, snapshots, forwards = run_with_snapshots(
        model, prompt, 40, draft_max, _state
    )
    assert got == expected
    assert 0 < stats.accepted < stats.drafted  # accepted and rejected drafts
    assert stats.generation_tokens == len(got) == stats.rounds + stats.accepted
    assert forwards == stats.rounds == len(snapshots)  # no replay for a rollback
    assert_states_match(reference, prompt, got, snapshots, check_state)


def test_the_trunk_alone_generates_as_mlx_lm(folders, models):
    _, trunk = folders
    _, reference = models
    model = mlx_mtp.load_model(trunk)
    assert model.head is None and "no MTP tensors" in model.notice
    prompt = tiny.random_prompt(20, seed=6)
    got, stats, _ = mtp_greedy(model, prompt, 12, draft_max=3)
    assert got == reference_greedy(reference, prompt, 12) and stats.drafted == 0


# -- rollback --------------------------------------------------------------------


def check_rollback(model, reference, prompt, n, split):
    """Verify 6 tokens (one forward, or two), roll back ``n``: the window and
    offsets are those of mlx-lm's decode of the prompt and the kept tokens."""
    cache, ref = verify_and_roll_back(model, reference, prompt, n, split)
    assert not cache[0].verifying
    assert_same_state(_state(cache), _state(ref))


def test_rollback_of_every_length(models):
    model, reference = models
    prompt = tiny.random_prompt(20, seed=4)
    for n, split in [(0, 6), (1, 6), (2, 6), (3, 6), (4, 6), (5, 6), (4, 2), (2, 3)]:
        check_rollback(model, reference, prompt, n, split)
    check_rollback(model, reference, prompt[:1], 5, 6)  # a history shorter than 3
    cache = model.make_cache().trunk
    start_verify(cache)
    model.target(mx.array([[7, 8]]), cache)
    with pytest.raises(ValueError, match="cannot roll back 3 of 2"):
        rollback(cache, 3)
    with pytest.raises(RuntimeError, match="outside a verify pass"):
        rollback(cache, 1)


def test_a_snapshot_brings_the_window_back(models):
    model, _ = models
    cache = model.make_cache()
    model.target(mx.array([tiny.random_prompt(21, seed=5)]), cache.trunk)
    before = _state(cache.trunk)
    snapshot = cache.snapshot(trunk_only=True)
    assert snapshot is not None
    model.target(mx.array([[3, 4, 5, 6, 7]]), cache.trunk)
    cache.restore(snapshot)
    assert_same_state(_state(cache.trunk), before)


# -- batches, chat ---------------------------------------------------------------


# different lengths (some shorter than the n-gram window), limits that end them apart
LENGTHS = [5, 30, 12, 41, 2, 21, 9, 34]
LIMITS = [10, 16, 7, 18, 12, 9, 15, 13]
EOS = tiny.special_id("<|im_end|>")


@pytest.mark.parametrize("streams, draft_max", [(4, 1), (4, 2), (4, 3), (8, 1), (8, 2), (8, 3)])
def test_batch_generate_on_ragged_streams_is_greedy_and_batched(
    folders, models, streams, draft_max
):
    """4 or 8 prompts of different lengths (8: at most 5 at once, so streams
    leave at their limits and waiting ones join): one trunk forward a round
    for all streams (``BatchCacheList``, the window's ``BatchStatesCache``),
    and each prompt's tokens are mlx-lm's greedy alone, with the drafts it
    drafts and keeps alone at that depth."""
    _, reference = models
    model, tokenizer = mlx_mtp.load(folders[0])
    assert Decoder(model).batched
    prompts = [tiny.random_prompt(n, seed=10 + i) for i, n in enumerate(LENGTHS)]
    prompts, limits = prompts[:streams], LIMITS[:streams]
    got = mlx_mtp.batch_generate(
        model, tokenizer, prompts, max_tokens=limits, return_token_ids=True,
        draft_max=draft_max, adaptive_draft=False, draft_source="mtp",
        completion_batch_size=5, prefill_step_size=PREFILL,
    )  # fmt: skip
    for i, (p, n) in enumerate(zip(prompts, limits)):
        want = reference_greedy(reference, p, n, stop=(EOS,))
        assert got.token_ids[i] == [t for t in want if t != EOS], i
        _, alone, _ = mtp_greedy(model, p, n, draft_max, stop=(EOS,))
        stats = got.mtp_stats[i]
        assert (stats.drafted, stats.accepted) == (alone.drafted, alone.accepted), i
    assert 0 < sum(s.accepted for s in got.mtp_stats) < sum(
        s.drafted for s in got.mtp_stats
    )
    # the streams shared their rounds' forwards (one stream at a time would
    # take a batch round per stream round; the first alone decodes 4 at once)
    assert got.stats.generation_steps <= sum(s.rounds for s in got.mtp_stats) - 3


def _batch_state(caches):
    """``_state``, and each attention's keys and values up to its offset."""
    arrays = [
        np.array(x[..., : cache_offset(c), :])
        for c in caches[1:]
        for m in c.caches
        for x in (m.keys, m.values)
    ]
    return _state(caches), arrays


def test_a_batch_rolls_each_stream_back_by_its_own_count(models):
    """Streams at their own lengths verify ragged drafts in one forward and
    keep different counts of them: each stream's caches, taken out of the
    batch, are those of mlx-lm's decode of its prompt and kept tokens."""
    model, reference = models
    prompts = [tiny.random_prompt(n, seed=30 + i) for i, n in enumerate([17, 2, 9, 25])]
    drafts = [[7, 8, 9, 10], [11, 12], [13, 14, 15], [16]]
    keep = [1, 2, 0, 1]  # each stream keeps all its verified tokens but these
    streams = [_prefilled(model, p) for p in prompts]  # each read to its last token
    verified = [p[-1:] + d for p, d in zip(prompts, drafts)]
    batch = Decoder(model)
    batch.add(streams)
    trunk = batch.trunk
    assert isinstance(trunk[1], BatchCacheList)
    assert trunk[1].lengths == [len(p) - 1 for p in prompts]
    start_verify(trunk)
    width = max(map(len, verified))
    padded = [v + [0] * (width - len(v)) for v in verified]
    model.target.forward(mx.array(padded), trunk)
    batch.rollback(trunk, [width - len(v) + k for v, k in zip(verified, keep)])
    batch.remove(streams)
    for s, p, v, k in zip(streams, prompts, verified, keep):
        ref = make_prompt_cache(reference)
        reference(mx.array(p[:-1])[None], cache=ref)
        for t in v[: len(v) - k]:
            reference(mx.array([[t]]), cache=ref)
        (got, keys), (want, ref_keys) = _batch_state(s.cache.trunk), _batch_state(ref)
        assert not s.cache.trunk[0].verifying
        assert_same_state(got, want)
        assert len(keys) == len(ref_keys) > 0
        for a, b in zip(keys, ref_keys):
            np.testing.assert_allclose(a, b, atol=1e-5)


def _prefilled(model, prompt):
    cache = model.make_cache()
    prefill(model, cache, prompt, PREFILL, True)
    s = Stream(list(prompt), cache, ExactMatchVerifier(), 8)
    s.source = None
    return s


def test_chat_reuses_its_cache(folders):
    """The n-gram window is a ``KeepStatesCache``, the layers' caches
    ``CacheList``s: the prompt cache still counts its tokens and answers equal
    fresh ones."""
    model, tok = mlx_mtp.load(folders[0])
    session = ChatSession(model, tok, max_tokens=8)
    answer(session, "hello")
    assert session.cache.offset == len(session.cached_tokens) > 20
    got = answer(session, "and then?")
    assert got == fresh_answer(model, tok, session.messages[:-1], max_tokens=8)
    assert session.cache.offset == len(session.cached_tokens)


def test_kv_bits_is_refused_in_one_line(folders, capsys):
    from mlx_mtp.cli.app import run_app

    code = run_app(["generate", "-m", str(folders[0]), "-p", "hi", "-n", "4",
                    "--no-chat-template", "--kv-bits", "8"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert "longcat_flash_ngram" in err[0] and "kv_bits" in err[0]


def test_info_counts_its_layers_and_head(folders, capsys):
    from mlx_mtp.cli.app import run_app

    assert run_app(["info", str(folders[0]), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["layers"] == tiny_ngram.CONFIG["num_layers"]
    assert info["mtp_layers"] == 1


def test_convert_keeps_the_head_at_higher_precision(folders, tmp_path, capsys):
    from mlx_mtp.cli.app import run_app

    out = tmp_path / "q4"
    assert run_app(["convert", str(folders[0]), str(out), "-q"]) == 0
    capsys.readouterr()
    assert run_app(["info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert any(k.startswith("4-bit") for k in info["trunk_precision"])
    assert any(k.startswith("8-bit") for k in info["mtp_precision"])
    assert not any(k.startswith("4-bit") for k in info["mtp_precision"])
    model = mlx_mtp.load_model(out)
    assert model.head is not None and model.notice is None
