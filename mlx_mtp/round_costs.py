"""Round costs that the rounds themselves correct.

The probe (``probe.measure``) times a verify over 2 tokens once, without the
loop's own work around it (the verifier, the rollback, the drafters reading
along, a lookup's search), and extrapolates wider verifies from it. On a
small model a round is mostly that work; a probe taken on a loaded machine
can be off either way; and a stored cost stays what it was. So the rounds
of one stream (alone, or a served batch of one) are timed as they run
(``Decoder.step``), and their times correct the costs the probe (or
``tune``) stored:

- the unit is a plain step as the loop runs it: the median of this
  process's latest plain rounds run ahead (``UNIT_MIN`` of them at least);
  before there are that many, the unit an earlier run's rounds stored, else
  the probe's plain step (measured with the rest of its costs);
- each drafted round is a sample ``(width, cost)``, its verify's width and
  its time in units, kept per source: each drafter (by its checkpoint,
  ``Drafter.key``) and the lookups (rounds that are a verify alone), over
  the latest ``WINDOW`` rounds;
- once a source has ``MIN_SAMPLES``, its excess over the stored round cost
  is fit as ``a + b (width - 2)``: ``b`` (at least 0) from the medians of the
  narrowest and widest widths with two samples each, 0 while there is one
  width; ``a`` the median of what is left. A round of any width then costs
  the stored cost plus that excess, never less: a probe that missed the
  loop's work, or extrapolated a 2-token verify to 9 tokens, is raised to
  what the rounds pay, and noise cannot make drafts look free. A source
  whose corrected costs do not pay stops drafting and so stops measuring:
  its estimate stands, so the drafting cannot swing back and forth. A
  drafter without samples of its own pays the lookups' excess (its rounds
  do the same work), unless its stored costs are ``tune``'s whole rounds.

The samples are stored in the probe's entry in ``costs.json``
(``timing.COSTS_FILE``), under its key (machine, BLAS, model files: a new
key is probed afresh and starts without samples), when a stream leaves the
loop; a later process starts from them. Long contexts (``timing.costs_at``)
and several processes (``mlx.launch``: every rank drafts alike) are not
corrected, nor anything under ``MLX_MTP_COSTS=prior``.
"""

import statistics
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Tuple

from .adaptive import Costs

WINDOW = 16  # samples per source
MIN_SAMPLES = 3  # before a source's correction holds (a first round is slow)
UNIT_WINDOW = 16
UNIT_MIN = 2
MAX_WIDTH = 17  # widths corrected: up to ``defaults.MAX_DRAFT_MAX`` drafts
CHANGE = 0.02  # plain steps: a correction that moves less is not passed on
LOOKUP = "lookup"  # the lookups' samples (a drafter's are under its key)

# (width, seconds, unit): ``unit`` None while this process has no unit of
# its own (the time is read against the best unit known when it is used)
Sample = Tuple[int, float, Optional[float]]


def fit(samples: List[Tuple[int, float]]) -> Tuple[float, float]:
    """``(a, b)`` of ``excess(width) = a + b (width - 2)`` over ``(width,
    excess)`` samples (see the module's docstring)."""
    by_width: Dict[int, List[float]] = {}
    for w, e in samples:
        by_width.setdefault(w, []).append(e)
    paired = sorted(w for w, es in by_width.items() if len(es) >= 2)
    b = 0.0
    if len(paired) >= 2:
        lo, hi = paired[0], paired[-1]
        rise = statistics.median(by_width[hi]) - statistics.median(by_width[lo])
        b = max(0.0, rise / (hi - lo))
    a = statistics.median(e - b * (w - 2) for w, e in samples)
    return a, b


class RoundCosts:
    """One model's round-time samples in this process (see the module's
    docstring); ``costs`` corrects stored costs by them."""

    def __init__(self, stored: Optional[Dict[str, Any]] = None, probe_unit=None):
        """``stored``: what an earlier process saved (``to_dict``);
        ``probe_unit``: the probe's plain step in seconds, if it timed one."""
        self.plain: Deque[float] = deque(maxlen=UNIT_WINDOW)
        self.samples: Dict[str, Deque[Sample]] = {}
        self.stored_unit = probe_unit
        self.dirty = False
        self.fits: Dict[str, Tuple[float, float]] = {}  # as last passed on
        stored = stored or {}
        try:
            unit = stored.get("unit")
            if unit is not None and float(unit) > 0:
                self.stored_unit = float(unit)
            for key, rows in (stored.get("sources") or {}).items():
                kept = self.samples.setdefault(str(key), deque(maxlen=WINDOW))
                for w, r in rows:
                    if int(w) >= 2 and float(r) > 0:
                        kept.append((int(w), float(r), 1.0))
        except (AttributeError, TypeError, ValueError):
            self.samples.clear()  # damaged: the rounds start anew

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
        source's correction moved by more than ``CHANGE`` at some width
        (its draft source should be costed anew)."""
        own = len(self.plain) >= UNIT_MIN
        kept = self.samples.setdefault(key, deque(maxlen=WINDOW))
        kept.append((width, seconds, self.unit() if own else None))
        self.dirty = True
        now = self._fit(key, None)
        if now is None:
            return False
        was = self.fits.get(key, (0.0, 0.0))
        moved = max(abs(_at(now, w) - _at(was, w)) for w in (2, MAX_WIDTH))
        if moved <= CHANGE:
            return False
        self.fits[key] = now
        return True

    def relative(self, key: str) -> List[Tuple[int, float]]:
        """``key``'s samples as ``(width, cost in plain steps)``."""
        unit = self.unit()
        out = []
        for w, s, u in self.samples.get(key, ()):
            u = u if u is not None else unit
            if u:
                out.append((w, s / u))
        return out

    def _fit(self, key: str, base: Optional[Costs], drafter: bool = False):
        rows = self.relative(key)
        if len(rows) < MIN_SAMPLES:
            return None
        if base is None:
            return fit(rows)

        def stored(w: int) -> float:
            return base.round(w - 1) if drafter else base.verify_cost(w)

        return fit([(w, r - stored(w)) for w, r in rows])

    def costs(self, base: Costs, drafter: Optional[str] = None) -> Costs:
        """``base`` corrected by the rounds: the lookups' excess on every
        verify; ``drafter``'s own (its key) on its rounds, else the
        lookups' where ``base`` holds no whole rounds."""
        look = self._fit(LOOKUP, base)
        verify = [base.verify_cost(1)] + [
            base.verify_cost(w) + _raise(look, w) for w in range(2, MAX_WIDTH + 1)
        ]
        own = self._fit(drafter, base, drafter=True) if drafter else None
        extra = own if own is not None else (look if not base.rounds else None)
        if look is None and extra is None:
            return base
        rounds = None
        if extra is not None:
            rounds = [1.0] + [
                base.round(k) + _raise(extra, k + 1) for k in range(1, MAX_WIDTH)
            ]
            for k in range(1, len(rounds)):  # more drafts never cost less
                rounds[k] = max(rounds[k], rounds[k - 1])
        elif base.rounds:
            rounds = list(base.rounds)
        for t in range(1, len(verify)):
            verify[t] = max(verify[t], verify[t - 1])
        return Costs(verify, list(base.draft), rounds)

    def to_dict(self) -> Dict[str, Any]:
        """What a later process starts from: the unit and each source's
        samples in plain steps."""
        unit = statistics.median(self.plain) if len(self.plain) >= UNIT_MIN else None
        sources = {
            key: [[w, round(r, 4)] for w, r in self.relative(key)]
            for key in self.samples
        }
        return {
            "unit": round(unit, 6) if unit else self.stored_unit,
            "sources": {k: v for k, v in sources.items() if v},
        }


def _at(ab: Tuple[float, float], width: int) -> float:
    return ab[0] + ab[1] * (width - 2)


def _raise(ab: Optional[Tuple[float, float]], width: int) -> float:
    """The excess at ``width`` (none below 0: a correction only raises)."""
    return 0.0 if ab is None else max(0.0, _at(ab, width))
