"""On a real terminal (a pseudo-terminal here): chat line editing and history,
the progress of a long prompt, and a chat footer that fits 80 columns."""

import fcntl
import os
import pty
import re
import select
import struct
import sys
import tempfile
import termios
import time

import pytest
from mlx_mtp.cli import app
from mlx_mtp.cli.chat import footer
from typer.testing import CliRunner

from mlx_mtp.stats import MTPStats

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\r")


class Terminal:
    """``python -m mlx_mtp ARGS`` on a pseudo-terminal of 80 columns."""

    def __init__(self, *args):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: becomes mlx-mtp
            os.chdir(tempfile.gettempdir())
            env = dict(os.environ, TERM="xterm", COLUMNS="80", LINES="24")
            argv = [sys.executable, "-m", "mlx_mtp", *map(str, args)]
            os.execvpe(sys.executable, argv, env)
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
        self.out = b""

    def read_until(self, pattern: bytes, count: int = 1, timeout: float = 300):
        end = time.time() + timeout
        while self.out.count(pattern) < count:
            if time.time() > end:
                raise AssertionError(f"no {pattern!r} in {self.out[-2000:]!r}")
            ready, _, _ = select.select([self.fd], [], [], 0.5)
            if ready:
                try:
                    self.out += os.read(self.fd, 65536)
                except OSError:  # the child is gone
                    raise AssertionError(self.out[-2000:]) from None

    def prompt_after(self, marker: bytes, count: int = 1):
        """Wait for the ``count``-th ``marker``, then for the prompt after it:
        only then does the chat read the terminal (keys typed before are
        echoed by the terminal itself)."""
        self.read_until(marker, count)
        start = [m.end() for m in re.finditer(re.escape(marker), self.out)][count - 1]
        while b">>> " not in self.out[start:]:
            self.read_until(b">>> ", self.out.count(b">>> ") + 1)

    def send(self, data: bytes):
        os.write(self.fd, data)

    def finish(self) -> int:
        try:
            while True:
                ready, _, _ = select.select([self.fd], [], [], 60)
                if not ready:
                    break
                chunk = os.read(self.fd, 65536)
                if not chunk:
                    break
                self.out += chunk
        except OSError:
            pass
        _, status = os.waitpid(self.pid, 0)
        os.close(self.fd)
        return os.waitstatus_to_exitcode(status)

    def text(self) -> str:
        return ANSI.sub("", self.out.decode(errors="replace"))


@pytest.fixture(scope="module")
def full(tiny_folders):
    return tiny_folders("mimo")[0]


def test_chat_recalls_and_edits_earlier_lines(full):
    # --fixed-draft: the same drafts in the terminal's process as in this one,
    # whose regime the tests pin (conftest), so the same cache is left behind
    term = Terminal("chat", "-m", full, "-n", 4, "--fixed-draft", "--draft-source", "mtp")
    term.prompt_after(b"/help lists the commands")
    term.send(b"hello\r")
    term.prompt_after(b"/pass")
    term.send(b"\x1b[A\r")  # arrow up, enter: the same line again
    term.prompt_after(b"/pass", 2)
    term.send(b"\x1b[A\x7f\x7fp me!\r")  # arrow up, two backspaces: "help me!"
    term.prompt_after(b"/pass", 3)
    term.send(b"/stats\r")
    term.prompt_after(b"cached tokens")
    term.send(b"\x04")  # Ctrl-D
    assert term.finish() == 0
    text = term.text()
    assert "^[[A" not in text  # the terminal did not echo the raw arrow key
    # something moves while the model loads and before each answer's first token
    assert "loading the model" in text and text.count("thinking") >= 3
    footers = [line for line in text.splitlines() if "/pass" in line]
    assert len(footers) == 3 and all(len(line) <= 80 for line in footers), footers
    # the same conversation typed out in full leaves the same cache behind
    typed = CliRunner().invoke(
        app,
        ["chat", "-m", str(full), "-n", "4", "--fixed-draft", "--draft-source", "mtp"],
        input="hello\nhello\nhelp me!\n/stats\n",
    )
    cached = re.compile(r"cached tokens: \d+, reused in the last answered prompt: \d+/\d+")
    assert cached.findall(text) == cached.findall(typed.output) != []


def test_long_prompt_shows_its_progress(full):
    term = Terminal("generate", "-m", full, "-p", "x" * 700, "-n", 2)
    assert term.finish() == 0
    assert "reading the prompt" in term.text()
    short = Terminal("generate", "-m", full, "-p", "x" * 20, "-n", 2)
    assert short.finish() == 0 and "reading the prompt" not in short.text()


def test_footer_fits_80_columns():
    big = MTPStats(
        prompt_tokens=99999,
        prompt_time=12.0,
        generation_tokens=9999,
        generation_time=12.0,
        rounds=2500,
        drafted=9999,
        accepted=7499,
        peak_memory=123.4,
    )
    assert len(footer(big)) <= 80, footer(big)
    small = MTPStats(
        prompt_tokens=38,
        prompt_time=2.0,
        generation_tokens=39,
        generation_time=4.5,
        rounds=29,
        drafted=29,
        accepted=10,
        peak_memory=0.58,
    )
    assert footer(small).endswith(" | 0.6 GB") and len(footer(small)) <= 80
    assert footer(small, width=120).endswith("GB") and "GB" not in footer(big)
