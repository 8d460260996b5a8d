"""One stream two ways (not a test): the single-stream fast path
(``speculative_generate_step``: plain steps run one ahead) against the
decoding engine's batch of one (``decoder.Decoder``), interleaved, with no
drafts and with the head's drafts at a fixed count. Prints wall and CPU
tokens per second and the ratio batch-of-one / fast path (medians of ratios
paired within a repetition).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python scripts/bench/bench_one_stream.py [MODEL] [--tokens 64] [--repeats 5]
"""

import argparse
import statistics
import time

import mlx_mtp
from mlx_mtp.adaptive import FixedDraft
from mlx_mtp.decoder import Decoder
from mlx_mtp.drafts import HeadDrafts
from mlx_mtp.rounds import Stream
from mlx_mtp.sampling import ExactMatchVerifier
from mlx_mtp.speculative import prefill, speculative_generate_step

PREFILL = 512


def fast_path(model, prompt, tokens, k):
    steps = speculative_generate_step(
        prompt, model, max_tokens=tokens, drafts=FixedDraft(k, draft_max=max(k, 1))
    )
    return [t for t, _ in steps]


def batch_of_one(model, prompt, tokens, k):
    cache = model.make_cache()
    prefill(model, cache, prompt, PREFILL, model.head is not None)
    s = Stream(list(prompt), cache, ExactMatchVerifier(), tokens)
    s.source = HeadDrafts(FixedDraft(k, draft_max=max(k, 1)))
    decoder = Decoder(model, adaptive=False)
    decoder.add([s])
    out = []
    while not s.done:
        out += decoder.step()[0]
    return out


def timed(fn, *args):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn(*args)
    return out, time.perf_counter() - wall, time.process_time() - cpu


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--draft-max", type=int, default=2)
    args = ap.parse_args()
    if args.model is None:
        from mlx_mtp.convert.default_model import default_model_path

        args.model = default_model_path(print)
    model, tokenizer = mlx_mtp.load(args.model)
    prompt = tokenizer.encode("Write a short story about a lighthouse keeper.")
    for k in (0, args.draft_max):
        fast_path(model, prompt, 8, k)  # warm up both
        batch_of_one(model, prompt, 8, k)
        rows = []
        for _ in range(args.repeats):
            a, wa, ca = timed(fast_path, model, prompt, args.tokens, k)
            b, wb, cb = timed(batch_of_one, model, prompt, args.tokens, k)
            assert a == b, "the two paths disagree"
            rows.append((len(a) / wa, len(b) / wb, len(a) / ca, len(b) / cb))
        med = [statistics.median(r[i] for r in rows) for i in range(4)]
        ratio = statistics.median(r[1] / r[0] for r in rows)
        cpu_ratio = statistics.median(r[3] / r[2] for r in rows)
        print(f"k={k}: fast path {med[0]:.1f} tok/s, batch of one {med[1]:.1f} "
              f"tok/s (x{ratio:.3f}); per CPU-second {med[2]:.1f} vs {med[3]:.1f} "
              f"(x{cpu_ratio:.3f})")  # fmt: skip


if __name__ == "__main__":
    main()
