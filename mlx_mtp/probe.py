"""What a round costs here, measured once per machine and model.

The draft policies weigh expected tokens against round costs in plain steps
(``adaptive.Costs``). ``mlx-mtp tune`` measures them thoroughly (a minute or
so) and stores them beside the model; without it, they are measured here
the first time a model drafts on a machine, cheaply, and kept in
``$XDG_CACHE_HOME/mlx-mtp/costs.json`` (by machine and by the model's files,
as ``tune`` keys its entries), so later processes read them instead:

- the unit: two plain steps, the second started before the first's token is
  read (as the loop runs them);
- verify passes over 2 and ``timing.DEPTHS + 1`` (5) tokens, waited for;
  those between are interpolated, wider ones extrapolated from the two
  (a 2-token verify alone, extrapolated as a straight line, made 4 drafts
  dearer than they were where a forward is memory-bound); the rounds then
  correct them (``round_costs``);
- each drafter's proposal of 1 draft from a warm cache (its catch-up over two
  positions included) and, for a chain, of 2; a block drafter costs the same
  whatever it drafts (``Drafter.flat_cost``). Drafters are stored under
  ``Drafter.key``: a drafter checkpoint attached later is measured then (a
  block drafter's prior, from the bytes it reads, can be far from what a
  compute-bound machine measures).

Each part is timed ``timing.REPEATS`` times, interleaved (drift on a busy
machine hits all alike), after one untimed forward and proposal, and the
medians kept (``timing.time_parts``): about ten trunk forwards on the default
model (see docs/performance.md for what that costs a fresh process).

From ``timing.LONG_CONTEXT`` tokens on, a single stream's rounds are weighed
by costs timed the same way on its own caches at its context
(``timing.costs_at``: once per power of two of the context, per machine,
model and cache form, stored in the same file).

The rounds' own times correct what is stored here (``round_costs``: per
source and verify width), kept in the same entry; ``machine_costs``
returns the costs so corrected. The entry's key is the machine (its BLAS
and the libraries preloaded: ``config.costs_machine``) and the model's
files with their stamp (``config.costs_identity``): another BLAS or
rewritten weights are probed afresh.

A tuned entry wins at short contexts; over several processes
(``mlx.launch``) every rank uses the same prior guess
(``adaptive.prior_costs``), as it must draft alike.
``MLX_MTP_COSTS=prior`` keeps the prior guess everywhere (the test suite
pins it so that policies stay deterministic).
"""

import os
import time
from typing import Any, Dict, Optional

from . import config
from .adaptive import Costs, prior_costs
from .decoder import Decoder
from .round_costs import RoundCosts
from .sampling import ExactMatchVerifier
from .stream import start_stream
from .timing import (
    covers,
    drafting,
    entry_key,
    read_entries,
    stored_or_timed,
    time_parts,
    write_entry,
)

CONTEXT = 48  # tokens of warm cache the parts are timed after


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
        return drafting(prior_costs(), drafter, None)
    base = stored_costs(model, drafter, name)
    fix = corrections(model)
    if fix is None:
        return base
    return fix.costs(base, drafter.key if drafter is not None else None)


def stored_costs(model, drafter, name: str) -> Costs:
    """``machine_costs`` as stored, before the rounds correct them."""
    entry = config.tuned_entry(model) if model.drafters else None
    if entry is not None:
        tuned = Costs.from_dict(entry["costs"])
        if name == "mtp":
            return tuned
        return drafting(
            tuned, drafter, (entry["costs"].get("drafters") or {}).get(name)
        )
    found = None
    if os.environ.get("MLX_MTP_COSTS") != "prior":
        found = measured_entry(model)
    if found is None:
        return drafting(prior_costs(config.compute_bound()), drafter, None)
    measured = Costs([float(x) for x in found["verify"]], [0.08])
    key = drafter.key if drafter is not None else name
    return drafting(measured, drafter, found["draft"].get(key), replace=True)


def probe_key(model) -> Dict[str, Any]:
    """What the probe's entry (and the rounds' corrections) are kept under:
    the machine (its BLAS and the libraries preloaded) and the model's
    files (with their stamp)."""
    return entry_key(
        {"machine": config.costs_machine(), "model": config.costs_identity(model)}
    )


def corrections(model) -> Optional[RoundCosts]:
    """``model``'s round-time corrections (``round_costs``) in this process,
    from what earlier processes stored under the probe's key; None where
    costs are not measured (``MLX_MTP_COSTS=prior``, several processes)."""
    if os.environ.get("MLX_MTP_COSTS") == "prior" or config.sharded(model):
        return None
    found = getattr(model, "_round_costs", None)
    if found is None:
        key = probe_key(model)
        entry = next((e for e in read_entries() if entry_key(e) == key), {})
        measured = getattr(model, "_measured_costs", None) or {}
        step = measured.get("step_ms")
        found = RoundCosts(
            entry.get("rounds"), float(step) / 1e3 if step else None
        )
        found.corrected = lambda drafter: machine_costs(model, drafter)
        found.save = lambda: save_corrections(model)
        object.__setattr__(model, "_round_costs", found)
    return found


def save_corrections(model) -> None:
    """Store ``model``'s corrections in the probe's entry, where the rounds
    added to them (a stream leaves the loop: ``Decoder.remove``)."""
    fix = getattr(model, "_round_costs", None)
    if fix is None or not fix.dirty:
        return
    fix.dirty = False
    key = probe_key(model)
    entries = read_entries()
    entry = next((e for e in entries if entry_key(e) == key), None) or dict(key)
    write_entry(entries, {**entry, "rounds": fix.to_dict()})


def measured_entry(model) -> Optional[Dict[str, Any]]:
    """The stored measurement for ``model`` here, measured and stored now
    when there is none (None where it cannot be measured)."""
    cached = getattr(model, "_measured_costs", None)
    if covers(cached, model):
        return cached
    found = stored_or_timed(model, probe_key(model), lambda: measure(model))
    object.__setattr__(model, "_measured_costs", found)
    return found


def measure(model) -> Optional[Dict[str, Any]]:
    """Time the parts of a round on ``model`` (see the module's docstring):
    ``{"verify": [1..DEPTHS + 1 tokens], "draft": {name: [k = 1..DEPTHS]}}``
    in plain steps, with the plain step's milliseconds and the measurement's
    own seconds; None where the caches cannot be brought back to time from
    one point."""
    tic = time.perf_counter()
    vocab = model.target.embed_tokens.weight.shape[0]
    context = [(7 * i + 3) % min(vocab, 256) for i in range(CONTEXT)]
    stream = start_stream(model, context, ExactMatchVerifier(), None, max_tokens=2)
    view = Decoder(model, merge=False)
    view.add([stream])
    view.read_chunk([context], [0], CONTEXT)  # all but the last: y
    found = time_parts(model, view, stream)
    view.remove([stream])
    if found is not None:
        found["seconds"] = round(time.perf_counter() - tic, 3)
    return found
