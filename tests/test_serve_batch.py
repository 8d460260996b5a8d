"""Several streams at once, with MTP: one trunk forward verifies every stream's
drafts and each keeps its own number of tokens.

Every stream's greedy tokens equal those of the same request alone, on a
DeepSeek-style model and on a hybrid gated-delta-net model (Qwen3-Next),
through the server with 8 clients at once and through the batch decoder with
streams joining and leaving between rounds; afterwards each stream's caches
equal those of the single-stream loop.
"""

import statistics
import threading

import mlx.core as mx
import numpy as np
import pytest
import tiny
import tiny_hybrid
import tiny_ngram
import tiny_own_layout
import tiny_recurrent
from live_server import LiveServer
from test_multilayer import build_multilayer

import mlx_mtp
from mlx_mtp.adaptive import FixedDraft
from mlx_mtp.generate import stream_generate
from mlx_mtp.sampling import ExactMatchVerifier
from mlx_mtp.draft_settings import DraftSettings
from mlx_mtp.serve import ServeConfig
from mlx_mtp.decoder import Decoder as BatchDecoder
from mlx_mtp.drafts import ModelDrafts
from mlx_mtp.stream import Stream
from mlx_mtp.batch_policy import BatchDraftLength, expected_tokens
from mlx_mtp.speculative import prefill, speculative_generate_step

PREFILL = 16
CLIENTS = 8


def _catch_up(model, cache):
    """Every drafter of ``cache`` reads what it has pending."""
    s = Stream([], cache, None, 0)
    one = BatchDecoder(model, merge=False)
    one.add([s])
    for d in model.drafters:
        d.catch_up(one, [s])
    one.remove([s])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    built = {}

    def get(kind):
        if kind not in built:
            if kind == "multi":
                built[kind] = build_multilayer(root / kind)[0]
            elif kind == "longcat_flash_ngram":
                built[kind] = tiny_ngram.build_folder(root / kind)
            elif kind in tiny_hybrid.MODEL_TYPES:
                built[kind] = tiny_hybrid.build_folder(root / kind, kind)[0]
            elif kind in tiny_recurrent.MODEL_TYPES:
                built[kind] = tiny_recurrent.build_folder(root / kind, kind)[0]
            elif (
                kind in tiny_own_layout.MULTI_LAYER_TYPES + tiny_own_layout.MODEL_TYPES
            ):
                built[kind] = tiny_own_layout.build_folder(root / kind, kind)[0]
            else:
                built[kind] = tiny.build_folder(root / kind, kind)[0]
        return built[kind]

    return get


# -- through the server ---------------------------------------------------------


def _prompts():
    # different lengths, so the streams sit at different positions
    return [f"Q{i}: " + "abcdefgh"[: i + 1] * (i + 1) for i in range(CLIENTS)]


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_next"])
@pytest.mark.parametrize("draft", ["fixed", "adaptive"])
def test_eight_clients_at_once_get_their_answers_alone(folders, family, draft):
    model, tokenizer = mlx_mtp.load(folders(family))
    # no lookup memory: drafts from the answers alone would let the first
    # requests finish before the last has joined (peak_batch below)
    config = ServeConfig(max_batch=CLIENTS, prompt_cache_entries=0, lookup_memory_bytes=0, drafts=DraftSettings(adaptive=draft == "adaptive"))
    server = LiveServer(model, tokenizer, family, config)
    try:
        client = server.client()

        def ask(i, prompt):
            r = client.completions.create(
                model=family,
                prompt=prompt,
                max_tokens=24 + 4 * i,  # they finish at different rounds
                extra_body={"draft_max": [3, 3, 1, 4, 3, 0, 2, 3][i]},
            )
            return r.choices[0].text, r.usage

        alone = [ask(i, p) for i, p in enumerate(_prompts())]
        together = [None] * CLIENTS
        threads = [
            threading.Thread(target=lambda i=i, p=p: together.__setitem__(i, ask(i, p)))
            for i, p in enumerate(_prompts())
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert [t for t, _ in together] == [t for t, _ in alone]
        assert server.get("/health")[1]["peak_batch"] == CLIENTS
        for (_, u), i in zip(together, range(CLIENTS)):
            assert u.completion_tokens == 24 + 4 * i
            assert u.mtp["rounds"] + u.mtp["accepted"] == u.completion_tokens
        if draft == "fixed":  # ragged acceptance happened
            accepted = {u.mtp["accepted"] for _, u in together}
            assert len(accepted) > 2 and sum(u.mtp["drafted"] for _, u in together)
    finally:
        server.close()


def test_ngram_clients_at_once_get_plain_greedy_answers(folders):
    """LongCat-Flash-Ngram served batched (its layers' ``CacheList``s and its
    n-gram window have batch forms): clients at once, with different depths
    and limits, each get mlx-lm's plain greedy answer to its prompt."""
    from mlx_lm.utils import load_model as mlx_lm_load_model
    from test_speculative import reference_greedy

    family = "longcat_flash_ngram"
    full, trunk = folders(family)
    model, tokenizer = mlx_mtp.load(full)
    reference, _ = mlx_lm_load_model(trunk)
    n = 5
    config = ServeConfig(max_batch=n, prompt_cache_entries=0, lookup_memory_bytes=0,
                         drafts=DraftSettings(adaptive=False))  # fmt: skip
    server = LiveServer(model, tokenizer, family, config)
    try:
        client = server.client()
        assert server.get("/health")[1]["batched"] is True
        limits, depths = [14, 22, 10, 18, 16], [3, 1, 2, 3, 0]

        def ask(i, prompt):
            r = client.completions.create(
                model=family, prompt=prompt, max_tokens=limits[i],
                extra_body={"draft_max": depths[i]},
            )  # fmt: skip
            return r.choices[0].text, r.usage

        prompts = _prompts()[:n]
        together = [None] * n
        threads = [
            threading.Thread(target=lambda i=i, p=p: together.__setitem__(i, ask(i, p)))
            for i, p in enumerate(prompts)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        for i, (p, (text, usage)) in enumerate(zip(prompts, together)):
            ids = tokenizer.encode(p)
            tokens = reference_greedy(reference, ids, limits[i])
            # plain decoding's text (the server's detokenizer) of mlx-lm's tokens
            plain = list(stream_generate(model, tokenizer, ids, limits[i], draft_max=0))
            assert [r.token for r in plain] == tokens, i
            assert text == "".join(r.text for r in plain), i
            assert usage.mtp["rounds"] + usage.mtp["accepted"] == len(tokens)
        assert sum(u.mtp["accepted"] for _, u in together) > 0
        assert server.get("/health")[1]["peak_batch"] > 1
    finally:
        server.close()


def test_recurrent_prompt_cache_resumes_at_a_turn_boundary(folders):
    """Gated-delta-net states cannot be cut: the next turn starts from the
    state kept at the end of the last prompt or answer."""
    family = "qwen3_next"
    model, tokenizer = mlx_mtp.load(folders(family))
    server = LiveServer(model, tokenizer, family, ServeConfig(drafts=DraftSettings(adaptive=False)))
    fresh = LiveServer(
        model,
        tokenizer,
        "fresh",
        ServeConfig(prompt_cache_entries=0, drafts=DraftSettings(adaptive=False)),
    )
    try:
        client, plain = server.client(), fresh.client()
        turn = [{"role": "user", "content": "Hello there."}]
        a = client.chat.completions.create(model=family, messages=turn, max_tokens=10)
        assert a.usage.prompt_tokens_details.cached_tokens == 0
        turn += [
            {"role": "assistant", "content": a.choices[0].message.content},
            {"role": "user", "content": "Go on."},
        ]
        b = client.chat.completions.create(model=family, messages=turn, max_tokens=10)
        cached = b.usage.prompt_tokens_details.cached_tokens
        assert cached >= a.usage.prompt_tokens - 1
        c = plain.chat.completions.create(model="fresh", messages=turn, max_tokens=10)
        assert c.usage.prompt_tokens_details.cached_tokens == 0
        assert b.choices[0].message.content == c.choices[0].message.content
    finally:
        server.close()
        fresh.close()


def test_caches_without_a_batch_form_are_served_one_token_at_a_time(folders):
    """LongCat-Flash caches in an ``OffsetCacheList``: no batch form here, so
    streams take turns through the single-stream loop; answers are the same."""
    family = "longcat_flash"
    model, tokenizer = mlx_mtp.load(folders(family))
    server = LiveServer(model, tokenizer, family, ServeConfig())
    try:
        client = server.client()
        assert server.get("/health")[1]["batched"] is False

        def ask(prompt, n=12, **kwargs):
            r = client.completions.create(
                model=family, prompt=prompt, max_tokens=n, **kwargs
            )
            return r.choices[0].text, r.usage

        prompts = _prompts()[:3]
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
            t.join(timeout=120)
        assert [t for t, _ in together] == [t for t, _ in alone]
        # a stop string ends the answer inside a round; the cache it leaves
        # holds what the trunk read, and the next request reuses it exactly
        text = alone[0][0]
        cut, usage = ask(prompts[0], stop=text[5:7])
        assert cut == text[:5] and usage.completion_tokens < 12
        first = tokenizer.encode(prompts[0])
        answer = [r.token for r in stream_generate(model, tokenizer, first, 12)]
        longer = first + answer[:8]
        again, usage = ask(longer)
        assert usage.prompt_tokens_details.cached_tokens >= len(first)
        expected = list(stream_generate(model, tokenizer, longer, 12))
        assert again == "".join(r.text for r in expected)
    finally:
        server.close()


# -- the batch decoder itself -------------------------------------------------------


def _stream(model, prompt, max_tokens, draft_max):
    cache = model.make_cache()
    prefill(model, cache, prompt, PREFILL, True)
    stream = Stream(
        history=list(prompt),
        cache=cache,
        verifier=ExactMatchVerifier(),
        max_tokens=max_tokens,
    )
    stream.source = ModelDrafts(FixedDraft(draft_max))
    return stream


def _layer_arrays(c):
    if getattr(c, "keys", None) is not None:
        return [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
    return [x for x in getattr(c, "cache", []) if x is not None]


def _assert_same_caches(alone, cache):
    """Every layer's state and the head's pending inputs are equal."""
    for a, b in zip(alone.state_list(), cache.state_list()):
        assert a.offset == b.offset if hasattr(a, "offset") else True
        for x, y in zip(_layer_arrays(a), _layer_arrays(b)):
            np.testing.assert_allclose(np.array(x), np.array(y), atol=1e-5)
    for qa, qb in zip(alone.pending, cache.pending):
        assert (qa.size, qa.tokens) == (qb.size, qb.tokens)


# attention, several MTP layers, and each recurrent cache (GDN, Mamba2, KDA,
# lightning attention)
BATCHED = ["deepseek_v3", "mimo", "multi", "step3p5", "qwen3_next", "qwen3_5"]
BATCHED += ["nemotron_h", "kimi_linear", "bailing_hybrid"]


@pytest.mark.parametrize("family", BATCHED)
def test_streams_join_and_leave_between_rounds(folders, family):
    model = mlx_mtp.load_model(folders(family))
    prompts = [
        tiny.random_prompt(n, seed=i)
        for i, n in enumerate([5, 17, 1, 30, 9, 2, 12, 40])
    ]
    limits = [40, 25, 40, 33, 40, 20, 40, 36]
    drafts = [3, 3, 2, 3, 1, 3, 2, 5]
    decoder = BatchDecoder(model)
    first = [_stream(model, p, n, k) for p, n, k in zip(prompts, limits, drafts)][:5]
    late = [_stream(model, p, n, k) for p, n, k in zip(prompts, limits, drafts)][5:]
    decoder.add(first)
    streams, out, rounds = first + late, {}, 0
    while decoder.streams or late:
        if rounds == 4:  # three more join the running batch
            decoder.add(late)
            late = []
        for s, tokens in zip(list(decoder.streams), decoder.step()):
            out.setdefault(id(s), []).extend(tokens)
        done = [s for s in decoder.streams if s.done]
        if done:
            decoder.remove(done)  # each gets its caches back
        rounds += 1
    for i, s in enumerate(streams):
        alone = model.make_cache()
        expected = [
            t
            for t, _ in speculative_generate_step(
                prompts[i],
                model,
                max_tokens=limits[i],
                drafts=FixedDraft(drafts[i]),
                prefill_step_size=PREFILL,
                prompt_cache=alone,
            )
        ]
        assert out[id(s)] == expected, f"stream {i}"
        assert s.stats.drafted > 0
        # the caches it leaves with are the single-stream loop's (the head
        # layers once both have read what they have pending)
        for c in (alone, s.cache):
            _catch_up(model, c)
        _assert_same_caches(alone, s.cache)
        assert alone.start == s.cache.start


@pytest.mark.parametrize("family", ["deepseek_v3", "multi", "qwen3_next"])
def test_prompts_of_different_lengths_are_read_together(folders, family):
    """Attention caches read prompts of different lengths in one forward,
    right-padded (recurrent ones in chunks of one length): each stream's
    caches are then those of reading its prompt alone."""
    model = mlx_mtp.load_model(folders(family))
    prompts = [tiny.random_prompt(n, seed=i) for i, n in enumerate([9, 14, 6, 12])]
    reader = BatchDecoder(model)
    streams = []
    for p in prompts:
        c = model.make_cache()
        streams.append(Stream(history=list(p), cache=c,
                              verifier=ExactMatchVerifier(), max_tokens=8))  # fmt: skip
    reader.add(streams)
    read, forwards = [0] * 4, 0
    while any(r < len(p) - 1 for r, p in zip(read, prompts)):
        live = [b for b, s in enumerate(streams) if s in reader.streams]
        takes, _, done = reader.read_chunk(
            [prompts[b] for b in live], [read[b] for b in live], 512
        )
        forwards += 1
        for b, n in zip(live, takes):
            read[b] += n
        reader.remove([streams[b] for b, d in zip(live, done) if d])
    recurrent = family == "qwen3_next"
    assert forwards == (4 if recurrent else 1)
    for p, s in zip(prompts, streams):
        alone = model.make_cache()
        prefill(model, alone, p, 512, True)
        for c in (alone, s.cache):
            _catch_up(model, c)
        _assert_same_caches(alone, s.cache)


def test_ragged_prompt_chunks_pad_no_more_than_they_read(folders):
    """A chunk is as wide as its padding stays within its real tokens."""
    reader = BatchDecoder(mlx_mtp.load_model(folders("deepseek_v3")))
    reader.add([_plain_stream(reader.model, [1, 2, 3], 4) for _ in range(4)])
    assert reader.chunks([40, 35, 30, 45], 512) == [40, 35, 30, 45]
    assert reader.chunks([40, 35, 30, 45], 32) == [32, 32, 30, 32]
    assert reader.chunks([100, 2, 2, 2], 512) == [2, 2, 2, 2]
    assert reader.chunks([100, 60, 2, 2], 512) == [60, 60, 2, 2]
    assert reader.chunks([7], 512) == [7]


def test_a_one_token_prompt_drafts_from_position_zero(folders):
    """The head reads position 0 inside a batch (per-stream position-0 zeroing)."""
    model = mlx_mtp.load_model(folders("deepseek_v3"))
    decoder = BatchDecoder(model)
    streams = [_stream(model, [7], 12, 3), _stream(model, tiny.random_prompt(9), 12, 3)]
    decoder.add(streams)
    got = {0: [], 1: []}
    while decoder.streams:
        for s, tokens in zip(list(decoder.streams), decoder.step()):
            got[streams.index(s)].extend(tokens)
        decoder.remove([s for s in decoder.streams if s.done])
    alone = model.make_cache()
    expected = list(
        speculative_generate_step([7], model, max_tokens=12, prompt_cache=alone)
    )
    assert got[0] == [t for t, _ in expected]
    head = streams[0].cache.head[0]
    np.testing.assert_allclose(
        np.array(head.keys[..., : head.offset, :]),
        np.array(alone.head[0].keys[..., : alone.head[0].offset, :]),
        atol=1e-5,
    )


def _plain_stream(model, prompt, max_tokens, verifier=None, stop=()):
    cache = model.make_cache()
    prefill(model, cache, prompt, PREFILL, True)
    stream = Stream(
        history=list(prompt),
        cache=cache,
        verifier=verifier or ExactMatchVerifier(),
        max_tokens=max_tokens,
        stop_tokens=set(stop),
    )
    stream.source = ModelDrafts(FixedDraft(0))
    return stream


def _decode(decoder, first, late, join_at=3, extract=True):
    """Run ``decoder`` to the end; ``late`` join after ``join_at`` rounds.
    Returns each stream's tokens and how many rounds started one ahead."""
    decoder.add(first)
    out, rounds, ahead = {}, 0, 0
    while decoder.streams or late:
        if rounds == join_at and late:
            decoder.add(late)
            late = []
        for s, tokens in zip(list(decoder.streams), decoder.step()):
            out.setdefault(id(s), []).extend(tokens)
        ahead += decoder.ahead is not None
        done = [s for s in decoder.streams if s.done]
        if done:
            decoder.remove(done, extract=extract)
        rounds += 1
    return out, ahead


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_next"])
def test_rounds_without_drafts_run_one_ahead_and_keep_every_token(folders, family):
    """With no drafts each round starts the next on its lazy tokens (caches
    with a length: attention; a recurrent state decodes in step): streams
    that join while a round is under way, stop on a stop token or at their
    limit, and leave with their caches get the tokens and caches they get alone."""
    model = mlx_mtp.load_model(folders(family))
    prompts = [tiny.random_prompt(n, seed=10 + i) for i, n in enumerate([6, 19, 3, 27, 11])]
    limits = [30, 12, 30, 21, 30]
    # a stop token the first stream writes first at its ``at``-th token
    first = [t for t, _ in speculative_generate_step(
        prompts[0], model, max_tokens=limits[0], drafts=FixedDraft(0))]  # fmt: skip
    at = next(i for i in range(5, len(first)) if first[i] not in first[:i])
    stop = first[at]
    streams = [_plain_stream(model, p, n, stop=[stop] if i == 0 else ())
               for i, (p, n) in enumerate(zip(prompts, limits))]  # fmt: skip
    out, ahead = _decode(BatchDecoder(model), streams[:3], streams[3:])
    assert (ahead > 0) == (family == "deepseek_v3")
    for i, s in enumerate(streams):
        cache = model.make_cache()
        expected = [
            t
            for t, _ in speculative_generate_step(
                prompts[i], model, max_tokens=limits[i], drafts=FixedDraft(0),
                stop_tokens=[stop] if i == 0 else (), prefill_step_size=PREFILL,
                prompt_cache=cache,
            )
        ]  # fmt: skip
        assert out[id(s)] == expected, f"stream {i}"
        assert s.history == prompts[i] + expected
        # the caches it leaves with hold all but its last token, as alone
        for a, b in zip(cache.trunk, s.cache.trunk):
            if hasattr(a, "offset"):
                assert a.offset == b.offset == len(s.history) - 1
            for x, y in zip(_layer_arrays(a), _layer_arrays(b)):
                np.testing.assert_allclose(np.array(x), np.array(y), atol=1e-5)
    assert out[id(streams[0])][-1] == stop and len(out[id(streams[0])]) == at + 1


def test_a_cache_left_one_ahead_resumes_as_if_never_left(folders):
    """A stream that leaves while the next round is under way takes that
    token back: generating on from its caches continues its tokens exactly."""
    model = mlx_mtp.load_model(folders("deepseek_v3"))
    prompt = tiny.random_prompt(13, seed=3)
    whole = [t for t, _ in speculative_generate_step(
        prompt, model, max_tokens=24, drafts=FixedDraft(0))]  # fmt: skip
    s = _plain_stream(model, prompt, 10)
    decoder = BatchDecoder(model)
    out, ahead = _decode(decoder, [s, _plain_stream(model, [5, 6, 7], 30)], [])
    assert ahead and out[id(s)] == whole[:10]
    rest = [t for t, _ in speculative_generate_step(
        [s.history[-1]], model, max_tokens=14, drafts=FixedDraft(0),
        prompt_cache=s.cache, cached_tokens=s.history[:-1])]  # fmt: skip
    assert rest == whole[10:]


def test_sampled_rounds_one_ahead_equal_rounds_in_step(folders, monkeypatch):
    """Sampling (seeded, penalties that read the lazy token) and
    log-probabilities are the same whether a round starts one ahead or not."""
    from mlx_mtp.stream import Logprobs
    from mlx_mtp.sampling import SamplingConfig, SamplingVerifier

    model = mlx_mtp.load_model(folders("deepseek_v3"))
    config = SamplingConfig(temp=0.8, top_p=0.9, repetition_penalty=1.3, seed=7)

    def run():
        streams = []
        for i, n in enumerate([4, 15, 9]):
            s = _plain_stream(
                model, tiny.random_prompt(n, seed=i), 20, SamplingVerifier(config)
            )
            s.logprobs = Logprobs(top=2)
            streams.append(s)
        out, ahead = _decode(BatchDecoder(model), streams, [])
        return [(out[id(s)], s.logprobs.entries) for s in streams], ahead

    got, ahead = run()
    monkeypatch.setattr(BatchDecoder, "_may_run_ahead", lambda self: False)
    expected, none = run()
    assert ahead > 0 and none == 0
    for (tokens, entries), (tokens_, entries_) in zip(got, expected):
        assert tokens == tokens_
        for (t, lp, top), (t_, lp_, top_) in zip(entries, entries_):
            assert t == t_ and lp == pytest.approx(lp_, abs=1e-4)
            assert [x for x, _ in top] == [x for x, _ in top_]


# -- the draft length of a batched round ------------------------------------------


def test_expected_tokens():
    assert expected_tokens([0.5, 0.5], 0) == 1
    assert expected_tokens([0.5, 0.5], 2) == 1 + 0.5 + 0.25
    assert expected_tokens([1.0, 1.0, 1.0], 2) == 3


def _measured(policy, batch, times, rounds=3):
    for _ in range(rounds):
        for k, t in times.items():
            policy.record(batch, k, t)


def test_policy_measures_both_ends_then_picks_the_fastest():
    policy = BatchDraftLength(explore=1000)
    rates, caps = [[0.9] * 4] * 8, [4] * 8
    # the largest K, then K = 0, until each has 3 rounds (K = 0 in a run:
    # a plain round costs what it does after another one)
    picks = []
    for _ in range(6):
        k = policy.choose(8, rates, caps)
        picks.append(k)
        policy.record(8, k, 1.0 if k else 0.2)
    assert picks == [4, 4, 4, 0, 0, 0]
    # compute-bound: a round with 4 drafts costs 5x a plain one (1 drafts 1.8x);
    # at 0.9 acceptance 4 drafts give 4.1 tokens per stream, 1 gives 1.9
    assert policy.choose(8, rates, caps) == 0
    # a slow round does not sway the median
    policy.record(8, 0, 5.0)
    assert policy.choose(8, rates, caps) == 0
    # a batch size not seen yet starts from the nearest one's times
    assert policy.choose(6, rates, caps) == 0
    # memory-bound: drafts nearly free, so draft all the way
    fast = BatchDraftLength(explore=1000)
    _measured(fast, 1, {4: 0.11, 0: 0.10})
    assert fast.choose(1, [[0.9] * 4], [4]) == 4
    # low acceptance: drafting does not pay even when it is cheap-ish
    assert fast.choose(1, [[0.01] * 4], [4]) == 0
    # an expected gain under 5% does not move it from the drafts asked for
    one = BatchDraftLength(explore=1000)
    _measured(one, 1, {1: 0.11, 0: 0.10})
    assert one.choose(1, [[0.08]], [1]) == 1  # K = 0 would be 1.8% faster
    assert one.choose(1, [[0.01]], [1]) == 0  # 8.9% faster


def test_policy_drafts_nothing_no_stream_expects_to_keep():
    """Where no stream expects to keep a draft (a drafter that never agreed,
    by a server's history), K = 0 stands for the drafts asked for, even
    where drafts are measured free, and the largest K is not timed for it;
    a stream that expects to keep one brings the drafts back."""
    free = BatchDraftLength(explore=1000)
    _measured(free, 2, {4: 0.10, 0: 0.10})
    assert free.choose(2, [[0.0] * 4] * 2, [4, 4]) == 0
    assert free.choose(2, [[0.0] * 4, [0.5] * 4], [4, 4]) == 4
    fresh = BatchDraftLength(explore=1000)
    picks = []
    for _ in range(4):
        picks.append(fresh.choose(2, [[0.0] * 4] * 2, [4, 4]))
        fresh.record(2, picks[-1], 0.1)
    assert picks == [0, 0, 0, 0] and set(fresh.samples[2]) == {0}
    # exploring rounds still try drafts now and then
    exploring = BatchDraftLength(explore=2)
    _measured(exploring, 2, {4: 0.10, 0: 0.10})
    picks = [exploring.choose(2, [[0.0] * 4] * 2, [4, 4]) for _ in range(8)]
    assert 0 < sum(1 for k in picks if k) <= 4


def test_policy_interpolates_and_explores():
    policy = BatchDraftLength(explore=2)
    _measured(policy, 2, {0: 1.0, 4: 1.1})
    times = {k: statistics.median(v) for k, v in policy.times(2).items()}
    assert policy._seconds(times, 2) == pytest.approx(1.05)
    picks = [policy.choose(2, [[1.0] * 4] * 2, [4, 4]) for _ in range(11)]
    # the best, and every other round another length, the most overdue
    # first; K = 0 for two rounds (the second runs on from the first)
    assert picks[0:7:2] == [4] * 4 and sorted(picks[1:8:2]) == [0, 1, 2, 3]
    assert picks[picks.index(0) + 1] == 0
    assert policy.choose(2, [[1.0] * 4] * 2, [0, 0]) == 0


def _explored(policy, rates, caps, rounds):
    picks = [policy.choose(8, rates, caps) for _ in range(rounds)]
    return {k: picks.count(k) for k in range(max(caps) + 1)}


def test_policy_explores_within_its_cost():
    """Measuring other lengths costs at most about 1% of the time: a length
    far behind the best is measured rarely (but at least every 512 rounds),
    one near it every few ``explore`` rounds."""
    rates, caps = [[0.4] * 3] * 8, [3] * 8
    # compute-bound: K drafts cost K + 1 plain rounds; K = 0 is the choice
    slow = BatchDraftLength(explore=16)
    _measured(slow, 8, {0: 1.0, 3: 4.0})
    n = _explored(slow, rates, caps, 1024)
    extra = {1: 2 - 1.4, 2: 3 - 1.56, 3: 4 - 1.624}  # seconds beyond K = 0's
    cost = sum(extra[k] * n[k] for k in extra) / 1024
    assert cost <= 0.015 and n[3] >= 1024 // 512 and n[1] > n[2] >= n[3]
    # every length in turn each 64 rounds would have cost 6.9%
    assert sum(extra.values()) / 64 > 0.06
    # memory-bound, low acceptance: 1 and 2 drafts near the best (3), each
    # measured every other ``explore`` slot; K = 0 (a quarter fewer tokens
    # a second) less often, two rounds at a time
    near = BatchDraftLength(explore=16)
    _measured(near, 8, {0: 1.0, 3: 1.05})
    n = _explored(near, [[0.3] * 3] * 8, caps, 960)
    assert min(n[1], n[2]) >= 960 // 32 - 4 and 8 <= n[0] < n[1]
    assert n[3] == 960 - n[0] - n[1] - n[2]


def test_rope_offsets_per_stream_match_single_streams():
    """mlx's rope takes one offset per sequence: the basis of RaggedKVCache."""
    x = mx.random.normal((3, 4, 5, 8))
    offsets = [0, 7, 2]
    batched = mx.fast.rope(
        x, 8, traditional=False, base=1e4, scale=1.0, offset=mx.array(offsets)
    )
    for b, o in enumerate(offsets):
        one = mx.fast.rope(
            x[b : b + 1], 8, traditional=False, base=1e4, scale=1.0, offset=o
        )
        assert mx.array_equal(one, batched[b : b + 1])


def test_stream_rates_are_the_single_stream_estimator():
    """A served stream estimates acceptance with the single-stream loop's
    estimator and constants: it starts from what train-head or tune measured
    (not an optimistic 1, which made every request's first rounds draft in
    full), follows the rounds, and undrafted depths drift back."""
    from mlx_mtp.adaptive import AcceptanceEstimate, CostAwareDraft, prior_costs

    rates = AcceptanceEstimate(3, [0.3, 0.2])
    single = CostAwareDraft(3, prior_costs(), [0.3, 0.2])
    assert rates.rates == single.acceptance == [0.3, 0.2, 0.2]
    rates.update(1, 1)  # the first draft kept
    single.update(1, 1)
    assert rates.rates == single.acceptance and rates.rates[0] > 0.3
    for _ in range(500):
        rates.update(0, 0)  # rounds that drafted nothing
    assert rates.rates == pytest.approx([0.3, 0.3, 0.3], abs=1e-3)
    assert AcceptanceEstimate(2).rates == [0.5, 0.5]  # nothing measured: a guess


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_next"])
def test_streams_that_take_no_head_drafts_leave_the_head_alone(folders, family):
    """A stream whose source takes no head drafts (``draft_max`` 0) reads its
    prompt and decodes beside streams that draft, without feeding the head
    (mlx-lm's plain decoding does no such work): its head reads nothing and
    holds nothing; every stream's tokens are those of decoding alone."""
    model = mlx_mtp.load_model(folders(family))
    prompts = [tiny.random_prompt(n, seed=i) for i, n in enumerate([9, 14, 6, 12])]
    drafts = [0, 2, 0, 3]
    streams = []
    for p, k in zip(prompts, drafts):
        s = Stream(history=list(p), cache=model.make_cache(),
                   verifier=ExactMatchVerifier(), max_tokens=20)  # fmt: skip
        s.source = ModelDrafts(FixedDraft(k))
        streams.append(s)
    reader, decoder = BatchDecoder(model), BatchDecoder(model)
    reader.add(streams)
    read = [0] * len(prompts)
    while reader.streams:
        live = [b for b, s in enumerate(streams) if s in reader.streams]
        takes, _, done = reader.read_chunk(
            [prompts[b] for b in live], [read[b] for b in live], 512
        )
        for b, n in zip(live, takes):
            read[b] += n
        reader.remove([streams[b] for b, d in zip(live, done) if d])
    decoder.add(streams)
    got = [[] for _ in streams]
    while decoder.streams:
        for s, tokens in zip(list(decoder.streams), decoder.step()):
            got[streams.index(s)].extend(tokens)
        decoder.remove([s for s in decoder.streams if s.done])
    for p, k, s, tokens in zip(prompts, drafts, streams, got):
        alone = speculative_generate_step(p, model, max_tokens=20,
                                          drafts=FixedDraft(k))  # fmt: skip
        assert tokens == [t for t, _ in alone]
        fed = tiny.head_offset(s.cache) + s.cache.pending[0].size
        assert (fed == 0) == (k == 0)
        assert tiny.head_follows(s.cache, model.head.layer_cache) == (k > 0)
