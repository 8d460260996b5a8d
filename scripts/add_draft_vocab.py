"""Add a draft vocabulary to a head trained before train-head saved one.

The subset is the one its softmax was trained over: the ``--vocab-top K`` most
frequent targets of ``HEAD/work/train.safetensors``, ranked as ``train`` does.

    python scripts/add_draft_vocab.py MODEL HEAD --vocab-top 8192
"""

import argparse
from pathlib import Path

import mlx.core as mx

from mlx_mtp.loader import load
from mlx_mtp.train_head import HEAD_FILE, WORK_DIR, _vocab_subset, load_dataset


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("head", type=Path)
    ap.add_argument("--vocab-top", type=int, default=8192)
    ap.add_argument(
        "--work", type=Path, help="folder of train.safetensors (default HEAD/work)"
    )
    args = ap.parse_args()
    model, _ = load(args.model, mtp=args.head)
    ds = load_dataset((args.work or args.head / WORK_DIR) / "train.safetensors")
    keep = _vocab_subset(model.head, ds, args.vocab_top)[0]
    path = args.head / HEAD_FILE
    weights, meta = mx.load(str(path), return_metadata=True)
    prefix = next(k for k in weights if k.endswith("eh_proj.weight"))[
        : -len("eh_proj.weight")
    ]
    weights[f"{prefix}draft_vocab"] = mx.array(keep, dtype=mx.int32)
    tmp = path.with_name(".tmp." + path.name)
    mx.save_safetensors(str(tmp), weights, metadata=meta)
    tmp.replace(path)
    print(f"{path}: draft vocabulary of {len(keep)} tokens")


if __name__ == "__main__":
    main()
