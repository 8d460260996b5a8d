"""How far reading a long prompt has got, on stderr (generate, chat, bench).

The API calls ``prefill_progress(done, total)`` before each chunk of the
prompt and at the end. On a terminal that is a bar from ``LONG_PROMPT``
tokens on; elsewhere (a log, a pipe) a plain line every ``LINE_EVERY``
seconds, so that only a prompt that takes a while to read says so.
"""

import sys
import time
from typing import Callable, Optional

# prompts from this many tokens up show a bar on a terminal
LONG_PROMPT = 512
LINE_EVERY = 5.0  # seconds between plain lines


class PromptProgress:
    """A ``prefill_progress`` callback; one object serves one prompt after another.

    ``notice`` is printed when the first prompt is accepted, before it is read.
    ``status`` (a rich ``Status`` already on screen, as chat and bench have)
    shows the count in its text instead of a bar of its own, then ``after``;
    ``label`` is what goes before the count.
    """

    def __init__(
        self,
        notice: Optional[str] = None,
        status=None,
        label: str = "reading the prompt",
        after: Optional[str] = None,
        terminal: Optional[bool] = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.notice, self.status, self.label = notice, status, label
        self.after = after
        if terminal is None:
            terminal = status is not None or sys.stderr.isatty()
        self.terminal, self.clock = terminal, clock
        self.bar = self.task = None
        self.started = self.last = None  # the prompt's start, the last line's time
        self.lines = 0

    def __call__(self, done: int, total: int) -> None:
        if self.notice is not None:
            _say(self.notice)
            self.notice = None
        if done == 0 or self.started is None:
            self.started = self.last = self.clock()
            self.lines = 0
        if self.terminal:
            self._show(done, total)
        else:
            self._line(done, total)
        if done >= total:
            self.close()
            self.started = None

    def _show(self, done: int, total: int) -> None:
        if total < LONG_PROMPT:
            return
        if self.status is not None:
            if done < total:
                self.status.update(f"{self.label} {done}/{total} tokens")
            elif self.after is not None:
                self.status.update(self.after)
            return
        if self.bar is None:
            self.bar = _bar(self.label)
            self.bar.start()
            self.task = self.bar.add_task("prefill", total=total)
        self.bar.update(self.task, completed=done)

    def _line(self, done: int, total: int) -> None:
        now = self.clock()
        took = now - self.started
        if done >= total:
            if self.lines:  # a prompt that said it was being read says it is done
                _say(f"{self.label}: all {total} tokens in {took:.0f} s")
        elif done and now - self.last >= LINE_EVERY:
            _say(f"{self.label}: {done}/{total} tokens, {took:.0f} s")
            self.last, self.lines = now, self.lines + 1

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def duration(seconds: float) -> str:
    """``seconds`` as a person reads it in a progress line."""
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)  # sys.stderr as it is now


def _bar(label: str):
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    return Progress(
        SpinnerColumn(),
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tokens"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
