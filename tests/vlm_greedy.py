"""Greedy decoding shared by the tests of the families mlx-vlm loads: the
language model's own plain greedy tokens (``vlm_greedy``) and mlx-mtp's at a
fixed draft count (``mtp_greedy``)."""

import mlx.core as mx

from mlx_mtp.adaptive import FixedDraft
from mlx_mtp.speculative import speculative_generate_step
from mlx_mtp.stats import MTPStats


def vlm_greedy(lm, prompt, n, stop=()):
    """mlx-vlm's language model ``lm``, decoding one token at a time."""
    cache = lm.make_cache()
    logits = lm(mx.array(prompt)[None], cache=cache).logits
    out = []
    while len(out) < n:
        t = int(mx.argmax(logits[0, -1]))
        out.append(t)
        if t in stop:
            break
        logits = lm(mx.array([[t]]), cache=cache).logits
    return out


def mtp_greedy(m, prompt, n, k, stop=()):
    """mlx-mtp's greedy tokens with ``k`` drafts a round, and their stats."""
    stats = MTPStats(trace=[])
    steps = speculative_generate_step(
        prompt, m, max_tokens=n, drafts=FixedDraft(k), stop_tokens=stop, stats=stats
    )
    return [int(t) for t, _ in steps], stats


def batched_greedy(m, prompts, limits, drafts, join=(), join_at=1):
    """mlx-mtp's greedy tokens of ``prompts`` decoded together by one batch
    decoder (``decoder.Decoder``): stream ``i`` drafts ``drafts[i]`` a round
    (fixed) and leaves after ``limits[i]`` tokens; the streams ``join`` join
    the running batch at round ``join_at``. Returns each stream's tokens, the
    decoder, its rounds and the trunk forwards the rounds ran."""
    from mlx_mtp.decoder import Decoder
    from mlx_mtp.drafts import ModelDrafts
    from mlx_mtp.sampling import ExactMatchVerifier
    from mlx_mtp.speculative import prefill
    from mlx_mtp.stream import Stream

    def stream(i):
        cache = m.make_cache()
        prefill(m, cache, prompts[i], 16, True)
        s = Stream(history=list(prompts[i]), cache=cache,
                   verifier=ExactMatchVerifier(), max_tokens=limits[i])  # fmt: skip
        s.source = ModelDrafts(FixedDraft(drafts[i]))
        return s

    streams = [stream(i) for i in range(len(prompts))]
    late = [streams[i] for i in join]
    decoder = Decoder(m)
    decoder.add([s for s in streams if s not in late])
    forward, forwards = m.target.forward, [0]

    def counted(*args, **kwargs):
        forwards[0] += 1
        return forward(*args, **kwargs)

    m.target.forward = counted
    out, rounds = {}, 0
    try:
        while decoder.streams or late:
            if rounds == join_at and late:
                decoder.add(late)
                late = []
            for s, tokens in zip(list(decoder.streams), decoder.step()):
                out.setdefault(id(s), []).extend(tokens)
            rounds += 1
            done = [s for s in decoder.streams if s.done]
            if done:
                decoder.remove(done)
    finally:
        m.target.forward = forward
    return [out[id(s)] for s in streams], streams, decoder, rounds, forwards[0]


def streamed_text(tok, ids):
    """``ids`` as text, detokenized token by token as the server streams it."""
    d = tok.detokenizer
    d.reset()
    for t in ids:
        d.add_token(t)
    d.finalize()
    return d.text
