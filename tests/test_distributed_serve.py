"""``mlx-mtp serve`` over several processes on 127.0.0.1 (MLX's ring backend):
one server, rank 0 listening.

The answers (official OpenAI and Anthropic clients, streamed and not, one
stream and four at once, with and without drafts) must be those of the
single-process server on the same model, for a pipeline-split family and a
tensor-sharded one. Faults end every rank: SIGINT under load (exit 0), a
killed rank (503s, rank 0 exits non-zero within seconds), a rank started
with other settings (one line at start).
"""

import json
import os
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import anthropic
import openai
import pytest
import tiny
from live_server import LiveServer
from test_distributed import LAUNCH, _ports, _Process, launcher_problems

import mlx_mtp
from mlx_mtp.serve import ServeConfig

pytestmark = pytest.mark.slow  # end-to-end: see pyproject's markers

START = 240  # seconds for every rank to load and rank 0 to listen
MAX_TOKENS = 16
SCHEMA = {
    "name": "sea",
    "schema": {
        "type": "object",
        "properties": {
            "colour": {"enum": ["grey", "green"]},
            "depth": {"type": "integer"},
        },
        "required": ["colour", "depth"],
    },
}
PROMPTS = ["Tell me about the sea.", "Count to ten.", "Why is the sky blue?",
           "Write a short poem."]  # fmt: skip


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_cmd(folder, port: int, *args) -> list:
    return [sys.executable, "-m", "mlx_mtp", "serve", "-m", str(folder),
            "--port", str(port), "-n", str(MAX_TOKENS), *map(str, args)]  # fmt: skip


def hostfile(n: int) -> str:
    port = _ports()  # p and p + 1 free; more ranks take the next ones
    path = Path(tempfile.mkdtemp()) / "hosts.json"
    path.write_text(json.dumps([[f"127.0.0.1:{port + r}"] for r in range(n)]))
    return str(path)


def env() -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def start_ranks(commands):
    """One process per rank, as mlx.launch starts them: each exit code is seen."""
    hosts = hostfile(len(commands))
    return [
        _Process(argv, {**env(), "MLX_RANK": str(r), "MLX_HOSTFILE": hosts})
        for r, argv in enumerate(commands)
    ]


def launch(n: int, command) -> _Process:
    argv = [sys.executable, "-c", LAUNCH, "--backend", "ring", "-n", str(n)]
    argv += ["--starting-port", str(_ports()), "--", *command]
    return _Process(argv, env())


def wait_up(port: int, procs) -> None:
    deadline = time.monotonic() + START
    while time.monotonic() < deadline:
        if any(p.proc.poll() is not None for p in procs):
            break
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return
        except OSError:
            time.sleep(0.3)
    for p in procs:
        p.kill()
    errors = [p.err.seek(0) or p.err.read() for p in procs]
    pytest.fail(f"the server did not start: {errors}")


def health(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as r:
        return json.loads(r.read())


def post(port: int, path: str, body: dict):
    """``(status, body)`` of a raw POST, error statuses included."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# -- the requests, and their answers ---------------------------------------------


def answers(url: str) -> dict:
    """Every kind of request, each with and without drafts; then four streams
    at once. Returns the texts by request."""
    oa = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    an = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    out = {}
    for k in (0, 2):
        extra = {"draft_max": k}
        chat = [{"role": "user", "content": PROMPTS[0]}]
        r = oa.chat.completions.create(
            model="m", messages=chat, temperature=0, extra_body=extra
        )
        out["chat", k] = r.choices[0].message.content
        parts = oa.chat.completions.create(
            model="m", messages=chat, temperature=0, stream=True, extra_body=extra
        )
        out["chat stream", k] = "".join(
            c.choices[0].delta.content or "" for c in parts if c.choices
        )
        r = oa.completions.create(
            model="m", prompt=PROMPTS[1], temperature=0, extra_body=extra
        )
        out["text", k] = r.choices[0].text
        m = an.messages.create(
            model="m", max_tokens=MAX_TOKENS, messages=chat, extra_body=extra
        )
        out["messages", k] = m.content[0].text if m.content else ""
        with an.messages.stream(
            model="m", max_tokens=MAX_TOKENS, messages=chat, extra_body=extra
        ) as s:
            out["messages stream", k] = "".join(s.text_stream)
        # a constraint, built from the request on every rank
        r = oa.chat.completions.create(
            model="m", messages=chat, max_tokens=60, extra_body=extra,
            response_format={"type": "json_schema", "json_schema": SCHEMA},
        )  # fmt: skip
        out["json", k] = r.choices[0].message.content
        r = oa.chat.completions.create(
            model="m", messages=chat, temperature=1.0, seed=3, extra_body=extra
        )
        out["sampled", k] = r.choices[0].message.content
        out["together", k] = together(oa, extra)
    return out


def together(oa, extra) -> list:
    """Four chat streams sent at once (they decode as one batch)."""
    texts = [None] * len(PROMPTS)

    def one(i):
        parts = oa.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": PROMPTS[i]}],
            temperature=0,
            stream=True,
            extra_body=extra,
        )
        texts[i] = "".join(c.choices[0].delta.content or "" for c in parts)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return texts


@pytest.fixture(scope="module")
def alone(tiny_folders):
    """The single-process server's answers, per family."""
    cache = {}

    def get(folder):
        if folder not in cache:
            model, tokenizer = mlx_mtp.load(folder)
            config = ServeConfig(max_tokens=MAX_TOKENS)
            server = LiveServer(model, tokenizer, Path(folder).name, config)
            try:
                cache[folder] = answers(server.url)
            finally:
                server.close()
        return cache[folder]

    return get


def run_cluster(procs, port: int):
    """The answers of a cluster server and its ``/health``; then SIGINT to the
    server, whose ranks all end."""
    wait_up(port, procs)
    try:
        out = answers(f"http://127.0.0.1:{port}")
        info = health(port)
    finally:  # Ctrl-C: by hand to rank 0; to mlx.launch as a terminal sends
        # it, to the launcher and every rank
        os.killpg(procs[0].proc.pid, signal.SIGINT)
    deadline = time.monotonic() + 60
    return out, info, [p.finish(deadline) for p in procs]


def test_pipeline_over_mlx_launch_answers_as_one_process(tiny_folders, alone):
    folder = tiny_folders("deepseek_v3")[0]
    port = _free_port()
    proc = launch(2, serve_cmd(folder, port, "--sharding", "pipeline"))
    out, info, [(code, _, err)] = run_cluster([proc], port)
    assert out == alone(folder)
    # every rank ended 0, or 130 where mlx.launch passed the Ctrl-C on; it
    # dies of the Ctrl-C itself (a traceback)
    assert code in (0, -signal.SIGINT) and not launcher_problems(err, True), err
    assert any(out["together", 2])  # four streams, each with text
    c = info["cluster"]
    assert c["processes"] == 2 and c["sharding"] == "pipeline"
    # one plan a turn, one decision a round: 2 collectives a round
    assert c["rounds"] > 0 and c["decision_collectives"] == c["rounds"]
    assert c["plan_collectives"] >= c["turns"] > 0
    assert 0 < c["collective_share"] < 1 and c["plan_ms"] > 0
    assert info["peak_batch"] == 4 and err.count(f"serving {folder.name} on") == 1


def test_tensor_sharding_answers_as_one_process(tiny_folders, alone):
    folder = tiny_folders("glm4_moe")[0]
    port = _free_port()
    procs = start_ranks([serve_cmd(folder, port, "--sharding", "tensor")] * 2)
    out, info, results = run_cluster(procs, port)
    assert [code for code, _, _ in results] == [0, 0], results
    assert out == alone(folder)
    assert info["cluster"]["sharding"] == "tensor"


def test_three_processes_answer_as_one(tmp_path):
    full, _ = tiny.build_folder(tmp_path / "ds3", "deepseek_v3", num_hidden_layers=3)
    port = _free_port()
    proc = launch(3, serve_cmd(full, port, "--draft-max", 2))
    wait_up(port, [proc])
    try:
        oa = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        spread = together(oa, {})
    finally:
        os.killpg(proc.proc.pid, signal.SIGINT)
    code, _, err = proc.finish(time.monotonic() + 60)
    assert code in (0, -signal.SIGINT) and not launcher_problems(err, True), err
    assert "distributed: pipeline over 3 processes" in err
    model, tokenizer = mlx_mtp.load(full)
    server = LiveServer(model, tokenizer, "ds3", ServeConfig(max_tokens=MAX_TOKENS))
    try:
        assert spread == together(server.client(), {})
    finally:
        server.close()


# -- faults ---------------------------------------------------------------------


def stream_in_thread(port: int, results: list, i: int, max_tokens: int):
    def run():
        try:
            body = {"prompt": PROMPTS[i], "max_tokens": max_tokens}
            results[i] = post(port, "/v1/completions", body)
        except Exception as e:  # noqa: BLE001 - the test reads it
            results[i] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def busy(port: int, n: int) -> None:
    deadline = time.monotonic() + 60
    while health(port)["decoding"] < n:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_sigint_under_load_ends_every_rank(tiny_folders):
    folder = tiny_folders("deepseek_v3")[0]
    port = _free_port()
    cmd = serve_cmd(folder, port, "--shutdown-timeout", 1)
    procs = start_ranks([cmd, cmd])
    wait_up(port, procs)
    results = [None] * 4
    threads = [stream_in_thread(port, results, i, 100000) for i in range(4)]
    busy(port, 4)
    tic = time.monotonic()
    procs[0].proc.send_signal(signal.SIGINT)
    ends = [p.finish(time.monotonic() + 60) for p in procs]
    assert [code for code, _, _ in ends] == [0, 0], ends
    assert time.monotonic() - tic < 30
    for t in threads:
        t.join(10)
    # the running answers end where they are, as on one process
    assert [r[0] for r in results] == [200] * 4, results
    assert all(r[1]["choices"][0]["finish_reason"] == "length" for r in results)


def test_a_killed_rank_gives_503_and_ends_rank_0(tiny_folders):
    folder = tiny_folders("deepseek_v3")[0]
    port = _free_port()
    procs = start_ranks([serve_cmd(folder, port)] * 2)
    wait_up(port, procs)
    results = [None] * 2
    threads = [stream_in_thread(port, results, i, 100000) for i in range(2)]
    busy(port, 2)
    tic = time.monotonic()
    os.killpg(procs[1].proc.pid, signal.SIGKILL)
    time.sleep(0.3)
    status, body = post(port, "/v1/completions", {"prompt": "hi"})
    for t in threads:
        t.join(10)
    code, _, err = procs[0].finish(time.monotonic() + 10)
    assert code != 0 and time.monotonic() - tic < 10, err
    assert status == 503 and "rank 1" in body["error"]["message"], body
    assert [r[0] for r in results] == [503, 503], results
    # one line of its own (MLX's "[ring] ..." lines about the lost peer may
    # be written into the middle of it)
    assert err.count("error: ") == 1 and "Traceback" not in err, err
    assert err.count("error: rank 1 of this server stopped") == 1, err
    procs[1].finish(time.monotonic() + 5)


def test_a_rank_with_other_settings_is_refused_in_one_line(tiny_folders):
    folder = tiny_folders("deepseek_v3")[0]
    port = _free_port()
    procs = start_ranks(
        [serve_cmd(folder, port), serve_cmd(folder, port, "--max-batch", 4)]
    )
    results = [p.finish(time.monotonic() + START) for p in procs]
    assert [code for code, _, _ in results] == [1, 1], results
    (_, _, err), (_, _, err1) = results
    assert err.strip().splitlines() == [
        "error: rank 1 was started with another --max-batch than rank 0: start "
        "every rank with the same serve command and model"
    ]
    assert err1 == ""  # the other ranks are quiet
    with pytest.raises(OSError):  # it never listened
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)


def test_quantized_caches_over_two_processes_answer_as_one(tmp_path):
    """--kv-bits over mlx.launch: every rank's caches quantized, the answers
    (four streams at once, with drafts) those of one process."""
    full, _ = tiny.build_folder(
        tmp_path / "q", "glm4_moe", num_attention_heads=2, head_dim=32
    )
    kv = ["--kv-bits", 8, "--kv-group-size", 32, "--quantized-kv-start", 0]
    port = _free_port()
    proc = launch(
        2, serve_cmd(full, port, "--sharding", "pipeline", "--draft-max", 2, *kv)
    )
    wait_up(port, [proc])
    try:
        oa = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        spread = together(oa, {})
    finally:
        os.killpg(proc.proc.pid, signal.SIGINT)
    code, _, err = proc.finish(time.monotonic() + 60)
    assert code in (0, -signal.SIGINT) and not launcher_problems(err, True), err
    assert "KV cache: 8-bit keys and values" in err
    from mlx_mtp.kv import KVSettings

    model, tokenizer = mlx_mtp.load(full)
    config = ServeConfig(max_tokens=MAX_TOKENS, kv=KVSettings(8, 32, 0))
    server = LiveServer(model, tokenizer, "q", config)
    try:
        assert spread == together(server.client(), {})
    finally:
        server.close()
