"""``batch_generate``: mlx-lm's batch API on the server's decoding engine.

Many prompts decode together in the ragged batched rounds of
``decoder.Decoder`` (each stream drafts from its own source, MTP head or
prompt lookup, and keeps its own number of tokens a round); prompts are read
in chunks by a second ``Decoder`` as the server's engine reads them, so a long
prompt does not hold up the streams already decoding. Streams leave as they
finish and waiting prompts take their places, at most
``completion_batch_size`` at once. Greedy output is each prompt's output
alone.
"""

import dataclasses
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.generate import BatchResponse as MLXBatchResponse
from mlx_lm.generate_utils import BatchStats

from .batch_policy import BatchDraftLength
from .cache import MTPCache
from .decoder import Decoder
from .defaults import DEFAULT_PREFILL_STEP
from .errors import MTPError
from .generate import request_from
from .loader import MTPModel
from .prompts import context_length, encode, fit_context
from .request import GenerationRequest
from .rounds import Logprobs, Stream
from .sampling import Sampler
from .serve.prompt_cache import copy_cache
from .stats import MTPStats


_POLICIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@dataclass
class BatchResponse(MLXBatchResponse):
    """mlx-lm's ``BatchResponse`` (``texts``, ``stats``, ``caches``,
    ``token_ids``, ``logprobs``), plus each prompt's speculative stats."""

    finish_reasons: Optional[List[str]] = None  # "stop" or "length", per prompt
    mtp_stats: Optional[List[MTPStats]] = None


@dataclass
class _Job:
    index: int
    stream: Stream
    prompt: List[int]
    read: int = 0  # prompt tokens its caches hold


class _Batch:
    """The scheduler: waiting prompts, prompts being read, streams decoding."""

    def __init__(
        self, model, request: GenerationRequest, limit: int, reading: int, step: int
    ):
        self.model, self.step = model, step
        # the round times measured on this model serve its later calls too
        policy = _POLICIES.setdefault(model.trunk, BatchDraftLength())
        drafts = request.drafts
        self.decoder = Decoder(model, drafts.p_min, drafts.adaptive, policy)
        self.reader = Decoder(model)
        capacity = self.decoder.capacity or limit
        self.limit = min(limit, capacity)
        self.reading_limit = min(reading, self.limit)
        self.waiting: deque = deque()
        self.reading: Dict[int, _Job] = {}  # by id of the stream
        self.decoding: Dict[int, _Job] = {}
        self.counters = BatchStats()

    def busy(self) -> bool:
        return bool(self.waiting or self.reading or self.decoding)

    def start(self) -> None:
        """Waiting prompts start reading while the batch has room."""
        while (
            self.waiting
            and len(self.reading) + len(self.decoding) < self.limit
            and len(self.reading) < self.reading_limit
        ):
            job = self.waiting.popleft()
            if len(job.prompt) > 1:
                self.reader.add([job.stream])
                self.reading[id(job.stream)] = job
            else:  # nothing to read but its last token
                self._join([job])

    def read(self) -> None:
        """Every prompt being read takes its next chunk, in one forward."""
        jobs = [self.reading[id(s)] for s in self.reader.streams]
        takes, seconds, read = self.reader.read_chunk(
            [j.prompt for j in jobs], [j.read for j in jobs], self.step
        )
        self.counters.prompt_time += seconds
        self.counters.prompt_tokens += sum(takes)
        for j, n in zip(jobs, takes):
            j.read += n
            j.stream.stats.prompt_time += seconds
        done = [j for j, r in zip(jobs, read) if r]
        if done:
            self.reader.remove([j.stream for j in done])
            for j in done:
                del self.reading[id(j.stream)]
            self._join(done)

    def _join(self, jobs: List[_Job]) -> None:
        for j in jobs:
            self.decoding[id(j.stream)] = j
        self.decoder.add([j.stream for j in jobs])

    def round(self, keep_caches: bool) -> List[_Job]:
        """One round of every decoding stream; returns those that finished."""
        tic = time.perf_counter()
        out = self.decoder.step()
        self.counters.decode_time += time.perf_counter() - tic
        self.counters.generation_steps += 1
        self.counters.generation_tokens += sum(map(len, out))
        finished = [self.decoding[id(s)] for s in self.decoder.streams if s.done]
        if finished:
            self.decoder.remove([j.stream for j in finished], extract=keep_caches)
            for j in finished:
                del self.decoding[id(j.stream)]
        return finished


def _stream(model, tokenizer, request, sampler, prompt: List[int], i: int, cache):
    """Prompt ``i``'s stream; a seeded request gives each prompt its own seed."""
    sampling = request.sampling
    if sampling.seed is not None:
        sampling = dataclasses.replace(sampling, seed=sampling.seed + i)
    own = dataclasses.replace(request, sampling=sampling)
    stream = Stream(
        history=list(prompt),
        cache=cache if cache is not None else model.make_cache(),
        verifier=own.verifier(sampler),
        max_tokens=request.max_tokens,
        stop_tokens=set(getattr(tokenizer, "eos_token_ids", ()) or ()),
    )
    stream.source = request.drafts.make(model, batched=True)
    stream.stats.draft_max = stream.source.draft_max
    stream.stats.prompt_tokens = len(prompt)
    return stream


def batch_generate(
    model: MTPModel,
    tokenizer: Any,
    prompts: Sequence[Union[Sequence[int], str]],
    prompt_caches: Optional[Sequence[Optional[MTPCache]]] = None,
    max_tokens: Optional[Union[int, Sequence[int]]] = None,
    verbose: bool = False,
    return_prompt_caches: bool = False,
    return_token_ids: bool = False,
    return_logprobs: bool = False,
    *,
    request: Optional[GenerationRequest] = None,
    sampler: Optional[Sampler] = None,
    completion_batch_size: int = 32,
    prefill_batch_size: int = 8,
    prefill_step_size: int = DEFAULT_PREFILL_STEP,
    **kwargs,
) -> BatchResponse:
    """Generate a completion of each of ``prompts``, decoding them together.

    mlx-lm's ``batch_generate``, with its arguments and its return value
    (``texts``, ``stats``, and when asked ``caches``, ``token_ids``,
    ``logprobs``; plus each prompt's ``finish_reasons`` and ``mtp_stats``).
    A prompt is token ids (or text). ``max_tokens`` is one limit or one per
    prompt (default: 128, as mlx-lm's, or ``request.max_tokens``).
    ``prompt_caches`` are ``MTPCache`` s (``return_prompt_caches`` gives them)
    holding what comes before each prompt; they are not changed. What to
    generate is a ``GenerationRequest`` (``request=``) or, as
    ``stream_generate`` takes them, its fields: sampling (``temp=``,
    ``top_p=``, .., or ``sampler=``), ``logits_processors=``,
    ``draft_max=``, ``draft_source=``, ``mtp=``, ... At most
    ``completion_batch_size`` prompts are decoded at once, and at most
    ``prefill_batch_size`` of them read their prompts together, in chunks of
    ``prefill_step_size`` tokens. Each round drafts as deep as pays at this
    batch size (by measured time), none where drafts cannot pay.
    """
    if request is not None and kwargs:
        names = ", ".join(sorted(kwargs))
        raise TypeError(f"pass either request= or its fields ({names}), not both")
    if max_tokens is None:  # mlx-lm's default, or the request's
        max_tokens = 128 if request is None else request.max_tokens
    if request is None:
        request = request_from(caller="batch_generate", **kwargs)
    request.validate()
    n = len(prompts)
    limits = [max_tokens] * n if isinstance(max_tokens, int) else list(max_tokens)
    caches = list(prompt_caches) if prompt_caches is not None else [None] * n
    if len(limits) != n or len(caches) != n:
        raise ValueError("max_tokens and prompt_caches need one entry per prompt")
    if completion_batch_size < 1 or prefill_batch_size < 1 or prefill_step_size < 1:
        raise ValueError("batch and step sizes must be at least 1")
    batch = _Batch(
        model, request, completion_batch_size, prefill_batch_size, prefill_step_size
    )
    jobs = _jobs(model, tokenizer, request, sampler, prompts, limits, caches)
    for j in jobs if return_logprobs else ():
        j.stream.logprobs = Logprobs()
    batch.waiting.extend(jobs)
    _run(batch, n, verbose, return_prompt_caches)
    return _response(batch, jobs, tokenizer, verbose, return_prompt_caches,
                     return_token_ids, return_logprobs)  # fmt: skip


def _jobs(model, tokenizer, request, sampler, prompts, limits, caches) -> List[_Job]:
    """Each prompt's stream, on a copy of its cache (a new one if None)."""
    jobs = []
    for i, (prompt, limit, cache) in enumerate(zip(prompts, limits, caches)):
        tokens = encode(tokenizer, prompt)
        if not tokens:
            raise MTPError(f"prompt {i} is empty")
        if cache is not None and not isinstance(cache, MTPCache):
            raise TypeError(
                "prompt_caches are MTPCaches (return_prompt_caches=True gives them)"
            )
        tokens, limit = fit_context(
            tokens,
            cache.offset if cache is not None else 0,
            limit,
            context_length(model),
            request.truncate_prompt,
            getattr(tokenizer, "bos_token_id", None),
        )
        own = dataclasses.replace(request, max_tokens=limit)
        copy = copy_cache(cache) if cache is not None else None
        jobs.append(
            _Job(i, _stream(model, tokenizer, own, sampler, tokens, i, copy), tokens)
        )
    return jobs


def _run(batch: _Batch, n: int, verbose: bool, keep_caches: bool) -> None:
    """The engine's turn, until every prompt is done: start waiting prompts,
    read one chunk of the prompts being read, one round of the batch."""
    tic, done = time.perf_counter(), 0
    if verbose:
        print(f"[batch_generate] Finished processing 0/{n} ...", end="\r")
    while batch.busy():
        batch.start()
        if batch.reading:
            batch.read()
        if batch.decoding:
            done += len(batch.round(keep_caches))
            if verbose:
                print(f"[batch_generate] Finished processing {done}/{n} ...", end="\r")
    batch.counters.wall_time = time.perf_counter() - tic
    batch.counters.peak_memory = mx.get_peak_memory() / 1e9
    if verbose:
        print(f"[batch_generate] Finished processing {done}/{n}")


def _logprobs(job: _Job, out: List[int]) -> List[float]:
    return [e[1] for e in job.stream.logprobs.entries[: len(out)]]


def _response(batch, jobs, tokenizer, verbose, caches, token_ids, logprobs):
    outputs = []
    for j in jobs:
        s = j.stream
        out = s.history[len(j.prompt) :]
        if out and out[-1] in s.stop_tokens:  # as mlx-lm: the stop token is not text
            out = out[:-1]
        outputs.append(out)
        s.stats.peak_memory = batch.counters.peak_memory
    stats = batch.counters
    response = BatchResponse(
        texts=[tokenizer.decode(out) for out in outputs],
        stats=stats,
        caches=[j.stream.cache for j in jobs] if caches else None,
        token_ids=outputs if token_ids else None,
        logprobs=[_logprobs(j, o) for j, o in zip(jobs, outputs)] if logprobs else None,
        finish_reasons=[
            "stop" if j.stream.history[-1] in j.stream.stop_tokens else "length"
            for j in jobs
        ],
        mtp_stats=[j.stream.stats for j in jobs],
    )
    if verbose:
        print(
            f"[batch_generate] Prompt: {stats.prompt_tokens} tokens, "
            f"{stats.prompt_tps:.3f} tokens-per-sec"
        )
        print(
            f"[batch_generate] Generation: {stats.generation_tokens} tokens, "
            f"{stats.generation_tps:.3f} tokens-per-sec"
        )
        print(f"[batch_generate] Peak memory: {stats.peak_memory:.3f} GB")
        total = MTPStats()
        for s in response.mtp_stats:
            total.add(s)
        print(total.summary())
    return response
