"""Long contexts: peak memory, decoding speed and acceptance at 16 K and 32 K
tokens of context, full precision against ``--kv-bits 8`` and 4, with and
without drafts, against mlx-lm at the same settings (not a test).

Every configuration runs in a fresh process (``--one``), so that its peak
memory is its own: mlx-lm's ``stream_generate`` (``kv_bits``,
``kv_group_size``, ``quantized_kv_start`` 0), mlx-mtp without drafts
(``mtp=False``, the same loop), with 3 head drafts every round (``mtp``:
acceptance) and as ``generate`` drafts by default (``auto``). The
context is the shipped bench prompts repeated to the length (one user
message through the chat template), then ``--tokens`` greedy tokens. Per
configuration and length, the medians over ``--repeats`` processes of: peak
memory (GB, ``mx.get_peak_memory``), decode tok/s (after the first token),
prompt tok/s, acceptance (accepted / drafted) and the mean accepted length;
mlx-mtp's outputs are checked against mlx-lm's of the same settings (the
first token that differs is reported, with the length it ran).

    python scripts/bench/bench_long_context.py [MODEL] [--contexts 16384 32768]
        [--bits 0 8 4] [--tokens 128] [--repeats 3] [--json]

The default model's trained context is 8 K (SmolLM2-135M): past it the model
still runs (its position limit is raised for the run), so memory and speed
hold, and acceptance is that of a model reading past its training.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time

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


def one(model_path, config: str, length: int, bits: int, tokens: int) -> dict:
    """Run one configuration in this process; return its figures."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import stream_generate as lm_stream

    import mlx_mtp

    room = {"max_position_embeddings": length + tokens + 64}
    model, tokenizer = mlx_mtp.load(model_path, model_config=room)
    prompt = context_prompt(tokenizer, length)
    kv = {}
    if bits:
        kv = {"kv_bits": bits, "kv_group_size": GROUP, "quantized_kv_start": 0}
    mx.reset_peak_memory()
    tic, first, out, last = time.perf_counter(), None, [], None
    if config == "mlx-lm":
        reference, _ = mlx_lm.load(str(model.path), model_config=room)
        del model
        mx.reset_peak_memory()
        tic = time.perf_counter()
        for r in lm_stream(reference, tokenizer, prompt, tokens, **kv):
            first = first or time.perf_counter()
            out.append(r.token)
    else:
        drafts = {
            "no-mtp": {"mtp": False},
            "mtp": {"draft_source": "mtp", "draft_max": DRAFT_MAX,
                    "adaptive_draft": False},
            "auto": {},
        }[config]  # fmt: skip
        steps = mlx_mtp.stream_generate(model, tokenizer, prompt, tokens, **drafts, **kv)
        for last in steps:
            first = first or time.perf_counter()
            out.append(last.token)
    end = time.perf_counter()
    stats = last.stats if last is not None else None
    return {
        "config": config,
        "context": length,
        "bits": bits,
        "tokens": out,
        "peak_gb": mx.get_peak_memory() / 1e9,
        "prompt_tps": len(prompt) / (first - tic),
        "decode_tps": (len(out) - 1) / max(end - first, 1e-9),
        "acceptance": stats.acceptance_rate if stats else None,
        "mean_accepted_length": stats.mean_accepted_length if stats else None,
    }


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?")
    ap.add_argument("--contexts", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--bits", type=int, nargs="+", default=[0, 8, 4])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--one", nargs=3, metavar=("CONFIG", "CONTEXT", "BITS"))
    args = ap.parse_args()
    if args.one:  # a child: one configuration, one JSON line
        config, length, bits = args.one
        print(json.dumps(one(args.model, config, int(length), int(bits), args.tokens)))
        return
    model = args.model
    if model is None:
        from mlx_mtp.convert.default_model import default_model_path

        model = str(default_model_path())
    runs = []
    for rep in range(args.repeats):
        for length in args.contexts:
            for bits in args.bits:
                for config in CONFIGS:
                    cmd = [sys.executable, __file__, model, "--tokens",
                           str(args.tokens), "--one", config, str(length), str(bits)]  # fmt: skip
                    done = subprocess.run(cmd, capture_output=True, text=True)
                    if done.returncode:
                        sys.exit(f"{config} at {length} ({bits} bits): {done.stderr}")
                    runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
                    print(f"repeat {rep + 1}: {config}, {length} tokens, "
                          f"{bits or 'full'} bits", file=sys.stderr)  # fmt: skip
    rows = []
    for length in args.contexts:
        for bits in args.bits:
            base = [r for r in runs if r["config"] == "mlx-lm" and
                    (r["context"], r["bits"]) == (length, bits)]  # fmt: skip
            for config in CONFIGS:
                mine = [r for r in runs if r["config"] == config and
                        (r["context"], r["bits"]) == (length, bits)]  # fmt: skip
                med = lambda k: statistics.median(r[k] for r in mine)  # noqa: E731
                row = {
                    "context": length, "bits": bits or "full", "config": config,
                    "peak_gb": med("peak_gb"), "decode_tps": med("decode_tps"),
                    "prompt_tps": med("prompt_tps"),
                    "vs_mlx_lm": med("decode_tps") / statistics.median(
                        r["decode_tps"] for r in base),
                    "acceptance": mine[0]["acceptance"],
                    "mean_accepted_length": mine[0]["mean_accepted_length"],
                    "differs_from_mlx_lm_at": first_difference(
                        mine[0]["tokens"], base[0]["tokens"]),
                }  # fmt: skip
                rows.append(row)
    if args.json:
        print(json.dumps(rows))
        return
    print(f"{'context':>8} {'bits':>5} {'config':>7} {'peak GB':>8} {'decode':>8} "
          f"{'vs lm':>6} {'prompt':>8} {'accept':>7} {'len':>5} {'differs':>7}")  # fmt: skip
    for r in rows:
        acc = "" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        length = "" if r["mean_accepted_length"] is None else (
            f"{r['mean_accepted_length']:.2f}")  # fmt: skip
        diff = "-" if r["differs_from_mlx_lm_at"] is None else r["differs_from_mlx_lm_at"]
        print(f"{r['context']:>8} {r['bits']!s:>5} {r['config']:>7} "
              f"{r['peak_gb']:>8.3f} {r['decode_tps']:>8.1f} {r['vs_mlx_lm']:>6.2f} "
              f"{r['prompt_tps']:>8.0f} {acc:>7} {length:>5} {diff!s:>7}")  # fmt: skip


if __name__ == "__main__":
    main()
