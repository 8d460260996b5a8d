"""Held-out acceptance of an MTP head: greedy, draft-max 1..4, per prompt kind.

    python scripts/eval_head.py MODEL [--mtp HEAD] [--tokens 96] [--per-kind 4]

Prompts are ``mlx_mtp.train_data.EVAL_PROMPTS`` (never used for training),
through the chat template. Prints one line per (kind, draft-max) and a JSON
summary on the last line.
"""

import argparse
import json

from mlx_mtp.loader import load
from mlx_mtp.train_data import EVAL_PROMPTS, render_prompt
from mlx_mtp.train_head import acceptance


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--mtp")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--per-kind", type=int, default=4)
    ap.add_argument("--draft-max", type=int, nargs="+", default=[1, 2, 3, 4])
    args = ap.parse_args()
    model, tokenizer = load(args.model, mtp=args.mtp)
    if model.head is None:
        raise SystemExit(f"no MTP head: {model.notice}")
    summary = {}
    for kind, prompts in EVAL_PROMPTS.items():
        ids = [render_prompt(tokenizer, {"chat": p}) for p in prompts[: args.per_kind]]
        summary[kind] = acceptance(model, tokenizer, ids, args.draft_max, args.tokens)
        for k, a in summary[kind].items():
            print(
                f"{kind:6s} draft-max {k}: acceptance {a['acceptance_rate']:.1%} "
                f"({a['accepted']}/{a['drafted']}), mean accepted length "
                f"{a['mean_accepted_length']:.2f}",
                flush=True,
            )
    total = {}
    for k in args.draft_max:
        acc = sum(s[k]["accepted"] for s in summary.values())
        dr = sum(s[k]["drafted"] for s in summary.values())
        rounds = sum(s[k]["rounds"] for s in summary.values())
        total[k] = {
            "acceptance_rate": acc / max(dr, 1),
            "mean_accepted_length": (rounds + acc) / max(rounds, 1),
        }
        print(
            f"all    draft-max {k}: acceptance {acc / max(dr, 1):.1%} ({acc}/{dr}), "
            f"mean accepted length {total[k]['mean_accepted_length']:.2f}"
        )
    print(json.dumps({"per_kind": summary, "all": total}))


if __name__ == "__main__":
    main()
