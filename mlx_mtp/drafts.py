"""Draft sources: where a round's drafts come from.

Before each round the loop asks every stream's source for a ``Plan``: a ready
proposal (tokens found without a model call, such as a prompt lookup) or how
many drafts which of the model's drafters should make (0: a plain step).
After the verify the source hears how many of its drafts were kept. The loop
(``decoder.py``, one stream or a batch) only asks; it knows no kinds. A new
kind is one class here and one line in ``make_source``, the only place that
turns a name into a source and validates it (the command line, the Python
API and both HTTP APIs go through it).

- ``ModelDrafts``: one of the model's drafters (``drafter.Drafter``: its MTP
  head, a Gemma 4 assistant, a drafter from a checkpoint of its own); its
  count policy (``adaptive.CostAwareDraft`` or ``FixedDraft``) keeps the
  running acceptance per depth;
- ``LookupDrafts``: prompt lookup (``ngram.PromptLookup``), and lookups in a
  predicted answer and a server's earlier requests, checked whenever that is
  expected to beat a plain step;
- ``AutoDrafts``: per round, a lookup proposal where it is expected to keep
  more per unit of time than the best drafter's round, else that drafter;
- ``PhasedDrafts``: a thinking model's, one source per phase (thinking, answer);
- ``NoDrafts``: plain steps.
"""

import math
from collections import deque
from dataclasses import dataclass, field
from typing import (
    Any,
    Callable,
    Deque,
    Dict,
    FrozenSet,
    List,
    Optional,
    Protocol,
    Sequence,
)

from . import config
from .adaptive import (
    DEFAULT_PRIOR_ACCEPTANCE,
    RAMP,
    AcceptanceHistory,
    CostAwareDraft,
    Costs,
    FixedDraft,
    best_draft_count,
    expected_tokens,
    prior_costs,
    speedups,
)
from .cache import MTP, can_rollback
from .config import default_draft_max
from .defaults import (
    DEFAULT_DRAFT_MAX,
    DEFAULT_DRAFT_SOURCE,
)
from .draft_settings import check_source_name
from .errors import MTPError
from .ngram import Lookup, LookupMemory, MemoryLookup, PredictionLookup, PromptLookup
from .timing import drafting

# A drafter takes part only where, at an optimistic acceptance, some draft
# count is expected to beat plain steps by this much (``can_pay``).
PAY_MARGIN = 1.05
# A cost-aware source gives a drafter up for the rest of the generation once
# it has kept none of its drafts in ``RETIRE_ROUNDS`` drafting rounds, and in
# enough that, at 95% confidence, its first draft is kept less often than any
# draft count needs to pay (by the rule of three: none kept in ``n`` tests
# bounds the rate by ``3 / n``; on a CPU a DFlash block at 0.48 of a step
# needs 0.47, 7 rounds, which a drafter keeping 70% misses running 0.02% of
# the time; the default head's cheap drafts need 0.21, 15 rounds, which the
# head, keeping 29%, misses running 0.6% of the time). Given up, it costs
# nothing: it no longer reads the trunk's features as they come (a cost the
# rounds' costs leave out).
RETIRE_ROUNDS = 6
# The single-stream loop runs a plain round ahead of its token (the next
# forward starts before this one's token is read) unless a lookup may propose
# after that token; a round that waits for the token costs more where the
# forward is long (``Decoder.wait_cost``: it grows with the context; figures
# in docs/performance.md).
# Where lookups propose seldom, waiting for them lost more than they gained:
# at 16 K tokens, with the whole context to look in, they may propose after
# nearly every token. So once ``WAIT_SAMPLES`` waits are known, a source
# whose latest ``WAIT_WINDOW`` waits gained less per round (tokens kept less
# the round's cost, 0 where nothing was proposed) than a wait costs runs
# ahead instead, but for one round in ``WAIT_RETRY``, which waits.
WAIT_WINDOW = 16
WAIT_SAMPLES = 4
WAIT_RETRY = 8


@dataclass
class Plan:
    """What one stream checks this round: ``tokens`` (a ready proposal), or
    up to ``k`` drafts from the model's drafter ``drafter``; neither is a
    plain step."""

    k: int = 0
    drafter: str = "mtp"
    tokens: List[int] = field(default_factory=list)
    source: str = "mtp"  # what the tokens' ``Draft``s are tagged with


class DraftSource(Protocol):
    """One stream's drafts, asked once per round."""

    name: str
    # the most model drafts a round may take (0: no drafter reads along)
    draft_max: int
    # the drafters whose drafts it may take: they read the trunk's features
    # as they come (``rounds.reads_along``)
    drafters: FrozenSet[str]

    def count(self) -> int:
        """Model drafts this source would like next round, by its own policy
        (the single-stream loop asks before the round; a batch picks one
        length for all its streams instead)."""

    def bound(self) -> int:
        """The most model drafts a round may take now: ``draft_max``, less
        while a drafter's acceptance is only a guess (``adaptive.RAMP``)."""

    def rates(self) -> Sequence[float]:
        """Its drafter's running acceptance per depth (for the batch's policy)."""

    def plan(self, history: Sequence[int], room: int, k: int) -> Plan:
        """This round's plan after ``history``: a proposal of at most ``room``
        tokens, or up to ``k`` model drafts (``k`` is what the loop offers)."""

    def update(self, source: str, drafted: int, accepted: int) -> None:
        """The round checked ``drafted`` drafts of ``source`` and kept ``accepted``."""

    def may_propose_after(
        self, history: Sequence[int], wait_cost: Optional[float] = 0.0
    ) -> bool:
        """Whether the round after the token that follows ``history`` may hold
        a ready proposal worth waiting for: the single-stream loop runs plain
        steps ahead only while none can come, and a round that waits costs
        ``1 + wait_cost`` plain steps (``Decoder.wait_cost``)."""

    # whether what it drafts follows round costs (a long context's are
    # measured there and given to ``recost``)
    weighs_costs: bool

    def recost(self, costs: Callable[[Optional[str]], Costs]) -> None:
        """Weigh rounds from now on by ``costs`` (a drafter's name: the costs
        of rounds with its drafts; None: of a lookup's, verifies alone)."""


class NoDrafts:
    """Plain steps: no drafts."""

    name = "none"
    draft_max = 0
    drafters: FrozenSet[str] = frozenset()
    asked = 0  # drafts per round asked for, of drafters left out (``can_pay``)
    weighs_costs = False

    def count(self) -> int:
        return 0

    def bound(self) -> int:
        return 0

    def rates(self) -> Sequence[float]:
        return []

    def plan(self, history: Sequence[int], room: int, k: int) -> Plan:
        return Plan()

    def update(self, source: str, drafted: int, accepted: int) -> None:
        pass

    def may_propose_after(
        self, history: Sequence[int], wait_cost: Optional[float] = 0.0
    ) -> bool:
        return False

    def recost(self, costs: Callable[[Optional[str]], Costs]) -> None:
        pass


class ModelDrafts(NoDrafts):
    """The drafts of one of the model's drafters (its MTP head, by default),
    counted by ``policy`` (``CostAwareDraft`` or ``FixedDraft``), which also
    keeps their running acceptance; ``costs`` are the rounds' with this
    drafter (what "auto" weighs its drafts by)."""

    name = "mtp"

    def __init__(
        self,
        policy,
        drafter: str = "mtp",
        costs: Optional[Costs] = None,
        cost_aware: Optional[bool] = None,
        history: Optional[AcceptanceHistory] = None,
    ):
        """``cost_aware``: whether its count follows the costs (by default,
        whether ``policy`` is a ``CostAwareDraft``; a served stream's, whose
        count the batch's policy chooses, is when its request left the count
        adaptive). Such a source ramps its drafts up from ``RAMP`` while its
        acceptance is only the default guess, and gives a drafter up once it
        has kept nothing in ``retire_after`` drafting rounds (see
        ``RETIRE_ROUNDS``): it stops drafting and reading along. ``history``
        (a server's) hears every round, for the generations after this one."""
        self.policy, self.drafter, self.costs = policy, drafter, costs
        self.history = history
        self.kept = self.rounds = 0
        if cost_aware is None:
            cost_aware = isinstance(policy, CostAwareDraft)
        self.retire_after: Optional[int] = None
        self.ramp: Optional[int] = None  # see ``adaptive.RAMP``
        if cost_aware:
            costs_here = costs or policy.costs
            self.retire_after = rounds_to_give_up(costs_here, policy.draft_max)
            if not policy.estimate.measured:
                self.ramp = RAMP
        self.retired = False

    @property
    def draft_max(self) -> int:
        return 0 if self.retired else self.policy.draft_max

    @property
    def weighs_costs(self) -> bool:
        return self.retire_after is not None and not self.retired

    def recost(self, costs: Callable[[Optional[str]], Costs]) -> None:
        """Its count follows ``costs`` of its drafter's rounds; where by them
        even its measured acceptance cannot pay (``can_pay``), it gives the
        drafter up (a context only grows, and its costs with it)."""
        if not self.weighs_costs:
            return
        self.costs = costs(self.drafter)
        k = self.policy.draft_max
        if isinstance(self.policy, CostAwareDraft):
            self.policy.set_costs(self.costs)
        self.retire_after = rounds_to_give_up(self.costs, k)
        prior = self.policy.estimate.prior if self.policy.estimate.measured else None
        self.retired = not can_pay(self.costs, prior, k)

    @property
    def drafters(self) -> FrozenSet[str]:
        return frozenset([self.drafter]) if self.draft_max > 0 else frozenset()

    def bound(self) -> int:
        return self.draft_max if self.ramp is None else min(self.draft_max, self.ramp)

    def count(self) -> int:
        return 0 if self.retired else min(self.policy(), self.bound())

    def rates(self) -> Sequence[float]:
        return self.policy.acceptance

    def speed(self, k: int, costs: Costs) -> float:
        """Expected tokens per unit of time of a round with ``k`` of its drafts
        (by its own costs, else ``costs``)."""
        return expected_tokens(self.rates(), k) / (self.costs or costs).round(k)

    def plan(self, history: Sequence[int], room: int, k: int) -> Plan:
        return Plan(k=max(0, min(k, self.bound())), drafter=self.drafter)

    def update(self, source: str, drafted: int, accepted: int) -> None:
        self.policy.update(drafted, accepted)
        if self.history is not None and drafted:
            self.history.record(self.drafter, drafted, accepted)
        self.kept += accepted
        self.rounds += drafted > 0
        if accepted and self.ramp is not None:
            twice = 2 * self.ramp
            self.ramp = twice if twice < self.policy.draft_max else None
        if self.retire_after is not None and not self.kept:
            self.retired |= self.rounds >= self.retire_after


def rounds_to_give_up(costs: Costs, draft_max: int) -> int:
    """Drafting rounds with nothing kept that give a drafter up (see
    ``RETIRE_ROUNDS``): enough that ``3 / n`` falls below the first-draft
    acceptance at which some count up to ``draft_max`` pays under ``costs``."""
    pays = (
        a / 100
        for a in range(1, 101)
        if best_draft_count([a / 100], costs, draft_max) > 0
    )
    return max(RETIRE_ROUNDS, math.ceil(3.0 / next(pays, 1.0)))


class LookupDrafts(NoDrafts):
    """Lookup drafts, checked where that beats a plain step: prompt lookup
    (``lookup``, in the generation's own tokens) and ``others`` (a predicted
    answer, a server's memory of earlier requests: ``ngram.Lookup``s). Each
    round the proposal expected to keep the most per unit of time wins."""

    name = "ngram"

    def __init__(self, lookup: Optional[PromptLookup], others: Sequence[Lookup] = ()):
        self.lookup = lookup
        lookups = ([lookup] if lookup else []) + list(others)
        self.lookups: List[Lookup] = sorted(lookups, key=lambda x: x.order)
        # what the rounds that waited for a proposal gained, in plain steps
        # (0: none came); see ``WAIT_WINDOW``
        self.waits: Deque[float] = deque(maxlen=WAIT_WINDOW)
        self.waiting = False  # the next round waited
        self.checking = False  # the round under way checks a waited-for proposal
        self.passed = 0  # waits passed up in a row

    def plan(self, history: Sequence[int], room: int, k: int) -> Plan:
        return self._propose(history, room, 1.0)

    def may_propose_after(
        self, history: Sequence[int], wait_cost: Optional[float] = 0.0
    ) -> bool:
        """Whether a lookup may propose after the next token, and waiting
        for it has paid: where the latest waits gained less per round than
        a wait costs (``wait_cost``), the next round runs ahead instead, but
        for one in ``WAIT_RETRY``, which waits to see whether lookups pay
        again (a passage being copied). While the loop has not timed both
        kinds of round (``wait_cost`` None), every other wait runs ahead
        unless the waits so far gained a plain step each (a predicted answer
        being followed), so that the loop times both."""
        if not any(lookup.may_propose_after(history) for lookup in self.lookups):
            return False
        waits, retry = self.waits, WAIT_RETRY
        if wait_cost is None:
            pass_up, retry = not waits or sum(waits) / len(waits) < 1.0, 2
        else:
            pass_up = len(waits) >= WAIT_SAMPLES and sum(waits) / len(waits) < wait_cost
        if pass_up:
            self.passed += 1
            if self.passed < retry:
                return False
        self.passed = 0
        self.waiting = True
        return True

    def _propose(self, history: Sequence[int], room: int, against: float) -> Plan:
        plan = self._offer(history, room, against)
        if self.waiting:  # its gain is known once the verify is (``update``)
            self.waiting, self.checking = False, bool(plan.tokens)
            if not plan.tokens:
                self.waits.append(0.0)
        return plan

    def _offer(self, history: Sequence[int], room: int, against: float) -> Plan:
        if room <= 0:
            return Plan()
        best, tokens, value = None, [], against
        for lookup in self.lookups:
            lookup.sync(history)
            offer, worth = lookup.offer(room)
            if offer and worth > value:
                best, tokens, value = lookup, offer, worth
        if best is None:
            return Plan()
        best.used += 1
        return Plan(tokens=tokens, source=best.tag)

    def update(self, source: str, drafted: int, accepted: int) -> None:
        for lookup in self.lookups:
            if lookup.tag == source:
                lookup.update(drafted, accepted)
                if self.checking:  # tokens kept, less the round's cost
                    cost = lookup.costs.verify_cost(drafted + 1)
                    self.waits.append(accepted + 1 - cost)
                    self.checking = False

    def _costs(self) -> Costs:
        return self.lookups[0].costs if self.lookups else prior_costs()

    @property
    def weighs_costs(self) -> bool:
        return bool(self.lookups)

    def recost(self, costs: Callable[[Optional[str]], Costs]) -> None:
        for lookup in self.lookups:
            lookup.costs = costs(None)


class AutoDrafts(LookupDrafts):
    """Per round, a lookup proposal where checking it is expected to keep
    more per unit of time than the best of the model's drafters (each by its
    own costs and running acceptance), else that drafter's drafts (``lookup``
    None: the drafters alone)."""

    name = "auto"

    def __init__(
        self,
        models: Sequence[ModelDrafts],
        lookup: Optional[PromptLookup],
        others: Sequence[Lookup] = (),
    ):
        super().__init__(lookup, others)
        self.models = list(models)
        self.chosen = self.models[0]  # the drafter the next round asks

    @property
    def head(self) -> ModelDrafts:
        return self.models[0]

    @property
    def draft_max(self) -> int:
        return max(m.draft_max for m in self.models)

    def bound(self) -> int:
        return max(m.bound() for m in self.models)

    @property
    def drafters(self) -> FrozenSet[str]:
        return frozenset().union(*(m.drafters for m in self.models))

    def count(self) -> int:
        """Each drafter's own count (its policy is asked once a round); the
        round asks the one whose count is expected to keep the most per
        unit of time."""
        counts = [(m.count(), m) for m in self.models]
        k, self.chosen = max(counts, key=lambda c: self._speed(c[1], c[0]))
        return k

    def _speed(self, model: ModelDrafts, k: int) -> float:
        return model.speed(k, self._costs())

    def rates(self) -> Sequence[float]:
        return self.chosen.rates()

    def plan(self, history: Sequence[int], room: int, k: int) -> Plan:
        model = self.chosen
        if len(self.models) > 1:  # the best at the length the loop offers
            model = max(self.models, key=lambda m: self._speed(m, min(k, m.bound())))
        k = max(0, min(k, model.bound()))
        against = self._speed(model, k) if k > 0 else 1.0  # a plain step: 1
        proposal = self._propose(history, room, against)
        return proposal if proposal.tokens else Plan(k=k, drafter=model.drafter)

    def update(self, source: str, drafted: int, accepted: int) -> None:
        super().update(source, drafted, accepted)
        for m in self.models:
            if m.drafter == source:
                m.update(source, drafted, accepted)

    @property
    def weighs_costs(self) -> bool:
        return super().weighs_costs or any(m.weighs_costs for m in self.models)

    def recost(self, costs: Callable[[Optional[str]], Costs]) -> None:
        super().recost(costs)
        for m in self.models:
            m.recost(costs)


class PhasedDrafts:
    """A thinking model's drafts: a source of its own for each phase of the
    answer (``thinking.Phases``: thinking, then the answer), built by
    ``make`` when the phase first comes. Drafts are kept at other rates while
    a model thinks than in its answer (a head trained on answers, lookups
    in quoted code), so neither phase's running acceptance starts the
    other's: the answer's source starts from the priors, as a new
    generation does, and its lookups index the thinking too."""

    def __init__(self, make: Callable[[], DraftSource], phases):
        self.make, self.phases = make, phases
        self.costs: Optional[Callable[[Optional[str]], Costs]] = None
        self.sources: Dict[str, DraftSource] = {phases.phase: make()}
        self.current = self.sources[phases.phase]
        self.planned: Optional[DraftSource] = None  # the source of the last plan
        first = self.current
        self.draft_max, self.drafters = first.draft_max, first.drafters
        self.asked = getattr(first, "asked", 0)

    @property
    def name(self) -> str:
        return self.current.name

    def _follow(self, history: Sequence[int]) -> None:
        phase = self.phases(history)
        if phase not in self.sources:
            self.sources[phase] = self.make()
            if self.costs is not None:  # the context's costs hold for it too
                self.sources[phase].recost(self.costs)
        self.current = self.sources[phase]

    def count(self) -> int:
        return self.current.count()

    def bound(self) -> int:
        return self.current.bound()

    def rates(self) -> Sequence[float]:
        return self.current.rates()

    def plan(self, history: Sequence[int], room: int, k: int) -> Plan:
        self._follow(history)
        self.planned = self.current
        return self.current.plan(history, room, k)

    def update(self, source: str, drafted: int, accepted: int) -> None:
        (self.planned or self.current).update(source, drafted, accepted)

    def may_propose_after(
        self, history: Sequence[int], wait_cost: Optional[float] = 0.0
    ) -> bool:
        self._follow(history)
        return self.current.may_propose_after(history, wait_cost)

    @property
    def weighs_costs(self) -> bool:
        return any(source.weighs_costs for source in self.sources.values())

    def recost(self, costs: Callable[[Optional[str]], Costs]) -> None:
        self.costs = costs
        for source in self.sources.values():
            source.recost(costs)


def assumed_costs(model, drafter=None) -> Costs:
    """Round costs guessed, not measured (``prior_costs`` by the BLAS, and
    ``drafter``'s prior draft costs): where the caller passes no measured
    ones (``probe.machine_costs`` is what requests pass)."""
    if drafter is None and model.drafters:
        drafter = model.drafters[0]
    return drafting(prior_costs(config.compute_bound()), drafter, None)


# ``costs(model, drafter)``: round costs in plain steps with ``drafter``'s drafts
CostsOf = Callable[[Any, Any], Costs]


def make_lookup(model, costs: Optional[CostsOf] = None) -> Optional[PromptLookup]:
    """A prompt lookup for ``model``, or None where it cannot
    pay or cannot be checked: where even drafts that are always kept cannot beat
    a plain step (a CPU with MLX's bundled BLAS: a verify over t tokens costs
    about t steps), and on a trunk whose caches cannot drop rejected drafts."""
    lookup = PromptLookup((costs or assumed_costs)(model, None))
    if not lookup.can_pay() or not can_rollback(model.make_cache().trunk):
        return None
    return lookup


def acceptance_prior(model, drafter: str = "mtp") -> Optional[List[float]]:
    """Per-depth acceptance measured for ``drafter`` (the MTP head by
    default): by ``tune`` on this machine, else by ``train-head``; None when
    neither has."""
    if not model.drafters:
        return None
    entry = config.tuned_entry(model)
    if drafter != "mtp":
        found = ((entry or {}).get("drafters_acceptance") or {}).get(drafter)
        return [float(a) for a in found] if found else None
    if entry is not None:
        return [float(a) for a in entry["acceptance_by_depth"]]
    return config.trained_acceptance(model)


def make_policy(
    model,
    draft_max: int,
    adaptive: bool = True,
    drafter=None,
    prior=None,
    costs: Optional[CostsOf] = None,
):
    """How many of ``drafter``'s drafts (None: the model's first drafter, its
    MTP head) a round of one stream takes: ``CostAwareDraft`` from
    ``costs(model, drafter)`` (this machine's, ``probe.machine_costs``, where
    a request is made) and ``prior`` (by default the tuned or trained
    acceptance), or ``FixedDraft(draft_max)``."""
    if not adaptive or draft_max == 0 or not model.drafters:
        return FixedDraft(draft_max)
    drafter = drafter or model.drafters[0]
    costs = (costs or assumed_costs)(model, drafter)
    if prior is None:
        prior = acceptance_prior(model, drafter.name)
    return CostAwareDraft(draft_max, costs, prior)


def can_pay(costs: Costs, prior: Optional[Sequence[float]], draft_max: int) -> bool:
    """Whether a drafter may pay at all here: whether, with half the misses
    of its measured acceptance (``prior``; the default guess without one),
    some draft count is expected to beat plain steps by ``PAY_MARGIN``.
    Where a verify costs about as many steps as it reads tokens (a
    compute-bound BLAS), a head kept a third of the time cannot: its drafts,
    and the head reading along to make them, would only cost there."""
    rates = list(prior or []) or [DEFAULT_PRIOR_ACCEPTANCE]
    optimistic = [1.0 - (1.0 - min(max(a, 0.0), 1.0)) / 2 for a in rates]
    return max(speedups(optimistic, costs, draft_max)) >= PAY_MARGIN


def make_source(
    model,
    name: str = DEFAULT_DRAFT_SOURCE,
    draft_max: Optional[int] = 0,
    adaptive: bool = True,
    batched: bool = False,
    prediction: Sequence[int] = (),
    memory: Optional[LookupMemory] = None,
    history: Optional[AcceptanceHistory] = None,
    costs: Optional[CostsOf] = None,
) -> DraftSource:
    """The draft source ``name`` for one generation.

    "mtp" takes the drafts of the model's own head (a Gemma 4 assistant is
    one; a model without a head: its attached drafters'), a drafter's name
    ("dflash") that drafter's alone, "ngram" prompt lookup's, and "auto" any
    of them, per round (``AutoDrafts``). ``draft_max`` bounds a drafter's
    drafts per round (0: none; None: each drafter's own bound: the head's
    recommended count, a block drafter's block); ``adaptive``: as many as pay
    by ``costs(model, drafter)`` (this machine's, ``probe.machine_costs``,
    passed in where a request is made; None: ``assumed_costs``; without
    ``adaptive``, always the bound), and a
    drafter that cannot pay here at all (``can_pay``) is left out: it would
    cost without a chance to gain. ``batched``: a served stream, whose draft
    count the batch's policy chooses (each drafter's count policy then only
    keeps its running acceptance, from its measured prior). ``prediction``:
    tokens the answer is expected to be (OpenAI's Predicted Outputs), and
    ``memory``: earlier generations (a server's), both looked up beside the
    prompt ("ngram", "auto"). ``history``: what each drafter's drafts were
    worth in earlier generations (a server's ``AcceptanceHistory``); where it
    has tested a drafter enough, the drafter's acceptance starts there rather
    than at the tuned rates or the default guess, and where by that it cannot
    pay the drafter is left out, but for one generation in ``HISTORY_RETRY``,
    which takes it afresh. A source that cannot be used here falls back to
    what can: no drafter, no lookup, or plain steps.
    """
    check_source_name(name)  # (the bounds are ``DraftSettings.validate``'s)
    costs = costs or assumed_costs
    models: List[ModelDrafts] = []
    asked = 0  # the most drafts a left-out drafter would have taken
    for d in _drafters_of(model, name):
        own = default_draft_max(model) if d.name == MTP else d.max_drafts
        k = min(own if draft_max is None else draft_max, d.max_drafts)
        if k <= 0:
            continue
        measured, prior = costs(model, d), acceptance_prior(model, d.name)
        if adaptive and not can_pay(measured, prior, k):
            asked = max(asked, k)
            continue
        seen = history.prior(d.name) if history is not None else None
        if seen and adaptive and not can_pay(measured, seen, k):
            if history.leave_out(d.name):
                asked = max(asked, k)
                continue
            seen = None  # this one tries it afresh
        if batched:
            policy = FixedDraft(k, prior=seen or prior)
        else:
            policy = make_policy(model, k, adaptive, d, seen or prior, costs)
        models.append(ModelDrafts(policy, d.name, measured, adaptive, history))
    lookup = make_lookup(model, costs) if name in ("ngram", "auto") else None
    others: List[Lookup] = []
    if lookup is not None and prediction:
        others.append(PredictionLookup(prediction, lookup.costs))
    if lookup is not None and memory is not None and memory.max_bytes > 0:
        others.append(MemoryLookup(memory, lookup.costs))
    if models and (lookup is not None or len(models) > 1):
        return AutoDrafts(models, lookup, others)
    if lookup is not None:
        lookups = LookupDrafts(lookup, others)
        lookups.asked = asked  # the stats say why the drafters drafted nothing
        return lookups
    if models:
        return models[0]
    none = NoDrafts()
    none.asked = asked
    return none


def _drafters_of(model, name: str) -> list:
    """The model's drafters that source ``name`` takes drafts from."""
    if name == "ngram":
        return []
    if name == "auto":
        return list(model.drafters)
    if name == MTP:
        head = [d for d in model.drafters if d.name == MTP]
        return head or list(model.drafters)
    found = [d for d in model.drafters if d.name == name]
    if not found:
        attached = ", ".join(d.name for d in model.drafters) or "none"
        raise MTPError(
            f"draft source {name!r}: no such drafter attached (attached: {attached}; "
            "attach one with --draft FOLDER)"
        )
    return found


def as_source(drafts) -> DraftSource:
    """A ``DraftSource`` as is; a bare count policy (``FixedDraft``,
    ``CostAwareDraft``, anything with ``draft_max``, ``__call__`` and
    ``update``) as the head's drafts it counts; None as the default count of
    head drafts."""
    if drafts is None:
        drafts = FixedDraft(DEFAULT_DRAFT_MAX)
    return drafts if hasattr(drafts, "plan") else ModelDrafts(drafts)
