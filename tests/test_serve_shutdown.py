"""``mlx-mtp serve`` stops cleanly on SIGINT and SIGTERM while streams run:
they finish (or, past ``--shutdown-timeout``, end with "length"), every
client gets its last chunk, and the process exits 0."""

import signal
import threading
import time

import pytest
from test_cli_serve import Served

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def folder(tiny_folders):
    return str(tiny_folders("deepseek_v3")[0])


class Streams:
    """``n`` streamed chat requests through the official client, in threads."""

    def __init__(self, served: Served, n: int, max_tokens: int):
        import openai

        client = openai.OpenAI(
            base_url=f"{served.url}/v1", api_key="none", max_retries=0
        )
        self.started = threading.Barrier(n + 1, timeout=60)
        self.results = [None] * n
        self.threads = [
            threading.Thread(target=self._one, args=(client, i, max_tokens))
            for i in range(n)
        ]
        for t in self.threads:
            t.start()
        self.started.wait()  # every stream has its first text

    def _one(self, client, i: int, max_tokens: int) -> None:
        text, finish, usage, first = [], None, None, True
        try:
            stream = client.chat.completions.create(
                model="",
                messages=[{"role": "user", "content": f"Story number {i}"}],
                max_tokens=max_tokens,
                temperature=0.0,
                stream=True,
                stream_options={"include_usage": True},
            )
            for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    text.append(choice.delta.content or "")
                    finish = choice.finish_reason or finish
                    if first and choice.delta.content:
                        first = False
                        self.started.wait()
            self.results[i] = ("".join(text), finish, usage)
        except Exception as e:  # what the test reports
            self.results[i] = e
            if first:
                self.started.abort()

    def join(self, timeout: float = 60):
        for t in self.threads:
            t.join(timeout)
        return self.results


def _exit_code(served: Served, timeout: float) -> int:
    try:
        return served.process.wait(timeout=timeout)
    finally:
        if served.process.poll() is None:
            served.process.kill()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_lets_running_streams_finish_then_exits_0(folder, sig):
    served = Served("--model", folder, "--shutdown-timeout", "60")
    streams = Streams(served, 3, max_tokens=300)
    served.process.send_signal(sig)
    results = streams.join()
    assert _exit_code(served, 60) == 0, served.process.stderr.read()
    log = served.process.stderr.read()
    assert "terminate called" not in log and "Traceback" not in log, log
    said = [line for line in log.splitlines() if "shutting down" in line]
    assert said == [
        "shutting down: running requests may go on for 60 s (Ctrl-C again ends "
        "them now)"
    ]
    for r in results:
        assert not isinstance(r, Exception), r
        text, finish, usage = r
        assert finish in ("stop", "length")
        # nothing was cut short: a "length" answer has all its tokens
        assert finish == "stop" or usage.completion_tokens == 300


def test_past_the_shutdown_timeout_streams_end_with_length(folder):
    served = Served("--model", folder, "--shutdown-timeout", "0.5")
    streams = Streams(served, 2, max_tokens=100_000)
    tic = time.perf_counter()
    served.process.send_signal(signal.SIGINT)
    results = streams.join()
    assert _exit_code(served, 60) == 0, served.process.stderr.read()[-2000:]
    assert time.perf_counter() - tic < 30
    for r in results:
        assert not isinstance(r, Exception), r
        text, finish, usage = r
        assert finish == "length"
        assert 0 < usage.completion_tokens < 100_000


def test_a_second_sigint_ends_the_streams_at_once(folder):
    served = Served("--model", folder, "--shutdown-timeout", "600")
    streams = Streams(served, 2, max_tokens=100_000)
    served.process.send_signal(signal.SIGINT)
    time.sleep(0.5)
    served.process.send_signal(signal.SIGINT)
    results = streams.join()
    assert _exit_code(served, 60) == 0, served.process.stderr.read()[-2000:]
    assert all(r[1] == "length" for r in results), results
    log = served.process.stderr.read()
    assert "shutting down now: the running requests end here" in log
