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
   joins the decoding batch. Under a quantizing cache policy (``kv``) the
   prompts whose caches are still in full precision are read apart, in a
   second forward (a batch holds one form), until their caches turn;
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
from .kv import KVSettings, quantizes_later
from .prompt import Prompt, as_prompt
from .stream import Stream


@dataclass
class Job:
    """One request in the scheduler: its prompt (``prompt.Prompt``: tokens
    with media) and, once started, its stream."""

    prompt: Prompt
    stream: Optional[Stream] = None
    read: int = 0  # prompt tokens its stream's caches hold
    reused: int = 0  # of those, the ones a prompt cache held

    def __post_init__(self):
        self.prompt = as_prompt(self.prompt)


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
        kv: Optional[KVSettings] = None,
    ):
        """``max_batch``: jobs started at once (read or decoding);
        ``max_reading``: of those, prompts read at once (0: any); ``kv``: the
        policy the streams' caches follow."""
        self.model = model
        self.draft_p_min, self.prefill_step = draft_p_min, prefill_step
        self.kv = kv
        self.reset(policy)
        self.batched = self.decoder.batched
        self.max_batch = max_batch if self.batched else 1
        self.max_reading = min(max_reading or self.max_batch, self.max_batch)

    def busy(self) -> bool:
        return bool(self.waiting or self.reading or self.jobs)

    def free_slots(self) -> int:
        return self.max_batch - len(self.reading) - len(self.jobs)

    def reset(self, policy: Optional[BatchDraftLength] = None) -> None:
        """Forget every job: the batch starts afresh (at the start, and after
        an internal error)."""
        self.waiting: Deque[Job] = deque()
        self.reading: Dict[int, Job] = {}  # by id of their stream
        self.jobs: Dict[int, Job] = {}  # decoding, by id of their stream
        self.decoder = Decoder(self.model, self.draft_p_min, policy, kv=self.kv)
        # streams whose prompts are being read; of those, the ones whose
        # caches turn quantized later (``kv``)
        self.reader = Decoder(self.model, kv=self.kv)
        self.full_reader = Decoder(self.model, convert=False, kv=self.kv)

    # -- hooks --------------------------------------------------------------

    def prepare(self, job: Job) -> None:
        """Give a starting job its stream (it may have one already)."""

    def joining(self, jobs: List[Job]) -> None:
        """``jobs`` are about to join the decoding batch (their streams still
        hold their own caches)."""

    # -- a turn ---------------------------------------------------------------

    def admit(self) -> None:
        """Waiting jobs start while the batch has room."""
        while self.waiting and self.free_slots() > 0 and len(self.reading) < self.max_reading:
            job = self.waiting.popleft()
            self.prepare(job)
            if job.read < len(job.prompt) - 1:
                reader = self.reader
                if self.batched and quantizes_later(job.stream.cache.trunk):
                    reader = self.full_reader
                reader.add([job.stream])
                self.reading[id(job.stream)] = job
            else:  # nothing to read but its last token
                self.join([job])

    def readers(self) -> List[Decoder]:
        """The readers holding prompts: those of full-precision caches first."""
        return [r for r in (self.full_reader, self.reader) if r.streams]

    def read(self) -> Tuple[List[int], float]:
        """Every prompt being read takes its next chunk, in one forward (two
        where some caches have still to turn quantized); returns how many
        tokens each read, and the seconds it took."""
        all_takes, total = [], 0.0
        for reader in self.readers():
            jobs = [self.reading[id(s)] for s in reader.streams]
            takes, seconds, read = reader.read_chunk(
                [j.prompt for j in jobs], [j.read for j in jobs], self.prefill_step
            )
            for j, n in zip(jobs, takes):
                j.read += n
                j.stream.stats.prompt_time += seconds
            done = [j for j, r in zip(jobs, read) if r]
            if done:
                reader.remove([j.stream for j in done])
                for j in done:
                    del self.reading[id(j.stream)]
                self.join(done)
            turning = reader.turning()
            if turning:  # their caches turn quantized: the quantized reader's
                reader.remove(turning)
                self.reader.add(turning)
            all_takes += takes
            total += seconds
        return all_takes, total

    def finishing(self) -> List[Stream]:
        """The streams whose prompts the next ``read`` reads to the end."""
        out = []
        for reader in self.readers():
            jobs = [self.reading[id(s)] for s in reader.streams]
            left = [len(j.prompt) - 1 - j.read for j in jobs]
            takes = reader.chunks(
                left, self.prefill_step, [j.prompt for j in jobs], [j.read for j in jobs]
            )
            out += [j.stream for j, m, n in zip(jobs, left, takes) if m == n]
        return out

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
        for reader in self.readers():
            mine = {id(s) for s in reader.streams}
            gone = [j.stream for j in reading if id(j.stream) in mine]
            if gone:
                reader.remove(gone, extract=False)
        for j in reading:
            del self.reading[id(j.stream)]
        decoding = [j for j in jobs if id(j.stream) in self.jobs]
        if decoding:
            self.leave(decoding, extract=False)
