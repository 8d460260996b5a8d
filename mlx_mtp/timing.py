"""Round costs timed on a stream as it stands, and where they are kept.

``time_parts`` times the parts of a round on a stream's own caches (two plain
steps run ahead, a verify over two tokens and one over ``DEPTHS + 1``, each
drafter's proposal of one and two drafts; interleaved, ``REPEATS`` times,
medians) and brings the caches back. ``probe`` uses it at a short context,
once per machine and model; the loop (``Decoder``) through ``costs_at``
from ``LONG_CONTEXT`` tokens on, once per power of two of the context,
machine, model and cache form: a verify's attention grows with the
context, by more than a plain step's where the caches are quantized. Both kinds of entry are kept in
``$XDG_CACHE_HOME/mlx-mtp/costs.json``.
"""

import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import mlx.core as mx

from . import config
from .adaptive import Costs
from .cache import start_verify
from .kv import describe_layer

COSTS_FILE = "costs.json"
# From this many tokens of context on, a stream's rounds are weighed by costs
# measured at its context (``costs_at``): a verify's attention over the
# context grows with it, and by more than a plain step's where the caches
# are quantized (figures in docs/performance.md).
LONG_CONTEXT = 4096
REPEATS = 2
MAX_ENTRIES = 32
DEPTHS = 4  # verify costs kept for 1..DEPTHS + 1 tokens


def costs_file() -> Path:
    return config.cache_file(COSTS_FILE)


def context_bucket(length: int) -> Optional[int]:
    """The context class whose costs a stream of ``length`` tokens is weighed
    by: None below ``LONG_CONTEXT`` (the costs measured at a short context),
    else the power of two at or below ``length``."""
    if length < LONG_CONTEXT:
        return None
    return 1 << (length.bit_length() - 1)


def costs_at(model, view, stream) -> Optional[Callable[[Optional[str]], Costs]]:
    """The round costs at ``stream``'s context (``context_bucket`` of the
    tokens its caches hold), by drafter name (None: a lookup's, whose rounds
    are verifies alone): stored for this machine, model, context class and
    cache form, else timed now on the stream itself (``time_parts``, about
    ten plain steps at that context, once per machine) and stored. None
    where costs are not measured (``MLX_MTP_COSTS=prior``, several
    processes) or the stream's caches cannot be brought back."""
    length = stream.cache.offset + 1  # the last token is read by the round
    bucket = context_bucket(length)
    if bucket is None or config.sharded(model):
        return None
    if os.environ.get("MLX_MTP_COSTS") == "prior":
        return None
    form = sorted({describe_layer(c) for c in stream.cache.trunk})
    key = entry_key(
        {
            "machine": config.costs_machine(),
            "model": config.costs_identity(model),
            "context": bucket,
            "kv": "; ".join(form),
        }
    )

    def timed() -> Optional[Dict[str, Any]]:
        found = time_parts(model, view, stream)
        if found is not None:
            found["at"] = length
        return found

    found = stored_or_timed(model, key, timed)
    if found is None:
        return None
    verify = Costs([float(x) for x in found["verify"]], [0.0])
    drafters = {d.name: d for d in model.drafters}

    def costs(name: Optional[str]) -> Costs:
        d = drafters.get(name) if name is not None else None
        draft = found["draft"].get(d.key) if d is not None else None
        return drafting(verify, d, draft, replace=True)

    return costs


def stored_or_timed(model, key, timed) -> Optional[Dict[str, Any]]:
    """The stored costs under ``key`` where they hold every drafter attached
    to ``model``; else ``timed()``'s (None: they cannot be timed), stored with
    the drafters timed before kept (a drafter attached since, each
    checkpoint under its own key, is timed with the rest)."""
    entries = read_entries()
    found = next(
        (e["costs"] for e in entries if entry_key(e) == key and valid_entry(e)), None
    )
    if covers(found, model):
        return found
    before = found["draft"] if found is not None else {}
    # the rounds' corrections (``round_costs``) hold for the same key still
    rounds = next((e.get("rounds") for e in entries if entry_key(e) == key), None)
    found = timed()
    if found is not None:
        found["draft"] = {**before, **found["draft"]}
        entry = {**key, "created": time.time(), "costs": found}
        if rounds:
            entry["rounds"] = rounds
        write_entry(entries, entry)
    return found


def drafting(costs: Costs, drafter, draft, replace: bool = False) -> Costs:
    """``costs`` with ``drafter``'s draft costs ``draft``; where those were not
    measured, its prior ones (the head's prior is ``costs``' own, unless
    ``replace``)."""
    if draft:
        return Costs(costs.verify, [float(x) for x in draft])
    if drafter is None or (drafter.name == "mtp" and not replace):
        return costs
    return Costs(costs.verify, [drafter.prior_cost(k) for k in range(1, DEPTHS + 1)])


class PartTimer:
    """The one timer of a round's parts (``time_parts`` here, ``tune``'s
    thorough ``CostTimer``): each named part runs from one point (``reset``,
    untimed, before each run), the parts interleaved in an order that
    rotates with the repetition (drift on a busy machine hits all alike);
    wall and CPU seconds kept, medians read."""

    def __init__(self, jobs: Dict[Any, Callable[[], Any]], reset: Callable[[Any], None]):
        self.jobs, self.reset = jobs, reset
        self.times: Dict[Any, List[tuple]] = {key: [] for key in jobs}

    def warm(self, keys=None) -> None:
        """Run ``keys`` (all) once, untimed: the kernels of each shape."""
        for key in self.jobs if keys is None else keys:
            self.reset(key)
            self.jobs[key]()

    def run(self, rep: int = 0) -> None:
        """Every part once, timed, in the order of repetition ``rep``."""
        keys = list(self.jobs)
        shift = rep % len(keys)
        for key in keys[shift:] + keys[:shift]:
            self.reset(key)
            cpu, wall = time.process_time(), time.perf_counter()
            self.jobs[key]()
            self.times[key].append(
                (time.perf_counter() - wall, time.process_time() - cpu)
            )

    def medians(self, cpu: bool = False) -> Dict[Any, float]:
        """Each part's median seconds (``cpu``: of this process's CPU time, a
        measure of work that other jobs on a shared CPU do not stretch)."""
        return {
            key: statistics.median(t[cpu] for t in ts) for key, ts in self.times.items()
        }


def time_parts(model, view, stream) -> Optional[Dict[str, Any]]:
    """The parts of a round (see the module's docstring) timed on ``stream``
    as it stands in ``view`` (its last token not yet read by the trunk), in
    plain steps: ``{"verify": [1..DEPTHS + 1 tokens], "draft": {key: [k =
    1..DEPTHS]}}``, with the plain step's milliseconds and the timing's own
    seconds. The stream is brought back to where it stood; None where its
    caches cannot be."""
    tic = time.perf_counter()
    cache, y = stream.cache, stream.history[-1]
    snapshot = cache.snapshot()
    if snapshot is None:
        return None

    def plain():  # two steps, the second started before the first is read
        logits, _ = model.target(mx.array([[y]]), cache.trunk)
        token = mx.argmax(logits[0, -1:], axis=-1)
        mx.async_eval(token)
        logits, _ = model.target(token.reshape(1, 1), cache.trunk)
        last = mx.argmax(logits[0, -1:], axis=-1)
        mx.async_eval(last)
        token.item()
        last.item()

    def verify(t):
        def run():
            start_verify(cache.trunk)
            logits, _ = model.target(mx.array([[y] * t]), cache.trunk)
            mx.eval(mx.argmax(logits, axis=-1))

        return run

    def draft(d, k):
        def run():
            drafts, _ = d.propose(view, [stream], [k], 0.0)
            mx.eval([x.token for x in drafts[0]])

        return run

    wide = DEPTHS + 1
    jobs = {("plain", 0): plain, ("verify", 2): verify(2)}
    jobs["verify", wide] = verify(wide)
    for d in model.drafters:
        for k in (1,) if d.flat_cost else (1, 2):
            jobs[d.name, k] = draft(d, k)
    timer = PartTimer(jobs, lambda key: cache.restore(snapshot))
    try:
        timer.warm(list(jobs)[1:])
        for rep in range(REPEATS):
            timer.run(rep)
    finally:
        cache.restore(snapshot)
    med = timer.medians()
    step = med["plain", 0] / 2
    v2 = max(med["verify", 2] / step, 1.0)
    per_token = (max(med["verify", wide] / step, v2) - v2) / (wide - 2)
    drafts = {}
    for d in model.drafters:
        first = med[d.name, 1] / step
        chained = 0.0 if d.flat_cost else max(med[d.name, 2] / step - first, 0.0)
        drafts[d.key] = [round(first + chained * j, 4) for j in range(DEPTHS)]
    return {
        "verify": [1.0, round(v2, 4)]
        + [round(v2 + (t - 2) * per_token, 4) for t in range(3, wide + 1)],
        "draft": drafts,
        "step_ms": round(step * 1e3, 3),
        "seconds": round(time.perf_counter() - tic, 3),
    }


def covers(costs: Optional[Dict[str, Any]], model) -> bool:
    """Whether measured ``costs`` hold every drafter attached to ``model``."""
    return costs is not None and all(d.key in costs["draft"] for d in model.drafters)


def entry_key(entry) -> Dict[str, Any]:
    return {k: entry.get(k) for k in ("machine", "model", "context", "kv")}


def valid_entry(entry) -> bool:
    try:
        costs = entry["costs"]
        return bool([float(x) for x in costs["verify"]]) and all(
            float(x) >= 0 for d in costs["draft"].values() for x in d
        )
    except (AttributeError, KeyError, TypeError, ValueError):
        return False


def read_entries() -> List[Dict[str, Any]]:
    return config.read_entries(costs_file())


def write_entry(entries: List[Dict[str, Any]], entry: Dict[str, Any]) -> None:
    """Add ``entry`` (replacing its key's), atomically; a cache folder that
    cannot be written keeps the measurement in this process only."""
    kept = [e for e in entries if entry_key(e) != entry_key(entry)]
    config.write_entries(costs_file(), (kept + [entry])[-MAX_ENTRIES:])
