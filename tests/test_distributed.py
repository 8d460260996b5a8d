"""MTP over mlx.distributed: 2 processes on 127.0.0.1 with MLX's ring backend.

Each test starts its processes once (``mlx.launch --backend ring -n 2``, or
two ranks by hand where exit codes matter: the launcher itself always exits
0) and bounds them with a timeout, killing the whole process group on expiry.
Greedy output must equal mlx-lm's plain greedy generation on one process.
"""

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step
from test_multilayer import build_multilayer

pytestmark = pytest.mark.slow  # end-to-end: see pyproject's markers

TIMEOUT = 300  # seconds per launch: generous for a loaded 2-core CI machine
MAX_TOKENS = 24
PROMPT = list(range(3, 40))
FAMILIES = ["deepseek_v3", "glm4_moe"]
MULTI = "deepseek_v3, 3 MTP layers"
# mlx.launch's own entry point (the console script may not be on PATH)
LAUNCH = (
    "import sys; from mlx._distributed_utils.launch import main; "
    "sys.argv[0] = 'mlx.launch'; sys.exit(main())"
)
# Runs under the launcher: every rank loads each model sharded, generates at
# draft-max 0..3 and writes one JSON line per run to a file of its own (the
# launcher merges the ranks' stdout, and under load it can join two ranks'
# lines into one).
WORKER = """
import json, sys
from pathlib import Path
from mlx_mtp import distributed, stream_generate

out, prompt, n = Path(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
for spec in sys.argv[4:]:
    path, sharding = spec.split("@")
    model, tokenizer = distributed.load(path, sharding=sharding)
    for k in range(4):
        tokens = []
        for r in stream_generate(model, tokenizer, prompt, n, draft_max=k, mtp=k > 0):
            tokens.append(r.token)
        with open(out / f"rank{model.sharding.rank}.jsonl", "a") as f:
            f.write(json.dumps({
                "rank": model.sharding.rank, "spec": spec, "mode": model.sharding.mode,
                "k": k, "tokens": tokens, "stats": r.stats.to_dict(),
            }) + "\\n")
"""


def _ports() -> int:
    """A port p with p and p + 1 free (the ring backend listens on one per rank)."""
    for _ in range(100):
        port = random.randint(20000, 60000)
        socks = []
        try:
            for p in (port, port + 1):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


class _Process:
    """A command in its own process group, stdout and stderr into files.

    stdin stays open until the end: mlx.launch busy-loops on a closed input
    (and never passes the end of it on to its processes)."""

    def __init__(self, argv, env=None, stdin: str = ""):
        self.out = tempfile.TemporaryFile("w+")
        self.err = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=self.out,
            stderr=self.err,
            text=True,
            env=env,
            cwd=tempfile.gettempdir(),
            start_new_session=True,
        )
        self.proc.stdin.write(stdin)
        self.proc.stdin.flush()

    def read_out(self) -> str:
        self.out.seek(0)
        return self.out.read()

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def finish(self, deadline: float):
        """(returncode, stdout, stderr); fails the test past ``deadline``."""
        try:
            code = self.proc.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"still running after {TIMEOUT} s: {self.proc.args[:6]}")
        finally:
            self.proc.stdin.close()
        self.out.seek(0)
        self.err.seek(0)
        return code, self.out.read(), self.err.read()


def start_ranks(commands, stdin: str = ""):
    """One process per rank, started as mlx.launch starts them (MLX_RANK and a
    ring hostfile): here each rank's exit code is seen, which mlx.launch hides."""
    port = _ports()
    hosts = Path(tempfile.mkdtemp()) / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    return [
        _Process(
            argv, dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=str(hosts)), stdin
        )
        for rank, argv in enumerate(commands)
    ]


def finish_ranks(procs, timeout: float = TIMEOUT):
    deadline = time.monotonic() + timeout
    try:
        return [p.finish(deadline) for p in procs]
    finally:
        for p in procs:
            p.kill()


def run_ranks(commands, stdin: str = ""):
    return finish_ranks(start_ranks(commands, stdin))


def launch(*command, stdin: str = ""):
    """``mlx.launch --backend ring -n 2 -- command`` on 127.0.0.1: (code, out, err)."""
    argv = [sys.executable, "-c", LAUNCH, "--backend", "ring", "-n", "2"]
    argv += ["--starting-port", str(_ports()), "--", *map(str, command)]
    return _Process(argv, stdin=stdin).finish(time.monotonic() + TIMEOUT)


def mtp_cli(*args):
    return [sys.executable, "-m", "mlx_mtp", *map(str, args)]


def launcher_problems(stderr: str, interrupted: bool = False):
    """The launcher's reports of ranks that failed or were killed.

    It prints them from one thread per rank, so two reports can interleave
    ("[WARN][WARN]  Node with rank 0 ...\nNode with rank 1 ..."): read the
    reports from the whole text, not line by line. ``interrupted``: the test
    stopped the process group with SIGINT, which the launcher, when it meets
    it inside its own ``select``, raises as a KeyboardInterrupt and passes on
    to the ranks, which then exit with 130 (128 + SIGINT): no problem."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", stderr)
    found = re.findall(r"Node with rank \d+ (?:was killed|exited with code -?\d+)", text)
    if interrupted:
        found = [f for f in found if not f.endswith("exited with code 130")]
    return found


def plain_greedy(folder, prompt, n=MAX_TOKENS):
    """mlx-lm's own greedy generation on one process."""
    model, _ = mlx_lm_load(str(folder))
    steps = generate_step(mx.array(prompt), model)
    return [int(t) for (t, _), _ in zip(steps, range(n))]


@pytest.fixture(scope="module")
def models(tiny_folders, tmp_path_factory):
    """(folder with MTP, trunk alone) per model: the two families, and DeepSeek-V3
    with 3 MTP layers (layer j drafts depth j + 1)."""
    out = {f: tiny_folders(f) for f in FAMILIES}
    out[MULTI] = build_multilayer(tmp_path_factory.mktemp("multi") / "ds3")
    return out


@pytest.fixture(scope="module")
def api_runs(models):
    """One launch: every model, pipeline and tensor, draft-max 0..3."""
    specs = [
        f"{full}@{mode}"
        for full, _ in models.values()
        for mode in ("pipeline", "tensor")
    ]
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(WORKER)
        code, _, err = launch(
            sys.executable, script, tmp, json.dumps(PROMPT), MAX_TOKENS, *specs
        )
        assert code == 0 and not launcher_problems(err), err
        lines = [
            line for f in sorted(Path(tmp).glob("rank*.jsonl"))
            for line in f.read_text().splitlines()
        ]  # fmt: skip
    return [json.loads(line) for line in lines]


@pytest.mark.parametrize("name", [*FAMILIES, MULTI])
@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_sharded_mtp_matches_single_process_greedy(api_runs, models, name, mode):
    full, trunk = models[name]
    expected = plain_greedy(trunk, PROMPT)
    runs = [r for r in api_runs if r["spec"] == f"{full}@{mode}"]
    assert sorted((r["rank"], r["k"]) for r in runs) == [
        (rank, k) for rank in (0, 1) for k in range(4)
    ]
    for r in runs:
        assert r["mode"] == mode
        assert r["tokens"] == expected, (r["rank"], r["k"])
        stats = r["stats"]
        assert stats["syncs"] == stats["rounds"]  # one collective per round
        if r["k"] > 0:
            assert stats["drafted"] > 0 and stats["accepted"] > 0


def test_generate_cli_under_launch(tiny_folders):
    full, trunk = tiny_folders("deepseek_v3")
    code, out, err = launch(
        *mtp_cli("generate", "-m", full, "-p", "hello", "-n", MAX_TOKENS),
        *("--no-chat-template", "--draft-max", 3, "--json"),
    )
    assert code == 0 and not launcher_problems(err), err
    lines = out.strip().splitlines()
    assert len(lines) == 1, out  # rank 0 prints, rank 1 is silent
    result = json.loads(lines[0])
    _, tokenizer = mlx_lm_load(str(trunk))
    assert result["tokens"] == plain_greedy(trunk, tokenizer.encode("hello"))
    stats = result["stats"]
    assert stats["accepted"] > 0 and stats["syncs"] == stats["rounds"]
    assert 0 < stats["sync_share"] < 1
    assert err.count("distributed: pipeline over 2 processes") == 1, err


def test_bad_model_path_on_one_rank_under_launch(tiny_folders, tmp_path):
    full, _ = tiny_folders("deepseek_v3")
    (tmp_path / "rank0").symlink_to(full)  # rank 1 looks for rank1: missing
    cmd = " ".join(mtp_cli("generate", "-m", f"{tmp_path}/rank$MLX_RANK", "-p", "hi"))
    code, out, err = launch("bash", "-c", f"exec {cmd}")
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: rank 1: {tmp_path}/rank1: no such file or folder"]
    assert "Traceback" not in err and out == ""
    # mlx.launch exits 0 whatever its processes do; it reports each one that
    # ended non-zero (or that it stopped once the first one had)
    for rank in (0, 1):
        assert any(f"rank {rank} " in line for line in launcher_problems(err)), err


def both(*args):
    return [mtp_cli(*args)] * 2


def test_bad_model_path_ends_every_rank_nonzero(tiny_folders, tmp_path):
    full, _ = tiny_folders("glm4_moe")
    bad = tmp_path / "missing"
    results = run_ranks(
        [
            mtp_cli("generate", "-m", full, "-p", "hi", "-n", 4),
            mtp_cli("generate", "-m", bad, "-p", "hi", "-n", 4),
        ]
    )
    assert [code for code, _, _ in results] == [1, 1]
    err = "".join(e for _, _, e in results)
    assert err.strip().splitlines() == [f"error: rank 1: {bad}: no such file or folder"]
    assert all(out == "" for _, out, _ in results)


def test_peer_dying_before_loading_ends_the_other(tiny_folders):
    """A rank that dies outright (no error to share) must not leave rank 0 waiting."""
    full, _ = tiny_folders("glm4_moe")
    die = "import os, mlx.core as mx; mx.distributed.init(); os._exit(9)"
    (code, out, err), (peer, _, _) = run_ranks(
        [mtp_cli("generate", "-m", full, "-p", "hi"), [sys.executable, "-c", die]]
    )
    assert peer == 9 and code == 1 and out == ""
    # MLX's ring backend prints its own "[ring] ..." lines about the lost peer
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "stopped before all had loaded" in errors[0], err
    assert "Traceback" not in err


def test_chat_over_two_ranks_with_tensor_sharding(tiny_folders):
    full, _ = tiny_folders("glm4_moe")
    results = run_ranks(
        both("chat", "-m", full, "-n", 8, "--sharding", "tensor"),
        stdin="hello\n/stats\n/quit\n",
    )
    assert [code for code, _, _ in results] == [0, 0], results
    (_, out, err), (_, out1, err1) = results
    assert out1 == err1 == ""  # rank 1 is silent
    # and the notice of a CPU where MTP cannot gain, where that is so, and the
    # mark of an answer cut by -n
    lines = [
        line
        for line in err.splitlines()
        if "MTP cannot gain" not in line and not line.startswith("[cut at ")
    ]
    assert lines[0] == "distributed: tensor over 2 processes", err
    assert len(lines) == 2 and "/pass" in lines[1], err  # the answer's footer
    assert "collective: " in out  # /stats totals


def test_ranks_drafting_differently_stop_together(tiny_folders):
    """A rank whose head differs (say, another MLX build) would verify other
    tokens than those emitted: every rank stops with one line instead."""
    full, _ = tiny_folders("glm4_moe")
    other, _ = tiny_folders("glm4_moe", seed=1)
    args = ["generate", "-m", full, "-p", "hello", "-n", 16, "--draft-max", 2]
    head = other / "model.safetensors"  # holds the MTP layer of another model
    results = run_ranks([mtp_cli(*args), mtp_cli(*args, "--mtp", head)])
    assert [code for code, _, _ in results] == [1, 1], results
    err = "".join(e for _, _, e in results)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "drafted different tokens" in errors[0], err
    assert "Traceback" not in err


def test_ctrl_c_ends_a_distributed_chat(tiny_folders):
    """Ctrl-C reaches every process (a terminal signals the whole group), each at
    its own moment: they must all end, not wait on each other for ever."""
    full, _ = tiny_folders("glm4_moe")
    procs = start_ranks(both("chat", "-m", full, "-n", 100000), stdin="hello\n")
    deadline = time.monotonic() + TIMEOUT
    # the answer has begun (piped input is echoed after the prompt)
    while not procs[0].read_out().partition(">>> hello\n")[2]:
        assert time.monotonic() < deadline and procs[0].proc.poll() is None
        time.sleep(0.2)
    for p in procs:
        p.proc.send_signal(signal.SIGINT)
    results = finish_ranks(procs, timeout=60)
    assert [code for code, _, _ in results] == [-signal.SIGINT] * 2


def test_bench_over_two_ranks_reports_the_collective(tiny_folders, tmp_path):
    full, _ = tiny_folders("glm4_moe")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello there\n")
    results = run_ranks(
        both(
            "bench",
            "-m",
            full,
            "--prompts",
            prompts,
            "-n",
            18,
            "-r",
            1,
            "--draft-max",
            2,
            "--json",
        )
    )
    assert [code for code, _, _ in results] == [0, 0], results
    result = json.loads(results[0][1])
    assert all(c["same_output"] for c in result["configs"])
    d = result["distributed"]
    assert d["sharding"] == "pipeline" and d["processes"] == 2
    assert d["syncs"] > 0 and 0 < d["sync_share"] < 1


def test_unsharded_family_runs_replicated_with_one_notice(tiny_folders):
    full, trunk = tiny_folders("mimo")
    results = run_ranks(
        both(
            "generate",
            "-m",
            full,
            "-p",
            "hello",
            "-n",
            12,
            "--no-chat-template",
            "--draft-max",
            2,
            "--json",
        )
    )
    assert [code for code, _, _ in results] == [0, 0], results
    (_, out, err), _ = results
    # besides the notice of a CPU where MTP cannot gain, where that is so
    lines = [line for line in err.splitlines() if "MTP cannot gain" not in line]
    assert lines[-1].startswith("notice: mimo: mlx-lm has no")
    assert sum(line.startswith("notice:") for line in lines) == 1, err
    _, tokenizer = mlx_lm_load(str(trunk))
    expected = plain_greedy(trunk, tokenizer.encode("hello"), 12)
    assert json.loads(out)["tokens"] == expected
