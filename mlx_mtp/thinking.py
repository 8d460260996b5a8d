"""Where a thinking model's thinking opens and closes in its tokens.

Thinking models (Qwen3.x, GLM-4.5+, DeepSeek-R1/V3.1+, Kimi, gpt-oss) write
their reasoning between two markers before the answer; their chat templates
often open it in the generation prompt. A ``Thinking`` (built once per
request, from the prompt's tokens) names the markers' tokens, whether the
prompt leaves the thinking open, and a budget of thinking tokens. From it:

- ``Phases`` follows a stream's tokens and says whether it is thinking or
  answering (``drafts.PhasedDrafts`` keeps a draft source, and so an
  acceptance estimate, per phase: drafts are kept at other rates in the
  two);
- ``ThinkingBudget`` is the logits processor that, once the thinking has
  taken ``budget`` tokens, writes ``close`` (ending in the end marker) one
  token at a time, after which the answer follows as the model writes it.
  It reads only the tokens before the position it is asked about, so it
  holds for drafts and rolled-back rounds alike.
"""

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

THINKING, ANSWER = "thinking", "answer"


def find(tokens: Sequence[int], pattern: Sequence[int], at: int = 0) -> int:
    """Where ``pattern`` first occurs in ``tokens`` from ``at``; -1 where not."""
    pattern = list(pattern)
    if not pattern:
        return -1
    if isinstance(tokens, np.ndarray):
        hits = np.flatnonzero(tokens[at : len(tokens) - len(pattern) + 1] == pattern[0])
        for i in hits + at:
            if tokens[i : i + len(pattern)].tolist() == pattern:
                return int(i)
        return -1
    first = pattern[0]
    while True:
        try:
            i = tokens.index(first, at)
        except ValueError:
            return -1
        if list(tokens[i : i + len(pattern)]) == pattern:
            return i
        at = i + 1


@dataclass(frozen=True)
class Thinking:
    """A request's thinking: ``start`` and ``end`` (the markers' tokens),
    ``close`` (what the server writes to end it: the end marker and the
    whitespace the template puts after it), ``prompt_len`` (the answer's
    first position), ``open`` (the prompt ends inside the thinking) and
    ``budget`` (thinking tokens at most; None: any)."""

    start: Tuple[int, ...]
    end: Tuple[int, ...]
    close: Tuple[int, ...]
    prompt_len: int
    open: bool = False
    budget: Optional[int] = None

    def span(self, generated: Sequence[int]) -> Tuple[int, int]:
        """Where the thinking opens and where its end marker begins in the
        answer's tokens ``generated``; -1 for a marker not written (yet)."""
        opened = 0
        if not self.open:
            at = find(generated, self.start)
            if at < 0:
                return -1, -1
            opened = at + len(self.start)
        return opened, find(generated, self.end, opened)

    def tokens_in(self, generated: Sequence[int]) -> int:
        """The thinking's tokens in ``generated``, markers included."""
        opened, closed = self.span(generated)
        if opened < 0:
            return 0
        first = 0 if self.open else opened - len(self.start)
        last = len(generated) if closed < 0 else closed + len(self.end)
        return last - first

    def phases(self) -> "Phases":
        return Phases(self)

    def processor(self) -> Optional["ThinkingBudget"]:
        """The logits processor that holds the budget (None: no budget)."""
        return None if self.budget is None else ThinkingBudget(self)


class Phases:
    """A stream's phase ("thinking" or "answer"), followed as its history
    grows: each call scans only the tokens it has not seen."""

    def __init__(self, thinking: Thinking):
        self.thinking = thinking
        self.inside = thinking.open
        self.scanned = thinking.prompt_len

    @property
    def phase(self) -> str:
        return THINKING if self.inside else ANSWER

    def __call__(self, history: Sequence[int]) -> str:
        t = self.thinking
        while True:
            marker = t.end if self.inside else t.start
            at = find(
                history, marker, max(t.prompt_len, self.scanned - len(marker) + 1)
            )
            if at < 0:
                self.scanned = max(self.scanned, len(history))
                return self.phase
            self.inside = not self.inside
            self.scanned = at + len(marker)


class ThinkingBudget:
    """A logits processor: past ``budget`` thinking tokens, the next token of
    ``close`` and nothing else, until the thinking is closed."""

    def __init__(self, thinking: Thinking):
        self.thinking = thinking

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        t = self.thinking
        generated = np.array(tokens[t.prompt_len :])
        opened, closed = t.span(generated)
        if opened < 0:
            return logits
        limit = opened + t.budget
        if 0 <= closed < limit:  # the model closed it in time
            return logits
        j = len(generated) - limit
        if not 0 <= j < len(t.close):
            return logits
        forced = mx.arange(logits.shape[-1]) == t.close[j]
        return mx.where(forced, mx.zeros_like(logits), -mx.inf)
