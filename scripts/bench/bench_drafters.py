"""Each drafter's cost per draft count beside the MTP head's, and the speed-up
the cost model predicts from published acceptance lengths (not a test).

No real DFlash or EAGLE-3 checkpoint exists for the default model, so the
drafters are random ones of the published shape sized to the target (the
target's layer widths; DFlash: 5 layers, a block of 16; DFlash 2: 5 layers,
a block of 8, a 2-tap convolution in groups of 16, a selector of rank 256
over the top 16; EAGLE-3: one layer, a draft vocabulary of 32000): their
COSTS are real, their acceptance is not and is taken from what was
published (``PUBLISHED``, sources beside each number). Costs are timed as
``mlx-mtp tune`` times them (``tune.CostTimer``: every part once per
repetition, in a rotating order, medians in plain decode steps).

For each drafter and count k the prediction is ``E(k) / (c_verify(k + 1) +
c_draft(k))``, ``E`` from a constant per-position acceptance ``a`` that
gives the published mean accepted length at the published block (``(1 -
a^(B+1)) / (1 - a) = tau``); ``auto`` takes, each round, the drafter and k
with the most tokens per unit of time, or a plain step where none beats 1.
The same is shown with the memory-bound prior verify costs (``1 + 0.2 (T -
1)``: a GPU), since a CPU with MLX's bundled BLAS verifies T tokens for
about T steps and no drafter can pay there.

    python scripts/bench/bench_drafters.py [--model FOLDER] [--k-max 8]
        [--repeats 7] [--json] [--keep DIR]

A drafter that never agrees (these random ones) against plain decoding,
through the loop and the server, is then measured with ``mlx-mtp bench
--draft DIR/DFlashDraftModel --draft-max 7`` (the ``dflash auto`` row against
``no-mtp``) and ``scripts/bench/bench_serve.py``.
"""

import argparse
import json
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

import mlx_mtp
from mlx_mtp.adaptive import Costs, expected_tokens, prior_costs
from mlx_mtp.config import trained_acceptance
from mlx_mtp.drafters import dflash, dflash2, eagle3, load_drafter
from mlx_mtp.drafters.dflash import default_layer_ids
from mlx_mtp.prompts import encoded_prompts, load_prompts
from mlx_mtp.tune import CostTimer

# Published mean accepted lengths (tokens per round, the bonus included) at
# the block or chain length they were measured with.
PUBLISHED = {
    # z-lab/Qwen3-4B-DFlash-b16 on SGLang, greedy, B = 16, measured by a third
    # party on z-lab's datasets (huggingface.co/seliny2/qwen3-4b-dflash-data,
    # "z-lab M0"): gsm8k 6.27, math500 8.24, humaneval 6.72, mbpp 5.61,
    # mt-bench 3.43; and Red Hat's Qwen3-8B DFlash speculator, 3.74 tokens per
    # step (ai-primer.com, "DFlash adds Qwen3-8B speculator").
    "dflash": {
        "tau": {"gsm8k": 6.27, "mt-bench": 3.43, "redhat-8b": 3.74},
        "block": 16,
    },
    # No acceptance length of DFlash 2 was found published (only speed-ups:
    # 1.36x-1.65x on Qwen3.8-27B, issue 40): DFlash's chat figure at its block.
    "dflash2": {"tau": {"as dflash mt-bench": 3.43}, "block": 8},
    # yuhuili/EAGLE3-LLaMA3.1-Instruct-8B at temperature 1, a chain of 7
    # (huggingface.co/nebius/EAGLE3-Llama-3.3-70B-Instruct, its comparison
    # table): MT-bench 2.77, HumanEval 3.49, GSM8K 3.34.
    "eagle3": {"tau": {"mt-bench": 2.77, "humaneval": 3.49, "gsm8k": 3.34}, "block": 8},
}


def per_position(tau: float, block: int) -> float:
    """The constant acceptance ``a`` with ``1 + a + ... + a^(block-1) = tau``."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        if expected_tokens([a], block - 1) < tau:
            lo = a
        else:
            hi = a
    return (lo + hi) / 2


def target_dims(model):
    c = model.config.get("text_config", model.config)
    heads = c["num_attention_heads"]
    return dict(
        hidden_size=c["hidden_size"],
        num_attention_heads=heads,
        num_key_value_heads=c.get("num_key_value_heads", heads),
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        intermediate_size=c["intermediate_size"],
        rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        vocab_size=c["vocab_size"],
        max_position_embeddings=c.get("max_position_embeddings", 8192),
    )


def save(folder: Path, config: dict, model) -> Path:
    """A checkpoint of ``model``'s random parameters (bf16 floats) under its names."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    weights = {
        k: v.astype(mx.bfloat16) if mx.issubdtype(v.dtype, mx.floating) else v
        for k, v in tree_flatten(model.parameters())
    }
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    return folder


def build_drafters(model, root: Path) -> list:
    """Random drafters of the published shapes for ``model``: their folders."""
    dims, n = target_dims(model), model.target.num_layers
    out = []
    for kind, block, extra in [
        ("DFlashDraftModel", 16, {}),
        ("DFlash2DraftModel", 8, dict(conv_kernel_size=2, conv_group_size=16,
                                      selector_rank=256, selector_top_k=16)),
    ]:  # fmt: skip
        config = {
            "architectures": [kind], "model_type": "qwen3",
            "tie_word_embeddings": False, **dims,
            "num_hidden_layers": 5,
            "rope_theta": 1e6, "num_target_layers": n, "block_size": block,
            "dflash_config": {"mask_token_id": 0,
                              "target_layer_ids": default_layer_ids(n, 5), **extra},
        }  # fmt: skip
        module = dflash2 if extra else dflash
        drafter = module.make_model(config)
        _randomize(drafter)
        out.append(save(root / kind, config, drafter))
    config = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "transformer_layer_config": {**dims, "model_type": "llama",
                                     "num_hidden_layers": 1, "rope_theta": 1e6},
        "draft_vocab_size": min(32000, dims["vocab_size"]),
        "target_hidden_size": dims["hidden_size"],
    }  # fmt: skip
    head = eagle3.make_model(config)
    _randomize(head)
    head.d2t = mx.zeros_like(head.d2t)
    out.append(save(root / "eagle3", config, head))
    return out


def _randomize(module) -> None:
    """Small random floats everywhere (norms too: the costs do not care)."""
    rng = np.random.default_rng(0)
    flat = [
        (k, mx.array((rng.normal(size=v.shape) * 0.02).astype(np.float32)))
        if mx.issubdtype(v.dtype, mx.floating)
        else (k, v)
        for k, v in tree_flatten(module.parameters())
    ]
    module.update(tree_unflatten(flat))


def predict(acceptance: float, costs: Costs, k_max: int) -> list:
    return [
        expected_tokens([acceptance], k) / costs.round_parts(k) if k else 1.0
        for k in range(k_max + 1)
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="target folder (default model)")
    parser.add_argument("--k-max", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="write the random drafters here (a folder per kind) and keep them: "
        "mlx-mtp bench --draft KEEP/DFlashDraftModel then times a drafter that "
        "never agrees against plain decoding",
    )
    args = parser.parse_args()

    model, tokenizer = mlx_mtp.load(args.model)
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench-drafters-"))
    for folder in build_drafters(model, root):
        model.attach(load_drafter(folder, model))
    prompt = encoded_prompts(tokenizer, load_prompts()[:1])[0]
    context = prompt + prompt[: args.k_max + 8]
    timer = CostTimer(model, context, args.k_max)
    for rep in range(args.repeats):
        timer.run_once(rep)
    measured = timer.costs()
    head_acc = trained_acceptance(model)
    rows = {}
    for name in ["mtp"] + list(measured["drafters"]):
        draft = measured["draft"] if name == "mtp" else measured["drafters"][name]
        here = Costs(measured["verify"], draft)
        gpu = Costs(prior_costs().verify, draft)
        if name == "mtp":
            acc = {"trained (mtp_config.json)": (head_acc or [0.5])[0]}
        else:
            pub = PUBLISHED[name]
            acc = {w: per_position(t, pub["block"]) for w, t in pub["tau"].items()}
        rows[name] = {
            "draft_cost": [round(x, 4) for x in draft[: args.k_max]],
            "predicted": {
                w: {
                    "acceptance": round(a, 3),
                    "here": [round(x, 3) for x in predict(a, here, args.k_max)],
                    "memory_bound": [round(x, 3) for x in predict(a, gpu, args.k_max)],
                }
                for w, a in acc.items()
            },
        }
    choice = {}
    for where in ("here", "memory_bound"):
        best = ("plain", 0, 1.0)
        for name, row in rows.items():
            for w, p in row["predicted"].items():
                k = max(range(len(p[where])), key=p[where].__getitem__)
                if p[where][k] > best[2]:
                    best = (f"{name} ({w})", k, p[where][k])
        choice[where] = {"source": best[0], "k": best[1], "speedup": round(best[2], 3)}
    out = {
        "verify": [round(x, 4) for x in measured["verify"]],
        "step_ms": round(measured["step_seconds"] * 1e3, 3),
        "drafters": rows,
        "auto_would_choose": choice,
    }
    if args.json:
        print(json.dumps(out))
        return
    print(f"plain step {out['step_ms']} ms; verify over T tokens: {out['verify']}")
    for name, row in rows.items():
        print(f"\n{name}: draft cost k=1..: {row['draft_cost']}")
        for w, p in row["predicted"].items():
            print(f"  {w}: a={p['acceptance']}  speed-up by k here {p['here']}")
            print(f"  {' ' * len(w)}  memory-bound verify    {p['memory_bound']}")
    for where, c in choice.items():
        print(f"auto ({where}): {c['source']} k={c['k']} ({c['speedup']}x)")


if __name__ == "__main__":
    main()
