"""Build a bigger random model of a tiny family for ``mlx-mtp bench`` (not a test).

No real MTP model can be downloaded here, so benchmarks of the loop run on
scaled-up tiny models (tests/tiny.py, tests/tiny_hybrid.py): ``agreeable``
weights make the head often agree with the trunk, ``--disagreeable`` gives a
head whose drafts are (almost) never kept. float32 weights, for the
memory-bound regime of docs/performance.md.

    python scripts/bench/build_bench_model.py OUT [--family mimo] [--hidden 1024]
        [--layers 8] [--vocab N] [--experts N] [--disagreeable] [--mrope]
        [--vision]

Families: mimo, deepseek_v3, glm4_moe, glm4_moe_lite (dense or MoE as their
tiny configs), qwen3_next (MoE, gated delta net), qwen3_5 (dense GDN),
qwen3_5_moe. ``--vision`` (qwen3_5, qwen3_5_moe; mlx-vlm needed) writes a
vision-language folder: the language model at the given size, a tiny
vision tower (decode speed after an image is what it is for).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import tiny  # noqa: E402
import tiny_hybrid  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--family", default="mimo")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, help="default: 3 x hidden")
    ap.add_argument("--vocab", type=int, help="default: the tiny byte vocabulary")
    ap.add_argument("--experts", type=int, help="routed experts (MoE families)")
    ap.add_argument("--experts-per-token", type=int)
    ap.add_argument("--disagreeable", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--vision",
        action="store_true",
        help="qwen3_5*: a vision-language folder (tests/tiny_vlm.py's tower)",
    )
    ap.add_argument(
        "--mrope",
        action="store_true",
        help="qwen3_5*: add the mrope_section that mlx-vlm's config needs",
    )
    args = ap.parse_args()
    h = args.hidden
    common = dict(
        hidden_size=h,
        intermediate_size=args.intermediate or 3 * h,
        num_hidden_layers=args.layers,
    )
    if args.vocab:
        common["vocab_size"] = args.vocab
    if args.family in tiny_hybrid.MODEL_TYPES:
        over = dict(
            common,
            num_attention_heads=max(4, h // 128),
            num_key_value_heads=2,
            head_dim=128 if h >= 512 else 16,
            linear_num_key_heads=max(2, h // 256),
            linear_num_value_heads=max(4, h // 128),
            linear_key_head_dim=128 if h >= 512 else 32,
            linear_value_head_dim=128 if h >= 512 else 16,
        )
        if "moe" in args.family or args.family == "qwen3_next":
            over.update(
                moe_intermediate_size=h // 2,
                shared_expert_intermediate_size=h,
                num_experts=args.experts or 16,
                num_experts_per_tok=args.experts_per_token or 2,
            )
        build = tiny_hybrid.build_folder
    else:
        over = dict(common, num_attention_heads=16, num_key_value_heads=4)
        if "head_dim" in tiny.CONFIGS[args.family]:
            over["head_dim"] = h // 16
        if "n_routed_experts" in tiny.CONFIGS[args.family]:
            over.update(
                moe_intermediate_size=h // 2,
                n_routed_experts=args.experts or 16,
                num_experts_per_tok=args.experts_per_token or 2,
            )
        build = tiny.build_folder
    if args.vision:
        import tiny_vlm  # noqa: E402

        tiny_vlm.VISION["out_hidden_size"] = h  # the tower hands on text-wide rows
        full = tiny_vlm.build_folder(
            args.out, args.seed, not args.disagreeable, args.family, **over
        )
        print(full)
        return
    full, _ = build(
        args.out, args.family, args.seed, agreeable=not args.disagreeable, **over
    )
    if args.mrope:
        import json

        for folder in (full, _):
            cfg = Path(folder) / "config.json"
            c = json.loads(cfg.read_text())
            rope = c.get("text_config", c)["rope_parameters"]
            rotary = int(rope.get("partial_rotary_factor", 1.0) * over["head_dim"])
            half = rotary // 2  # the frequencies, split over (t, h, w)
            rope["mrope_section"] = [half - 2 * (half // 3), half // 3, half // 3]
            cfg.write_text(json.dumps(c, indent=2))
    print(full)


if __name__ == "__main__":
    main()
