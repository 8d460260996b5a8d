"""``mlx-mtp tune``: what drafting costs and gains for one model on this machine.

Measured for the model as loaded, every timing a median over repetitions that
run each measurement once in turn (so drift on a busy machine hits all alike):

- the plain decode step as the loop runs it (one step ahead, like mlx-lm): the
  unit of every cost below;
- ``c_verify(T)``, ``T = 1..K+1``: the trunk's forward over ``T`` tokens with a
  warm cache, as a verify pass runs it (per-token states kept where the
  caches keep them);
- ``c_draft(k)``, ``k = 1..K``: the head's ``k`` drafts (depth 1 with its
  catch-up over two positions, then the chained depths);
- ``round(k)``, ``k = 0..K``: a whole round, the loop's own
  (``Decoder.step``: the drafts, the verify pass and its one host sync, the
  rollback);
- the per-depth acceptance on the shipped prompts (code, prose, chat), drafting
  ``K`` each round;
- for a head without a draft vocabulary: the acceptance and draft cost with
  the most frequent tokens only, kept when it raises the bound.

The result goes into the MTP config beside the model (``mtp_config.json``,
under ``tuned``) with what identifies the machine (device, backend, BLAS, MLX
version) and the model's files, so that an entry made elsewhere is ignored.
``CostAwareDraft`` then starts from it.
"""

import statistics
import time
from datetime import datetime, timezone
from typing import Any, Callable, Dict, List, Optional, Sequence

import mlx.core as mx

from .adaptive import Costs, FixedDraft, speedups
from .cache import start_verify
from .config import cached_identity, machine
from .decoder import Decoder
from .defaults import DEFAULT_PREFILL_STEP, DEFAULT_TUNE_REPEATS, DEFAULT_TUNE_TOKENS
from .drafts import AutoDrafts, ModelDrafts
from .errors import MTPError
from .loader import MTPModel
from .prompts import encoded_prompts, load_prompts
from .sampling import make_verifier
from .speculative import read_prompt, speculative_generate_step
from .stats import MTPStats
from .stream import start_stream
from .timing import PartTimer

PLAIN_STEPS = 8  # plain steps per timing of the plain step
# Candidate draft vocabularies for a head that has none: the most frequent
# tokens, at sizes below half the vocabulary.
DRAFT_VOCAB_SIZES = (4096, 8192, 16384, 32768)
# The least an entry is stored from: later runs start their acceptance from it
# as if it were several tests (adaptive.PRIOR_WEIGHT) whatever its size, so it
# must hold. 24 depth-1 tests put the acceptance within about 0.1 (one
# standard error); a median of fewer than 3 timings is no median.
MIN_STORED_TESTS = 24
MIN_STORED_REPEATS = 3


# -- timing --------------------------------------------------------------------


class _State:
    """A warm cache position to time from: a stream after ``context`` (its
    prompt read, one plain round run, so the head's next draft catches up
    over two positions, as after a round that kept one token), the decoding
    loop it runs in, and the snapshot every timed part starts from
    (``restore``, before each part, untimed)."""

    def __init__(self, model: MTPModel, context: List[int], k_max: int, progress=None):
        self.model, self.drafter = model, model.drafters[0]
        # every drafter reads along, so that each can be timed from here
        reading = [
            ModelDrafts(FixedDraft(0, draft_max=max(k_max, d.max_drafts)), d.name)
            for d in model.drafters
        ]
        self.stream = start_stream(
            model,
            context[:-1],
            make_verifier(),  # greedy
            reading[0] if len(reading) == 1 else AutoDrafts(reading, None),
            max_tokens=1 << 30,
        )
        self.decoder = Decoder(model, merge=False)
        self.decoder.add([self.stream])
        read_prompt(self.decoder, self.stream, 0, DEFAULT_PREFILL_STEP, progress)
        self.decoder.step()
        self.decoder.remove([self.stream])  # (a plain round run ahead goes back)
        self.cache = self.stream.cache
        self.history = list(self.stream.history)
        self.snapshot = self.cache.snapshot()
        if self.snapshot is None:
            raise MTPError("this model's caches cannot be brought back: cannot time")
        self.restore()

    @property
    def y(self) -> int:
        return self.history[-1]

    def restore(self, source=None) -> None:
        """Back to the snapshot, in a new loop; the stream drafts from
        ``source`` next (None: as it did)."""
        self.decoder.remove([self.stream])
        self.cache.restore(self.snapshot)
        s = self.stream
        s.history, s.generated, s.done = list(self.history), 0, False
        s.max_tokens = 1 << 30
        s.source = source if source is not None else s.source
        self.decoder = Decoder(self.model, merge=False)
        self.decoder.add([s])


def _warm_state(model: MTPModel, context: List[int], k_max: int, progress=None):
    return _State(model, context, k_max, progress)


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _time(fn: Callable[[], Any], clock: str = "wall") -> float:
    now = CLOCKS[clock]
    tic = now()
    fn()
    return now() - tic


def _verify(state: _State, t: int) -> None:
    """The trunk's forward over ``t`` tokens, as a verify pass runs it."""
    trunk = state.cache.trunk
    tokens = [state.y] + state.history[-t:-1] if t > 1 else [state.y]
    if t > 1:
        start_verify(trunk)
    logits, hidden = state.model.target(mx.array(tokens)[None], trunk)
    mx.eval(mx.argmax(logits, axis=-1), hidden)


def _draft(state: _State, k: int, drafter=None) -> None:
    """The proposal of ``k`` drafts (its catch-up included) of ``drafter``
    (None: the first, the head where there is one)."""
    drafter = drafter or state.drafter
    drafts, _ = drafter.propose(state.decoder, [state.stream], [k], 0.0)
    mx.eval([d.token for d in drafts[0]])


def _round_source(state: _State, k: int):
    return ModelDrafts(FixedDraft(k), state.drafter.name)


def _round(state: _State) -> None:
    """A round as the loop runs it (``Decoder.step``), its drafts planned by
    the stream's source (``_round_source``): the drafts, the verify pass and
    its one host sync, the rollback."""
    state.decoder.step()


def _plain_steps(state: _State, n: int) -> None:
    """``n`` rounds without drafts through the loop, each started before the
    previous token is read (the stream ends with the last: none runs on)."""
    state.stream.max_tokens = n
    for _ in range(n):
        state.decoder.step()


class CostTimer:
    """The parts of a round timed from one warm cache position
    (``timing.PartTimer``): plain steps, verifies over 1..k+1 tokens, each
    drafter's proposals, whole rounds.

    ``run_once`` times every part once, in an order that rotates with ``rep``;
    ``costs`` returns the medians in plain steps (``Costs.from_dict`` reads it).
    ``progress(done, total)`` hears ``context`` being read.
    """

    def __init__(self, model: MTPModel, context: List[int], k_max: int, progress=None):
        self.state = state = _warm_state(model, context, k_max, progress)
        jobs = {("plain", 0): lambda: _plain_steps(state, PLAIN_STEPS)}
        sources = {("plain", 0): ModelDrafts(FixedDraft(0))}
        for t in range(1, k_max + 2):
            jobs["verify", t] = lambda t=t: _verify(state, t)
        for k in range(1, k_max + 1):
            jobs["draft", k] = lambda k=k: _draft(state, k)
        for k in range(1, k_max + 1):
            jobs["round", k] = lambda: _round(state)
            sources["round", k] = _round_source(state, k)
        # every other drafter's proposals, up to its own bound (a block drafter
        # drafts a whole block for about the cost of one draft)
        self.others = {d.name: d.max_drafts for d in model.drafters[1:]}
        for d in model.drafters[1:]:
            for k in range(1, d.max_drafts + 1):
                jobs[f"draft:{d.name}", k] = lambda k=k, d=d: _draft(state, k, d)
        self.k_max = k_max
        self.timer = PartTimer(jobs, lambda key: state.restore(sources.get(key)))
        self.timer.warm()

    def run_once(self, rep: int = 0) -> None:
        self.timer.run(rep)

    @property
    def times(self) -> Dict[tuple, List[tuple]]:
        """Each part's ``(wall, cpu)`` seconds, run by run."""
        return self.timer.times

    def costs(self, cpu: bool = False) -> Dict[str, Any]:
        """Medians in plain steps; ``cpu``: of this process's CPU time (a
        measure of work that other jobs on a shared CPU do not stretch)."""
        med = self.timer.medians(cpu)
        step = med["plain", 0] / PLAIN_STEPS
        k_max = self.k_max
        return {
            "step_seconds": step,
            "verify": [med["verify", t] / step for t in range(1, k_max + 2)],
            "draft": [med["draft", k] / step for k in range(1, k_max + 1)],
            "round": [1.0] + [med["round", k] / step for k in range(1, k_max + 1)],
            "drafters": {
                name: [med[f"draft:{name}", k] / step for k in range(1, n + 1)]
                for name, n in self.others.items()
            },
        }


def measure_costs(
    model: MTPModel, context: List[int], k_max: int, repeats: int
) -> Dict[str, Any]:
    """Median costs of the parts of a round, interleaved over ``repeats``."""
    timer = CostTimer(model, context, k_max)
    for rep in range(repeats):
        timer.run_once(rep)
    return timer.costs()


# -- acceptance ------------------------------------------------------------------


def measure_acceptance(
    model: MTPModel,
    prompts: Sequence[List[int]],
    k: int,
    max_tokens: int,
    stop_tokens: Sequence[int] = (),
    drafter: str = "mtp",
) -> tuple:
    """Greedy generations drafting ``k`` every round with ``drafter``: their
    stats and sequences."""
    stats, sequences = MTPStats(), []
    for prompt in prompts:
        one = MTPStats()
        out = [
            t
            for t, _ in speculative_generate_step(
                prompt,
                model,
                max_tokens=max_tokens,
                drafts=ModelDrafts(FixedDraft(k), drafter),
                stop_tokens=stop_tokens,
                stats=one,
            )
        ]
        stats.add(one)
        sequences.append(list(prompt) + out)
    return stats, sequences


def _depths(stats: MTPStats, k: int) -> List[float]:
    """Per-depth acceptance. A deeper depth is reached in fewer rounds: its
    rate is pulled toward the one before it as if two more tests had gone that
    way (three rejections out of three say little)."""
    out: List[float] = []
    for j in range(k):
        kept = stats.accepted_at[j] if j < len(stats.accepted_at) else 0
        tested = stats.drafted_at[j] if j < len(stats.drafted_at) else 0
        if j == 0:
            out.append(kept / tested if tested else 0.0)
        else:
            out.append((kept + 2 * out[-1]) / (tested + 2))
    return out


# -- a draft vocabulary for a head that has none ---------------------------------


def rank_tokens(model: MTPModel, prompts: Sequence[List[int]]) -> mx.array:
    """Token ids, most expected first: by the trunk's mean next-token
    probability over every position of the prompts (the answers are left out,
    so that the acceptance measured on them is not flattered)."""
    total = 0
    for prompt in prompts:
        logits, _ = model.target(mx.array(prompt)[None], model.target.make_cache())
        total = total + mx.softmax(logits[0].astype(mx.float32), axis=-1).sum(axis=0)
    return mx.argsort(-total).astype(mx.int32)


def depth1_hits(
    model: MTPModel, sequences: Sequence[List[int]], prompt_lens: Sequence[int]
) -> List[mx.array]:
    """Per sequence: the head's depth-1 logits at every answer position, and
    the token there (the trunk's greedy choice), teacher-forced."""
    out = []
    for seq, n in zip(sequences, prompt_lens):
        tokens = mx.array(seq)[None]
        _, taps = model.target.forward(tokens, model.target.make_cache())
        hidden = model.drafters[0].features(taps)  # the head's drafter is the first
        logits, _ = model.head(hidden[:, :-1], tokens[:, 1:], model.head.make_cache())
        first = max(n - 2, 0)  # row i predicts token i + 2
        out.append((logits[0, first:-1], mx.array(seq[first + 2 :])))
    return out


def subset_acceptance(rows, vocab: Optional[mx.array]) -> float:
    """Depth-1 acceptance when drafting from ``vocab`` only (None: all tokens)."""
    hits = n = 0
    for logits, targets in rows:
        if vocab is None:
            drafts = mx.argmax(logits, axis=-1)
        else:
            drafts = vocab[mx.argmax(mx.take(logits, vocab, axis=-1), axis=-1)]
        hits += (drafts == targets).sum().item()
        n += targets.size
    return hits / max(n, 1)


def draft_vocab_trial(
    model: MTPModel,
    state: "_State",
    prompts: Sequence[List[int]],
    sequences: Sequence[List[int]],
    sizes: Sequence[int],
    k_max: int,
    repeats: int,
    clock: str = "wall",
) -> List[Dict[str, Any]]:
    """For each size (None: the whole vocabulary): depth-1 acceptance on the
    answers and the head's draft costs in seconds, interleaved."""
    ranked = rank_tokens(model, prompts)
    rows = depth1_hits(model, sequences, [len(p) for p in prompts])
    trials = [{"size": None, "vocab": None}]
    trials += [{"size": n, "vocab": mx.sort(ranked[:n])} for n in sizes]
    times = {i: {k: [] for k in range(1, k_max + 1)} for i in range(len(trials))}
    try:
        for rep in range(repeats):
            shift = rep % len(trials)
            for i in list(range(shift, len(trials))) + list(range(shift)):
                model.head.set_draft_vocab(trials[i]["vocab"])
                state.restore()
                _draft(state, 1)  # gathers the rows: not timed
                for k in range(1, k_max + 1):
                    state.restore()
                    times[i][k].append(_time(lambda k=k: _draft(state, k), clock))
    finally:
        model.head.set_draft_vocab(None)
    for i, trial in enumerate(trials):
        trial["acceptance_1"] = subset_acceptance(rows, trial["vocab"])
        trial["draft_seconds"] = [statistics.median(times[i][k]) for k in times[i]]
    return trials


def _choose_draft_vocab(entry: Dict[str, Any], trials, step: float) -> None:
    """Keep the draft vocabulary with the best predicted speed-up in ``entry``
    (costs and acceptance made its own), or none when the whole one wins."""
    costs, acceptance = entry["costs"], entry["acceptance_by_depth"]
    full = trials[0]
    best, best_speedup = None, max(entry["speedups"]["rounds"])
    entry["draft_vocab_trials"] = []
    for trial in trials:
        scale = trial["acceptance_1"] / max(full["acceptance_1"], 1e-9)
        extra = [
            (s - f) / step
            for s, f in zip(trial["draft_seconds"], full["draft_seconds"])
        ]
        mine = {
            "verify": costs["verify"],
            "draft": [d + e for d, e in zip(costs["draft"], extra)],
            "round": costs["round"][:1]
            + [r + e for r, e in zip(costs["round"][1:], extra)],
        }
        accept = [
            min(a * scale, 1.0) if j == 0 else a for j, a in enumerate(acceptance)
        ]
        speedup = max(speedups(accept, Costs.from_dict(mine), len(costs["draft"])))
        entry["draft_vocab_trials"].append(
            {
                "size": trial["size"],
                "acceptance_1": round(trial["acceptance_1"], 4),
                "draft": [round(d, 4) for d in mine["draft"]],
                "speedup": round(speedup, 4),
            }
        )
        if trial["size"] is not None and speedup > best_speedup * 1.01:
            best, best_speedup = (trial, mine, accept), speedup
    if best is not None:
        trial, mine, accept = best
        entry["draft_vocab"] = trial["vocab"].tolist()
        entry["costs"] = {
            **{k: [round(x, 4) for x in v] for k, v in mine.items()},
            "drafters": entry["costs"].get("drafters", {}),
        }
        entry["acceptance_by_depth"] = [round(a, 4) for a in accept]
        entry["speedups"] = _predicted(accept, entry["costs"], len(accept))


# -- the whole tune ---------------------------------------------------------------


def tune(
    model: MTPModel,
    tokenizer,
    draft_max: int,
    max_tokens: int = DEFAULT_TUNE_TOKENS,
    repeats: int = DEFAULT_TUNE_REPEATS,
    progress: Optional[Callable[[str], None]] = None,
    vocab_sizes: Optional[Sequence[int]] = None,
    clock: str = "wall",
) -> Dict[str, Any]:
    """Measure ``model`` on this machine; returns the entry ``store_tuned`` writes.

    ``clock="cpu"`` times this process's CPU time instead of wall time: on a
    CPU shared with other jobs the work done, which their load does not
    stretch (with one BLAS thread; spinning BLAS threads would add to it).

    A head without a draft vocabulary is also tried with the ``vocab_sizes``
    most expected tokens (default: ``DRAFT_VOCAB_SIZES`` below half the
    vocabulary); the best goes into the entry when it raises the bound.
    """
    if not model.drafters:
        raise MTPError("this model has no MTP head and no drafter: nothing to tune")
    if draft_max < 1:
        raise MTPError("tune needs a draft-max of at least 1")
    say = progress or (lambda msg: None)
    tic = time.perf_counter()
    first = {}
    for p in load_prompts():  # one prompt of each kind
        first.setdefault(p.kind, p)
    prompts = encoded_prompts(tokenizer, list(first.values()))
    stops = list(getattr(tokenizer, "eos_token_ids", ()) or ())

    say(f"acceptance: {len(prompts)} prompts, {max_tokens} tokens, {draft_max} drafts")
    first_drafter = model.drafters[0]
    draft_max = min(draft_max, first_drafter.max_drafts)
    stats, sequences = measure_acceptance(
        model, prompts, draft_max, max_tokens, stops, first_drafter.name
    )
    acceptance = _depths(stats, draft_max)
    others = {}
    for d in model.drafters[1:]:
        say(f"acceptance of {d.name}: {d.max_drafts} drafts")
        found, _ = measure_acceptance(
            model, prompts, d.max_drafts, max_tokens, stops, d.name
        )
        others[d.name] = _depths(found, d.max_drafts)
    say(f"costs: {repeats} repetitions")
    context = max(sequences, key=len)
    timer = CostTimer(model, context, draft_max)
    for rep in range(repeats):
        timer.run_once(rep)
    costs = timer.costs(cpu=clock == "cpu")
    entry: Dict[str, Any] = {
        "machine": machine(),
        "model": cached_identity(model),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "draft_max": draft_max,
        "clock": clock,
        "step_ms": round(costs["step_seconds"] * 1e3, 3),
        "costs": {
            k: [round(x, 4) for x in costs[k]] for k in ("verify", "draft", "round")
        },
        "acceptance_by_depth": [round(a, 4) for a in acceptance],
        "tokens": stats.generation_tokens,
        "tests": stats.drafted_at[0] if stats.drafted_at else 0,
        "repeats": repeats,
    }
    entry["speedups"] = _predicted(acceptance, entry["costs"], draft_max)
    _drafter_entries(entry, first_drafter, acceptance, costs, others)
    vocab = model.target.embed_tokens.weight.shape[0]
    if vocab_sizes is None:
        vocab_sizes = [n for n in DRAFT_VOCAB_SIZES if 2 * n <= vocab]
    takes_vocab = getattr(model.head, "takes_draft_vocab", model.head is not None)
    if vocab_sizes and takes_vocab and "draft_vocab" not in model.head.layer(0):
        say(f"draft vocabulary: {', '.join(map(str, vocab_sizes))} tokens")
        trials = draft_vocab_trial(
            model,
            timer.state,
            prompts,
            sequences,
            vocab_sizes,
            draft_max,
            repeats,
            clock,
        )
        _choose_draft_vocab(entry, trials, costs["step_seconds"])
    entry["seconds"] = round(time.perf_counter() - tic, 1)
    return entry


def _drafter_entries(entry, first, acceptance, costs, others) -> None:
    """Each drafter but the head, under its name: its draft costs
    (``costs.drafters``, what ``adaptive.machine_costs`` reads), its per-depth
    acceptance (``drafters_acceptance``) and its predicted speed-up per count
    (``drafter_speedups``, verify costs extended past those measured)."""
    drafts = {name: list(c) for name, c in costs["drafters"].items()}
    accept = dict(others)
    if first.name != "mtp":  # the first drafter is no head: it is one of them
        drafts[first.name], accept[first.name] = list(costs["draft"]), acceptance
    entry["costs"]["drafters"] = {
        name: [round(x, 4) for x in c] for name, c in drafts.items()
    }
    entry["drafters_acceptance"] = {
        name: [round(a, 4) for a in rates] for name, rates in accept.items()
    }
    entry["drafter_speedups"] = {
        name: [
            round(x, 4)
            for x in speedups(
                accept[name], Costs(costs["verify"], drafts[name]), len(drafts[name])
            )
        ]
        for name in drafts
    }


def too_small(entry: Dict[str, Any]) -> Optional[str]:
    """Why ``entry`` is too small a sample to store, or None when it holds."""
    tests, repeats = entry.get("tests", 0), entry.get("repeats", 0)
    short = []
    if tests < MIN_STORED_TESTS:
        short.append(f"{tests} depth-1 drafts checked (at least {MIN_STORED_TESTS})")
    if repeats < MIN_STORED_REPEATS:
        short.append(f"each part timed {repeats}x (at least {MIN_STORED_REPEATS}x)")
    return "; ".join(short) or None


def _predicted(acceptance, costs: Dict[str, List[float]], k_max: int) -> Dict:
    """The bound per draft count, from the parts and from whole rounds."""
    parts = Costs(costs["verify"], costs["draft"])
    rounds = Costs.from_dict(costs)
    return {
        "bound": [round(s, 4) for s in speedups(acceptance, parts, k_max)],
        "rounds": [round(s, 4) for s in speedups(acceptance, rounds, k_max)],
    }
