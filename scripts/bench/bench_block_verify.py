"""Block verification against token-wise verification, sampled, paired (not a test).

The default model, 4 of the shipped bench prompts (chat template), 128
tokens, temperatures 0.7 and 1.0, seeds fixed per prompt and repetition, the
two verifiers in an order that alternates; decode tok/s from the first token
to the last, mean tokens per round, drafts kept. Run it with OpenBLAS
preloaded (the memory-bound regime of docs/performance.md):

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
    OPENBLAS_NUM_THREADS=1 python scripts/bench/bench_block_verify.py

``--model M`` another folder; ``--draft-max K --fixed`` drafts K every round
(longer chains than the default model's head keeps, where the two rules
differ most); ``--prompts N``, ``--tokens N``, ``--repeats N``.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx_mtp

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--model", default=None)
ap.add_argument("--draft-max", type=int, default=None)
ap.add_argument("--fixed", action="store_true")
ap.add_argument("--prompts", type=int, default=4)
ap.add_argument("--tokens", type=int, default=128)
ap.add_argument("--repeats", type=int, default=2)
args = ap.parse_args()
drafts = {}
if args.draft_max is not None:
    drafts["draft_max"] = args.draft_max
if args.fixed:
    drafts.update(draft_source="mtp", adaptive_draft=False)

m, tok = mlx_mtp.load(args.model)  # None: the default model
prompts = json.loads(
    (Path(mlx_mtp.__file__).parent / "bench_prompts.json").read_text()
)[: args.prompts]
msgs = [
    tok.apply_chat_template(
        [{"role": "user", "content": p["prompt"]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    for p in prompts
]
rows = {}
for r in mlx_mtp.stream_generate(m, tok, msgs[0], 16, temp=0.7, seed=0):
    pass  # warm up
for rep in range(args.repeats):
    for i, msg in enumerate(msgs):
        for T in (0.7, 1.0):
            order = ("block", "token") if (rep + i) % 2 == 0 else ("token", "block")
            for v in order:
                n, first = 0, None
                for r in mlx_mtp.stream_generate(
                    m, tok, msg, args.tokens, temp=T, seed=100 * rep + i, verify=v,
                    **drafts,
                ):
                    n += 1
                    if first is None:
                        first = time.perf_counter()
                el = time.perf_counter() - first
                s = r.stats
                rows.setdefault((T, v), []).append(
                    ((n - 1) / el, s.generation_tokens / max(s.rounds, 1),
                     s.accepted, s.drafted)
                )  # fmt: skip
for (T, v), rs in sorted(rows.items()):
    print(
        f"T={T} {v}: tok/s median {statistics.median(x[0] for x in rs):.2f}, "
        f"tokens/round {sum(x[1] for x in rs) / len(rs):.3f}, "
        f"kept {sum(x[2] for x in rs)}/{sum(x[3] for x in rs)}"
    )
for T in (0.7, 1.0):
    pair = [b[0] / t[0] for b, t in zip(rows[(T, "block")], rows[(T, "token")])]
    print(f"T={T} block / token, paired median {statistics.median(pair):.3f}")
