"""Round costs that the rounds themselves correct.

The probe (``probe.measure``) times a verify over 2 tokens once, without the
loop's own work around it (the verifier, the rollback, the drafters reading
along, a lookup's search), and extrapolates wider verifies from it. On a
small model a round is mostly that work; a probe taken on a loaded machine
can be off either way; and a stored cost stays what it was. So the rounds
of one stream (alone, or a served batch of one) are timed as they run
(``Decoder.step``), and their times correct the costs the probe (or
``tune``) stored (a batch's rounds: below):

- the unit is a plain step as the loop runs it: the median of this
  process's latest plain rounds run ahead (``UNIT_MIN`` of them at least);
  before there are that many, the unit an earlier run's rounds stored, else
  the probe's plain step (measured with the rest of its costs);
- each drafted round is a sample of its verify's width and its time in
  units, kept per source (each drafter by its checkpoint, ``Drafter.key``;
  the lookups, whose rounds are a verify alone) and width, the latest
  ``PER_WIDTH`` of each;
- a width with ``MIN_SAMPLES`` costs their median: what the rounds pay,
  above or below the stored cost (a probe that missed the loop's work, or
  extrapolated a 2-token verify to 9 tokens). Another width costs the
  stored cost plus the excess of the measured ones: between two of them,
  interpolated; outside them, the nearest one's excess, changing with the
  width as it changes between the narrowest and widest measured (while no
  width has ``MIN_SAMPLES``, the median excess of all the source's samples,
  once there are as many: a lookup proposes at many widths). No width
  costs less than a plain step, nor less than a narrower one;
- a source that by its corrected costs does not pay stops drafting at that
  width, so that width is measured no more and its median stands: the
  drafting cannot swing back and forth. A width never measured is tried
  at most ``MIN_SAMPLES`` rounds before its own median holds. A drafter
  without samples of its own pays what the lookups' rounds pay beyond the
  stored verify (its rounds do the same work; a lookup's cheaper round does
  not lower a drafter's), unless its stored costs are ``tune``'s whole
  rounds.

A batch's rounds (the batch policy's, ``batch_policy.BatchDraftLength``,
which picks each round's ``K`` by expected tokens per measured second at
its batch size) are kept too, as that policy keys them: per batch source
(the drafters its streams draft from, by ``Drafter.key``), batch size and
``K``, in units of a plain round of as many streams (this process's, run
ahead; before ``UNIT_MIN`` of them, the unit stored), the latest
``PER_WIDTH`` of each. A policy that meets a batch size of a source for the
first time in a process starts from them (``batch_seed``: each ``K``
measured ``MIN_SAMPLES`` times, against its own plain rounds where it has
them), so that a batch whose drafts cost more than they bring does not
measure them again at a loss in every new process; the rounds it measures
push the seeds out.

The samples are stored in the probe's entry in ``costs.json``
(``timing.COSTS_FILE``, atomically: a temporary file renamed), under its
key (the machine, its BLAS and the libraries preloaded, the model's files
and their stamp: a new key is probed afresh and starts without samples),
off the requests' path (``store``): at the end of a one-shot generation
(``speculative_generate_step``, ``batch_generate``), and by a server when
idle, at most every ``serve.engine.STORE_EVERY`` seconds, and when it
stops; a later process starts from them. Long contexts
(``timing.costs_at``) and several processes (``mlx.launch``: every rank
drafts alike) are not corrected, nor anything under
``MLX_MTP_COSTS=prior``.
"""

import statistics
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from .adaptive import Costs

PER_WIDTH = 8  # samples per source and width
MIN_SAMPLES = 3  # before a width's median holds (a first round is slow)
UNIT_WINDOW = 16
UNIT_MIN = 2
MAX_WIDTH = 17  # widths corrected: up to ``defaults.MAX_DRAFT_MAX`` drafts
# a width's median that moved by less (a share of it) is not passed on: the
# counts barely change for it, and costing a source anew takes a fraction
# of a millisecond, much of a tiny model's round
CHANGE = 0.05
LOOKUP = "lookup"  # the lookups' samples (a drafter's are under its key)

# (seconds, unit): ``unit`` None while this process has no unit of its own
# (the time is read against the best unit known when it is used)
Sample = Tuple[float, Optional[float]]


def of(model) -> Optional["RoundCosts"]:
    """``model``'s corrections in this process (set by the probe), if any."""
    return getattr(model, "_round_costs", None)


def store(model) -> None:
    """Store ``model``'s corrections, where the rounds added to them since
    they were last stored (atomically: ``config.write_entries``). Called off
    the requests' path: at a one-shot generation's end, by a server when
    idle (at most every ``serve.engine.STORE_EVERY`` seconds) and at its
    close."""
    fix = of(model)
    if fix is not None:
        fix.save()


def corrected(stored: Callable[[int], float], samples: Dict[int, List[float]]):
    """Costs at widths 2..``MAX_WIDTH`` (index 0: width 2) from ``stored(w)``
    and ``samples`` (per width, in plain steps), as the module's docstring
    says; None before ``MIN_SAMPLES``. While no width has as many, the
    median excess of all of them holds at every width (a lookup's
    proposals come at many widths)."""
    measured = {w: statistics.median(r) for w, r in samples.items()
                if len(r) >= MIN_SAMPLES}  # fmt: skip
    if not measured:
        pooled = [r - stored(w) for w, rs in samples.items() for r in rs]
        if len(pooled) < MIN_SAMPLES:
            return None
        a = statistics.median(pooled)
        out: List[float] = []
        for w in range(2, MAX_WIDTH + 1):
            out.append(max(stored(w) + a, 1.0, out[-1] if out else 1.0))
        return out
    widths = sorted(measured)
    excess = {w: measured[w] - stored(w) for w in widths}
    lo, hi = widths[0], widths[-1]
    slope = (excess[hi] - excess[lo]) / (hi - lo) if hi > lo else 0.0
    out = []
    for w in range(2, MAX_WIDTH + 1):
        if w in measured:
            c = measured[w]
        elif w < lo:
            c = stored(w) + excess[lo] - slope * (lo - w)
        elif w > hi:
            c = stored(w) + excess[hi] + slope * (w - hi)
        else:
            below = max(v for v in widths if v < w)
            above = min(v for v in widths if v > w)
            t = (w - below) / (above - below)
            c = stored(w) + excess[below] + t * (excess[above] - excess[below])
        out.append(max(c, 1.0, out[-1] if out else 1.0))
    return out


class RoundCosts:
    """One model's round-time samples in this process (see the module's
    docstring); ``costs`` corrects stored costs by them."""

    def __init__(self, stored: Optional[Dict[str, Any]] = None, probe_unit=None):
        """``stored``: what an earlier process saved (``to_dict``);
        ``probe_unit``: the probe's plain step in seconds, if it timed one."""
        self.plain: Deque[float] = deque(maxlen=UNIT_WINDOW)
        self.samples: Dict[str, Dict[int, Deque[Sample]]] = {}
        self.stored_unit = probe_unit
        self.dirty = False
        # set by the probe (which runs the loop, so the loop calls it back
        # through these): a drafter's costs as corrected, and storing them
        self.corrected: Callable[[Any], Any] = lambda drafter: None
        self.save: Callable[[], None] = lambda: None
        self.seen: Dict[str, Dict[int, float]] = {}  # as last passed on
        # a batch's rounds (the batch policy's, ``batch_policy``): per batch
        # size its plain rounds run ahead (seconds), and per batch source
        # (``Decoder``: the drafters its streams draft from) and (streams, K)
        # its drafted rounds
        self.batch_plain: Dict[int, Deque[float]] = {}
        self.stored_batch_units: Dict[int, float] = {}
        self.batch: Dict[str, Dict[Tuple[int, int], Deque[Sample]]] = {}
        stored = stored or {}
        try:
            unit = stored.get("unit")
            if unit is not None and float(unit) > 0:
                self.stored_unit = float(unit)
            for key, rows in (stored.get("sources") or {}).items():
                for w, r in rows:
                    if int(w) >= 2 and float(r) > 0:
                        self._kept(str(key), int(w)).append((float(r), 1.0))
            batch = stored.get("batch") or {}
            for b, u in (batch.get("units") or {}).items():
                if int(b) >= 1 and float(u) > 0:
                    self.stored_batch_units[int(b)] = float(u)
            for key, rows in (batch.get("sources") or {}).items():
                for b, k, r in rows:
                    if int(b) >= 1 and int(k) >= 1 and float(r) > 0:
                        kept = self._batch_kept(str(key), int(b), int(k))
                        kept.append((float(r), 1.0))
        except (AttributeError, TypeError, ValueError):
            self.samples.clear()  # damaged: the rounds start anew
            self.batch.clear()
            self.stored_batch_units.clear()

    def _kept(self, key: str, width: int) -> Deque[Sample]:
        widths = self.samples.setdefault(key, {})
        return widths.setdefault(width, deque(maxlen=PER_WIDTH))

    def _batch_kept(self, key: str, streams: int, k: int) -> Deque[Sample]:
        shapes = self.batch.setdefault(key, {})
        return shapes.setdefault((streams, k), deque(maxlen=PER_WIDTH))

    def unit(self) -> Optional[float]:
        """A plain step's seconds: this process's, else the stored one."""
        if len(self.plain) >= UNIT_MIN:
            return statistics.median(self.plain)
        return self.stored_unit

    def record_plain(self, seconds: float) -> None:
        """A plain round of one stream, run ahead of its token."""
        self.plain.append(seconds)

    def record(self, key: str, width: int, seconds: float) -> bool:
        """A round of ``key``'s drafts (``LOOKUP``, or a drafter's key) that
        verified ``width`` tokens in ``seconds``. Returns whether the
        width's median holds now, or moved by more than ``CHANGE`` since
        (the stream's draft source is to be costed anew)."""
        own = len(self.plain) >= UNIT_MIN
        kept = self._kept(key, width)
        kept.append((seconds, self.unit() if own else None))
        self.dirty = True
        unit = self.unit()
        if not unit:
            return False
        if len(kept) < MIN_SAMPLES:  # the pooled excess, where no width holds
            widths = self.samples[key].values()
            if any(len(k) >= MIN_SAMPLES for k in widths):
                return False
            width, kept = 0, [x for k in widths for x in k]
            if len(kept) < MIN_SAMPLES:
                return False
        now = statistics.median(s / (u or unit) for s, u in kept)
        seen = self.seen.setdefault(key, {})
        was = seen.get(width)
        if was is not None and abs(now - was) <= CHANGE * max(now, was):
            return False
        seen[width] = now
        return True

    # -- a batch's rounds ----------------------------------------------------

    def batch_unit(self, streams: int) -> Optional[float]:
        """A plain round's seconds at ``streams`` streams: this process's
        (the median of its latest, run ahead), else the stored one; where
        neither is, the nearest batch size's (as the batch policy borrows
        the nearest one's times)."""
        own = {b: statistics.median(p) for b, p in self.batch_plain.items()
               if len(p) >= UNIT_MIN}  # fmt: skip
        units = {**self.stored_batch_units, **own}
        if not units:
            return None
        return units[min(units, key=lambda b: (abs(b - streams), b))]

    def record_batch_plain(self, streams: int, seconds: float) -> None:
        """A plain round of ``streams`` streams run ahead (the batch policy's
        sample of ``K = 0``)."""
        plain = self.batch_plain.setdefault(streams, deque(maxlen=UNIT_WINDOW))
        plain.append(seconds)

    def record_batch(self, key: str, streams: int, k: int, seconds: float) -> None:
        """A round of ``streams`` streams whose drafts (from ``key``, the
        batch's drafters) the batch policy measured at ``K = k``."""
        plain = self.batch_plain.get(streams, ())
        unit = statistics.median(plain) if len(plain) >= UNIT_MIN else None
        self._batch_kept(key, streams, k).append((seconds, unit))  # (None: later)
        self.dirty = True

    def batch_relative(self, key: str) -> Dict[Tuple[int, int], List[float]]:
        """``key``'s batch rounds per (streams, K), in plain rounds of as
        many streams."""
        out: Dict[Tuple[int, int], List[float]] = {}
        for (b, k), kept in self.batch.get(key, {}).items():
            unit = self.batch_unit(b)
            for s, u in kept:
                u = u if u is not None else unit
                if u:
                    out.setdefault((b, k), []).append(s / u)
        return out

    def batch_seed(
        self, key: str, streams: int, unit: Optional[float] = None
    ) -> Optional[Dict[int, List[float]]]:
        """What a batch policy (``BatchDraftLength.seed``) starts from at
        ``streams`` streams of ``key``'s drafts: per K measured
        ``MIN_SAMPLES`` times (in this or an earlier process), its rounds'
        seconds against a plain round of ``unit`` seconds (None: this
        process's, else the stored one), and the plain round's; None where
        nothing was measured."""
        unit = unit or self.batch_unit(streams)
        found = {
            k: [r * unit for r in rs]
            for (b, k), rs in self.batch_relative(key).items()
            if b == streams and len(rs) >= MIN_SAMPLES
        }
        if not found or not unit:
            return None
        return {0: [unit] * MIN_SAMPLES, **found}

    def relative(self, key: str) -> Dict[int, List[float]]:
        """``key``'s samples per width, in plain steps."""
        unit = self.unit()
        out: Dict[int, List[float]] = {}
        for w, kept in self.samples.get(key, {}).items():
            for s, u in kept:
                u = u if u is not None else unit
                if u:
                    out.setdefault(w, []).append(s / u)
        return out

    def costs(self, base: Costs, drafter: Optional[str] = None) -> Costs:
        """``base`` corrected by the rounds: its verifies by the lookups'
        rounds; ``drafter``'s rounds (its key) by its own, else by the
        lookups' where ``base`` holds no whole rounds."""
        look = corrected(base.verify_cost, self.relative(LOOKUP))
        own = None
        if drafter is not None:
            own = corrected(lambda w: base.round(w - 1), self.relative(drafter))
        if look is None and own is None:
            return base
        verify = [base.verify_cost(1)] + (
            look or [base.verify_cost(w) for w in range(2, MAX_WIDTH + 1)]
        )
        rounds = list(base.rounds) if base.rounds else None
        if own is not None:
            rounds = [1.0] + own
        elif look is not None and not base.rounds:
            # (raised only: a lookup's cheap round says nothing of a drafter's)
            rounds = [1.0] + [
                base.round(k) + max(0.0, look[k - 1] - base.verify_cost(k + 1))
                for k in range(1, MAX_WIDTH)
            ]
        return Costs(verify, list(base.draft), rounds)

    def to_dict(self) -> Dict[str, Any]:
        """What a later process starts from: the unit and each source's
        samples in plain steps."""
        unit = statistics.median(self.plain) if len(self.plain) >= UNIT_MIN else None
        sources = {
            key: [[w, round(r, 4)] for w, rs in self.relative(key).items() for r in rs]
            for key in self.samples
        }
        units = {b: self.batch_unit(b) for b in set(self.batch_plain) | set(self.stored_batch_units)
                 | {b for shapes in self.batch.values() for b, _ in shapes}}  # fmt: skip
        batch = {
            key: [[b, k, round(r, 4)] for (b, k), rs in self.batch_relative(key).items()
                  for r in rs]
            for key in self.batch
        }  # fmt: skip
        return {
            "unit": round(unit, 6) if unit else self.stored_unit,
            "sources": {k: v for k, v in sources.items() if v},
            "batch": {
                "units": {str(b): round(u, 6) for b, u in sorted(units.items()) if u},
                "sources": {k: v for k, v in batch.items() if v},
            },
        }
