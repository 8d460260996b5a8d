"""``mlx-mtp serve`` as a command: it listens where it is told and each flag
reaches the server."""

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import pytest

from mlx_mtp.serve import DEFAULT_LOOKUP_MEMORY_MB

# the checkout's mlx_mtp/ would shadow the installed package
NOT_THE_CHECKOUT = tempfile.gettempdir()


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Served:
    """``mlx-mtp serve`` in a subprocess, stopped on exit."""

    def __init__(self, *args: str, host: str = "127.0.0.1", env=None):
        self.port = _free_port(host)
        self.url = f"http://{host}:{self.port}"
        cmd = [sys.executable, "-m", "mlx_mtp", "serve", "--port", str(self.port)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.process = subprocess.Popen(
            cmd + list(args),
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=NOT_THE_CHECKOUT,
        )
        self.log = ""  # to "serving ... on ...", once up (notices before it)
        while "serving" not in self.log and self.process.poll() is None:
            line = self.process.stderr.readline()
            if not line:
                break
            self.log += line
        if self.process.poll() is not None or "serving" not in self.log:
            self.log += self.process.stderr.read()
            raise RuntimeError(f"the server did not start: {self.log}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.process.terminate()
        self.process.wait(timeout=30)

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.loads(r.read())

    def complete(self, **body) -> dict:
        request = urllib.request.Request(
            self.url + "/v1/completions",
            data=json.dumps({"prompt": "Once upon a time", **body}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as r:
            return json.loads(r.read())


@pytest.fixture(scope="module")
def folder(tiny_folders):
    return str(tiny_folders("deepseek_v3")[0])


def test_defaults_and_flags_reach_the_server(folder):
    args = ["--model", folder, "--max-tokens", "5", "--draft-max", "0"]
    args += ["--max-batch", "1", "--prompt-cache-entries", "0"]
    args += ["--lookup-memory-mb", "0", "--reasoning-parser", "think"]
    with Served(*args) as s:
        assert s.log.strip().endswith(f"on http://127.0.0.1:{s.port}/v1")
        first = s.complete()
        assert first["usage"]["completion_tokens"] == 5  # --max-tokens
        assert first["usage"]["mtp"]["drafted"] == 0  # --draft-max 0
        again = s.complete()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # --max-batch 1: two requests at once are served one after the other
        threads = [threading.Thread(target=s.complete, kwargs={"max_tokens": 30})]
        threads.append(threading.Thread(target=s.complete, kwargs={"max_tokens": 30}))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        health = s.get("/health")
        assert health["peak_batch"] == 1 and health["max_batch"] == 1
        assert health["draft_policy"] == "adaptive"
        assert health["prompt_cache"]["max_entries"] == 0
        assert health["lookup_memory"]["max_bytes"] == 0  # --lookup-memory-mb 0
        assert health["reasoning_parser"] == "think"


def test_more_flags(folder):
    args = ["--model", folder, "--draft-max", "2", "--fixed-draft"]
    args += ["--prompt-cache-mb", "0", "--host", "127.0.0.2"]
    with Served(*args, host="127.0.0.2") as s:  # --host
        r = s.complete(max_tokens=12)
        assert 0 < r["usage"]["mtp"]["drafted"] <= 2 * r["usage"]["mtp"]["rounds"]
        assert s.get("/health")["draft_policy"] == "fixed"
        memory = s.get("/health")["lookup_memory"]  # the default size, in use
        assert memory["max_bytes"] == DEFAULT_LOOKUP_MEMORY_MB << 20
        assert memory["tokens"] > 0
        assert s.get("/health")["reasoning_parser"] is None  # its template: none
        again = s.complete(max_tokens=12)  # --prompt-cache-mb 0 keeps nothing
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert s.get("/health")["prompt_cache"]["entries"] == 0
        with pytest.raises(urllib.error.URLError):  # not on 127.0.0.1
            urllib.request.urlopen(f"http://127.0.0.1:{s.port}/health", timeout=5)


def test_no_mtp(folder):
    with Served("--model", folder, "--no-mtp") as s:
        r = s.complete(max_tokens=8, draft_max=3)
        assert r["usage"]["mtp"]["drafted"] == 0
        assert s.get("/health")["mtp"] is False


def test_guard_flags_reach_the_server(folder):
    import httpx2

    key, origin = "k-from-the-environment", "http://app.example"
    args = ["--model", folder, "--host", "0.0.0.0", "--cors-origin", origin]
    args += ["--strict-model-names", "--max-body-mb", "1"]
    with Served(*args, env={"MLX_MTP_API_KEY": key}) as s:
        # beyond loopback with a key: no warning
        with open(f"/proc/{s.process.pid}/cmdline", "rb") as f:
            assert key.encode() not in f.read()

        def post(path, body, key=key, **headers):
            headers["Authorization"] = f"Bearer {key}"
            return httpx2.post(s.url + path, json=body, headers=headers, timeout=60)

        body = {"prompt": "abc", "max_tokens": 2}
        assert post("/v1/completions", body).status_code == 200
        assert post("/v1/completions", body, key="other").status_code == 401
        assert post("/v1/completions", {**body, "model": "gpt-4o"}).status_code == 404
        big = {"prompt": "x" * (2 << 20)}
        assert post("/v1/completions", big).status_code == 413
        r = httpx2.options(
            s.url + "/v1/completions",
            headers={"Origin": origin, "Access-Control-Request-Method": "POST"},
        )
        assert r.headers["access-control-allow-origin"] == origin


def test_beyond_loopback_without_a_key_it_warns(folder):
    with Served("--model", folder, "--host", "0.0.0.0") as s:
        warning = s.process.stderr.readline()
        assert warning.startswith("warning: 0.0.0.0 is reachable from other machines")
        assert "--api-key" in warning


def test_an_empty_api_key_is_one_line(folder):
    from mlx_mtp.cli import app
    from typer.testing import CliRunner

    r = CliRunner().invoke(
        app, ["serve", "--model", folder], env={"MLX_MTP_API_KEY": " "}
    )
    assert r.exit_code == 1
    assert r.stderr.strip().splitlines() == [
        "error: the API key is empty (--api-key or MLX_MTP_API_KEY)"
    ]


def test_an_unknown_reasoning_parser_is_one_line(folder):
    from mlx_mtp.cli import app
    from typer.testing import CliRunner

    r = CliRunner().invoke(
        app, ["serve", "--model", folder, "--reasoning-parser", "eagle"]
    )
    assert r.exit_code == 1
    [line] = r.stderr.strip().splitlines()
    assert line.startswith("error: --reasoning-parser: reasoning parser must be one")


def test_a_bad_model_folder_is_one_line(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "mlx_mtp", "serve", "--model", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=NOT_THE_CHECKOUT,
    )
    assert out.returncode == 1
    assert out.stderr.startswith("error: ") and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_a_port_in_use_is_one_line(folder):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        start = time.time()
        out = subprocess.run(
            [sys.executable, "-m", "mlx_mtp", "serve", "--model", folder,
             "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=NOT_THE_CHECKOUT,
        )  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "Traceback" not in out.stderr and time.time() - start < 120
