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
