"""Check the gated-delta keep-intermediates kernel on this machine's GPU.

    python scripts/gpu_kernel_check.py [--max-tokens N]

Needs MLX with a GPU backend (Metal on a Mac, MLX's CUDA build on Linux) and
the installed mlx-mtp; no network, no test files. It runs

1. the real kernel (built as the dispatch builds it, called directly, not
   through the self-check) against the pure-MLX reference over the shape grid
   of tests/test_kernel_emulated.py plus a Qwen3-Next-sized head: y, final
   state and every intermediate slot, for T = 1..8, float32 and bfloat16;
2. greedy generation of a tiny random Qwen3-Next model (built in memory)
   with MTP, whose verify passes go through the kernel, against mlx-lm's own
   greedy generation of the same weights.

Exit status: 0 all checks passed, 1 a check failed, 2 no GPU backend here
(nothing was run).
"""

import argparse
import itertools
import sys
import time

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from mlx_mtp import gated_delta as gd

ATOL = 1e-5  # as tests/test_kernel_emulated.py: float32 sums in another order
NEAR_TIE = 1e-4  # a greedy divergence passes only on a top-2 logit gap below this
VARIANTS = [(False, False), (True, False), (False, True), (True, True)]
SHAPES = {  # (B, Hk, Hv, Dk, Dv)
    "mha-dk64": (2, 2, 2, 64, 16),
    "gqa-dk128-dv6": (2, 2, 4, 128, 6),
    "qwen3-next-head": (1, 16, 32, 128, 128),
}
DTYPES = {
    "f32": (mx.float32, mx.float32),
    "bf16-f32state": (mx.bfloat16, mx.float32),
    "bf16": (mx.bfloat16, mx.bfloat16),
}


def make_inputs(shape, T, dtypes, has_mask, vectorized):
    B, Hk, Hv, Dk, Dv = shape
    mx.random.seed(0)
    q, k = mx.random.normal((2, B, T, Hk, Dk))
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    q = q * Dk**-0.5
    v = mx.random.normal((B, T, Hv, Dv))
    g = mx.random.uniform(0.5, 1.0, (B, T, Hv, Dk) if vectorized else (B, T, Hv))
    beta = mx.random.uniform(0.0, 1.0, (B, T, Hv))
    state = 0.1 * mx.random.normal((B, Hv, Dv, Dk))
    mask = None
    if has_mask:
        start = mx.array([2 if T > 2 else 0] + [0] * (B - 1))
        mask = mx.arange(T)[None] >= start[:, None]
    dt, st = dtypes
    q, k, v, beta = (x.astype(dt) for x in (q, k, v, beta))
    return q, k, v, g, beta, state.astype(st), mask


def check_kernel(backend: str) -> list:
    failures, n = [], 0
    for (has_mask, vec), (s, shape), (d, dtypes), T in itertools.product(
        VARIANTS, SHAPES.items(), DTYPES.items(), range(1, 9)
    ):
        name = f"mask={has_mask} vec={vec} {s} {d} T={T}"
        inputs = make_inputs(shape, T, dtypes, has_mask, vec)
        try:
            out = gd._build_kernel(backend, has_mask, vec)(**gd.kernel_call(*inputs))
            mx.eval(out)
        except Exception as e:
            failures.append(f"{name}: {str(e).strip().splitlines()[0]}")
            continue
        problem = gd.kernel_disagreement(out, inputs, atol=ATOL)
        if problem is None and not mx.array_equal(out[2][:, -1], out[1]):
            problem = "the last slot is not the final state"
        mask = inputs[-1]
        if problem is None and mask is not None:
            if not mx.all(mx.where(mask[..., None, None], 0, out[0]) == 0).item():
                problem = "y is not 0 at masked tokens"
        if problem:
            failures.append(f"{name}: {problem}")
        n += 1
    print(f"kernel vs reference: {n - len(failures)}/{n} cases passed")
    return failures


def tiny_qwen3_next():
    """A tiny random Qwen3-Next trunk with an MTP head, and an unpatched copy
    of the trunk for mlx-lm's own generation."""
    from mlx_lm.models import qwen3_next

    from mlx_mtp.heads import qwen3_next as family
    from mlx_mtp.loader import MTPModel
    from mlx_mtp.trunk import Trunk, output_head

    config = dict(
        model_type="qwen3_next", vocab_size=288, hidden_size=64,
        intermediate_size=96, num_hidden_layers=4, full_attention_interval=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
        max_position_embeddings=4096, tie_word_embeddings=False,
        attention_bias=False, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, norm_topk_prob=True,
        mlp_only_layers=[], rope_theta=10000.0, partial_rotary_factor=0.25,
    )  # fmt: skip
    args = qwen3_next.ModelArgs.from_dict(config)
    mx.random.seed(0)
    trunk = qwen3_next.Model(args)
    params = dict(tree_flatten(trunk.parameters()))
    for k, v in params.items():  # mild decays, small block outputs: drafts agree
        if k.endswith("A_log"):
            params[k] = mx.log(mx.random.uniform(0.02, 0.3, v.shape))
        elif k.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight")):
            params[k] = 0.1 * v
        elif k.endswith("embed_tokens.weight"):
            params[k] = mx.random.normal(v.shape)
    trunk.update(tree_unflatten(list(params.items())))
    reference = qwen3_next.Model(args)
    reference.update(trunk.parameters())

    wrapped = Trunk(trunk)
    head = family.build(
        args, config, wrapped.backbone, {"mtp.layers.0.mlp.gate.weight": 0}
    )
    d = args.hidden_size
    head.fc.weight = mx.concatenate([mx.eye(d), 0.3 * mx.eye(d)], axis=1)
    hp = dict(tree_flatten(head.parameters()))
    for k, v in hp.items():
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            hp[k] = 0.1 * v
    head.update(tree_unflatten(list(hp.items())))
    head.bind(wrapped.embed_tokens, output_head(trunk))
    family.patch_trunk(trunk)
    for m in (trunk, reference, head):
        m.eval()  # as mlx-lm's load leaves them: the kernel serves inference
    mx.eval(trunk.parameters(), reference.parameters(), head.parameters())
    return MTPModel(trunk=wrapped, head=head, config=config), reference


def _argmax(logprobs):
    return mx.argmax(logprobs, axis=-1)


def check_greedy(max_tokens: int) -> list:
    from mlx_lm.generate import generate_step

    from mlx_mtp.speculative import speculative_generate_step
    from mlx_mtp.stats import MTPStats

    model, reference = tiny_qwen3_next()
    prompt = list(range(40, 70))
    expected = [
        int(t)
        for t, _ in generate_step(
            mx.array(prompt), reference, max_tokens=max_tokens, sampler=_argmax
        )
    ]
    stats = MTPStats()
    calls = 0
    build = gd._build_kernel

    def counted(*variant):
        def kernel(**call):
            nonlocal calls
            calls += 1
            return build(*variant)(**call)

        return kernel

    gd._build_kernel = counted
    try:
        got = [
            t
            for t, _ in speculative_generate_step(
                prompt, model, max_tokens=max_tokens, draft_max=3, stats=stats
            )
        ]
    finally:
        gd._build_kernel = build
    print(
        f"greedy MTP vs mlx-lm: {len(got)} tokens, {stats.rounds} verify passes, "
        f"{stats.accepted}/{stats.drafted} drafts accepted, {calls} kernel calls"
    )
    failures = []
    if not gd._verdicts or not all(gd._verdicts.values()):
        failures.append(f"self-check verdicts: {gd._verdicts}")
    if calls <= 1:
        failures.append("the verify passes did not run the kernel")
    if got != expected:
        i = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), None)
        if i is None:
            failures.append(f"lengths differ: {len(got)} vs {len(expected)}")
        else:
            logits = reference(mx.array(prompt + expected[:i])[None])[0, -1]
            top2 = mx.sort(logits)[-2:]
            gap = (top2[1] - top2[0]).item()
            msg = f"token {i}: {got[i]} vs {expected[i]} (top-2 gap {gap:.2e})"
            if gap < NEAR_TIE:
                print(f"  near tie, accepted: {msg}")
            else:
                failures.append(msg)
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    backend = gd._backend()
    device = mx.default_device()
    if backend is None:
        print(f"no GPU backend (MLX {mx.__version__}, default device {device}): "
              "nothing checked")  # fmt: skip
        return 2
    name = mx.device_info().get("device_name", "") if hasattr(mx, "device_info") else ""
    print(f"MLX {mx.__version__}, backend {backend}, {name}".rstrip(", "))
    tic = time.perf_counter()
    failures = check_kernel(backend) + check_greedy(args.max_tokens)
    for f in failures:
        print(f"FAIL {f}")
    print(f"{'PASS' if not failures else 'FAIL'} ({time.perf_counter() - tic:.1f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
