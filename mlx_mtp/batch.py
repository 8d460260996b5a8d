"""``batch_generate``: mlx-lm's batch API on the server's decoding engine.

Many prompts decode together in the ragged batched rounds of
``decoder.Decoder`` (each stream drafts from its own source, a drafter or
prompt lookup, and keeps its own number of tokens a round), scheduled by the
server's scheduler (``scheduler.Scheduler``): prompts are read in chunks, so a
long prompt does not hold up the streams already decoding, streams leave as
they finish and waiting prompts take their places, at most
``completion_batch_size`` at once. Greedy output is each prompt's output
alone.
"""

import time
import weakref
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.generate import BatchResponse as MLXBatchResponse
from mlx_lm.generate_utils import BatchStats

from .batch_policy import BatchDraftLength
from .cache import StreamCache
from .defaults import DEFAULT_PREFILL_STEP
from .errors import MTPError
from .generate import request_from
from .loader import MTPModel
from .prompts import context_length, encode_prompt, fit_prompt
from .request import GenerationRequest
from .round_costs import store
from .sampling import Sampler
from .scheduler import Job, Scheduler
from .stats import MTPStats
from .stream import Logprobs, Serving, open_stream
from .vision import with_images


_POLICIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@dataclass
class BatchResponse(MLXBatchResponse):
    """mlx-lm's ``BatchResponse`` (``texts``, ``stats``, ``caches``,
    ``token_ids``, ``logprobs``), plus each prompt's speculative stats."""

    finish_reasons: Optional[List[str]] = None  # "stop" or "length", per prompt
    mtp_stats: Optional[List[MTPStats]] = None


class _Batch(Scheduler):
    """The scheduler, counting what mlx-lm's ``BatchStats`` counts."""

    def __init__(
        self, model, request: GenerationRequest, limit: int, reading: int, step: int
    ):
        # the round times measured on this model serve its later calls too
        policy = None
        if request.drafts.adaptive:
            policy = _POLICIES.setdefault(model.target, BatchDraftLength())
        super().__init__(
            model, policy, request.drafts.p_min, limit, reading, step, request.kv
        )
        self.counters = BatchStats()

    def read(self):
        takes, seconds = super().read()
        self.counters.prompt_time += seconds
        self.counters.prompt_tokens += sum(takes)
        return takes, seconds

    def round(self):
        tic = time.perf_counter()
        out = super().round()
        self.counters.decode_time += time.perf_counter() - tic
        self.counters.generation_steps += 1
        self.counters.generation_tokens += sum(len(t) for _, t in out)
        return out


def batch_generate(
    model: MTPModel,
    tokenizer: Any,
    prompts: Sequence[Union[Sequence[int], str]],
    prompt_caches: Optional[Sequence[Optional[StreamCache]]] = None,
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
    images: Optional[Sequence[Any]] = None,
    **kwargs,
) -> BatchResponse:
    """Generate a completion of each of ``prompts``, decoding them together.

    mlx-lm's ``batch_generate``, with its arguments and its return value
    (``texts``, ``stats``, and when asked ``caches``, ``token_ids``,
    ``logprobs``; plus each prompt's ``finish_reasons`` and ``mtp_stats``).
    A prompt is token ids (or text, or a ``prompt.Prompt``: tokens with media). ``max_tokens`` is one limit or one per
    prompt (default: 128, as mlx-lm's, or ``request.max_tokens``).
    ``prompt_caches`` are ``StreamCache`` s (``return_prompt_caches`` gives them)
    holding what comes before each prompt; they are not changed. What to
    generate is a ``GenerationRequest`` (``request=``) or, as
    ``stream_generate`` takes them, its fields: sampling (``temp=``,
    ``top_p=``, .., or ``sampler=``), ``logits_processors=``,
    ``draft_max=``, ``draft_source=``, ``mtp=``, ..., and mlx-lm's cache
    keywords (``kv_bits=``, ``kv_group_size=``, ``quantized_kv_start=``:
    the batch holds every stream's caches quantized from where its prompt is
    read, or from ``quantized_kv_start`` if its prompt is longer;
    ``max_kv_size=`` decodes one prompt at a time). At most
    ``completion_batch_size`` prompts are decoded at once, and at most
    ``prefill_batch_size`` of them read their prompts together, in chunks of
    ``prefill_step_size`` tokens. Each round drafts as deep as pays at this
    batch size (by measured time), none where drafts cannot pay.
    ``images`` gives each prompt its images (a path, a list of paths, or
    None), as ``stream_generate``'s ``image``.
    """
    if request is not None and kwargs:
        names = ", ".join(sorted(kwargs))
        raise TypeError(f"pass either request= or its fields ({names}), not both")
    if max_tokens is None:  # mlx-lm's default, or the request's
        max_tokens = 128 if request is None else request.max_tokens
    if request is None:
        request = request_from(caller="batch_generate", **kwargs)
    request.validate(model)
    request.kv.check_model(model)
    n = len(prompts)
    if images is not None:
        if len(images) != n:
            raise ValueError("images needs one entry per prompt")
        prompts = [with_images(model, tokenizer, p, i) for p, i in zip(prompts, images)]
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
    try:
        _run(batch, n, verbose, return_prompt_caches)
    finally:
        store(model)  # what its rounds corrected, for later runs
    return _response(batch, jobs, tokenizer, verbose, return_prompt_caches,
                     return_token_ids, return_logprobs)  # fmt: skip


BATCHED = Serving(batched=True)  # the batch's policy chooses the draft length


def _jobs(model, tokenizer, request, sampler, prompts, limits, caches) -> List[Job]:
    """Each prompt's job and stream, on a copy of its cache (a new one if None)."""
    jobs = []
    eos = getattr(tokenizer, "eos_token_ids", ()) or ()
    for i, (prompt, limit, cache) in enumerate(zip(prompts, limits, caches)):
        tokens = encode_prompt(tokenizer, prompt)
        if not len(tokens):
            raise MTPError(f"prompt {i} is empty")
        if cache is not None and not isinstance(cache, StreamCache):
            raise TypeError(
                "prompt_caches are StreamCaches (return_prompt_caches=True gives them)"
            )
        tokens, limit = fit_prompt(
            tokens,
            cache.offset if cache is not None else 0,
            limit,
            context_length(model),
            request.truncate_prompt,
            getattr(tokenizer, "bos_token_id", None),
        )
        stream = open_stream(
            model,
            tokens,
            request,
            cache=cache.copy() if cache is not None else None,
            stop_tokens=eos,
            max_tokens=limit,
            sampler=sampler,
            seed_offset=i,
            serving=BATCHED,
        )
        stream.stats.prompt_tokens = len(tokens)
        jobs.append(Job(tokens, stream))
    return jobs


def _run(batch: _Batch, n: int, verbose: bool, keep_caches: bool) -> None:
    """The scheduler's turns until every prompt is done: start waiting
    prompts, read one chunk of the prompts being read, one round of the batch."""
    tic, done = time.perf_counter(), 0
    if verbose:
        print(f"[batch_generate] Finished processing 0/{n} ...", end="\r")
    while batch.busy():
        batch.admit()
        if batch.reading:
            batch.read()
        if batch.jobs:
            finished = [j for j, _ in batch.round() if j.stream.done]
            if finished:
                batch.leave(finished, extract=keep_caches)
            done += len(finished)
            if verbose:
                print(f"[batch_generate] Finished processing {done}/{n} ...", end="\r")
    batch.counters.wall_time = time.perf_counter() - tic
    batch.counters.peak_memory = mx.get_peak_memory() / 1e9
    if verbose:
        print(f"[batch_generate] Finished processing {done}/{n}")


def _logprobs(job: Job, out: List[int]) -> List[float]:
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
        print(batch_summary(stats, response.mtp_stats))
    return response


def batch_summary(stats: BatchStats, streams: Sequence[MTPStats]) -> str:
    """One stats line for a whole batch: the drafts of every stream, and the
    batch's own times (each stream's stats hold the whole batch's time of
    every round it took part in: summing them would count it once a stream)."""
    total = MTPStats()
    for s in streams:
        total.add(s)
    total.prompt_time, total.generation_time = stats.prompt_time, stats.generation_time
    # mlx-lm's count: the tokens the prompt reads took, each prompt's last
    # one left to its first round (a stream's own count holds it: summed,
    # they said one token a prompt more than mlx-lm's line above)
    total.prompt_tokens = stats.prompt_tokens
    return (
        f"{total.summary()}\n[batch_generate] Rounds: {stats.generation_steps} "
        f"batched, {total.rounds} of single streams"
    )
