"""The scheduler around the decoding loop: waiting requests, prompts being
read, streams decoding.

``batch_generate`` and the server's engine (and, through the engine, the
engine of several processes) run their requests here. Each turn

1) starts waiting jobs while the batch has room (``admit``) (``prepare`` gives a job its
   stream: the server looks up its prompt cache there);
2) reads one chunk of every prompt being read, together, in one forward
   (``Decoder.chunks``: ragged chunks right-padded where the caches are
   attention, one length where a recurrent state is read), so a long prompt
   does not stall the streams already decoding; a stream whose prompt is read
   joins the decoding batch;
3) runs one speculative round of the whole batch (``decoder.Decoder``).

What happens to a round's tokens (text, events, stop strings) and to a
stream that finished is the caller's: ``round`` returns each job's tokens,
and the caller lets the finished ones ``leave``.
"""

from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional, Tuple

from .batch_policy import BatchDraftLength
from .decoder import Decoder
from .stream import Stream


@dataclass
class Job:
    """One request in the scheduler: its prompt and, once started, its stream."""

    prompt: List[int]
    stream: Optional[Stream] = None
    read: int = 0  # prompt tokens its stream's caches hold
    reused: int = 0  # of those, the ones a prompt cache held


class Scheduler:
    """Jobs waiting, being read and decoding on one model."""

    def __init__(
        self,
        model,
        policy: Optional[BatchDraftLength] = None,
        draft_p_min: float = 0.0,
        max_batch: int = 32,
        max_reading: int = 0,
        prefill_step: int = 2048,
    ):
        """``max_batch``: jobs started at once (read or decoding);
        ``max_reading``: of those, prompts read at once (0: any)."""
        self.model = model
        self.draft_p_min, self.prefill_step = draft_p_min, prefill_step
        self.decoder = Decoder(model, draft_p_min, policy)
        self.reader = Decoder(model)  # streams whose prompts are being read
        self.batched = self.decoder.batched
        self.max_batch = max_batch if self.batched else 1
        self.max_reading = min(max_reading or self.max_batch, self.max_batch)
        self.waiting: Deque[Job] = deque()
        self.reading: Dict[int, Job] = {}  # by id of their stream
        self.jobs: Dict[int, Job] = {}  # decoding, by id of their stream

    def busy(self) -> bool:
        return bool(self.waiting or self.reading or self.jobs)

    def room(self) -> int:
        return self.max_batch - len(self.reading) - len(self.jobs)

    def reset(self, policy: Optional[BatchDraftLength] = None) -> None:
        """Forget every job: the batch starts afresh (after an internal error)."""
        self.waiting, self.reading, self.jobs = deque(), {}, {}
        self.decoder = Decoder(self.model, self.draft_p_min, policy)
        self.reader = Decoder(self.model)

    # -- hooks --------------------------------------------------------------

    def prepare(self, job: Job) -> None:
        """Give a starting job its stream (it may have one already)."""

    def joining(self, jobs: List[Job]) -> None:
        """``jobs`` are about to join the decoding batch (their streams still
        hold their own caches)."""

    # -- a turn ---------------------------------------------------------------

    def admit(self) -> None:
        """Waiting jobs start while the batch has room."""
        while self.waiting and self.room() > 0 and len(self.reading) < self.max_reading:
            job = self.waiting.popleft()
            self.prepare(job)
            if job.read < len(job.prompt) - 1:
                self.reader.add([job.stream])
                self.reading[id(job.stream)] = job
            else:  # nothing to read but its last token
                self.join([job])

    def read(self) -> Tuple[List[int], float]:
        """Every prompt being read takes its next chunk, in one forward;
        returns how many tokens each read, and the seconds it took."""
        jobs = [self.reading[id(s)] for s in self.reader.streams]
        takes, seconds, read = self.reader.read_chunk(
            [j.prompt for j in jobs], [j.read for j in jobs], self.prefill_step
        )
        for j, n in zip(jobs, takes):
            j.read += n
            j.stream.stats.prompt_time += seconds
        done = [j for j, r in zip(jobs, read) if r]
        if done:
            self.reader.remove([j.stream for j in done])
            for j in done:
                del self.reading[id(j.stream)]
            self.join(done)
        return takes, seconds

    def join(self, jobs: List[Job]) -> None:
        """Jobs whose prompts are read join the decoding batch."""
        for j in jobs:
            self.jobs[id(j.stream)] = j
        self.joining(jobs)
        self.decoder.add([j.stream for j in jobs])

    def round(self) -> List[Tuple[Job, List[int]]]:
        """One round of every decoding stream: each job with its tokens."""
        out = self.decoder.step()
        return [(self.jobs[id(s)], t) for s, t in zip(self.decoder.streams, out)]

    def leave(self, jobs: List[Job], extract: bool = True) -> None:
        """Decoding ``jobs`` leave the batch; with ``extract`` each stream gets
        its caches back."""
        self.decoder.remove([j.stream for j in jobs], extract=extract)
        for j in jobs:
            del self.jobs[id(j.stream)]

    def drop(self, jobs: List[Job]) -> None:
        """Started ``jobs`` go, being read or decoding (their state is freed)."""
        reading = [j for j in jobs if id(j.stream) in self.reading]
        if reading:
            self.reader.remove([j.stream for j in reading], extract=False)
            for j in reading:
                del self.reading[id(j.stream)]
        decoding = [j for j in jobs if id(j.stream) in self.jobs]
        if decoding:
            self.leave(decoding, extract=False)
