"""Adaptive draft length: draft as deep as the running acceptance pays for."""

from typing import List

DEFAULT_MIN_REACH = 0.3
DEFAULT_RATE = 0.1
DEFAULT_RECOVER = 0.02


class AdaptiveDraftLength:
    """Picks each round's draft length from running per-position acceptance.

    ``rates[j]`` is a moving average of P(draft j+1 accepted | the drafts
    before it accepted): a plain mean over the first ``1 / rate`` tests (the
    optimistic start counting as one), exponential after. Draft ``i`` is
    proposed while the chance of reaching and keeping it, ``rates[0] * ... *
    rates[i]``, stays at or above ``min_reach``: a draft always costs a head
    step and pays only when kept.
    Positions left undrafted drift back toward 1, so a longer chain is tried
    again when the text gets easier. At least one draft is always proposed.
    """

    def __init__(
        self,
        draft_max: int,
        min_reach: float = DEFAULT_MIN_REACH,
        rate: float = DEFAULT_RATE,
        recover: float = DEFAULT_RECOVER,
    ):
        self.rates: List[float] = [1.0] * draft_max  # start by drafting in full
        self.tests: List[int] = [1] * draft_max
        self.min_reach, self.rate, self.recover = min_reach, rate, recover

    def __call__(self) -> int:
        """The next round's draft length, in ``[1, draft_max]``."""
        k, reach = 0, 1.0
        for r in self.rates:
            reach *= r
            if reach < self.min_reach:
                break
            k += 1
        return max(k, 1) if self.rates else 0

    def update(self, drafted: int, accepted: int) -> None:
        """Learn from a round that proposed ``drafted`` drafts and kept ``accepted``."""
        tested = min(drafted, accepted + 1)  # drafts after the first rejection were not
        for j in range(tested):
            self.tests[j] += 1
            step = max(self.rate, 1.0 / self.tests[j])
            self.rates[j] += step * ((j < accepted) - self.rates[j])
        for j in range(drafted, len(self.rates)):
            self.rates[j] += self.recover * (1.0 - self.rates[j])
