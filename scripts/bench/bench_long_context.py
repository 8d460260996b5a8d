"""Long contexts: peak memory, decoding speed and acceptance at 16 K and 32 K
tokens of context, full precision against ``--kv-bits 8`` and 4, with and
without drafts, against mlx-lm at the same settings (not a test).

Reading a 16 K-token prompt takes minutes on a CPU, a 32 K one far longer,
so each context is read once, in full precision, by a process of its own
(its time and peak memory are reported), and written as a prompt-cache file
(``prompt_file``: mlx-lm's format, which mlx-lm's ``load_prompt_cache``
reads too). Every configuration then runs in a fresh process of its own that
loads that file and decodes ``--tokens`` greedy tokens after the prompt's
last token: mlx-lm's ``stream_generate`` with the trunk's caches
(``kv_bits``, ``kv_group_size`` 64, ``quantized_kv_start`` 0), and mlx-mtp
without drafts (``mtp=False``, the same loop), with 3 head drafts every
round (``mtp``: acceptance) and as ``generate`` drafts by default (``auto``).
With ``kv_bits`` both turn the loaded full-precision cache quantized at the
first token they write (mlx-lm through ``maybe_quantize_kv_cache``, mlx-mtp
through ``kv.QuantizingKVCache``): the cache a prompt read with
``--quantized-kv-start`` at its length has.

Per configuration and length, the medians over ``--repeats`` processes of:
the memory the caches hold once quantized (``kv GB``: active memory at the
first token less the weights), peak memory while decoding (after the second
token: the quantization's one-off copy left out), decode tok/s (after the
first token), acceptance (accepted / drafted) and the mean accepted length;
mlx-mtp's tokens are checked against mlx-lm's of the same settings (the
first token that differs, or ``-``).

    python scripts/bench/bench_long_context.py [MODEL] [--contexts 16384 32768]
        [--bits 0 8 4] [--tokens 64] [--repeats 2] [--dir DIR] [--json]

The default model's trained context is 8 K (SmolLM2-135M): past it the model
still runs (its position limit is raised for the run), so memory and speed
hold, and acceptance is that of a model reading past its training.

On Linux, MLX's bundled reference BLAS makes the reads slow: a 2048-token
read of the default model took 202 s with it and 23 s with OpenBLAS
preloaded (``LD_PRELOAD=.../openblas-pthread/libblas.so.3``, 2 threads),
and a 32 K read with OpenBLAS ran past an hour of one core here. Keep the
files (``--dir``) and reuse them.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = ("mlx-lm", "no-mtp", "mtp", "auto")
DRAFT_MAX = 3  # the fixed head drafts of "mtp" (acceptance is measured there)
GROUP = 64


def context_prompt(tokenizer, length: int):
    """The shipped prompts repeated to ``length`` tokens, as one user message."""
    from mlx_mtp.prompts import encode, load_prompts, user_prompt

    text = "\n\n".join(p.prompt for p in load_prompts())
    body = text
    while len(encode(tokenizer, user_prompt(tokenizer, body))) < length:
        body += "\n\n" + text
    tokens = encode(tokenizer, user_prompt(tokenizer, body))
    return tokens[: length - 8] + tokens[-8:]  # keep the template's ending


def read(model_path, length: int, tokens: int, path: str) -> dict:
    """Read the context's prompt but its last token, in full precision, and
    write its cache to ``path``."""
    import mlx.core as mx

    from mlx_mtp import prompt_file
    from mlx_mtp.speculative import prefill

    import mlx_mtp

    room = {"max_position_embeddings": length + tokens + 64}
    model, tokenizer = mlx_mtp.load(model_path, model_config=room)
    prompt = context_prompt(tokenizer, length)
    cache = model.make_cache()
    mx.reset_peak_memory()
    tic = time.perf_counter()
    prefill(model, cache, prompt)  # leaves the last token unread
    mx.eval([c.state for c in cache.state_list()])
    seconds = time.perf_counter() - tic
    peak = mx.get_peak_memory() / 1e9
    prompt_file.save(path, model, cache, prompt[:-1])
    return {"context": length, "seconds": seconds, "peak_gb": peak,
            "prompt_tps": (len(prompt) - 1) / seconds}  # fmt: skip


def one(model_path, config: str, length: int, bits: int, tokens: int, path) -> dict:
    """Run one configuration in this process from the context's file."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate as lm_stream
    from mlx_lm.models.cache import load_prompt_cache

    import mlx_mtp
    from mlx_mtp import prompt_file

    kv = {}
    if bits:
        kv = {"kv_bits": bits, "kv_group_size": GROUP, "quantized_kv_start": 0}
    room = {"max_position_embeddings": length + tokens + 64}
    if config == "mlx-lm":
        import mlx_lm

        reference, tokenizer = mlx_lm.load(model_path, model_config=room)
        prompt = context_prompt(tokenizer, length)
        weights = mx.get_active_memory()
        trunk = load_prompt_cache(path)[: len(reference.make_cache())]
        steps = lm_stream(reference, tokenizer, prompt[-1:], tokens,
                          prompt_cache=trunk, **kv)  # fmt: skip
    else:
        drafts = {
            "no-mtp": {"mtp": False},
            "mtp": {"draft_source": "mtp", "draft_max": DRAFT_MAX,
                    "adaptive_draft": False},
            "auto": {},
        }[config]  # fmt: skip
        model, tokenizer = mlx_mtp.load(model_path, model_config=room)
        prompt = context_prompt(tokenizer, length)
        weights = mx.get_active_memory()
        cached = prompt_file.load(path, model)
        assert cached.tokens == prompt[:-1]
        steps = mlx_mtp.stream_generate(model, tokenizer, prompt[-1:], tokens,
                                        prompt_cache=cached.cache, **drafts, **kv)  # fmt: skip
    first = kv_gb = None
    out, last = [], None
    for last in steps:
        out.append(last.token)
        if first is None:
            first = time.perf_counter()
            kv_gb = (mx.get_active_memory() - weights) / 1e9
        if len(out) == 2:  # the quantization's one-off copy is behind
            mx.reset_peak_memory()
    end = time.perf_counter()
    stats = getattr(last, "stats", None)
    return {
        "config": config,
        "context": length,
        "bits": bits,
        "tokens": out,
        "kv_gb": kv_gb,
        "peak_gb": mx.get_peak_memory() / 1e9,
        "decode_tps": (len(out) - 1) / max(end - first, 1e-9),
        "acceptance": stats.acceptance_rate if stats else None,
        "mean_accepted_length": stats.mean_accepted_length if stats else None,
    }


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def child(args, *what) -> dict:
    cmd = [sys.executable, __file__, args.model, "--tokens", str(args.tokens), *what]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(what)}: {done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?")
    ap.add_argument("--contexts", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--bits", type=int, nargs="+", default=[0, 8, 4])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where the contexts' files go (kept)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--read", nargs=2, metavar=("CONTEXT", "FILE"))
    ap.add_argument("--one", nargs=4, metavar=("CONFIG", "CONTEXT", "BITS", "FILE"))
    args = ap.parse_args()
    if args.read:  # a child: read one context into its file
        length, path = args.read
        print(json.dumps(read(args.model, int(length), args.tokens, path)))
        return
    if args.one:  # a child: one configuration, one JSON line
        config, length, bits, path = args.one
        result = one(args.model, config, int(length), int(bits), args.tokens, path)
        print(json.dumps(result))
        return
    if args.model is None:
        from mlx_mtp.convert.default_model import default_model_path

        args.model = str(default_model_path())
    folder = Path(args.dir or tempfile.mkdtemp(prefix="mlx-mtp-long-"))
    folder.mkdir(parents=True, exist_ok=True)
    files, reads = {}, {}
    for length in args.contexts:
        files[length] = str(folder / f"context-{length}.safetensors")
        if Path(files[length]).exists():
            print(f"reusing {files[length]}", file=sys.stderr)
            continue
        reads[length] = child(args, "--read", str(length), files[length])
        print(f"read {length} tokens: {json.dumps(reads[length])}", file=sys.stderr)
    runs = []
    for rep in range(args.repeats):
        for length in args.contexts:
            for bits in args.bits:
                for config in args.configs:
                    r = child(args, "--one", config, str(length), str(bits), files[length])
                    runs.append(r)
                    brief = {k: v for k, v in r.items() if k != "tokens"}
                    print(f"repeat {rep + 1}: {json.dumps(brief)}", file=sys.stderr,
                          flush=True)  # fmt: skip
    rows = []
    for length in args.contexts:
        for bits in args.bits:
            base = [r for r in runs if r["config"] == "mlx-lm" and
                    (r["context"], r["bits"]) == (length, bits)]  # fmt: skip
            for config in args.configs:
                mine = [r for r in runs if r["config"] == config and
                        (r["context"], r["bits"]) == (length, bits)]  # fmt: skip
                med = lambda k: statistics.median(r[k] for r in mine)  # noqa: E731
                lm = statistics.median(r["decode_tps"] for r in base) if base else None
                rows.append({
                    "context": length, "bits": bits or "full", "config": config,
                    "kv_gb": med("kv_gb"), "peak_gb": med("peak_gb"),
                    "decode_tps": med("decode_tps"),
                    "vs_mlx_lm": med("decode_tps") / lm if lm else None,
                    "acceptance": mine[0]["acceptance"],
                    "mean_accepted_length": mine[0]["mean_accepted_length"],
                    "differs_from_mlx_lm_at": first_difference(
                        mine[0]["tokens"], base[0]["tokens"]) if base else None,
                })  # fmt: skip
    if args.json:
        print(json.dumps({"reads": reads, "rows": rows}))
        return
    for length, r in reads.items():
        print(f"read {length} tokens (full precision): {r['seconds']:.0f} s, "
              f"{r['prompt_tps']:.0f} tok/s, peak {r['peak_gb']:.2f} GB")  # fmt: skip
    print(f"{'context':>8} {'bits':>5} {'config':>7} {'kv GB':>6} {'peak GB':>8} "
          f"{'decode':>7} {'vs lm':>6} {'accept':>7} {'len':>5} {'differs':>7}")  # fmt: skip
    for r in rows:
        acc = "" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        mal = r["mean_accepted_length"]
        mal = "" if mal is None else f"{mal:.2f}"
        vs = "" if r["vs_mlx_lm"] is None else f"{r['vs_mlx_lm']:.2f}"
        diff = "-" if r["differs_from_mlx_lm_at"] is None else r["differs_from_mlx_lm_at"]
        print(f"{r['context']:>8} {r['bits']!s:>5} {r['config']:>7} {r['kv_gb']:>6.3f} "
              f"{r['peak_gb']:>8.3f} {r['decode_tps']:>7.2f} {vs:>6} {acc:>7} "
              f"{mal:>5} {diff!s:>7}")  # fmt: skip


if __name__ == "__main__":
    main()
