"""Build a bigger random model of a tiny family for ``mlx-mtp bench`` (not a test).

No real MTP model can be downloaded here, so benchmarks of the loop run on
scaled-up tiny models (tests/tiny.py, tests/tiny_hybrid.py): ``agreeable``
weights make the head often agree with the trunk, ``--disagreeable`` gives a
head whose drafts are (almost) never kept. float32 weights, for the
memory-bound regime of docs/performance.md.

    python scripts/bench/build_bench_model.py OUT [--family mimo] [--hidden 1024]
        [--layers 8] [--vocab N] [--experts N] [--disagreeable] [--mrope]
        [--vision] [--assistant-hidden N] [--assistant-layers N]
        [--assistant-attention SCALE]

Families: mimo, deepseek_v3, glm4_moe, glm4_moe_lite (dense or MoE as their
tiny configs), qwen3_next (MoE, gated delta net), qwen3_5 (dense GDN),
qwen3_5_moe, gemma4. ``--vision`` (qwen3_5, qwen3_5_moe; mlx-vlm needed)
writes a vision-language folder: the language model at the given size, a
tiny vision tower (decode speed after an image is what it is for).

``gemma4`` writes a Gemma 4 text target (``gemma4_text``, as
tests/tiny_gemma4.py lays it out: sliding and full attention layers, four
sliding to one full and the last one full, the last third sharing K/V,
per-layer inputs) at OUT and its assistant drafter (``gemma4_assistant``, the published separate folder)
at ``OUT-assistant``, for ``scripts/bench/bench_gemma4_batch.py OUT
OUT-assistant``. The assistant drafts the token it is given, its attention
over the target's keys and values weighing in by ``--assistant-attention``
(tiny_gemma4.partly: some drafts kept, which depends on each stream's
context); ``--disagreeable``: a random assistant whose drafts are (almost)
never kept. Its queries read the target's caches, so it has the target's
head sizes; ``--assistant-hidden`` (default: a quarter of the target's) and
``--assistant-layers`` (default 4: three sliding, one full) size the rest.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import tiny  # noqa: E402
import tiny_hybrid  # noqa: E402

GEMMA4 = "gemma4"


def gemma4_configs(args):
    """The target's and the assistant's configs at the asked size (the
    tiny ones of tests/tiny_gemma4.py, scaled)."""
    import tiny_gemma4

    h, n = args.hidden, args.layers
    head_dim = 128 if h >= 512 else 16
    heads = max(4, h // 256)
    kinds = ((["sliding_attention"] * 4 + ["full_attention"]) * (n // 5 + 1))[:n]
    kinds[-1] = "full_attention"  # as every Gemma 4 (transformers insists)
    shared = n // 3
    if "full_attention" not in kinds[: n - shared]:
        raise SystemExit(f"gemma4: {n} layers hold no full attention layer with K/V")
    common = dict(
        num_attention_heads=heads,
        num_key_value_heads=1 if h >= 512 else 2,
        head_dim=head_dim,
        global_head_dim=2 * head_dim,
        sliding_window=args.window,
        rope_parameters=tiny_gemma4.ROPE,
        rms_norm_eps=1e-6,
    )
    vocab = args.vocab or tiny.VOCAB
    target = dict(
        tiny_gemma4.TARGET,
        **common,
        vocab_size=vocab,
        vocab_size_per_layer_input=vocab,
        hidden_size=h,
        intermediate_size=args.intermediate or 4 * h,
        num_hidden_layers=n,
        num_kv_shared_layers=shared,
        hidden_size_per_layer_input=max(8, h // 16),
        layer_types=kinds,
    )
    a = args.assistant_hidden or max(32, h // 4)
    m = args.assistant_layers
    assistant = dict(
        tiny_gemma4.PLAIN_ASSISTANT,
        backbone_hidden_size=h,
        text_config=dict(
            common,
            model_type="gemma4_text",
            vocab_size=vocab,
            hidden_size=a,
            intermediate_size=4 * a,
            num_hidden_layers=m,
            layer_types=(["sliding_attention"] * 3 + ["full_attention"])[-m:]
            if m <= 4
            else ["sliding_attention"] * (m - 1) + ["full_attention"],
        ),
    )
    return target, assistant


def build_gemma4(args):
    """The Gemma 4 target at ``args.out`` and its assistant beside it."""
    import mlx.core as mx
    import tiny_gemma4

    target, assistant = gemma4_configs(args)
    folder = tiny_gemma4.build_target(args.out, args.seed, target)
    side = Path(str(args.out) + "-assistant")
    if args.disagreeable:
        tiny_gemma4.build_assistant(side, args.seed + 1, assistant)
    else:
        tiny_gemma4.build_assistant(
            side,
            args.seed + 1,
            assistant,
            agree_with=tiny_gemma4.target_weights(args.seed, target),
            attention=args.assistant_attention,
        )
    def count(path):
        return sum(v.size for v in mx.load(str(path / "model.safetensors")).values())

    print(f"target {count(folder) / 1e6:.0f} M parameters, "
          f"assistant {count(side) / 1e6:.0f} M", file=sys.stderr)  # fmt: skip
    print(folder)
    print(side)


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
    ap.add_argument("--window", type=int, default=512, help="gemma4: sliding window")
    ap.add_argument("--assistant-hidden", type=int, help="gemma4: default hidden / 4")
    ap.add_argument("--assistant-layers", type=int, default=4)
    ap.add_argument(
        "--assistant-attention",
        type=float,
        default=2.0,
        help="gemma4: how much the assistant's attention weighs in (0: it "
        "drafts the token it is given)",
    )
    args = ap.parse_args()
    if args.family == GEMMA4:
        build_gemma4(args)
        return
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
