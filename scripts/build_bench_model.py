"""Build a bigger random model of a tiny family for ``mlx-mtp bench`` (not a test).

No real MTP model can be downloaded here, so benchmarks of the loop run on a
scaled-up tiny model (tests/tiny.py, ``agreeable`` weights: the head often
agrees with the trunk). float32 weights, for the memory-bound regime of
docs/performance.md.

    python scripts/build_bench_model.py OUT [--family mimo] [--hidden 1024] [--layers 8]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import tiny  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--family", default="mimo")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    full, _ = tiny.build_folder(
        args.out,
        args.family,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=4,
    )
    print(full)


if __name__ == "__main__":
    main()
