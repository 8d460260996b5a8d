"""Round-by-round state checks shared by the tests of the families mlx-lm 0.32
loads with a cache kind of their own (LongCat-Flash-Ngram's n-gram window,
DeepSeek-V4.1's layer caches): greedy rounds that snapshot the trunk's caches
after each one (``run_with_snapshots``), mlx-lm's decode of the same tokens
compared with every snapshot (``assert_states_match``), and a verify pass of
6 tokens rolled back (``verify_and_roll_back``).

Each family says what a snapshot holds (``state``: the trunk's caches to a
value) and how a snapshot is compared with mlx-lm's caches (``check``)."""

import dataclasses

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from test_hybrid import CountingTrunk
from test_speculative import PREFILL

from mlx_mtp.adaptive import FixedDraft
from mlx_mtp.cache import rollback, start_verify
from mlx_mtp.speculative import speculative_generate_step
from mlx_mtp.stats import MTPStats

VERIFIED = [7, 8, 9, 10, 11, 12]


def run_with_snapshots(model, prompt, max_tokens, draft_max, state, stop=()):
    """Greedy rounds at ``draft_max`` drafts; after each, ``state(trunk)``.
    Returns the tokens, the stats, ``(offset, state)`` per round and the
    trunk forwards the rounds took."""
    counting = CountingTrunk(model.target)
    model = dataclasses.replace(model, target=counting)
    cache = model.make_cache()
    snapshots, offset, out = [], 0, []
    stats = MTPStats(trace=[])
    for tok, _ in speculative_generate_step(
        prompt,
        model,
        max_tokens=max_tokens,
        drafts=FixedDraft(draft_max),
        stop_tokens=stop,
        prompt_cache=cache,
        prefill_step_size=PREFILL,
        stats=stats,
    ):
        if cache.offset != offset:  # a round has settled
            offset = cache.offset
            # nothing kept
            assert not any(getattr(c, "verifying", False) for c in cache.trunk)
            snapshots.append((offset, state(cache.trunk)))
        out.append(tok)
    prefill_calls = -(-(len(prompt) - 1) // PREFILL)
    return out, stats, snapshots, counting.calls - prefill_calls


def assert_states_match(reference, prompt, out, snapshots, check):
    """Each snapshot equals mlx-lm's caches after the same tokens, one at a
    time (``check(snapshot, caches)``)."""
    tokens, cache, done = prompt + out, make_prompt_cache(reference), 0
    for s in range(0, len(prompt) - 1, PREFILL):  # the same prefill chunks
        chunk = prompt[s : min(s + PREFILL, len(prompt) - 1)]
        reference(mx.array(chunk)[None], cache=cache)
        done += len(chunk)
    for offset, state in snapshots:
        for t in tokens[done:offset]:
            reference(mx.array([[t]]), cache=cache)
        done = offset
        check(state, cache)


def verify_and_roll_back(model, reference, prompt, n, split):
    """The trunk reads ``prompt``, then verifies 6 tokens (one forward, or two
    split at ``split``) and rolls back ``n``; returns its caches and mlx-lm's
    after the prompt and the ``6 - n`` kept tokens, one at a time."""
    cache = model.make_cache().trunk
    model.target(mx.array(prompt)[None], cache)
    start_verify(cache)
    model.target(mx.array(VERIFIED[:split])[None], cache)
    if split < len(VERIFIED):
        model.target(mx.array(VERIFIED[split:])[None], cache)
    rollback(cache, n)
    ref = make_prompt_cache(reference)
    reference(mx.array(prompt)[None], cache=ref)
    for t in VERIFIED[: len(VERIFIED) - n]:
        reference(mx.array([[t]]), cache=ref)
    return cache, ref
