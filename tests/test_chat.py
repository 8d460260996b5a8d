"""Chat sessions: the cache kept across turns changes nothing but speed.

Every answer is compared with a fresh generation from the full templated
conversation (greedy, float32 tiny models). The tiny byte-level models often
emit tokens whose text does not re-encode to the same tokens, so the cache is
cut back inside the previous answer in most of these runs, exercising both the
cut inside the head's pending states and the cut below them.
"""

import mlx.core as mx
import numpy as np
import pytest
from conftest import DRAFT_FAMILIES
from mlx_mtp.cli import app
from typer.testing import CliRunner

import tiny

import mlx_mtp
import mlx_mtp.chat
from mlx_mtp.adaptive import FixedDraft
from mlx_mtp.cache import cache_offset, truncate
from mlx_mtp.chat import ChatSession
from mlx_mtp.generate import stream_generate

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def loaded(tiny_folders):
    models = {}

    def get(family):
        if family not in models:
            models[family] = mlx_mtp.load(tiny_folders(family)[0])
        return models[family]

    return get


def fresh_answer(model, tokenizer, messages, max_tokens=MAX_TOKENS, **kwargs):
    """Tokens and text of a generation from scratch over the templated ``messages``."""
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    out = list(stream_generate(model, tokenizer, prompt, max_tokens, **kwargs))
    return [r.token for r in out], "".join(r.text for r in out)


def answer(session, text):
    out = list(session.send(text))
    return [r.token for r in out], "".join(r.text for r in out)


def assert_cache_holds(model, cache, tokens, successor=None):
    """The trunk's cache equals a fresh prefill of ``tokens``; the head's is consistent.

    A head with nothing pending has also read the pair of the last hidden
    state with ``successor``, the token the trunk reads next.
    """
    assert cache.offset == len(tokens)
    if not tokens:
        assert tiny.head_offset(cache) == 0 and tiny.pending_hidden(cache) is None
        return
    fresh = model.make_cache()
    _, hidden = model.target(mx.array(tokens)[None], fresh.trunk)
    assert_kv_close(cache.trunk, fresh.trunk)
    if model.head is None:
        return
    pending = 0 if tiny.pending_hidden(cache) is None else tiny.pending_hidden(cache).shape[1]
    assert tiny.head_offset(cache) + pending == len(tokens)
    assert len(tiny.pending_tokens(cache)) == max(pending - 1, 0)
    n = tiny.head_offset(cache)
    tokens = tokens + ([] if successor is None else [successor])
    head_fresh = model.head.make_cache()
    if n:  # (a head that defers its reads may not have read any yet)
        model.head(hidden[:, :n], mx.array(tokens[1 : n + 1])[None], head_fresh)
    assert_kv_close(cache.head, head_fresh)


def assert_kv_close(caches, fresh):
    for c, f in zip(caches, fresh):
        assert cache_offset(c) == cache_offset(f)
        # a CacheList (DeepSeek-V3.2's latent and indexer keys) holds several
        for ci, fi in zip(getattr(c, "caches", [c]), getattr(f, "caches", [f])):
            if not ci.offset:  # nothing held (a fresh cache has no arrays)
                continue
            for a, b in ((ci.keys, fi.keys), (ci.values, fi.values)):
                a, b = a[..., : ci.offset, :], b[..., : fi.offset, :]
                np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4)


@pytest.mark.parametrize("family", DRAFT_FAMILIES)
def test_second_turn_equals_fresh_generation(loaded, family):
    model, tok = loaded(family)
    session = ChatSession(model, tok, system="be brief", max_tokens=MAX_TOKENS)
    answer(session, "hello")
    got = answer(session, "and then?")
    assert got == fresh_answer(model, tok, session.messages[:-1])
    assert session.last.reused_tokens > 20  # the first turn's prompt at least
    assert session.total.generation_tokens == 2 * MAX_TOKENS
    assert session.total.drafted > 0
    assert_cache_holds(model, session.cache, session.cached_tokens)


def test_sampled_second_turn_equals_fresh_generation(loaded):
    """Seeded sampling with penalties sees the whole conversation, cached or not."""
    model, tok = loaded("deepseek_v3")
    sampling = dict(temp=1.0, seed=3, repetition_penalty=1.5, draft_sampling="sample")
    session = ChatSession(model, tok, max_tokens=MAX_TOKENS, **sampling)
    answer(session, "hello")
    got = answer(session, "hm")
    assert session.last.reused_tokens > 0
    assert got == fresh_answer(model, tok, session.messages[:-1], **sampling)


def test_template_that_rerenders_history(loaded):
    """A template showing earlier answers differently: the common prefix is reused."""
    model, tok = loaded("mimo")
    tok._tokenizer.chat_template, original = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if loop.last or m['role'] != 'assistant' %}{{ m['content'] }}"
        "{% else %}(earlier){% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        tok._tokenizer.chat_template,
    )
    try:
        session = ChatSession(model, tok, max_tokens=MAX_TOKENS)
        answer(session, "one")
        first_prompt = session.last.prompt_tokens
        answer(session, "two")
        reused = session.last.reused_tokens
        got = answer(session, "three")
        expected = fresh_answer(model, tok, session.messages[:-1])
    finally:
        tok._tokenizer.chat_template = original
    assert got == expected
    assert 0 < reused < first_prompt + MAX_TOKENS
    assert_cache_holds(model, session.cache, session.cached_tokens)


def test_rebuilds_when_the_cache_cannot_be_cut(loaded, monkeypatch):
    model, tok = loaded("deepseek_v3")
    monkeypatch.setattr(mlx_mtp.chat, "truncatable", lambda cache: False)
    session = ChatSession(model, tok, max_tokens=MAX_TOKENS)
    answer(session, "hi")
    session.cached_tokens[-1] = -1  # as if the template re-rendered the last token
    got = answer(session, "more")
    assert session.last.rebuilt and session.last.reused_tokens == 0
    assert got == fresh_answer(model, tok, session.messages[:-1])


@pytest.mark.parametrize("keep", [0, 1, 5, 30, 38, 39])
def test_truncate_equals_a_fresh_prefill(loaded, keep):
    """Cut anywhere (below, at and inside the pending states), then continue."""
    model, _ = loaded("glm4_moe")
    prompt = list(range(60, 100))
    cache = model.make_cache()
    list(
        mlx_mtp.speculative_generate_step(
            prompt, model, max_tokens=1, prompt_cache=cache
        )
    )
    kept = truncate(model, cache, keep)
    assert kept in (keep, keep - 1, 0)
    assert_cache_holds(model, cache, prompt[:kept], prompt[kept])
    more = [
        t
        for t, _ in mlx_mtp.speculative_generate_step(
            prompt[kept:] + [7, 8], model, max_tokens=6, prompt_cache=cache
        )
    ]
    ref = [
        t
        for t, _ in mlx_mtp.speculative_generate_step(
            prompt + [7, 8], model, max_tokens=6
        )
    ]
    assert more == ref


class Interrupt:
    """Wraps ``stream_generate``: records every call, interrupts chosen ones."""

    def __init__(self, monkeypatch, after=None):
        self.calls, self.after = [], dict(after or {})
        monkeypatch.setattr(mlx_mtp.chat, "stream_generate", self)

    def __call__(self, *args, **kwargs):
        call = len(self.calls)
        self.calls.append([])
        for response in stream_generate(*args, **kwargs):
            if len(self.calls[call]) == self.after.get(call):
                raise KeyboardInterrupt
            self.calls[call].append(response)
            yield response

    def tokens(self, call):
        return [r.token for r in self.calls[call]]

    def text(self, call):
        return "".join(r.text for r in self.calls[call])


@pytest.mark.parametrize("how", ["interrupt", "close"])
def test_interrupted_turn_is_dropped(loaded, monkeypatch, how):
    model, tok = loaded("glm4_moe_lite")
    Interrupt(monkeypatch, after={1: 4} if how == "interrupt" else None)
    session = ChatSession(model, tok, max_tokens=MAX_TOKENS)
    answer(session, "first")
    messages, cached = list(session.messages), list(session.cached_tokens)
    stream = session.send("second")
    if how == "interrupt":
        with pytest.raises(KeyboardInterrupt):
            list(stream)
    else:
        for _ in range(4):
            next(stream)
        stream.close()
    assert session.messages == messages and session.last.interrupted
    # the cache keeps what the dropped turn shared with the conversation
    kept = len(session.cached_tokens)
    assert 0 < kept <= len(cached) and session.cached_tokens == cached[:kept]
    successor = cached[kept] if kept < len(cached) else None
    assert_cache_holds(model, session.cache, cached[:kept], successor)
    got = answer(session, "third")
    assert got == fresh_answer(model, tok, session.messages[:-1])
    assert (
        session.total.generation_tokens == 2 * MAX_TOKENS
    )  # the dropped turn not counted


def test_abandoned_stream_closed_late_leaves_the_newer_turn_alone(loaded):
    model, tok = loaded("mimo")
    session = ChatSession(model, tok, max_tokens=MAX_TOKENS)
    answer(session, "first")
    abandoned = session.send("second")
    next(abandoned), next(abandoned)
    newer = session.send("third")  # drops the unfinished second turn
    head = [next(newer), next(newer)]
    abandoned.close()
    got = [r.token for r in head + list(newer)]
    assert [m["content"] for m in session.messages[::2]] == ["first", "third"]
    assert got == fresh_answer(model, tok, session.messages[:-1])[0]
    assert_cache_holds(model, session.cache, session.cached_tokens)


def test_chat_cli_end_to_end(tiny_folders, loaded, monkeypatch):
    """Two turns, /reset, an interrupted answer, a normal one, /stats, /help, /quit."""
    model, tok = loaded("mimo")
    spy = Interrupt(monkeypatch, after={3: 3})
    script = (
        "hello\nwhat next?\n/reset\nnew start\nplease go on\nagain\n"
        "/stats\n/help\n/nope\n/quit\nnever sent\n"
    )
    result = CliRunner().invoke(
        app,
        ["chat", "--model", str(tiny_folders("mimo")[0]), "-n", str(MAX_TOKENS)],
        input=script,
    )
    assert result.exit_code == 0, result.output
    assert len(spy.calls) == 5
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    bot = lambda call: {"role": "assistant", "content": spy.text(call)}  # noqa: E731
    expected = {
        0: [user("hello")],
        1: [user("hello"), bot(0), user("what next?")],
        2: [user("new start")],
        4: [user("new start"), bot(2), user("again")],  # turn 3 was interrupted
    }
    for call, messages in expected.items():
        assert spy.tokens(call) == fresh_answer(model, tok, messages)[0], call
    assert len(spy.tokens(3)) == 3
    assert "interrupted" in result.output
    assert result.output.count("/pass") == 4  # one footer per answer
    assert "draft acceptance" in result.output  # /stats
    assert "/reset  forget the conversation" in result.output  # /help
    assert "unknown command /nope" in result.output


def test_hybrid_model_keeps_its_recurrent_state_consistent(tmp_path, monkeypatch):
    """Gated-delta-net states cannot be cut back to any token, but a matching prefix
    is reused and an interrupted turn restores the states of the turn boundary."""
    import tiny_hybrid

    model, tok = mlx_mtp.load(tiny_hybrid.build_folder(tmp_path / "q", "qwen3_5")[0])
    spy = Interrupt(monkeypatch, after={2: 3})
    # one-token answers: nothing of them is re-encoded into the next prompt
    session = ChatSession(model, tok, max_tokens=1)
    answer(session, "hello")
    first_prompt = session.last.prompt_tokens
    got = answer(session, "and?")
    assert session.last.reused_tokens == first_prompt and not session.last.rebuilt
    assert got == fresh_answer(model, tok, session.messages[:-1], max_tokens=1)
    boundary = list(session.cached_tokens)
    session.max_tokens = MAX_TOKENS
    with pytest.raises(KeyboardInterrupt):
        answer(session, "stop me")
    assert not session.last.rebuilt
    # the recurrent states of the turn boundary are back
    assert session.cached_tokens == boundary and session.cache.offset == len(boundary)
    fresh = model.make_cache()
    model.target(mx.array(boundary)[None], fresh.trunk)
    pairs = zip(session.cache.trunk, fresh.trunk)
    recurrent = [(c, f) for c, f in pairs if not hasattr(c, "offset")]
    assert recurrent
    for c, f in recurrent:
        for a, b in zip(c.cache, f.cache):
            np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5)
    got = answer(session, "again")
    assert session.last.reused_tokens == len(boundary)
    assert got == fresh_answer(model, tok, session.messages[:-1])
    assert len(spy.calls) == 4


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_cache_lists_without_a_head_are_reused(tiny_folders, family, monkeypatch):
    """Trunks whose layers cache a ``CacheList`` (MLA latent + indexer keys) and
    no MTP head: the prompt cache is still measured, reused and cut back."""
    model, tok = mlx_mtp.load(tiny_folders(family)[1])
    assert model.head is None
    spy = Interrupt(monkeypatch, after={2: 3})
    session = ChatSession(model, tok, max_tokens=MAX_TOKENS)
    answer(session, "hello")
    assert session.cache.offset == len(session.cached_tokens) > 20
    first_prompt = session.last.prompt_tokens
    got = answer(session, "and then?")
    assert first_prompt <= session.last.reused_tokens < len(session.cached_tokens)
    assert got == fresh_answer(model, tok, session.messages[:-1])
    assert_cache_holds(model, session.cache, session.cached_tokens)
    boundary = list(session.cached_tokens)
    with pytest.raises(KeyboardInterrupt):
        answer(session, "stop me")
    assert session.cache.offset == len(session.cached_tokens) <= len(boundary)
    got = answer(session, "again")
    assert got == fresh_answer(model, tok, session.messages[:-1])
    assert len(spy.calls) == 4


def test_stats_after_a_dropped_turn_count_the_answered_one(loaded, monkeypatch):
    model, tok = loaded("glm4_moe_lite")
    session = ChatSession(model, tok, max_tokens=MAX_TOKENS)
    answer(session, "first")
    answer(session, "second")
    answered = session.answered
    assert answered.reused_tokens > 0
    Interrupt(monkeypatch, after={0: 3})  # the next call: the third turn
    with pytest.raises(KeyboardInterrupt):
        list(session.send("a much longer third message that shares less"))
    assert session.last.interrupted
    assert session.answered is answered  # the dropped turn's reuse counts nowhere


def _tokens(model, prompt, cache, k, n=6):
    return [
        t
        for t, _ in mlx_mtp.speculative_generate_step(
            prompt, model, max_tokens=n, prompt_cache=cache, drafts=FixedDraft(k)
        )
    ]


@pytest.mark.parametrize("before", ["never", "partly"])
@pytest.mark.parametrize("cut", [None, "below", "at", "inside"])
def test_a_head_left_behind_starts_again_where_the_trunk_stands(loaded, before, cut):
    """A generation without head drafts leaves the head behind the trunk
    (it never ran, or stopped part way with states pending). The next one that
    drafts starts the head where the trunk stands: its caches are those of a
    head that read from there, the output that of a fresh generation; a cut
    below, at or inside the new start keeps both so."""
    model, _ = loaded("glm4_moe")
    head = model.head.layer_cache
    prompt = list(range(60, 90))
    cache = model.make_cache()
    history = list(prompt)
    if before == "partly":  # the head reads the prompt, then stops
        history += _tokens(model, prompt, cache, 2) + [5, 6]
        history += _tokens(model, history[cache.offset :], cache, 0)
    else:
        history += _tokens(model, prompt, cache, 0)
    assert cache.offset == len(history) - 1
    assert not tiny.head_follows(cache, head)
    start = cache.offset
    history += [7, 8]
    history += _tokens(model, history[start:], cache, 3)
    assert cache.start[0] == start and tiny.head_follows(cache, head)
    # the head's caches: a head that read the pairs from ``start`` on
    n = cache.offset
    fresh = model.make_cache()
    _, hidden = model.target(mx.array(history[:n])[None], fresh.trunk)
    m = tiny.head_offset(cache)
    head_fresh = model.head.make_cache()
    model.head(
        hidden[:, start : start + m],
        mx.array(history[start + 1 : start + m + 1])[None],
        head_fresh,
    )
    assert_kv_close(cache.head, head_fresh)
    if cut is not None:
        keep = {"below": start - 4, "at": start, "inside": start + 3}[cut]
        kept = truncate(model, cache, keep)
        assert kept in (keep, keep - 1)
        assert tiny.head_follows(cache, head)
        history = history[:kept]
    more = _tokens(model, history[cache.offset :] + [9, 10], cache, 3)
    ref = _tokens(model, history + [9, 10], model.make_cache(), 0)
    assert more == ref
    assert tiny.head_follows(cache, head)
