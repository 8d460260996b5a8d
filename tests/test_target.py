"""A target the library does not know, written only here, and prompts with media.

``TokensAsMedia`` wraps an mlx-lm model (a ``target.Target`` subclass, loaded
with ``load(..., target=TokensAsMedia)``) and reads a prompt's media segment
as input embeddings: the segment's content is a few token ids, embedded as
the model embeds them, while the prompt's tokens hold placeholders there.
So a media prompt must generate exactly what the plain prompt with those
tokens in place generates, through the one loop, ``batch_generate`` and the
server's batched rounds, with drafts made, and no prompt cache (in memory,
in a file, on disk) may give one media prompt the state of another whose
tokens are equal and whose content is not.
"""

import threading

import mlx.core as mx
import numpy as np
import pytest
import tiny
import tiny_hybrid
from mlx_lm.generate import generate_step

import mlx_mtp
from mlx_mtp import prompt_file
from mlx_mtp.batch import batch_generate
from mlx_mtp.disk_cache import DiskCache
from mlx_mtp.errors import MTPError
from mlx_mtp.generate import stream_generate
from mlx_mtp.prompt import Prompt, Segment, digest_of
from mlx_mtp.prompt_cache import PromptCache
from mlx_mtp.request import DraftSettings, GenerationRequest
from mlx_mtp.serve import ServeConfig
from mlx_mtp.serve.engine import Engine, Request
from mlx_mtp.speculative import prefill
from mlx_mtp.target import Target

PLACEHOLDER = 3  # the token the prompt holds where its media is read


class TokensAsMedia(Target):
    """Reads a segment whose content is token ids as their embeddings."""

    def embed_segment(self, segment):
        return self.embed_tokens(mx.array(segment.data, dtype=mx.int32))


def media(tokens, start, length):
    """``tokens`` with ``tokens[start : start + length]`` read as media."""
    hidden = list(tokens[start : start + length])
    digest = digest_of(np.array(hidden, np.int32).tobytes())
    shown = list(tokens[:start]) + [PLACEHOLDER] * length + list(tokens[start + length :])
    return Prompt(tuple(shown), (Segment(start, length, digest, "tokens", hidden),))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("target")
    built = {}

    def get(family):
        if family not in built:
            if family in tiny_hybrid.MODEL_TYPES:
                folder = tiny_hybrid.build_folder(root / family, family)[0]
            else:
                folder = tiny.build_folder(root / family, family)[0]
            built[family] = mlx_mtp.load(folder, target=TokensAsMedia)
        return built[family]

    return get


def reference(model, tokenizer, tokens, n):
    """mlx-lm's greedy tokens after the plain ``tokens``, to an end token."""
    eos = set(tokenizer.eos_token_ids)
    out = []
    for t, _ in generate_step(mx.array(tokens), model, max_tokens=n):
        out.append(int(t))
        if int(t) in eos:
            break
    return out


FAMILIES = ["mimo", "qwen3_next"]  # attention caches; a recurrent hybrid's
DRAFTS = dict(draft_max=2, adaptive_draft=False)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("step", [4, 64])
def test_one_stream_reads_media_as_embeddings(models, family, step):
    model, tokenizer = models(family)
    tokens = tiny.random_prompt(24, seed=1)
    want = reference(model, tokenizer, tokens, 20)
    prompt = media(tokens, 6, 7)  # chunks of 4 meet the segment inside it
    out = list(stream_generate(model, tokenizer, prompt, 20, prefill_step_size=step,
                               **DRAFTS))  # fmt: skip
    assert [r.token for r in out] == want
    assert out[-1].stats.drafted > 0
    # the placeholders alone are another prompt
    shown, real = (model(mx.array([t]))[0, -1] for t in (prompt.tokens, tokens))
    assert not mx.allclose(shown, real)


def test_a_text_target_refuses_media_in_one_line(tmp_path):
    folder = tiny.build_folder(tmp_path / "m", "mimo")[0]
    model, tokenizer = mlx_mtp.load(folder)
    prompt = media(tiny.random_prompt(12), 2, 3)
    with pytest.raises(MTPError, match=r"reads text only: it cannot read a prompt's"):
        list(stream_generate(model, tokenizer, prompt, 4))


def test_a_prompt_must_end_with_a_token_after_its_media(models):
    model, tokenizer = models("mimo")
    tokens = tiny.random_prompt(10)
    with pytest.raises(MTPError, match="must end with a token after its media"):
        list(stream_generate(model, tokenizer, media(tokens, 6, 4), 4))


def _ragged():
    """Eight prompts of different lengths, most with media at other places."""
    prompts, plain = [], []
    for i in range(8):
        tokens = tiny.random_prompt(10 + 3 * i, seed=i)
        plain.append(tokens)
        prompts.append(media(tokens, 1 + i, 2 + i % 4) if i % 4 else Prompt(tokens))
    return prompts, plain


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_generate_of_ragged_media_prompts(models, family):
    model, tokenizer = models(family)
    prompts, plain = _ragged()
    out = batch_generate(model, tokenizer, prompts, max_tokens=12,
                         prefill_step_size=5, return_token_ids=True,
                         **DRAFTS)  # fmt: skip
    for ids, tokens in zip(out.token_ids, plain):
        assert ids == reference(model, tokenizer, tokens, 12)
    assert sum(s.drafted for s in out.mtp_stats) > 0


def _serve(engine, prompts, max_tokens=12):
    """Each prompt's text and usage from ``engine``, sent together."""
    done = [threading.Event() for _ in prompts]
    texts, usages = [""] * len(prompts), [None] * len(prompts)

    def emit_for(i):
        def emit(event):
            texts[i] += event.text
            if event.finish_reason is not None or event.error is not None:
                usages[i] = event.usage
                done[i].set()

        return emit

    params = GenerationRequest(
        max_tokens=max_tokens, drafts=DraftSettings(draft_max=2, adaptive=False)
    )
    for i, p in enumerate(prompts):
        engine.submit(Request(prompt=p, params=params, emit=emit_for(i)))
    for d in done:
        assert d.wait(120)
    return texts, usages


@pytest.mark.parametrize("family", FAMILIES)
def test_the_servers_batched_rounds_read_media(models, family):
    """The media prompts and their plain twins, served together: the same
    answers (the server's text of plain prompts is checked against the one
    loop elsewhere)."""
    model, tokenizer = models(family)
    prompts, plain = _ragged()
    engine = Engine(model, tokenizer, ServeConfig(prefill_step=5, drafts=DraftSettings(draft_max=2)))
    engine.start()
    try:
        texts, _ = _serve(engine, prompts + [Prompt(t) for t in plain])
    finally:
        engine.stop()
    assert texts[:8] == texts[8:]
    assert len(set(texts)) > 1 and engine.totals.drafted > 0


# -- no prompt cache serves a prompt with other media ---------------------------


START, LENGTH = 3, 12  # the twins' media: where the tiny models' answers differ


def _twins(n=16, start=START, length=LENGTH):
    """Two prompts of equal tokens whose media differ, and their plain forms."""
    a = tiny.random_prompt(n, seed=7)
    b = list(a)
    b[start : start + length] = tiny.random_prompt(length, seed=8)
    return media(a, start, length), media(b, start, length), a, b


def test_equal_tokens_and_other_media_have_other_keys():
    pa, pb, _, _ = _twins()
    assert pa.tokens == pb.tokens and pa.keys() != pb.keys()
    end = START + LENGTH
    assert pa.keys()[:START] == pb.keys()[:START]
    assert pa.keys()[end:] == pb.keys()[end:]
    assert all(k < 0 for k in pa.keys()[START:end])
    assert pa.cut(6) == START and pa.cut(end) == end
    assert pa.prefix(end).segments == pa.segments
    with pytest.raises(MTPError, match="split a media segment"):
        pa.prefix(6)


def test_the_memory_cache_keeps_them_apart(models):
    model, _ = models("mimo")
    pa, pb, _, _ = _twins()
    cache = model.make_cache()
    prefill(model, cache, pa)
    memory = PromptCache(4, 1 << 30)
    memory.insert(pa.prefix(len(pa) - 1), cache)
    assert memory.fetch(model, pa)[1] == len(pa) - 1
    # b shares the tokens before its media only (the cut may keep fewer:
    # ``StreamCache.truncate``)
    assert 0 < memory.fetch(model, pb)[1] <= START


def test_a_prompt_cache_file_keeps_the_digests(models, tmp_path):
    model, _ = models("mimo")
    pa, pb, _, _ = _twins()
    cache = model.make_cache()
    prefill(model, cache, pa)
    path = tmp_path / "a.safetensors"
    prompt_file.save(path, model, cache, pa.prefix(len(pa) - 1))
    loaded = prompt_file.load(path, model)
    assert loaded.tokens == list(pa.tokens[:-1])
    assert [s.digest for s in loaded.segments] == [pa.segments[0].digest]
    assert loaded.keys == pa.keys()[:-1] != pb.keys()[:-1]
    assert prompt_file.peek(path).keys == loaded.keys


def test_the_disk_cache_keeps_them_apart(models, tmp_path):
    model, _ = models("mimo")
    pa, pb, _, _ = _twins()
    cache = model.make_cache()
    prefill(model, cache, pa)
    disk = DiskCache(tmp_path, 1 << 30, model, None)
    disk.put(pa.prefix(len(pa) - 1), cache)
    disk.flush()
    again = DiskCache(tmp_path, 1 << 30, model, None)  # a restart reads it back
    assert again.best(pa.keys())[1] == len(pa) - 1
    assert again.best(pb.keys())[1] == START
    assert disk.name(pa.keys()[:-1]) != disk.name(pb.keys()[:-1])


def test_the_server_never_serves_one_media_prompt_anothers_state(models, tmp_path):
    """Request a, then b (equal tokens, other media), then a again: each
    answer is a cold read's of its own prompt, and only a's repeat reuses
    its media (from memory or disk). On the recurrent hybrid, whose tiny
    answers differ between the twins."""
    model, tokenizer = models("qwen3_next")
    pa, pb, a, b = _twins()
    config = ServeConfig(prompt_cache_dir=tmp_path / "disk", drafts=DraftSettings(draft_max=2))
    engine = Engine(model, tokenizer, config)
    engine.start()
    try:
        got = [_serve(engine, [p]) for p in (pa, pb, pa)]
    finally:
        engine.stop()
    engine = Engine(model, tokenizer, ServeConfig(drafts=DraftSettings(draft_max=2)))  # no cache
    engine.start()
    try:
        cold = [_serve(engine, [Prompt(t)])[0] for t in (a, b)]
    finally:
        engine.stop()
    assert [t for t, _ in got] == [cold[0], cold[1], cold[0]] and cold[0] != cold[1]
    cached = [u[0]["prompt_tokens_details"]["cached_tokens"] for _, u in got]
    assert cached[0] == 0 and cached[1] <= START and cached[2] >= START + LENGTH
