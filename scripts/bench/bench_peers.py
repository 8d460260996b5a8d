"""mlx-mtp beside its MLX peers on the same weights, interleaved (not a test).

Every engine runs in its own virtual environment, never as a dependency of
mlx-mtp, one process per engine and repetition, the engines in a rotating
order, and each engine's modes in a rotating order inside its process:

- ``mlx-lm``: plain ``generate_step`` (the common baseline);
- ``mlx-mtp``: plain (``mtp=False``), ``auto`` (the default), fixed
  ``k1`` / ``k3`` (``draft_source="mtp"``, ``adaptive_draft=False``);
- ``mlx-vlm``: plain ``generate_step`` and its MTP drafter
  (``speculative.drafters.load_drafter(path, kind="mtp")``) at draft block
  2 and 4 (1 and 3 drafts; ``prefer_requested_block_size``);
- ``MTPLX``: ``generate_ar``, ``generate_mtp1``, ``generate_mtpk`` at depth 3
  (``verify_strategy="batched"``; the Linux stand-in for libSystem's clocks
  is compiled here as in ``bench_mtplx.py``), timed by MTPLX's own decode
  clock (``GenerationStats.decode_tok_s``): its speculative paths take no
  token callback.

With ``--dflash DIR`` (a DFlash drafter of the target, e.g. a random one that
never agrees) the modes add ``mlx-mtp`` ``dflash`` and ``mlx-vlm``
``dflash``, and ``--dflash-python`` adds ``dflash-mlx`` (its
``stream_dflash_generate``; its plain decoding is mlx-lm's, in its venv).

Printed per mode: median decode tokens per second (first token to last, so
the prompt's prefill is out), its ratio to the engine's own plain decoding
and to mlx-lm's (medians over prompts and repetitions of per-run ratios
within one process, and across processes for mlx-lm), tokens per target
forward where the engine tells it, and whether the greedy tokens equal
mlx-lm's.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
    python scripts/bench/bench_peers.py MODEL --vlm-python VENV/bin/python \\
        --mtplx-python VENV2/bin/python [--dflash DRAFTER --dflash-python VENV3/bin/python]
        [--tokens 48] [--prompts 2] [--reps 3]

With ``--image PNG`` (a vision-language folder: ``build_bench_model.py
--family qwen3_5 --vision``) every prompt reads the image first, as
mlx-mtp's processor makes it (the same tokens and pixels for both engines);
only mlx-mtp and mlx-vlm run, and mlx-vlm's plain decoding is the
reference.

The model is a Qwen3.5-shaped folder (``build_bench_model.py --family
qwen3_5``) whose ``rope_parameters`` carry an ``mrope_section`` (mlx-vlm's
config needs one; with text alone every section sees the same positions, so
the model is the one mlx-lm runs).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_mtplx import STUB  # noqa: E402

ENGINE_MODES = {
    "mlx-lm": ["plain"],
    "mlx-mtp": ["plain", "auto", "k1", "k3"],
    "mlx-vlm": ["plain", "b2", "b4"],
    "MTPLX": ["plain", "mtp1", "mtpk3"],
    "dflash-mlx": ["plain", "dflash"],
}


def prompts(n, length=40):
    rows = [
        [(a * i + b) % 256 for i in range(length)]
        for a, b in ((7, 3), (13, 5), (31, 11), (17, 2))
    ]
    return rows[:n]


def image_prompts(args):
    """``args.prompts`` text prompts after ``args.image``, as mlx-mtp's
    processor reads them (tokens and the image's pixels): both engines
    decode the same tokens."""
    from pathlib import Path

    from mlx_lm.utils import load_tokenizer
    from mlx_mtp import vision

    vp = vision.processor_for(Path(args.model), load_tokenizer(Path(args.model)))
    texts = ["Describe the picture.", "What is in it?", "Name its colours.",
             "Write a caption."]  # fmt: skip
    return [vp.prompt(t, args.image) for t in texts[: args.prompts]]


class Clock:
    """Times a generation from its first token to its last."""

    def __init__(self):
        self.first = None
        self.n_first = 0
        self.n = 0

    def tokens(self, n):
        if self.first is None:
            self.first, self.n_first = time.perf_counter(), n
        self.n = n

    def row(self, tokens, **extra):
        span = time.perf_counter() - self.first
        return dict(tokens=tokens, tps=(len(tokens) - self.n_first) / span, **extra)


def side_mlx_lm(args, modes):
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, _ = load_model(args.model_path)

    def one(p, mode):
        c, out = Clock(), []
        for t, _ in generate_step(
            mx.array(p), model, max_tokens=args.tokens,
            sampler=lambda x: mx.argmax(x, axis=-1),
        ):
            out.append(int(t))
            c.tokens(len(out))
        return c.row(out)

    return one


def side_mlx_mtp(args, modes):
    import mlx_mtp

    model, tok = mlx_mtp.load(args.model)
    # every engine here generates max_tokens, past an end token (mlx-lm's and
    # mlx-vlm's generate_step do not stop at one)
    for t in (tok, getattr(tok, "tokenizer", None)):
        if t is not None and hasattr(t, "_eos_token_ids"):
            t._eos_token_ids = set()
    draft = None
    if args.dflash:
        draft, _ = mlx_mtp.load(args.model, draft=args.dflash)
    kw = {
        "plain": dict(mtp=False),
        "auto": {},
        "k1": dict(draft_max=1, adaptive_draft=False, draft_source="mtp"),
        "k3": dict(draft_max=3, adaptive_draft=False, draft_source="mtp"),
        "dflash": dict(draft_source="dflash"),
    }

    def one(p, mode):
        m = draft if mode == "dflash" else model
        if isinstance(p, int):  # an image prompt, by its index
            p = args.image_prompts[p]
        c, out, last = Clock(), [], None
        for r in mlx_mtp.stream_generate(m, tok, p, args.tokens, **kw[mode]):
            out.append(int(r.token))
            c.tokens(len(out))
            last = r
        s = last.stats
        return c.row(
            out,
            per_forward=s.generation_tokens / max(s.rounds, 1),
            accepted=f"{s.accepted}/{s.drafted}",
        )

    return one


def _counting(module):
    """Counts the calls of ``module`` (its class swapped for a subclass)."""
    base = type(module)
    calls = [0]

    def __call__(self, *a, **kw):
        calls[0] += 1
        return base.__call__(self, *a, **kw)

    module.__class__ = type(base.__name__, (base,), {"__call__": __call__})
    return calls


def side_mlx_vlm(args, modes):
    import mlx.core as mx
    from mlx_vlm import load
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.speculative.drafters import load_drafter

    model, _ = load(args.model)
    calls = _counting(model.language_model)
    drafters = {}
    if any(m.startswith("b") for m in modes):
        d, _ = load_drafter(args.model, kind="mtp")
        d.prefer_requested_block_size = True
        drafters["mtp"] = d
    if "dflash" in modes:
        d, _ = load_drafter(args.dflash, kind="dflash")
        drafters["dflash"] = d

    def one(p, mode):
        kw = dict(max_tokens=args.tokens, temperature=0.0)
        if mode.startswith("b"):
            kw.update(draft_model=drafters["mtp"], draft_kind="mtp",
                      draft_block_size=int(mode[1:]))
        elif mode == "dflash":
            kw.update(draft_model=drafters["dflash"], draft_kind="dflash")
        pixels = None
        if isinstance(p, int):  # an image prompt, by its index
            p = args.image_prompts[p]
            pixels = mx.concatenate(
                [mx.array(s.data["pixel_values"]) for s in p.segments]
            )
            kw["image_grid_thw"] = mx.array([s.data["grid_thw"] for s in p.segments])
            p = list(p.tokens)
        c, out = Clock(), []
        for item in generate_step(mx.array([p]), model, pixels, None, **kw):
            t = item[0]
            for x in (t.tolist() if hasattr(t, "tolist") else [t]):
                if isinstance(x, list):
                    out.extend(int(v) for v in x)
                else:
                    out.append(int(x))
            if c.first is None:
                calls[0] = 0
            c.tokens(len(out))
        out = out[: args.tokens]
        return c.row(out, per_forward=(len(out) - c.n_first) / max(calls[0], 1))

    return one


def side_mtplx(args, modes):
    import ctypes

    stub, init = os.environ["MLX_MTP_LIBSYSTEM_STUB"], ctypes.CDLL.__init__

    def patched(self, name, *a, **kw):
        init(self, stub if name == "/usr/lib/libSystem.B.dylib" else name, *a, **kw)

    ctypes.CDLL.__init__ = patched
    from mtplx.generation import generate_ar, generate_mtp1, generate_mtpk
    from mtplx.runtime import load
    from mtplx.sampling import SamplerConfig

    rt = load(args.model, mtp=True)
    greedy = SamplerConfig(temperature=0.0, top_p=1.0, top_k=0)
    spec = dict(sampler=greedy, draft_sampler=greedy, verify_strategy="batched")

    def one(p, mode):
        # MTPLX's speculative paths take no token callback: its own decode
        # clock (GenerationStats.decode_tok_s, prefill out) times every mode
        t = time.perf_counter()
        # no stop token: every engine here generates max_tokens
        kw = dict(max_tokens=args.tokens, stop_token_ids=set())
        if mode == "plain":
            out = generate_ar(rt, p, sampler=greedy, **kw)
        elif mode == "mtp1":
            out = generate_mtp1(rt, p, **spec, **kw)
        else:
            out = generate_mtpk(rt, p, speculative_depth=3, **spec, **kw)
        toks = [int(x) for x in out.tokens]
        st = out.stats
        tps = st.decode_tok_s or len(toks) / (time.perf_counter() - t)
        return dict(tokens=toks, tps=tps)

    return one


def side_dflash_mlx(args, modes):
    from dflash_mlx.engine.events import TokenEvent
    from dflash_mlx.runtime import stream_dflash_generate
    from dflash_mlx.runtime.bundle import load_runtime_bundle
    from dflash_mlx.runtime.context import build_offline_runtime_context

    plain = side_mlx_lm(args, ["plain"])  # dflash-mlx decodes plainly with mlx-lm
    ctx = build_offline_runtime_context()
    b = load_runtime_bundle(
        model_ref=args.model, draft_ref=args.dflash, verify_config=ctx.verify
    )

    def one(p, mode):
        if mode == "plain":
            return plain(p, mode)
        c, out, cycles = Clock(), [], 0
        for ev in stream_dflash_generate(
            target_model=b.target_model, target_ops=b.target_ops,
            tokenizer=b.tokenizer, draft_model=b.draft_model,
            draft_backend=b.draft_backend, prompt_tokens_override=list(p),
            max_new_tokens=args.tokens, stop_token_ids=[],
            runtime_context=ctx,
        ):
            if isinstance(ev, TokenEvent):
                out.append(int(ev.token_id))
                c.tokens(len(out))
                cycles = ev.cycles_completed
        return c.row(out, per_forward=len(out) / max(cycles, 1))

    return one


SIDES = {
    "dflash-mlx": side_dflash_mlx,
    "mlx-lm": side_mlx_lm,
    "mlx-mtp": side_mlx_mtp,
    "mlx-vlm": side_mlx_vlm,
    "MTPLX": side_mtplx,
}


def run_side(args):
    from pathlib import Path

    args.model_path = Path(args.model)
    modes = args.modes.split(",")
    one = SIDES[args.side](args, modes)
    if args.image:
        args.image_prompts = image_prompts(args)
        ps = list(range(args.prompts))  # indices into args.image_prompts
        warm = ps[0]
    else:
        ps = prompts(args.prompts)
        warm = ps[0][:16]
    for m in modes:  # warm every path once
        one(warm, m)
    rows = []
    for i, p in enumerate(ps):
        order = modes[i % len(modes):] + modes[: i % len(modes)]
        if args.rep % 2:
            order = order[::-1]
        for m in order:
            rows.append(dict(one(p, m), mode=m, prompt=i))
    print(json.dumps(rows))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--vlm-python", help="python of an environment with mlx-vlm")
    ap.add_argument("--mtplx-python", help="python of an environment with mtplx")
    ap.add_argument("--dflash-python", help="python of an environment with dflash-mlx")
    ap.add_argument("--dflash", help="a DFlash drafter folder of the model")
    ap.add_argument("--engines", default="mlx-lm,mlx-mtp,mlx-vlm,MTPLX,dflash-mlx")
    ap.add_argument("--image", help="an image every prompt reads (a VLM folder: "
                    "mlx-mtp and mlx-vlm only)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", help="write every row here")
    ap.add_argument("--side", help=argparse.SUPPRESS)
    ap.add_argument("--modes", help=argparse.SUPPRESS)
    ap.add_argument("--rep", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        return run_side(args)

    pythons = {
        "mlx-lm": sys.executable,
        "mlx-mtp": sys.executable,
        "mlx-vlm": args.vlm_python,
        "MTPLX": args.mtplx_python,
        "dflash-mlx": args.dflash_python if args.dflash else None,
    }
    engines = [e for e in args.engines.split(",") if pythons.get(e)]
    if args.image:  # the engines that read images
        engines = [e for e in engines if e in ("mlx-mtp", "mlx-vlm")]
    modes = {e: list(ENGINE_MODES[e]) for e in engines}
    if args.dflash:
        for e in ("mlx-mtp", "mlx-vlm"):
            if e in modes:
                modes[e].append("dflash")
    rows, failed = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = os.path.join(tmp, "stub.c"), os.path.join(tmp, "libsys.so")
        with open(src, "w") as f:
            f.write(STUB)
        subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", lib, src], check=True)
        env = dict(os.environ, MLX_MTP_LIBSYSTEM_STUB=lib)
        for rep in range(args.reps):
            order = engines[rep % len(engines):] + engines[: rep % len(engines)]
            for e in order:
                cmd = [pythons[e], os.path.abspath(__file__), args.model,
                       "--side", e, "--modes", ",".join(modes[e]),
                       "--rep", str(rep), "--tokens", str(args.tokens),
                       "--prompts", str(args.prompts)]
                if args.dflash:
                    cmd += ["--dflash", args.dflash]
                if args.image:
                    cmd += ["--image", args.image]
                t = time.perf_counter()
                out = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if out.returncode:  # reported, and the other engines go on
                    failed.setdefault(e, out.stderr.strip().splitlines()[-1:])
                    print(f"rep {rep} {e} failed: {out.stderr[-2000:]}",
                          file=sys.stderr)
                    continue
                got = json.loads(out.stdout.strip().splitlines()[-1])
                for r in got:
                    rows.append(dict(r, engine=e, rep=rep))
                print(f"rep {rep} {e}: {time.perf_counter() - t:.0f} s",
                      file=sys.stderr)
                if args.json:  # kept as it goes
                    with open(args.json, "w") as f:
                        json.dump(rows, f)
    report(rows, args)
    for e, why in failed.items():
        print(f"{e} failed: {' '.join(why)}")


def report(rows, args):
    def pick(e, m):
        return [r for r in rows if r["engine"] == e and r["mode"] == m]

    base = "mlx-lm" if pick("mlx-lm", "plain") else "mlx-vlm"
    ref = {r["prompt"]: r["tokens"] for r in pick(base, "plain")}
    lm = statistics.median(r["tps"] for r in pick(base, "plain")) if ref else None
    print(f"{args.model}: {args.tokens} tokens, {args.prompts} prompts, "
          f"{args.reps} repetitions; decode tok/s, first token to last")
    print(f"| engine | mode | tok/s | of own plain | of {base} | tokens/forward "
          f"| drafts kept | same as {base} |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for e in dict.fromkeys(r["engine"] for r in rows):
        for m in dict.fromkeys(r["mode"] for r in rows if r["engine"] == e):
            rs = pick(e, m)
            tps = statistics.median(r["tps"] for r in rs)
            own = [
                r["tps"] / p["tps"]
                for r in rs
                for p in pick(e, "plain")
                if p["rep"] == r["rep"] and p["prompt"] == r["prompt"]
            ]
            own_s = f"{statistics.median(own):.3f}" if own else "-"
            lm_s = f"{tps / lm:.3f}" if lm else "-"
            pf = [r["per_forward"] for r in rs if "per_forward" in r]
            pf_s = f"{statistics.median(pf):.2f}" if pf else "-"
            acc = rs[-1].get("accepted", "-")
            same = all(r["tokens"] == ref.get(r["prompt"]) for r in rs) if ref else "-"
            print(f"| {e} | {m} | {tps:.2f} | {own_s} | {lm_s} | {pf_s} | {acc} "
                  f"| {same} |")


if __name__ == "__main__":
    main()
