"""Draft sources: where a round's drafts come from.

Before each round the loop asks every stream's source for a ``Plan``: a ready
proposal (tokens found without a model call, such as a prompt lookup) or how
many drafts the MTP head should make (0: a plain step). After the verify the
source hears how many of its drafts were kept. The loops (``speculative.py``
for one stream, ``decoder.py`` for a batch) only ask; neither knows which
kinds exist. A new kind is one class here and one line in ``make_source``,
the only place that turns a name into a source and validates it (the command
line, the Python API and both HTTP APIs go through it).

- ``HeadDrafts``: the model's MTP head (or Gemma 4 assistant); its count
  policy (``adaptive.CostAwareDraft`` or ``FixedDraft``) keeps the running
  acceptance per depth;
- ``LookupDrafts``: prompt lookup (``ngram.PromptLookup``), checked whenever
  that is expected to beat a plain step;
- ``AutoDrafts``: per round, a lookup proposal where it is expected to keep
  more per unit of time than the head's round, else the head;
- ``NoDrafts``: plain steps.
"""

from dataclasses import dataclass, field
from typing import List, Optional, Protocol, Sequence

from .adaptive import (
    FixedDraft,
    acceptance_prior,
    expected_tokens,
    machine_costs,
    make_policy,
)
from .cache import can_rollback
from .defaults import (
    DEFAULT_DRAFT_MAX,
    DEFAULT_DRAFT_SOURCE,
    DRAFT_SOURCES,
    MAX_DRAFT_MAX,
)
from .errors import MTPError
from .ngram import PromptLookup


@dataclass
class Plan:
    """What one stream checks this round: ``tokens`` (a ready proposal) or
    ``head`` drafts from the MTP head; neither is a plain step."""

    head: int = 0
    tokens: List[int] = field(default_factory=list)
    source: str = "mtp"  # what the tokens' ``Draft``s are tagged with


class DraftSource(Protocol):
    """One stream's drafts, asked once per round."""

    name: str
    # the most head drafts a round may take; 0: the head does not read along
    draft_max: int

    def count(self) -> int:
        """Head drafts this source would like next round, by its own policy
        (the single-stream loop asks before the round; a batch picks one
        length for all its streams instead)."""

    def rates(self) -> Sequence[float]:
        """The head's running acceptance per depth (for the batch's policy)."""

    def plan(self, history: Sequence[int], room: int, k: int) -> Plan:
        """This round's plan after ``history``: a proposal of at most ``room``
        tokens, or up to ``k`` head drafts (``k`` is what the loop offers)."""

    def update(self, source: str, drafted: int, accepted: int) -> None:
        """The round checked ``drafted`` drafts of ``source`` and kept ``accepted``."""

    def may_propose_after(self, history: Sequence[int]) -> bool:
        """Whether the round after the token that follows ``history`` may hold
        a ready proposal (the single-stream loop runs plain steps ahead only
        while none can come)."""


class NoDrafts:
    """Plain steps: no drafts."""

    name = "none"
    draft_max = 0

    def count(self) -> int:
        return 0

    def rates(self) -> Sequence[float]:
        return []

    def plan(self, history: Sequence[int], room: int, k: int) -> Plan:
        return Plan()

    def update(self, source: str, drafted: int, accepted: int) -> None:
        pass

    def may_propose_after(self, history: Sequence[int]) -> bool:
        return False


class HeadDrafts(NoDrafts):
    """The MTP head's drafts, counted by ``policy`` (``CostAwareDraft`` or
    ``FixedDraft``), which also keeps their running acceptance."""

    name = "mtp"

    def __init__(self, policy):
        self.policy = policy

    @property
    def draft_max(self) -> int:
        return self.policy.draft_max

    def count(self) -> int:
        return self.policy()

    def rates(self) -> Sequence[float]:
        return self.policy.acceptance

    def plan(self, history: Sequence[int], room: int, k: int) -> Plan:
        return Plan(head=max(0, min(k, self.draft_max)))

    def update(self, source: str, drafted: int, accepted: int) -> None:
        self.policy.update(drafted, accepted)


class LookupDrafts(NoDrafts):
    """Prompt-lookup drafts, checked where that beats a plain step; the head
    (``head``, when the source is part of "auto") reads along."""

    name = "ngram"

    def __init__(self, lookup: PromptLookup):
        self.lookup = lookup

    def plan(self, history: Sequence[int], room: int, k: int) -> Plan:
        return self._propose(history, room, 1.0)

    def _propose(self, history: Sequence[int], room: int, against: float) -> Plan:
        self.lookup.sync(history)
        tokens = self.lookup.drafts(room, against) if room > 0 else []
        return Plan(tokens=tokens, source="lookup")

    def update(self, source: str, drafted: int, accepted: int) -> None:
        if source == "lookup":
            self.lookup.update(drafted, accepted)

    def may_propose_after(self, history: Sequence[int]) -> bool:
        self.lookup.sync(history)
        return self.lookup.may_propose_next(history[-1])


class AutoDrafts(LookupDrafts):
    """Per round, a lookup proposal where checking it is expected to keep
    more per unit of time than the head's round (by the same costs), else
    the head's drafts."""

    name = "auto"

    def __init__(self, head: HeadDrafts, lookup: PromptLookup):
        super().__init__(lookup)
        self.head = head

    @property
    def draft_max(self) -> int:
        return self.head.draft_max

    def count(self) -> int:
        return self.head.count()

    def rates(self) -> Sequence[float]:
        return self.head.rates()

    def plan(self, history: Sequence[int], room: int, k: int) -> Plan:
        k = max(0, min(k, self.draft_max))
        against = 1.0  # a plain step
        if k > 0:
            against = expected_tokens(self.rates(), k) / self.lookup.costs.round(k)
        proposal = self._propose(history, room, against)
        return proposal if proposal.tokens else Plan(head=k)

    def update(self, source: str, drafted: int, accepted: int) -> None:
        if source == "lookup":
            self.lookup.update(drafted, accepted)
        else:
            self.head.update(source, drafted, accepted)


def check_source_name(name: str) -> str:
    """``name`` if it names a draft source, else a one-line ``MTPError``."""
    if name not in DRAFT_SOURCES:
        raise MTPError(
            f"draft source must be one of {', '.join(DRAFT_SOURCES)}, not {name!r}"
        )
    return name


def check_draft_max(draft_max: Optional[int]) -> Optional[int]:
    if draft_max is not None and not 0 <= draft_max <= MAX_DRAFT_MAX:
        raise MTPError(f"draft_max must be 0 to {MAX_DRAFT_MAX}, not {draft_max}")
    return draft_max


def make_lookup(model) -> Optional[PromptLookup]:
    """A prompt lookup for ``model``, or None where it cannot
    pay or cannot be checked: where even drafts that are always kept cannot beat
    a plain step (a CPU with MLX's bundled BLAS: a verify over t tokens costs t
    steps), and on a trunk whose caches cannot drop rejected drafts."""
    lookup = PromptLookup(machine_costs(model))
    if not lookup.can_pay() or not can_rollback(model.make_cache().trunk):
        return None
    return lookup


def make_source(
    model,
    name: str = DEFAULT_DRAFT_SOURCE,
    draft_max: int = 0,
    adaptive: bool = True,
) -> DraftSource:
    """The draft source ``name`` ("mtp", "ngram", "auto") for one generation.

    ``draft_max`` bounds the head's drafts per round (0: the head drafts
    none; the caller resolves the head's recommended count); ``adaptive``:
    the head drafts as many as pay by the costs ``tune`` measured (else always
    ``draft_max``). A source that cannot be used here falls back to what
    can: no head, no lookup, or plain steps.
    """
    check_source_name(name)
    check_draft_max(draft_max)
    head: Optional[HeadDrafts] = None
    if model.head is not None and draft_max > 0 and name != "ngram":
        head = HeadDrafts(make_policy(model, draft_max, adaptive))
    lookup = make_lookup(model) if name != "mtp" else None
    if head is not None and lookup is not None:
        return AutoDrafts(head, lookup)
    if lookup is not None:
        return LookupDrafts(lookup)
    return head if head is not None else NoDrafts()


def batch_source(model, name: str, draft_max: int) -> DraftSource:
    """A served stream's source: its head count comes from the batch's
    policy, so its own only keeps the running acceptance (from the head's
    measured prior)."""
    source = make_source(model, name, draft_max, adaptive=False)
    head = source.head if isinstance(source, AutoDrafts) else source
    if isinstance(head, HeadDrafts):
        head.policy = FixedDraft(draft_max, prior=acceptance_prior(model))
    return source


def as_source(drafts) -> DraftSource:
    """A ``DraftSource`` as is; a bare count policy (``FixedDraft``,
    ``CostAwareDraft``, anything with ``draft_max``, ``__call__`` and
    ``update``) as the head's drafts it counts; None as the default count of
    head drafts."""
    if drafts is None:
        drafts = FixedDraft(DEFAULT_DRAFT_MAX)
    return drafts if hasattr(drafts, "plan") else HeadDrafts(drafts)
