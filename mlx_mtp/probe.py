"""What a round costs here, measured once per machine and model.

The draft policies weigh expected tokens against round costs in plain steps
(``adaptive.Costs``). ``mlx-mtp tune`` measures them thoroughly (a minute or
so) and stores them beside the model; without it, they are measured here
the first time a model drafts on a machine, cheaply, and kept in
``$XDG_CACHE_HOME/mlx-mtp/costs.json`` (by machine and by the model's files,
as ``tune`` keys its entries), so later processes read them instead:

- the unit: two plain steps, the second started before the first's token is
  read (as the loop runs them);
- a verify pass over 2 tokens, waited for; passes over more tokens are
  extrapolated from it (a straight line: pessimistic where a forward is
  memory-bound, its cost growing less than that);
- each drafter's proposal of 1 draft from a warm cache (its catch-up over two
  positions included) and, for a chain, of 2; a block drafter costs the same
  whatever it drafts (``Drafter.flat_cost``). Drafters are stored under
  ``Drafter.key``: a drafter checkpoint attached later is measured then (a
  DFlash block's prior, the bytes it reads, says 0.07 of a step where a
  CPU measures 0.56).

Each part is timed ``REPEATS`` times, interleaved (drift on a busy machine
hits all alike), after one untimed forward and proposal, and the medians
kept: about eight forwards on the default model (see docs/performance.md for
what that costs a fresh process).

From ``LONG_CONTEXT`` tokens on, a single stream's rounds are weighed by
costs timed the same way on its own caches at its context (``costs_at``:
once per power of two of the context, per machine, model and cache form,
stored in the same file): a verify's attention grows with the context.

A tuned entry wins at short contexts; over several processes
(``mlx.launch``) every rank uses the same prior guess
(``adaptive.prior_costs``), as it must draft alike.
``MLX_MTP_COSTS=prior`` keeps the prior guess everywhere (the test suite
pins it so that policies stay deterministic).
"""

import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import mlx.core as mx

from . import config
from .adaptive import Costs, prior_costs
from .cache import start_verify
from .kv import describe_layer
from .sampling import ExactMatchVerifier
from .stream import open_stream

COSTS_FILE = "costs.json"
# From this many tokens of context on, a stream's rounds are weighed by costs
# measured at its context (``costs_at``): a verify's attention over the
# context grows with it, and by more than a plain step's where the caches
# are quantized (on this machine's CPU, 16 K tokens of the default model's
# 8-bit cache took a verify over 4 tokens from 1.4 steps to 2.0).
LONG_CONTEXT = 4096
REPEATS = 2
CONTEXT = 48  # tokens of warm cache the parts are timed after
MAX_ENTRIES = 32
DEPTHS = 4  # verify costs kept for 1..DEPTHS + 1 tokens


def costs_file() -> Path:
    return config.cache_file(COSTS_FILE)


def machine_costs(model, drafter=None) -> Costs:
    """Round costs here with ``drafter``'s drafts (None: the model's first
    drafter, its MTP head when it has one): ``tune``'s entry for this model
    and machine, else the measured one (measured now on first use), else
    the prior guess. A drafter neither measured has its prior draft costs
    (``Drafter.prior_cost``)."""
    if drafter is None and model.drafters:
        drafter = model.drafters[0]
    name = drafter.name if drafter is not None else "mtp"
    if config.sharded(model):
        return _drafting(prior_costs(), drafter, None)
    entry = config.tuned_entry(model) if model.drafters else None
    if entry is not None:
        tuned = Costs.from_dict(entry["costs"])
        if name == "mtp":
            return tuned
        return _drafting(tuned, drafter, (entry["costs"].get("drafters") or {}).get(name))
    found = None
    if os.environ.get("MLX_MTP_COSTS") != "prior":
        found = measured_entry(model)
    if found is None:
        return _drafting(prior_costs(config.compute_bound()), drafter, None)
    measured = Costs([float(x) for x in found["verify"]], [0.08])
    key = drafter.key if drafter is not None else name
    return _drafting(measured, drafter, found["draft"].get(key), replace=True)


def _drafting(costs: Costs, drafter, draft, replace: bool = False) -> Costs:
    """``costs`` with ``drafter``'s draft costs ``draft``; where those were not
    measured, its prior ones (the head's prior is ``costs``' own, unless
    ``replace``)."""
    if draft:
        return Costs(costs.verify, [float(x) for x in draft])
    if drafter is None or (drafter.name == "mtp" and not replace):
        return costs
    return Costs(costs.verify, [drafter.prior_cost(k) for k in range(1, DEPTHS + 1)])


def measured_entry(model) -> Optional[Dict[str, Any]]:
    """The stored measurement for ``model`` here, measured and stored now
    when there is none (None where it cannot be measured)."""
    cached = getattr(model, "_measured_costs", None)
    if _covers(cached, model):
        return cached
    key = _key({"machine": config.machine(), "model": config.cached_identity(model)})
    entries = _read()
    found = next((e["costs"] for e in entries if _key(e) == key and _valid(e)), None)
    # a drafter attached since (each checkpoint under its own key) is measured
    # with the rest, and the drafters measured before are kept
    if not _covers(found, model):
        before = found["draft"] if found is not None else {}
        found = measure(model)
        if found is not None:
            found["draft"] = {**before, **found["draft"]}
            _write(entries, {**key, "created": time.time(), "costs": found})
    object.__setattr__(model, "_measured_costs", found)
    return found


def context_bucket(length: int) -> Optional[int]:
    """The context class whose costs a stream of ``length`` tokens is weighed
    by: None below ``LONG_CONTEXT`` (the costs measured at a short context),
    else the power of two at or below ``length``."""
    if length < LONG_CONTEXT:
        return None
    return 1 << (length.bit_length() - 1)


def costs_at(model, view, stream) -> Optional[Callable[[Optional[str]], Costs]]:
    """The round costs at ``stream``'s context (``context_bucket`` of the
    tokens its caches hold), by
    drafter name (None: a lookup's, whose rounds are verifies alone): stored
    for this machine, model, context class and cache form, else measured now
    on the stream itself (``time_parts``, about ten plain steps at that
    context, once per machine) and stored. None where costs are not
    measured (``MLX_MTP_COSTS=prior``, several processes) or the stream's
    caches cannot be brought back."""
    length = stream.cache.offset + 1  # the last token is read by the round
    bucket = context_bucket(length)
    if bucket is None or config.sharded(model):
        return None
    if os.environ.get("MLX_MTP_COSTS") == "prior":
        return None
    form = sorted({describe_layer(c) for c in stream.cache.trunk})
    key = _key({"machine": config.machine(), "model": config.cached_identity(model),
                "context": bucket, "kv": "; ".join(form)})  # fmt: skip
    entries = _read()
    found = next((e["costs"] for e in entries if _key(e) == key and _valid(e)), None)
    if not _covers(found, model):
        before = found["draft"] if found is not None else {}
        found = time_parts(model, view, stream)
        if found is None:
            return None
        found["draft"] = {**before, **found["draft"]}
        found["at"] = length
        _write(entries, {**key, "created": time.time(), "costs": found})
    verify = [float(x) for x in found["verify"]]
    drafters = {d.name: d for d in model.drafters}

    def costs(name: Optional[str]) -> Costs:
        d = drafters.get(name) if name is not None else None
        if d is None:
            return Costs(verify, [0.0])
        draft = found["draft"].get(d.key)
        if not draft:
            draft = [d.prior_cost(k) for k in range(1, DEPTHS + 1)]
        return Costs(verify, [float(x) for x in draft])

    return costs


def _covers(costs: Optional[Dict[str, Any]], model) -> bool:
    """Whether measured ``costs`` hold every drafter attached to ``model``."""
    return costs is not None and all(d.key in costs["draft"] for d in model.drafters)


def _key(entry) -> Dict[str, Any]:
    return {k: entry.get(k) for k in ("machine", "model", "context", "kv")}


def _valid(entry) -> bool:
    try:
        costs = entry["costs"]
        return bool([float(x) for x in costs["verify"]]) and all(
            float(x) >= 0 for d in costs["draft"].values() for x in d
        )
    except (AttributeError, KeyError, TypeError, ValueError):
        return False


def _read() -> List[Dict[str, Any]]:
    return config.read_entries(costs_file())


def _write(entries: List[Dict[str, Any]], entry: Dict[str, Any]) -> None:
    """Add ``entry`` (replacing its key's), atomically; a cache folder that
    cannot be written keeps the measurement in this process only."""
    kept = [e for e in entries if _key(e) != _key(entry)]
    config.write_entries(costs_file(), (kept + [entry])[-MAX_ENTRIES:])


def measure(model) -> Optional[Dict[str, Any]]:
    """Time the parts of a round on ``model`` (see the module's docstring):
    ``{"verify": [1..DEPTHS + 1 tokens], "draft": {name: [k = 1..DEPTHS]}}``
    in plain steps, with the plain step's milliseconds and the measurement's
    own seconds; None where the caches cannot be brought back to time from
    one point."""
    from .decoder import Decoder  # the loop's module weighs costs from here

    tic = time.perf_counter()
    vocab = model.trunk.embed_tokens.weight.shape[0]
    context = [(7 * i + 3) % min(vocab, 256) for i in range(CONTEXT)]
    stream = open_stream(model, context, verifier=ExactMatchVerifier(), max_tokens=2)
    view = Decoder(model, merge=False)
    view.add([stream])
    view.read_chunk([context], [0], CONTEXT)  # all but the last: y
    found = time_parts(model, view, stream)
    view.remove([stream])
    if found is not None:
        found["seconds"] = round(time.perf_counter() - tic, 3)
    return found


def time_parts(model, view, stream) -> Optional[Dict[str, Any]]:
    """``measure``'s timings on ``stream`` as it stands in ``view`` (its last
    token not yet read by the trunk), which is brought back to where it
    stood; None where its caches cannot be."""
    tic = time.perf_counter()
    cache, y = stream.cache, stream.history[-1]
    snapshot = cache.snapshot()
    if snapshot is None:
        return None

    def plain():  # two steps, the second started before the first is read
        logits, _ = model.trunk(mx.array([[y]]), cache.trunk)
        token = mx.argmax(logits[0, -1:], axis=-1)
        mx.async_eval(token)
        logits, _ = model.trunk(token.reshape(1, 1), cache.trunk)
        last = mx.argmax(logits[0, -1:], axis=-1)
        mx.async_eval(last)
        token.item()
        last.item()

    def verify():
        start_verify(cache.trunk)
        logits, _ = model.trunk(mx.array([[y, y]]), cache.trunk)
        mx.eval(mx.argmax(logits, axis=-1))

    def draft(d, k):
        def run():
            drafts, _ = d.propose(view, [stream], [k], 0.0)
            mx.eval([x.token for x in drafts[0]])

        return run

    jobs = {("plain", 0): plain, ("verify", 0): verify}
    for d in model.drafters:
        for k in (1,) if d.flat_cost else (1, 2):
            jobs[d.name, k] = draft(d, k)
    times: Dict[Any, List[float]] = {key: [] for key in jobs}
    keys = list(jobs)
    try:
        for key in keys[1:]:  # warm up: the kernels of each shape, untimed
            cache.restore(snapshot)
            jobs[key]()
        for rep in range(REPEATS):
            shift = rep % len(keys)
            for key in keys[shift:] + keys[:shift]:
                cache.restore(snapshot)
                start = time.perf_counter()
                jobs[key]()
                times[key].append(time.perf_counter() - start)
    finally:
        cache.restore(snapshot)
    med = {key: statistics.median(t) for key, t in times.items()}
    step = med["plain", 0] / 2
    v2 = max(med["verify", 0] / step, 1.0)
    drafts = {}
    for d in model.drafters:
        first = med[d.name, 1] / step
        chained = 0.0 if d.flat_cost else max(med[d.name, 2] / step - first, 0.0)
        drafts[d.key] = [round(first + chained * j, 4) for j in range(DEPTHS)]
    return {
        "verify": [round(1.0 + (t - 1) * (v2 - 1.0), 4) for t in range(1, DEPTHS + 2)],
        "draft": drafts,
        "step_ms": round(step * 1e3, 3),
        "seconds": round(time.perf_counter() - tic, 3),
    }
