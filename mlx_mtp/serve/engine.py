"""The serving engine: one thread that owns the model and runs every request.

It is the library's scheduler (``mlx_mtp.scheduler``, which ``batch_generate``
runs too) in a thread. Each turn of its loop

1) takes new requests, and drops cancelled ones (their state is freed);
2) starts waiting requests while the batch has room: each gets the prompt
   cache's best entry for its prompt;
3) reads one chunk of the started prompts, together, in one forward; a
   stream whose prompt is read joins the decoding batch;
4) runs one speculative round of the whole batch and turns each stream's
   tokens into text: end-of-sequence tokens, ``max_tokens`` and stop strings
   finish a stream, which leaves the batch and leaves its cache to the
   prompt cache, and its prompt and answer to the lookup memory that later
   requests draft from (``ngram.LookupMemory``). Every drafting round also
   tells ``adaptive.AcceptanceHistory`` what the drafter's drafts were worth:
   later requests start their acceptance there. What the rounds' times
   corrected of the stored costs (``round_costs``) is written to disk when
   the engine is idle, at most every ``STORE_EVERY`` seconds, and when it
   stops.

Models whose caches have no batch form here are served one stream at a time,
through the same decoder (a batch of one).

Events reach the HTTP side through each request's ``emit`` callback, called
on the engine thread.
"""

import logging
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Union

import mlx.core as mx

from .. import round_costs
from ..adaptive import AcceptanceHistory
from ..batch_policy import BatchDraftLength
from ..cache import truncatable
from ..ngram import LookupMemory
from ..disk_cache import DiskCache
from ..prompt import Prompt
from ..prompt_cache import PromptCache
from ..request import GenerationRequest
from ..scheduler import Job, Scheduler
from ..stats import MTPStats
from ..stream import Serving, open_stream
from . import ServeConfig
from .metrics import Metrics, timings

log = logging.getLogger("mlx_mtp.serve")

# When idle, how long the first request waits for others sent with it.
GATHER = 0.02
# The rounds' corrections of the costs (``round_costs``) are stored when the
# engine is idle, at most this often (seconds), and when it stops: never on
# a request's path.
STORE_EVERY = 60.0


@dataclass
class Event:
    """Text to send, and at the end the finish reason and usage (or an error)."""

    text: str = ""
    finish_reason: Optional[str] = None
    usage: Optional[dict] = None
    error: Optional[str] = None
    # (token, logprob, top alternatives) of the tokens behind this event, if asked
    logprobs: List = field(default_factory=list)
    timings: Optional[dict] = None  # at the end: llama-server's ``timings``


@dataclass
class Request:
    """A generation as the engine sees it: a prompt in (token ids, or a
    ``prompt.Prompt`` with media), events out; what to generate is the API's
    ``GenerationRequest``, as it was built."""

    prompt: Union[List[int], Prompt]
    params: GenerationRequest
    emit: Callable[[Event], None]
    cancelled: bool = False


class _Text:
    """A stream's tokens as text: stop strings, and what is safe to send."""

    def __init__(self, tokenizer, stop: List[str]):
        self.detokenizer = tokenizer.detokenizer
        self.detokenizer.reset()
        self.eos = set(getattr(tokenizer, "eos_token_ids", ()) or ())
        self.stop = [s for s in stop if s]
        self.sent = 0  # characters sent
        self.searched = 0  # characters searched for stop strings
        self.tokens = 0
        self.finish: Optional[str] = None
        self.end: Optional[int] = None  # where the text ends (at a stop string)

    def feed(self, tokens: List[int], max_tokens: int) -> str:
        """Take a round's tokens; return the new text that may be sent."""
        d = self.detokenizer
        for t in tokens:
            self.tokens += 1
            if t in self.eos:
                self.finish = "stop"
            else:
                d.add_token(t)
                if self.tokens >= max_tokens:
                    self.finish = "length"
            if self.finish:
                d.finalize()
            if self.stop and self._find_stop(d.text):
                self.finish = "stop"
            if self.finish:
                break
        text = d.text
        end = self.end if self.end is not None else len(text)
        if self.finish is None:
            end -= self._held_back(text)
        out = text[self.sent : max(end, self.sent)]
        self.sent = max(end, self.sent)
        return out

    def flush(self) -> str:
        """End the text here (cut short: "length"); return what was held back."""
        if self.finish is None:
            self.finish = "length"
            self.detokenizer.finalize()
        return self.feed([], self.tokens)

    def _find_stop(self, text: str) -> bool:
        start = max(0, self.searched - max(map(len, self.stop)) + 1)
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        self.searched = len(text)
        if hits:
            self.end = min(hits)
        return bool(hits)

    def _held_back(self, text: str) -> int:
        """Characters at the end of ``text`` that may begin a stop string."""
        held = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), held, -1):
                if text.endswith(s[:n]):
                    held = n
                    break
        return held


class EngineJob(Job):
    """A started request: its stream, its text, and what is left to read."""

    def __init__(self, request: Request, tokenizer):
        super().__init__(request.prompt)
        self.request = request
        self.text = _Text(tokenizer, request.params.stop)
        self.logprobs_sent = 0

    def logprobs(self) -> list:
        """The log-probabilities of the tokens fed to the text since last asked."""
        lp = self.stream.logprobs if self.stream is not None else None
        if lp is None:
            return []
        new = lp.entries[self.logprobs_sent : self.text.tokens]
        self.logprobs_sent += len(new)
        return new


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    reused: int,
    stats: MTPStats,
    reasoning: int = 0,
):
    """OpenAI's ``usage`` (``reasoning``: tokens of thinking), with the MTP
    counts; of a predicted answer's drafts, those kept and those not."""
    predicted, kept = stats.source_counts("prediction")
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": reused},
        "completion_tokens_details": {
            "reasoning_tokens": reasoning,
            "accepted_prediction_tokens": kept,
            "rejected_prediction_tokens": predicted - kept,
        },
        "mtp": {
            "draft_max": stats.draft_max,
            "rounds": stats.rounds,
            "drafted": stats.drafted,
            "accepted": stats.accepted,
            "acceptance_rate": stats.acceptance_rate,
            "mean_accepted_length": stats.mean_accepted_length,
            # of those, the lookups' drafts (the prompt's, a prediction's,
            # the memory's of earlier requests)
            "lookup_drafted": stats.lookup_drafted,
            "lookup_accepted": stats.lookup_accepted,
            # per source of drafts: the head "mtp", a drafter, "lookup",
            # "prediction", "memory"
            "by_source": stats.acceptance_by_source(),
        },
    }


class Engine(Scheduler):
    """Runs requests on ``model`` in a thread of its own (``start``/``stop``)."""

    reads_media = True  # its requests' prompts may hold images (``Prompt``)

    def __init__(self, model, tokenizer, config: Optional[ServeConfig] = None):
        self.config = config = config or ServeConfig()
        if config.kv is not None:
            config.kv.check_model(model)
        super().__init__(
            model,
            self._policy(),
            max_batch=config.max_batch,
            prefill_step=config.prefill_step,
            kv=config.kv,
        )
        self.tokenizer = tokenizer
        self.prompt_cache = PromptCache(
            config.prompt_cache_entries, config.prompt_cache_bytes, self._disk()
        )
        self.memory = None  # recent prompts and answers, that drafts come from
        if config.lookup_memory_bytes > 0:
            self.memory = LookupMemory(config.lookup_memory_bytes)
        self.metrics = Metrics()
        self.inbox: "queue.Queue[Optional[Request]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self._deadline: Optional[float] = None  # streams still running then end
        self.totals = MTPStats()  # of every request finished (``/health``)
        # what each drafter's drafts were worth so far: where a request's starts
        self.history = AcceptanceHistory()
        self._stored = time.monotonic()  # the rounds' corrections, last stored

    def _disk(self) -> Optional[DiskCache]:
        """The prompt cache's entries on disk, where the config asks for them."""
        c = self.config
        if c.prompt_cache_dir is None:
            return None
        return DiskCache(
            c.prompt_cache_dir, c.prompt_cache_disk_bytes, self.model, c.kv, log.warning
        )

    def _policy(self) -> Optional[BatchDraftLength]:
        return BatchDraftLength() if self.config.drafts.adaptive else None

    def notices(self) -> List[str]:
        """What the server says at start of how it holds caches."""
        disk = self.prompt_cache.disk
        out = disk.describe() if disk is not None else []
        kv = self.config.kv
        if kv is None or not kv.active:
            return out
        out.append(f"KV cache: {kv.describe()}")
        if not self.batched:
            out.append(
                "notice: bounded caches (--max-kv-size) have no batch form: "
                "requests are decoded one at a time"
            )
        elif kv.bits is not None and kv.quantized_start > 0:
            out.append(
                "notice: a batch holds its caches in one form: a stream's cache "
                f"turns quantized at token {kv.quantized_start}, or once its "
                "prompt is read if that is shorter"
            )
        return out

    # -- the HTTP side ---------------------------------------------------------

    def submit(self, request: Request) -> None:
        self.inbox.put(request)

    def cancel(self, request: Request) -> None:
        """Stop ``request`` (its client went away); its state is freed."""
        request.cancelled = True
        self.inbox.put(None)  # wake the loop

    def counts(self) -> Dict[str, int]:
        """Streams decoding, prompts being read, requests waiting: those not
        cancelled (the loop frees a cancelled one at its next turn)."""

        def live(jobs) -> int:
            return sum(not j.request.cancelled for j in list(jobs))

        with self.inbox.mutex:  # the inbox also holds the loop's wake-ups (None)
            sent = [r for r in self.inbox.queue if r is not None]
        waiting = [j.request for j in list(self.waiting)] + sent
        return {
            "decoding": live(self.jobs.values()),
            "reading": live(self.reading.values()),
            "waiting": sum(not r.cancelled for r in waiting),
            "peak_batch": self.decoder.peak if self.batched else 1,
        }

    def describe(self) -> Dict[str, object]:
        """How this engine runs (for ``/health``)."""
        c = self.config
        return {
            "mtp": bool(self.model.drafters) and c.drafts.mtp,
            "batched": self.batched,
            "max_batch": c.max_batch if self.batched else 1,
            "draft_policy": "adaptive" if c.drafts.adaptive else "fixed",
            # rounds per draft length so far (adaptive)
            "draft_lengths": dict(getattr(self.decoder.policy, "chosen", {})),
            # the requests finished so far, per source of drafts
            "acceptance_by_source": self.totals.acceptance_by_source(),
            # per drafter and depth, where the next request's acceptance starts
            "acceptance_priors": self.history.priors(),
            "prompt_cache": {
                "entries": len(self.prompt_cache),
                "max_entries": c.prompt_cache_entries,
                "bytes": self.prompt_cache.nbytes,
                "max_bytes": c.prompt_cache_bytes,
                **self._disk_health(),
            },
            "lookup_memory": {
                "sequences": len(self.memory) if self.memory else 0,
                "tokens": self.memory.tokens if self.memory else 0,
                "bytes": self.memory.nbytes if self.memory else 0,
                "max_bytes": c.lookup_memory_bytes,
            },
        }

    def _disk_health(self) -> Dict[str, object]:
        disk = self.prompt_cache.disk
        if disk is None:
            return {}
        return {
            "disk": {
                "folder": str(disk.folder),
                "entries": len(disk.entries),
                "bytes": disk.nbytes,
                "max_bytes": disk.max_bytes,
                "written": disk.written,
                "failed": disk.failed,
                "skipped": dict(disk.skipped),
            }
        }

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mlx-mtp engine")
        self._thread.daemon = True
        self._thread.start()

    def drain(self, seconds: float) -> None:
        """Let the running streams go on for ``seconds`` at most: then each ends
        with ``finish_reason`` "length" (as do requests still waiting)."""
        deadline = time.monotonic() + max(0.0, seconds)
        if self._deadline is None or deadline < self._deadline:
            self._deadline = deadline
        self.inbox.put(None)  # wake the loop

    def stop(self, timeout: float = 30.0) -> None:
        """End every stream now and wait for the engine thread to finish.

        Joining matters: a process that exits while the thread is inside an
        MLX call aborts ("terminate called without an active exception").
        """
        self.drain(0)
        self._stopping = True
        self.inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
        if self.prompt_cache.disk is not None:  # what is queued is written
            self.prompt_cache.disk.close(timeout)

    # -- the loop ----------------------------------------------------------------

    def _run(self) -> None:
        while not (self._stopping and not self.busy()):
            # 1) new requests (when idle, the rounds' corrections are stored
            # first: ``_store``); cancelled ones go
            idle = not self.busy()
            self._take(block=idle, timeout=self._store() if idle else None)
            self._drop_cancelled()
            try:
                # 2) start requests while there is room
                self.admit()
                # 3) one chunk of the prompts being read
                if self.reading:
                    self.read()
                # 4) one round
                if self.jobs:
                    self._round()
                if self._deadline is not None and time.monotonic() >= self._deadline:
                    self._end_all()
            except Exception as e:  # a bug must not take the server down
                traceback.print_exc(file=sys.stderr)
                self._fail_all(f"{type(e).__name__}: {e}")
        self._store(now=True)
        # MLX leaves a thread's streams to the thread (ml-explore/mlx#4327): left
        # to the process's exit, their teardown aborts it now and then
        # ("terminate called without an active exception", exit 134)
        mx.synchronize()
        mx.clear_streams()

    def _store(self, now: bool = False) -> Optional[float]:
        """Store what the rounds corrected of the costs (``round_costs``), off
        the requests' path: called when idle, it stores at most every
        ``STORE_EVERY`` seconds (``now``: at the engine's end, whatever the
        time). Returns the seconds until a store is due (None: nothing to
        store), which the idle engine waits at most before it calls again."""
        fix = round_costs.of(self.model)
        if fix is None or not fix.dirty:
            return None
        left = self._stored + STORE_EVERY - time.monotonic()
        if left > 0 and not now:
            return left
        fix.save()
        self._stored = time.monotonic()
        return None

    def _take(self, block: bool, timeout: Optional[float] = None) -> None:
        """Move new requests to ``waiting``; when idle, wait for one (for
        ``timeout`` seconds at most), then ``GATHER`` seconds more for others
        sent with it (their prompts are then read in one forward)."""
        try:
            item = self.inbox.get(block=block, timeout=timeout if block else None)
            gather = block and item is not None
            while True:
                if item is not None:
                    self.waiting.append(EngineJob(item, self.tokenizer))
                if gather:
                    item = self.inbox.get(timeout=GATHER)
                else:
                    item = self.inbox.get_nowait()
        except queue.Empty:
            pass

    def _drop_cancelled(self, cancelled=None) -> None:
        """Drop the requests ``cancelled(request)`` names (default: those whose
        client went away; over processes, those rank 0 named for this turn)."""
        cancelled = cancelled or (lambda r: r.cancelled)
        self.waiting = type(self.waiting)(
            j for j in self.waiting if not cancelled(j.request)
        )
        gone = [j for j in self.reading.values() if cancelled(j.request)]
        if gone:
            self.drop(gone)
        gone = [j for j in self.jobs.values() if cancelled(j.request)]
        if gone:  # what they decoded is kept in the prompt cache
            self._leave(gone)

    def prepare(self, job: EngineJob) -> None:
        """A starting request's stream, on the prompt cache's best entry."""
        request = job.request
        cache, job.read = self.prompt_cache.fetch(self.model, request.prompt)
        job.reused = job.read
        job.stream = open_stream(
            self.model,
            request.prompt,
            request.params,
            cache=cache,
            stop_tokens=self.text_eos(),
            serving=Serving(True, self.memory, self.history),
            kv=self.config.kv,
        )
        job.stream.stats.prompt_tokens = len(request.prompt) - job.read
        self.metrics.lookup(job.reused)

    def text_eos(self):
        return getattr(self.tokenizer, "eos_token_ids", ()) or ()

    def joining(self, jobs: List[EngineJob]) -> None:
        """A recurrent stream's state at the end of its prompt is kept: the
        next turn of its chat extends it (its answer's end is kept too)."""
        for job in jobs:
            s = job.stream
            if self.prompt_cache.enabled and not truncatable(s.cache):
                self.prompt_cache.insert(
                    job.prompt.prefix(len(job.prompt) - 1), s.cache.copy()
                )

    def _round(self) -> None:
        finished, last = [], []
        for job, tokens in self.round():
            text = job.text.feed(tokens, job.request.params.max_tokens)
            if job.text.finish is not None or job.stream.done:
                finished.append(job)
                last.append(text)
            elif text:
                job.request.emit(Event(text, logprobs=job.logprobs()))
        if finished:
            self._leave(finished, last)

    def _leave(self, jobs: List[EngineJob], texts: Optional[List[str]] = None) -> None:
        """Take ``jobs`` out of the batch; finished ones send their last event."""
        keep = self.prompt_cache.enabled
        self.leave(jobs, extract=keep)
        for i, job in enumerate(jobs):
            s = job.stream
            if keep:  # the trunk has read all of the history but its last token
                self.prompt_cache.insert(s.prompt.prefix(len(s.history) - 1), s.cache)
            if texts is None:
                self._report(job)  # counted, not answered: its client went away
                continue
            if self.memory is not None:
                self.memory.add(s.history)
            self._finish(job, texts[i])

    def _report(self, job: EngineJob):
        """A request's ``usage`` and ``timings``, counted in the metrics."""
        request, stats = job.request, job.stream.stats
        generated = job.text.tokens
        thinking = request.params.thinking
        reasoning = 0
        if thinking is not None:
            answer = job.stream.history[len(request.prompt) :][:generated]
            reasoning = thinking.tokens_in(answer)
        info = usage(len(request.prompt), generated, job.reused, stats, reasoning)
        timing = timings(stats.prompt_tokens, generated, job.reused, stats)
        self.metrics.request(timing, stats)
        return info, timing

    def _finish(self, job: EngineJob, text: str) -> None:
        reason = job.text.finish or "length"
        info, timing = self._report(job)
        self.totals.add(job.stream.stats)
        job.request.emit(
            Event(text, reason, info, logprobs=job.logprobs(), timings=timing)
        )

    def _end_all(self) -> None:
        """Shutting down past the drain time: every request ends where it is."""
        reading = list(self.reading.values())
        if reading:
            self.drop(reading)
            for job in reading:
                self._finish(job, "")
        if self.jobs:
            jobs = list(self.jobs.values())
            self._leave(jobs, [job.text.flush() for job in jobs])
        for job in self.waiting:
            info = usage(len(job.prompt), 0, 0, MTPStats())
            timing = timings(0, 0, 0, MTPStats())
            job.request.emit(Event(finish_reason="length", usage=info, timings=timing))
        self.waiting.clear()

    def _fail_all(self, message: str) -> None:
        """After an internal error: every request gets it, the batch starts afresh."""
        jobs = list(self.jobs.values()) + list(self.reading.values())
        for job in jobs + list(self.waiting):
            job.request.emit(Event(error=message))
        self.reset(self._policy())
