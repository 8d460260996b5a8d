"""How many drafts a batched round verifies.

Verifying ``K`` drafts for each of ``B`` streams reads ``B * (K + 1)`` tokens in
one forward. While that forward is memory-bound, drafts are nearly free; once
it is compute-bound (many streams, long drafts), every draft costs its share
and a round with no drafts (a plain batched decode step) can be the fastest.
So the round's ``K`` is the one with the most expected tokens per second:

- expected tokens: per stream ``1 + r_1 + r_1 r_2 + ... + r_1..r_K`` from its
  running per-position acceptance (``adaptive.AcceptanceEstimate``, the
  single-stream loop's estimator), at most
  the drafts it may take;
- seconds: the median of the last rounds measured at this batch size and
  ``K`` (a median: one slow round, another process's burst, does not sway
  it); between measured lengths the time is interpolated linearly.

The largest ``K`` is measured first, then ``K = 0``, until each has
``MIN_SAMPLES`` rounds (a first round at a new shape is slow: one sample is
no evidence); a batch size not seen yet starts from the nearest one's times,
or from what earlier processes measured at it (``seed``: the rounds'
corrections stored with the probe's costs, ``round_costs``).
Every ``explore`` rounds one length is measured again (contexts grow, the
machine's load changes): the one most overdue, each as often as keeps its
expected loss (the time its round takes beyond what the chosen length needs
for as many tokens) within its share of ``EXPLORE_COST`` of the time, and at
least every ``MAX_GAP`` rounds. So a length near the best is measured every
few ``explore`` rounds, and one far behind (3 drafts where a verify is
compute-bound cost 4 plain rounds) every ``MAX_GAP``. ``K = 0`` is measured
in runs of rounds: a plain round that follows one starts before the one
before it is read (``decoder``), which is what a plain round costs once
chosen, and the decoder records only those. The largest ``K`` (the drafts
asked for) stays unless another is expected ``MARGIN`` faster; where no
stream expects to keep a draft at all (a drafter that has never agreed, from
a server's ``adaptive.AcceptanceHistory``), ``K = 0`` stands in for it, and
the largest ``K`` is not measured for it: only exploring rounds draft then.
"""

import statistics
from collections import deque
from typing import Deque, Dict, List, Sequence, Set, Tuple

from .adaptive import expected_tokens

DEFAULT_EXPLORE = 16
DEFAULT_WINDOW = 8
MIN_SAMPLES = 3
MARGIN = 0.05
EXPLORE_COST = 0.01  # what measuring other lengths may cost, of the time
MAX_GAP = 512  # rounds: every length is measured again at least this often


class BatchDraftLength:
    """Picks each batched round's draft length from acceptance and measured time."""

    def __init__(self, explore: int = DEFAULT_EXPLORE, window: int = DEFAULT_WINDOW):
        self.explore, self.window = explore, window
        # batch size -> K -> the last ``window`` round times
        self.samples: Dict[int, Dict[int, Deque[float]]] = {}
        self.rounds = 0
        self.chosen: Dict[int, int] = {}  # K -> rounds that drafted K
        self.again = False  # an exploring plain round asks for a second
        self.last: Dict[int, int] = {}  # K -> the round it was last chosen
        # (batch source, batch size) already seeded (``seed``; the decoder's)
        self.seeded: Set[Tuple[str, int]] = set()

    def times(self, batch: int) -> Dict[int, Deque[float]]:
        """Round times per K at ``batch`` streams; a batch size not seen yet
        borrows the nearest one's."""
        if not self.samples:
            return {}
        if batch not in self.samples:
            batch = min(self.samples, key=lambda b: (abs(b - batch), b))
        return self.samples[batch]

    def choose(self, batch: int, rates: List[Sequence[float]], caps: List[int]) -> int:
        """The draft length for a round of ``batch`` streams.

        ``rates[b]`` is stream ``b``'s per-position acceptance, ``caps[b]`` the
        most drafts it may take.
        """
        top = max(caps, default=0)
        if top == 0:
            return 0

        def tokens(k: int) -> float:
            return sum(expected_tokens(r, min(k, c)) for r, c in zip(rates, caps))

        # the drafts asked for, where any stream expects to keep one
        asked = top if tokens(top) > tokens(0) else 0
        samples = self.times(batch)
        ends = [len(samples.get(k, ())) for k in (top, 0)]
        if ends[0] < MIN_SAMPLES and asked:  # the largest K first, then K = 0
            return top
        if ends[1] < MIN_SAMPLES:
            return 0
        self.rounds += 1
        if self.again:  # the plain round measured runs on from the one before
            self.again = False
            return self._take(0)
        times = {k: statistics.median(v) for k, v in samples.items()}

        def speed(k: int) -> float:
            return tokens(k) / self._seconds(times, k)

        # a length whose drafts no stream expects to keep cannot be faster
        # than plain rounds, whatever noise in the times says
        useful = [k for k in range(top + 1) if k == 0 or tokens(k) > tokens(0)]
        best = max(useful, key=speed)
        # the drafts asked for, unless clearly slower (noise must not move it)
        choice = best if speed(best) > speed(asked) * (1 + MARGIN) else asked
        if self.rounds % self.explore == 0:
            # each length's loss: the time its round takes beyond what the
            # choice takes for as many tokens
            loss = {
                k: self._seconds(times, k) - tokens(k) / speed(choice)
                for k in range(top + 1)
                if k != choice
            }
            per_round = EXPLORE_COST * self._seconds(times, choice) / len(loss)
            due = {
                k: (self.rounds - self.last.get(k, -MAX_GAP))
                / min(max(self.explore, loss[k] / per_round), MAX_GAP)
                for k in loss
            }
            k = max(due, key=lambda k: (due[k], -k), default=None)
            if k is not None and due[k] >= 1:
                self.again = k == 0
                return self._take(k)
        return self._take(choice)

    def _take(self, k: int) -> int:
        self.last[k] = self.rounds
        return k

    def seed(self, batch: int, times: Dict[int, List[float]]) -> None:
        """Start from ``times`` (per K, seconds) at ``batch`` streams where
        fewer than ``MIN_SAMPLES`` rounds are measured: what earlier rounds
        of this batch's sources measured, stored (``round_costs``). Rounds
        measured later push them out, as they push out older rounds."""
        table = self.samples.setdefault(batch, {})
        for k, seconds in times.items():
            have = table.get(k, ())
            if len(have) < MIN_SAMPLES:
                table[k] = deque(list(seconds) + list(have), maxlen=self.window)

    def record(self, batch: int, k: int, seconds: float) -> None:
        self.chosen[k] = self.chosen.get(k, 0) + 1
        table = self.samples.setdefault(batch, {})
        table.setdefault(k, deque(maxlen=self.window)).append(seconds)

    @staticmethod
    def _seconds(times: Dict[int, float], k: int) -> float:
        """Measured, or interpolated between the nearest measured lengths."""
        if k in times:
            return times[k]
        below = max((j for j in times if j < k), default=None)
        above = min((j for j in times if j > k), default=None)
        if below is None:
            return times[above]
        if above is None:
            return times[below]
        w = (k - below) / (above - below)
        return times[below] + w * (times[above] - times[below])
