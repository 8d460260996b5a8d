"""Prompt-lookup policies replayed over recorded greedy answers (not a test).

Under greedy decoding the answer does not depend on the drafts, so a lookup
policy can be judged without a clock: record each prompt's answer once with
mlx-lm, then replay ``PromptLookup`` over it as the loop runs it untuned
(deciding with ``prior_costs``), counting each round at its measured verify
cost (a plain step is 1). Prints, per prompt kind and answer length,
the speed-up over plain steps that the costs predict, and the first-draft
keep rate by agreement class (how many tokens before a proposal's source
agree with the latest ones: ``NgramIndex.match``), the numbers behind
``ngram.MATCH_PRIORS``.

    python scripts/bench/lookup_replay.py record MODEL OUT.json PROMPTS.json...
    python scripts/bench/lookup_replay.py replay OUT.json [--verify 1 1.17 1.35 1.51]

``record`` applies the chat template and keeps 256 tokens (or up to EOS);
``--verify`` gives the costs of a verify over T = 1, 2, ... tokens in plain
steps (past the last, each token adds the last step; default: measured on the
default model with OpenBLAS).
"""

import argparse
import json
from collections import defaultdict

from mlx_mtp.adaptive import Costs, prior_costs
from mlx_mtp.ngram import MATCH_CLASSES, NgramIndex, PromptLookup

LENGTHS = (48, 128, 256)


def record(model_path, out, prompt_files):
    from mlx_lm import load, stream_generate

    model, tokenizer = load(model_path)
    streams = []
    for path in prompt_files:
        for p in json.load(open(path)):
            messages = [{"role": "user", "content": p["prompt"]}]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            answer = [
                r.token for r in stream_generate(model, tokenizer, ids, max_tokens=256)
            ]
            streams.append(
                {"file": path, "kind": p["kind"], "prompt": list(ids), "answer": answer}
            )
            print(p["kind"], len(ids), len(answer), flush=True)
    json.dump(streams, open(out, "w"))


def replay(stream, n, costs):
    """Predicted speed-up over plain steps of ``PromptLookup`` (drafts "ngram") on the
    first ``n`` tokens of a recorded answer."""
    answer = stream["answer"][:n]
    lookup = PromptLookup(prior_costs())
    history = stream["prompt"] + answer[:1]  # the prefill's token
    done, cost = 1, 0.0
    while done < len(answer):
        lookup.sync(history)
        remaining = len(answer) - done
        drafts = lookup.drafts(remaining - 1) if remaining > 1 else []
        kept = 0
        while kept < len(drafts) and drafts[kept] == answer[done + kept]:
            kept += 1
        if drafts:
            lookup.update(len(drafts), kept)
        cost += costs.verify_cost(len(drafts) + 1) if drafts else 1.0
        history += answer[done : done + kept + 1]
        done += kept + 1
    return (len(answer) - 1) / cost


def keep_rates(stream, n):
    """Per agreement class: (proposals, first drafts kept) over the answer's first n tokens."""
    tokens = stream["prompt"] + stream["answer"][:n]
    start = len(stream["prompt"]) + 1
    index = NgramIndex()
    index.extend(tokens[:start])
    counts = defaultdict(lambda: [0, 0])
    for p in range(start, len(tokens)):
        proposal, agree = index.match(1)
        if proposal:
            c = counts[sum(agree >= least for least in MATCH_CLASSES[1:])]
            c[0] += 1
            c[1] += proposal[0] == tokens[p]
        index.append(tokens[p])
    return counts


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record")
    r.add_argument("model")
    r.add_argument("out")
    r.add_argument("prompts", nargs="+")
    p = sub.add_parser("replay")
    p.add_argument("streams")
    p.add_argument("--verify", type=float, nargs="+", default=[1.0, 1.17, 1.35, 1.51])
    args = parser.parse_args()
    if args.command == "record":
        return record(args.model, args.out, args.prompts)
    streams = json.load(open(args.streams))
    costs = Costs(args.verify, [0.1])
    groups = defaultdict(list)
    for s in streams:
        groups[(s["file"].rsplit("/", 1)[-1], s["kind"])].append(s)
    for n in LENGTHS:
        print(f"answers cut at {n} tokens: predicted speed-up over plain steps")
        for (name, kind), group in sorted(groups.items()):
            ups = [replay(s, n, costs) for s in group]
            print(f"  {name:24s} {kind:10s} {sum(ups) / len(ups):.2f}")
    for copying in (True, False):
        totals = defaultdict(lambda: [0, 0])
        for s in streams:
            if (s["kind"] in ("code edit", "summary")) == copying:
                for c, (seen, kept) in keep_rates(s, 128).items():
                    totals[c][0] += seen
                    totals[c][1] += kept
        label = "code edits and summaries" if copying else "other prompts"
        print(f"first draft kept by agreement, 128 tokens, {label}:")
        for c in sorted(totals):
            seen, kept = totals[c]
            print(f"  >= {MATCH_CLASSES[c]:2d} tokens: {kept / seen:.2f} of {seen}")


if __name__ == "__main__":
    main()
