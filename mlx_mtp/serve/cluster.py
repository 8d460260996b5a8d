"""One server over several processes (``mlx.launch``): rank 0 listens, every
rank runs the engine's turns in lockstep.

Rank 0 runs the HTTP server and decides each turn of the engine's loop
(``engine.py``): which requests leave (their clients went away), which start
(their prompt tokens and their ``GenerationRequest``), how many prompt-cache
entries are left at each lookup, the round's draft length, and whether the
running requests end now (shutdown). That ``Plan`` reaches the other ranks in
one ``all_gather`` before the turn (their rows carry back how many turns
failed there), and every rank then runs the same turn on its shard of the
model: the same prompt chunks, the same batched round. Whatever else a turn
does follows from its tokens, the same on every rank: draft sources, stop
strings, constraints (built from the request on each rank), the prompt
cache's lookups. One more ``all_gather`` per round (``Agreement``) makes rank
0's tokens every rank's, as ``distributed.SyncedVerifier`` does for
``generate``.

A process that dies is seen at once through a TCP connection from each rank
to rank 0 (``ranks.Liveness``): MLX's ring backend fails the first
collective with a dead peer after about a second and may wait for ever in
the next one, so the engine cannot be relied on to notice. Rank 0 then
answers 503 to the running and new requests and exits 1; the other ranks
exit 1. ``ranks.handshake`` starts it all.
"""

import dataclasses
import pickle
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np
from starlette.responses import JSONResponse

from ..distributed import PeerLost, gather
from ..errors import MTPError
from ..prompt_cache import PromptCache
from .app import run
from .engine import Engine, EngineJob, Event, Request
from .ranks import Liveness, exit_soon
from .service import Service, engine_request

PLAN_BYTES = 2048  # a turn's plan travels in one row this long, when it fits
# after a failed turn, how long the line to the other ranks may take to say
# that one of them died (the failure was then its garbage collective)
LOST_WAIT = 2.0


@dataclass
class Plan:
    """What rank 0 decided for one turn of the engine's loop."""

    turn: int = 0
    stop: bool = False  # the server is done: every rank ends
    reset: bool = False  # rank 0 failed before the turn: every rank starts afresh
    cancel: List[int] = field(default_factory=list)  # ids of requests that leave
    joins: List[Tuple[int, List[int], object]] = field(default_factory=list)
    fetches: List[int] = field(default_factory=list)  # cache entries at each lookup
    entries: int = 0  # prompt-cache entries once the joins started
    k: int = 0  # the round's draft length (adaptive policy)
    end: bool = False  # the shutdown's time is up: every request ends now


@dataclass
class ClusterStats:
    """The collectives serving adds, and the time they take (``/health``)."""

    turns: int = 0
    rounds: int = 0
    plans: int = 0  # plan collectives (more than turns when a plan is long)
    plan_time: float = 0.0
    decisions: int = 0  # one per round
    decision_time: float = 0.0
    turn_time: float = 0.0  # turns that did work, idle waits left out

    def to_dict(self) -> dict:
        def ms(seconds: float, n: int) -> float:
            return round(1e3 * seconds / n, 3) if n else 0.0

        added = self.plan_time + self.decision_time
        return {
            "turns": self.turns,
            "rounds": self.rounds,
            "plan_collectives": self.plans,
            "plan_ms": ms(self.plan_time, self.plans),
            "decision_collectives": self.decisions,
            "decision_ms": ms(self.decision_time, self.decisions),
            "collectives_per_round": round(
                (self.plans + self.decisions) / self.rounds, 3
            )
            if self.rounds
            else 0.0,
            "turn_ms": ms(self.turn_time, self.turns),
            "collective_share": round(added / self.turn_time, 4)
            if self.turn_time
            else 0.0,
        }


class Channel:
    """Rank 0's plan to every rank, every rank's status to all: one
    ``all_gather`` of fixed rows; a longer plan (long prompts) sends the rest
    in one more."""

    def __init__(self, group, stats: ClusterStats):
        self.group, self.stats = group, stats

    def exchange(self, data: bytes, status: int) -> Tuple[bytes, List[int]]:
        row = np.zeros(8 + PLAN_BYTES, np.uint8)
        row[:8] = np.frombuffer(np.array([len(data), status], "<u4").tobytes(), "u1")
        head = data[:PLAN_BYTES]
        row[8 : 8 + len(head)] = np.frombuffer(head, np.uint8)
        tic = time.perf_counter()
        rows = gather(row, self.group)
        header = rows[:, :8].copy().view("<u4")
        n, statuses = int(header[0, 0]), [int(s) for s in header[:, 1]]
        payload = rows[0, 8 : 8 + min(n, PLAN_BYTES)].tobytes()
        self.stats.plans += 1
        if n > PLAN_BYTES:
            rest = np.zeros(n - PLAN_BYTES, np.uint8)
            if data:
                rest[:] = np.frombuffer(data[PLAN_BYTES:], np.uint8)
            payload += gather(rest, self.group)[0].tobytes()
            self.stats.plans += 1
        self.stats.plan_time += time.perf_counter() - tic
        return payload, statuses


class Agreement:
    """Every rank keeps rank 0's tokens of a batched round: one ``all_gather``
    of each rank's ``[n, emitted, drafts]`` per stream (``rounds.verify``'s
    ``agree`` hook, the batched ``SyncedVerifier``). Drafts that differ from
    rank 0's (the ranks' heads disagree) stop the round on every rank."""

    def __init__(self, group, stats: ClusterStats):
        self.group, self.stats = group, stats

    def __call__(self, emitted: List[List[int]], drafts) -> List[List[int]]:
        width = 1 + max(len(d) for d in drafts)
        tokens = [x.token for d in drafts for x in d]
        proposed = mx.concatenate(tokens).tolist() if tokens else []
        row, at = [], 0
        for e, d in zip(emitted, drafts):
            mine = proposed[at : at + len(d)]
            at += len(d)
            row += [len(e)] + e + [-1] * (width - len(e))
            row += mine + [-1] * (width - 1 - len(d))
        tic = time.perf_counter()
        rows = gather(np.array(row, np.int32), self.group).tolist()
        self.stats.decisions += 1
        self.stats.decision_time += time.perf_counter() - tic
        size = 2 * width
        out = []
        for b in range(len(emitted)):
            ours = rows[0][b * size : (b + 1) * size]
            if any(r[b * size + 1 + width : (b + 1) * size] != ours[1 + width :]
                   for r in rows):  # fmt: skip
                raise MTPError(
                    "the processes drafted different tokens (different MLX "
                    "versions or hardware?); run the same setup everywhere or "
                    "serve with --draft-max 0"
                )
            out.append(ours[1 : 1 + ours[0]])
        return out


class SharedLength:
    """The batch's draft length policy on every rank: rank 0's own policy
    (``inner``) picks each round's length when it plans the turn, and every
    rank's decoder takes that length."""

    def __init__(self, inner=None):
        self.inner = inner
        self.k = 0
        self.chosen: Dict[int, int] = {}

    def choose(self, batch: int, rates, caps: List[int]) -> int:
        k = min(self.k, max(caps, default=0))
        self.chosen[k] = self.chosen.get(k, 0) + 1
        return k

    def record(self, batch: int, k: int, seconds: float) -> None:
        if self.inner is not None:  # times measured on rank 0
            self.inner.record(batch, k, seconds)


class SharedPromptCache(PromptCache):
    """The prompt cache, kept alike on every rank.

    Entries are bounded by bytes, and a rank's bytes depend on its shard, so
    only rank 0 evicts by bytes; it records how many entries it holds at each
    lookup and the other ranks keep as many (the newest: every rank inserts
    and looks up in the same order and evicts the oldest first, so rank 0's
    entries are always the newest of another rank's).
    """

    def __init__(self, max_entries: int, max_bytes: int, leader: bool):
        if not leader and max_bytes > 0:
            max_bytes = 1 << 62
        super().__init__(max_entries, max_bytes)
        self.leader = leader
        self.counts: List[int] = []  # rank 0: recorded; others: to follow

    def fetch(self, model, tokens):
        if self.leader:
            self.counts.append(len(self.entries))
        else:
            self.keep(self.counts.pop(0))
        return super().fetch(model, tokens)

    def keep(self, n: int) -> None:
        del self.entries[: max(0, len(self.entries) - n)]


def _wire(params) -> object:
    """A request's settings as they travel: its logits processors are built
    again from them on each rank (``service.engine_request``)."""
    return dataclasses.replace(params, logits_processors=[])


class LostGuard:
    """ASGI middleware: once a rank is lost, every request gets a 503, and an
    answer the engine failed (500) becomes one."""

    def __init__(self, app, engine: "ClusterEngine"):
        self.app, self.engine = app, engine

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.engine.lost is not None:
            body = {"error": {"message": self.engine.lost, "type": "server_error",
                              "param": None, "code": "unavailable"}}  # fmt: skip
            return await JSONResponse(body, status_code=503)(scope, receive, send)

        async def sending(message):
            lost = self.engine.lost is not None
            if lost and message["type"] == "http.response.start":
                if message["status"] == 500:
                    message = {**message, "status": 503}
            await send(message)

        return await self.app(scope, receive, sending)


class ClusterEngine(Engine):
    """The serving engine on one rank of several: rank 0 plans each turn and
    serves HTTP (``start``/``stop`` as ``Engine``); the others ``follow``."""

    reads_media = False  # the plan ships prompts as token ids

    def __init__(self, model, tokenizer, config, group, liveness: "Liveness"):
        if config is not None and config.prompt_cache_dir is not None:
            raise MTPError("a prompt cache on disk serves one process, not several")
        super().__init__(model, tokenizer, config)
        self.group, self.liveness = group, liveness
        self.leader = group.rank() == 0
        self.prompt_cache = SharedPromptCache(
            config.prompt_cache_entries, config.prompt_cache_bytes, self.leader
        )
        self.stats = ClusterStats()
        self.channel = Channel(group, self.stats)
        self.ids: Dict[int, int] = {}  # id(request) -> its number on every rank
        self.next_id = 0
        self.failures = 0  # turns that raised here (compared with rank 0's)
        self.failed = False
        self.live: Dict[int, Request] = {}  # rank 0: requests not answered yet
        self.lost: Optional[str] = None
        self.on_lost: Callable[[str], None] = lambda message: None
        self._lock = threading.Lock()
        self._done = False
        self._share()
        liveness.on_lost = self._peer_lost

    guard = LostGuard  # the app's middleware: 503 once a rank is lost

    def _share(self) -> None:
        """What makes the decoder's rounds the same on every rank."""
        self.decoder.agree = Agreement(self.group, self.stats)
        if self.decoder.policy is not None:
            inner = self.decoder.policy if self.leader else None
            self.decoder.policy = SharedLength(inner)

    def describe(self) -> Dict[str, object]:
        info = super().describe()
        sharding = self.model.sharding
        info["cluster"] = {
            "processes": sharding.size,
            "sharding": sharding.mode,
            **self.stats.to_dict(),
        }
        return info

    # -- rank 0: the HTTP side ---------------------------------------------------

    def submit(self, request: Request) -> None:
        key, emit = id(request), request.emit

        def tracked(event: Event) -> None:
            if event.finish_reason is not None or event.error is not None:
                self.live.pop(key, None)
            emit(event)

        request.emit = tracked
        self.live[key] = request
        if self.lost is not None:
            tracked(Event(error=self.lost))
            return
        super().submit(request)

    # -- rank 0: the loop ---------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                self._take(block=not self.busy())
                tic = time.perf_counter()
                stop = self._stopping and not self.busy()
                idle = self.idle  # as the last turn left it
                plan, data = self._plan_turn(stop)
                if idle:  # the others wait on their line to rank 0
                    self.liveness.wake()
                _, statuses = self.channel.exchange(data, self.failures)
                if any(s != self.failures for s in statuses):
                    raise PeerLost("a process failed a turn that rank 0 did not")
                if stop:
                    break
                if not plan.reset:
                    self._turn(plan)
                self.stats.turn_time += time.perf_counter() - tic
        except PeerLost as e:
            # the line to a rank that died names it (``Liveness``); under load
            # the collective failed first, and the answers said no rank
            self._peer_gone()
            self.lose(f"a process of this server stopped ({e})")
        finally:
            mx.synchronize()
            mx.clear_streams()

    def _plan_turn(self, stop: bool) -> Tuple[Plan, bytes]:
        """This turn's plan, and as it travels; rank 0 drops and starts its
        requests as it plans."""
        plan = Plan(turn=self.stats.turns, stop=stop)
        if stop:
            self._done = True  # the other ranks' connections close from here
            return plan, pickle.dumps(plan)
        try:
            self._admit_here(plan)
            plan.k = self._draft_length()
            plan.end = self._deadline is not None and time.monotonic() >= self._deadline
            return plan, pickle.dumps(plan)
        except Exception as e:  # a bug must not take the server down
            traceback.print_exc(file=sys.stderr)
            self._fail_all(f"{type(e).__name__}: {e}")
            plan = Plan(turn=plan.turn, reset=True)
            return plan, pickle.dumps(plan)

    def _admit_here(self, plan: Plan) -> None:
        active = list(self.waiting) + list(self.reading.values())
        requests = [j.request for j in active + list(self.jobs.values())]
        gone = {id(r) for r in requests if r.cancelled}
        plan.cancel = [self.ids[i] for i in gone if i in self.ids]
        self._drop_cancelled(lambda r: id(r) in gone)
        for key in gone:
            self.live.pop(key, None)
        for job in list(self.waiting)[: max(0, self.free_slots())]:
            request = job.request
            self.ids[id(request)] = self.next_id
            plan.joins.append((self.next_id, request.prompt, _wire(request.params)))
            self.next_id += 1
        self.prompt_cache.counts = []
        self.admit()
        plan.fetches = self.prompt_cache.counts
        plan.entries = len(self.prompt_cache)

    def _draft_length(self) -> int:
        """The draft length rank 0's policy picks for this turn's round: the
        batch it will decode is the one decoding now plus the prompts whose
        last chunk is read this turn (as ``read`` reads them)."""
        policy = self.decoder.policy
        if policy is None or policy.inner is None:
            return 0
        streams = list(self.decoder.streams) + self.finishing()
        if not streams:
            return 0
        caps = [self.decoder.cap(s) for s in streams]
        rates = [s.source.rates() for s in streams]
        return policy.inner.choose(len(streams), rates, caps)

    # -- every rank ------------------------------------------------------------------

    def _turn(self, plan: Plan) -> None:
        """The part of a turn every rank runs alike: prompt chunks, a round,
        and the end of every request when the shutdown's time is up."""
        if isinstance(self.decoder.policy, SharedLength):
            self.decoder.policy.k = plan.k
        try:
            if self.reading:
                self.read()
            if self.jobs:
                self._round()
                self.stats.rounds += 1
            if plan.end:
                self._end_all()
        except PeerLost:
            raise
        except Exception as e:  # the same on every rank: each starts afresh
            if self._peer_gone():
                raise PeerLost(self.lost) from None
            traceback.print_exc(file=sys.stderr)
            self._fail_all(f"{type(e).__name__}: {e}")
        self.stats.turns += 1
        active = {id(j.request) for j in self.reading.values()}
        active |= {id(j.request) for j in self.jobs.values()}
        self.ids = {k: v for k, v in self.ids.items() if k in active or k in self.live}

    def _peer_gone(self, wait: float = LOST_WAIT) -> bool:
        """Whether a rank is lost. A collective with a dead ring peer returns
        garbage (which then fails a check) about as soon as the line to that
        rank says it closed, so a failed turn gives the line ``wait`` seconds."""
        deadline = time.monotonic() + wait
        while self.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.lost is not None

    def _fail_all(self, message: str) -> None:
        super()._fail_all(message)
        self.failures += 1
        self.failed = True  # (another rank may not have: no idle wait)
        self._share()  # the decoder is new

    @property
    def idle(self) -> bool:
        """Nothing is being read or decoded: the same on every rank between
        turns. Then the other ranks wait for rank 0 on their line to it (a
        thread asleep), not in a collective: MLX's ring backend polls while
        it waits, a fifth of a core here."""
        return not (self.reading or self.jobs)

    # -- the other ranks ------------------------------------------------------------

    def follow(self, build: Callable[[List[int], object], Request]) -> None:
        """Run rank 0's turns until it stops the server (``build``: a request
        from its prompt and settings, constraints and all). ``PeerLost`` when
        rank 0 or another rank is gone."""
        while True:
            if self.idle and not self.failed:
                self.liveness.wait_wake()
            self.failed = False
            data, _ = self.channel.exchange(b"", self.failures)
            plan: Plan = pickle.loads(data)
            if plan.stop:
                self._done = True
                return
            if plan.reset:
                self._fail_all("rank 0 started afresh")
                self.failed = False  # as rank 0 did: the next wait is as usual
                continue
            try:
                self._admit_there(plan, build)
            except Exception as e:
                traceback.print_exc(file=sys.stderr)
                self._fail_all(f"{type(e).__name__}: {e}")
                continue
            self._turn(plan)

    def _admit_there(self, plan: Plan, build) -> None:
        gone = set(plan.cancel)
        self._drop_cancelled(lambda r: self.ids.get(id(r)) in gone)
        for number, prompt, params in plan.joins:
            request = build(prompt, params)
            self.ids[id(request)] = number
            self.waiting.append(EngineJob(request, self.tokenizer))
        self.prompt_cache.counts = list(plan.fetches)
        self.admit()
        self.prompt_cache.keep(plan.entries)

    # -- a lost rank ------------------------------------------------------------------

    def _peer_lost(self, rank: int) -> None:
        if not self._done:
            self.lose(f"rank {rank} of this server stopped")

    def lose(self, message: str) -> None:
        """A rank is gone: every request gets ``message`` (a 503 where its
        answer has not begun), and ``on_lost`` hears it once."""
        with self._lock:
            if self.lost is not None:
                return
            self.lost = message
        for request in list(self.live.values()):
            request.emit(Event(error=message))
        self.on_lost(message)


def serve(model, tokenizer, name: str, config, liveness: Liveness, sock, log) -> None:
    """Serve ``model`` (this rank's shard) with every rank of its group: rank 0
    listens on ``sock`` until interrupted; the others follow it."""
    group = model.sharding.group
    engine = ClusterEngine(model, tokenizer, config, group, liveness)
    try:
        if group.rank() == 0:
            engine.on_lost = exit_soon
            run(
                model, tokenizer, name, config=config, log=log, sock=sock, engine=engine
            )
            return
        service = Service(model, tokenizer, name, config, engine)

        def build(prompt: List[int], params) -> Request:
            return engine_request(service, prompt, params, "prompt", lambda e: None)

        try:
            engine.follow(build)
        except PeerLost as e:
            raise MTPError(f"rank 0 of this server stopped ({e})") from None
        finally:
            mx.synchronize()
            mx.clear_streams()
    finally:
        liveness.close()
