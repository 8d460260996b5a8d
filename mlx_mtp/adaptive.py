"""How many drafts each round proposes: cost-aware by default, or a fixed count.

A round with ``k`` drafts costs ``c_verify(k + 1) + c_draft(k)`` (the trunk's
forward over ``k + 1`` tokens, the head's ``k`` drafts) and emits on average
``E(k) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_k`` tokens, ``a_j`` being the
chance that draft ``j`` is kept once drafts ``1..j-1`` were. ``CostAwareDraft``
drafts, before each round, the ``k`` in ``0..draft_max`` with the most tokens
per unit of time ``E(k) / cost(k)``; ``k = 0`` is a plain decode step, so
drafts that cannot pay are not made.

Costs come from ``mlx-mtp tune`` (measured on this machine and stored beside
the model), the probe (``probe.py``) or ``prior_costs``. The acceptances
start from the tuned (or trained) per-depth acceptance and follow what this
generation's rounds keep. The rounds' own times correct the costs
(``round_costs``: per verify width, the median of its rounds): the rounds
of different ``k`` run at different moments, and on a shared machine the
load drifts between them by about the differences ``tune`` resolves (it
times every ``T`` interleaved), but not by a round that costs twice what
the stored costs say.
"""

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence


# Before a round has been seen: drafts are kept about half the time.
DEFAULT_PRIOR_ACCEPTANCE = 0.5
# A measured prior (``tune``, ``train-head``) counts as ``PRIOR_WEIGHT`` tests,
# the default guess as ``GUESS_WEIGHT``; each depth's estimate is the mean of
# its tests until they weigh ``1 / MIN_RATE``, then a moving average over about
# that many: it follows the text within a generation. A depth left untested
# drifts by ``RECOVER`` per drafting round back to its prior (or to the
# estimate of the depth before, when that is higher), so a deeper chain is
# tried again. Chosen by simulating Bernoulli acceptances against the default
# model's tuned costs: within 1% of the best fixed count over 256 tokens where
# the prior is right, and 2-3% where it is off.
PRIOR_WEIGHT = 4.0
GUESS_WEIGHT = 2.0
MIN_RATE = 0.05
RECOVER = 0.02
# While no draft pays, one probe round (a single draft) after a gap of plain
# rounds, the gap doubling after every rejected probe up to ``MAX_PROBE_GAP``.
# The first gap is at least ``PROBE_GAP`` and long enough that a probe's extra
# cost (``round(1) - 1`` plain steps) stays within ``PROBE_BUDGET`` of the
# plain rounds before it: where a draft is dear (a random Qwen3-Next's head
# costs half a step, its probe round 1.85 steps) probes every 8 rounds took
# 3-4% off plain speed.
PROBE_GAP = 8
MAX_PROBE_GAP = 128
PROBE_BUDGET = 0.01
# The count is chosen at the running acceptance plus ``OPTIMISM`` standard
# errors of it. At the estimate itself, a run of rejections near break-even
# stopped the drafting, and with no more tests (probes are rare) it stayed
# stopped: simulated Bernoulli acceptances against the default model's
# measured costs (verify 1.13 over 2 tokens, a draft 0.09) gave 0.95 of the
# best fixed count at 30-35% kept, the default head's rate; with one standard
# error, 0.98-1.00 at every rate from 5% to 70% (draft_max 1 to 3).
OPTIMISM = 1.0
# Where the acceptance is the default guess (no ``tune``, no training record:
# a drafter just attached), a round drafts at most ``RAMP`` until one keeps a
# draft, and each keeping round doubles that bound (``drafts.ModelDrafts``,
# for one stream and for each stream of a batch): the guess is no evidence,
# and a round of rejected drafts costs more the more it drafted, while its
# first rejection tells as much at 2 drafts as at 7. Simulated against a
# DFlash block's cost measured on a CPU (0.48 of a step, a verify over 2
# tokens 1.10), over 128 tokens: a drafter that never agrees kept 0.969 of
# plain speed without the bound and 0.975 with it; one that keeps 85% of its
# drafts 2.257x and 2.253x.
RAMP = 2


@dataclass
class Costs:
    """Round costs in units of one plain decode step.

    ``verify[t - 1]``: the trunk's forward over ``t`` tokens, its graph built
    and waited for (a plain step overlaps building the next step with this
    one's compute, so ``verify[0]`` can exceed 1); ``draft[k - 1]``:
    the head's work for ``k`` drafts (catch-up included); ``rounds[k]``, when
    measured: a whole round with ``k`` drafts as the loop runs it (it overlaps
    the head's drafting with building the verify pass, and pays one sync), so
    ``rounds[0]`` is 1. Past the measured lengths costs grow by their last step.
    """

    verify: Sequence[float]
    draft: Sequence[float]
    rounds: Optional[Sequence[float]] = None

    def verify_cost(self, t: int) -> float:
        return _extend(self.verify, t - 1)

    def draft_cost(self, k: int) -> float:
        return 0.0 if k == 0 else _extend(self.draft, k - 1)

    def round(self, k: int) -> float:
        if k == 0:
            return 1.0  # the unit: a plain step as the loop runs it, one ahead
        parts = self.verify_cost(k + 1) + self.draft_cost(k)
        if not self.rounds:
            return parts
        if k < len(self.rounds):
            return self.rounds[k]
        last = len(self.rounds) - 1
        return self.rounds[last] + parts - self.round_parts(last)

    def round_parts(self, k: int) -> float:
        return self.verify_cost(k + 1) + self.draft_cost(k)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Costs":
        rounds = d.get("round")
        return cls(
            [float(x) for x in d["verify"]],
            [float(x) for x in d["draft"]],
            [float(x) for x in rounds] if rounds else None,
        )


def _extend(values: Sequence[float], i: int) -> float:
    if i < len(values):
        return values[i]
    step = values[-1] - values[-2] if len(values) > 1 else values[-1]
    return values[-1] + (i - len(values) + 1) * max(step, 0.0)


def prior_costs(compute_bound: bool = False) -> Costs:
    """Costs to assume before ``tune`` has measured this machine.

    Memory-bound (a GPU, or a CPU with a fast BLAS): a verify pass over ``t``
    tokens costs ``1 + 0.2 (t - 1)`` steps and a draft 0.08 of a step, a little
    above what the default model measures on a CPU with OpenBLAS (1.21, 1.39,
    1.51; 0.06-0.08). Compute-bound (MLX's bundled reference BLAS): a pass costs
    ``t`` steps, and no draft can pay.
    """
    if compute_bound:
        return Costs([float(t) for t in range(1, 6)], [0.08 * k for k in range(1, 5)])
    return Costs([1.0 + 0.2 * t for t in range(5)], [0.08 * k for k in range(1, 5)])


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """``E(k)``: tokens a round with ``k`` drafts emits on average."""
    total, reach = 1.0, 1.0
    for j in range(k):
        reach *= acceptance[j] if j < len(acceptance) else acceptance[-1]
        total += reach
    return total


def speedups(acceptance: Sequence[float], costs: Costs, draft_max: int) -> List[float]:
    """The bound ``E(k) / cost(k)`` for ``k = 0..draft_max`` (``k = 0`` gives 1)."""
    return [
        expected_tokens(acceptance, k) / costs.round(k) for k in range(draft_max + 1)
    ]


def best_draft_count(acceptance: Sequence[float], costs: Costs, draft_max: int) -> int:
    """The ``k`` in ``0..draft_max`` with the most expected tokens per unit of time."""
    s = speedups(acceptance, costs, draft_max)
    return max(range(len(s)), key=lambda k: (s[k], -k))  # ties: fewer drafts


class FixedDraft:
    """Every round drafts ``k`` (for benchmarks at a fixed depth).

    ``draft_max`` (default ``k``) is the most a round may draft: with it above
    0 the head keeps up with the trunk even while ``k`` is 0. The running
    acceptance (from ``prior``) is kept all the same: a served batch chooses
    its draft length from it, and "auto" weighs lookups against it.
    """

    def __init__(
        self,
        k: int,
        draft_max: Optional[int] = None,
        prior: Optional[Sequence[float]] = None,
    ):
        self.k = k
        self.draft_max = k if draft_max is None else draft_max
        self.estimate = AcceptanceEstimate(self.draft_max, prior)

    @property
    def acceptance(self) -> List[float]:
        return self.estimate.rates

    def __call__(self) -> int:
        return self.k

    def update(self, drafted: int, accepted: int) -> None:
        self.estimate.update(drafted, accepted)


class AcceptanceEstimate:
    """The running P(draft j+1 kept | drafts 1..j kept), per depth.

    Each depth starts at ``prior`` (measured by ``tune`` or ``train-head``, else
    ``DEFAULT_PRIOR_ACCEPTANCE``), which counts as ``prior_weight`` tests; the
    estimate is the mean of its tests until they weigh ``1 / min_rate``, then a
    moving average over about that many, so it follows the text. A depth left
    untested drifts by ``recover`` per update back to its prior, or to the
    estimate of the depth before when that is higher, so that a deeper chain is
    tried again. One estimator serves the single-stream loop
    (``CostAwareDraft``) and each stream of a served batch.
    """

    def __init__(
        self,
        depths: int,
        prior: Optional[Sequence[float]] = None,
        prior_weight: Optional[float] = None,
        min_rate: float = MIN_RATE,
        recover: float = RECOVER,
    ):
        measured = bool(prior)
        self.measured = measured  # False: the rates start at the default guess
        prior = list(prior or []) or [DEFAULT_PRIOR_ACCEPTANCE]
        if prior_weight is None:
            prior_weight = PRIOR_WEIGHT if measured else GUESS_WEIGHT
        self.prior = [_clip(prior[min(j, len(prior) - 1)]) for j in range(depths)]
        self.rates = list(self.prior)
        self.tests = [prior_weight] * depths
        self.min_rate, self.recover = min_rate, recover

    def optimistic(self, bonus: float = OPTIMISM) -> List[float]:
        """Each depth's rate plus ``bonus`` standard errors of its estimate
        (over the tests of depth 1: the rounds that drafted, at most the
        window ``1 / min_rate``)."""
        n = min(self.tests[0], 1.0 / self.min_rate) if self.tests else 1.0
        return [min(1.0, a + bonus * math.sqrt(a * (1.0 - a) / n)) for a in self.rates]

    def update(self, drafted: int, accepted: int) -> None:
        """Learn from a round that proposed ``drafted`` drafts and kept ``accepted``."""
        tested = min(drafted, accepted + 1)  # drafts after the first rejection were not
        for j, a in enumerate(self.rates):
            if j < tested:
                self.tests[j] += 1
                rate = max(1.0 / self.tests[j], self.min_rate)
                self.rates[j] = a + rate * (float(j < accepted) - a)
            else:  # back toward the prior, or the depth before where that is kept
                target = (
                    self.prior[j] if j == 0 else max(self.prior[j], self.rates[j - 1])
                )
                self.rates[j] = a + self.recover * (target - a)


class CostAwareDraft:
    """Picks each round's draft count from costs and the running acceptance.

    ``prior[j]`` is the expected P(draft j+1 kept | drafts before it kept),
    from ``tune`` or training; the estimates start there and follow the
    rounds (``AcceptanceEstimate``). When ``k = 0`` wins, rounds are plain
    steps and nothing is learnt, so now and then one round drafts once to see
    whether the text got easier (see ``PROBE_GAP``).
    """

    def __init__(
        self,
        draft_max: int,
        costs: Costs,
        prior: Optional[Sequence[float]] = None,
        prior_weight: Optional[float] = None,
        min_rate: float = MIN_RATE,
        recover: float = RECOVER,
        probe_gap: int = PROBE_GAP,
        max_probe_gap: int = MAX_PROBE_GAP,
    ):
        self.draft_max = draft_max
        self.estimate = AcceptanceEstimate(
            draft_max, prior, prior_weight, min_rate, recover
        )
        self.probe_gap, self.max_gap = probe_gap, max_probe_gap
        self.set_costs(costs)
        self.gap, self.idle = self.first_gap, 0

    def set_costs(self, costs: Costs) -> None:
        """Weigh rounds by ``costs`` from now on (a long context's, measured
        there: ``timing.costs_at``); the acceptance learnt so far stays."""
        self.costs = costs
        extra = costs.round(1) - 1.0 if self.draft_max > 0 else 0.0
        probe_gap = max(self.probe_gap, math.ceil(extra / PROBE_BUDGET))
        self.first_gap = min(probe_gap, self.max_gap)
        # where even drafts that are always kept cannot pay, never draft
        self.can_pay = best_draft_count([1.0], costs, self.draft_max) > 0

    @property
    def acceptance(self) -> List[float]:
        return self.estimate.rates

    @property
    def prior(self) -> List[float]:
        return self.estimate.prior

    def __call__(self) -> int:
        """The next round's draft count (called once per round)."""
        if not self.can_pay:
            return 0
        k = best_draft_count(self.estimate.optimistic(), self.costs, self.draft_max)
        if k > 0:
            self.gap, self.idle = self.first_gap, 0
            return k
        self.idle += 1
        if self.idle < self.gap:
            return 0
        self.idle, self.gap = 0, min(2 * self.gap, self.max_gap)
        return 1  # a probe

    def update(self, drafted: int, accepted: int) -> None:
        """Learn from a round that proposed ``drafted`` drafts and kept ``accepted``."""
        self.estimate.update(drafted, accepted)
        if accepted and self.idle == 0 and self.gap > self.first_gap:
            self.gap = self.first_gap  # a kept probe: the text may have changed


# A server starts each request's drafter from what that drafter's drafts were
# worth in the requests before (``AcceptanceHistory``): once a depth has been
# tested ``HISTORY_MIN_TESTS`` times, its rate there is a measured prior (no
# ramp, ``PRIOR_WEIGHT``), over about the last ``HISTORY_WINDOW`` tests. Where
# that prior says the drafter cannot pay (``drafts.can_pay``), requests leave
# it out, reading along included, but one in ``HISTORY_RETRY`` takes it again
# from its tuned rates or the default guess, so that a drafter the text has
# come to suit is found again. Each request would otherwise ramp from the
# guess and pay its first rejected rounds, and its reading along, again.
HISTORY_MIN_TESTS = 8
HISTORY_WINDOW = 64
HISTORY_RETRY = 8


class AcceptanceHistory:
    """What each drafter's drafts were worth across generations (a server's):
    per drafter and depth, the drafts tested and kept, over about the last
    ``window`` tests of each depth. Its ``prior`` starts a new generation's
    estimate (``AcceptanceEstimate``) in place of the default guess or the
    tuned rates."""

    def __init__(
        self,
        min_tests: int = HISTORY_MIN_TESTS,
        window: int = HISTORY_WINDOW,
        retry: int = HISTORY_RETRY,
    ):
        self.min_tests, self.window, self.retry = min_tests, window, retry
        self.tests: Dict[str, List[float]] = {}
        self.kept: Dict[str, List[float]] = {}
        self.left_out: Dict[str, int] = {}  # requests in a row without it

    def leave_out(self, drafter: str) -> bool:
        """Whether a request whose ``drafter`` cannot pay by this history
        leaves it out: all but one in ``retry``, which tries it afresh."""
        n = self.left_out.get(drafter, 0) + 1
        if n >= self.retry:
            n = 0
        self.left_out[drafter] = n
        return n > 0

    def record(self, drafter: str, drafted: int, accepted: int) -> None:
        """A round checked ``drafted`` of ``drafter``'s drafts and kept ``accepted``."""
        tested = min(drafted, accepted + 1)  # drafts after the first rejection were not
        tests = self.tests.setdefault(drafter, [])
        kept = self.kept.setdefault(drafter, [])
        while len(tests) < tested:
            tests.append(0.0)
            kept.append(0.0)
        for j in range(tested):
            tests[j] += 1.0
            kept[j] += float(j < accepted)
            if tests[j] > self.window:  # older tests fade
                scale = self.window / tests[j]
                tests[j] *= scale
                kept[j] *= scale

    def prior(self, drafter: str) -> Optional[List[float]]:
        """``drafter``'s kept share per depth, over the depths tested at least
        ``min_tests`` times (None where its first depth has not been)."""
        rates = []
        for t, k in zip(self.tests.get(drafter, []), self.kept.get(drafter, [])):
            if t < self.min_tests:
                break
            rates.append(k / t)
        return rates or None

    def priors(self) -> Dict[str, List[float]]:
        """Every drafter's ``prior`` that there is (for a server's ``/health``)."""
        found = {name: self.prior(name) for name in sorted(self.tests)}
        return {name: [round(a, 4) for a in p] for name, p in found.items() if p}


def _clip(p: float) -> float:
    return min(max(float(p), 0.0), 1.0)
