"""How drafts are proposed and checked.

The loop talks to a *verifier* with two calls:

- ``draft(logits) -> Draft``: turn the MTP head's logits into a draft token;
- ``verify(logits, drafts, history) -> list[int]``: given the main model's logits
  at the ``len(drafts) + 1`` verified positions, return the accepted drafts
  followed by exactly one token from the main model (the correction or bonus).

``ExactMatchVerifier`` samples the main model at each position with the user's
sampler and keeps drafts while they equal the sample. Each emitted token is a
sample of the main model given the true prefix, so the output distribution is
the main model's for ANY sampler; under greedy it is token-identical.
"""

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import mlx.core as mx

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


@dataclass
class Draft:
    token: mx.array  # [1] int
    logits: mx.array  # [1, V] the head's logits it was drawn from

    @property
    def p(self) -> mx.array:
        """The draft distribution's top probability (lazy: costs nothing unless read)."""
        return mx.max(mx.softmax(self.logits.astype(mx.float32), axis=-1))


def _logprobs(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


class ExactMatchVerifier:
    def __init__(
        self,
        sampler: Optional[Sampler] = None,
        logits_processors: Optional[Sequence[LogitsProcessor]] = None,
    ):
        self.sampler = sampler or greedy
        self.logits_processors = list(logits_processors or [])

    def draft(self, logits: mx.array) -> Draft:
        return Draft(mx.argmax(logits, axis=-1), logits)

    def verify(
        self, logits: mx.array, drafts: List[Draft], history: List[int]
    ) -> List[int]:
        if self.logits_processors:
            return self._verify_in_order(logits, drafts, history)
        targets = self.sampler(_logprobs(logits))
        if drafts:
            proposed = mx.concatenate([d.token for d in drafts])
            mx.eval(targets, proposed)
            proposed = proposed.tolist()
        targets = targets.tolist()
        emitted = []
        for j, t in enumerate(targets):
            emitted.append(t)
            if j == len(drafts) or t != proposed[j]:
                break
        return emitted

    def _verify_in_order(self, logits, drafts, history) -> List[int]:
        """Processors see the true prefix at each position, so go one at a time."""
        tokens = mx.array(history)
        emitted = []
        for j in range(len(drafts) + 1):
            row = logits[j : j + 1]
            for processor in self.logits_processors:
                row = processor(tokens, row)
            t = self.sampler(_logprobs(row)).item()
            emitted.append(t)
            if j == len(drafts) or t != drafts[j].token.item():
                break
            tokens = mx.concatenate([tokens, mx.array([t])])
        return emitted
