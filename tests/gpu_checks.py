"""Check the keep-intermediates kernels (gated delta, Mamba2) on this machine's GPU.

    pytest tests/test_gpu_kernels.py          # skipped without a GPU backend
    python tests/gpu_checks.py [--max-tokens N]  # the same, standalone


Needs MLX with a GPU backend (Metal on a Mac, MLX's CUDA build on Linux) and
the installed mlx-mtp; no network, no other test file. For each kernel it runs

1. the real kernel (built as the dispatch builds it, called directly, not
   through the self-check) against the pure-MLX reference over the shape grid
   of its emulated tests (tests/test_kernel_emulated.py,
   tests/test_ssm_kernel_emulated.py) plus a real model's head
   (Qwen3-Next, Nemotron-H): y, final state and every intermediate slot, for
   T = 1..8, float32 and bfloat16;
2. greedy generation of a tiny random model built in memory (Qwen3-Next for
   the gated delta net, Nemotron-H for Mamba2) with MTP, whose verify passes
   go through the kernel, against mlx-lm's own greedy generation of the same
   weights.

Exit status: 0 all checks passed, 1 a check failed, 2 no GPU backend here
(nothing was run).
"""

import argparse
import itertools
import sys
import time

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from mlx_mtp.recurrent import gated_delta as gd
from mlx_mtp.recurrent import ssm_keep as sk

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
    print(f"gated delta kernel vs reference: {n - len(failures)}/{n} cases passed")
    return failures


SSM_SHAPES = {  # (b, H, Dh, G, Ds)
    "one-group": (1, 2, 8, 1, 32),
    "group-per-head": (2, 4, 8, 4, 32),
    "grouped-dh12": (2, 8, 12, 2, 64),
    "nemotron-head": (1, 128, 64, 8, 128),  # Nemotron 3 Super's Mamba2 layer
}
SSM_ATOL = 2e-5  # as tests/test_ssm_kernel_emulated.py


def make_ssm_inputs(shape, T, dtypes):
    b, H, Dh, G, Ds = shape
    mx.random.seed(0)
    x = mx.random.normal((b, T, H, Dh))
    B, C = 0.5 * mx.random.normal((2, b, T, G, Ds))
    D = mx.random.normal((H,))
    A_log = mx.log(mx.random.uniform(0.5, 4.0, (H,)))
    dt = mx.random.uniform(0.01, 1.0, (b, T, H))
    state = 0.3 * mx.random.normal((b, H, Dh, Ds))
    dt_in, st = dtypes
    x, B, C, D = (a.astype(dt_in) for a in (x, B, C, D))
    return x, A_log, B, C, D, dt, state.astype(st)


def check_ssm_kernel(backend: str) -> list:
    failures, n = [], 0
    for (s, shape), (d, dtypes), T in itertools.product(
        SSM_SHAPES.items(), DTYPES.items(), range(1, 9)
    ):
        name = f"ssm {s} {d} T={T}"
        inputs = make_ssm_inputs(shape, T, dtypes)
        try:
            out = sk._build_kernel(backend)(**sk.kernel_call(*inputs))
            mx.eval(out)
        except Exception as e:
            failures.append(f"{name}: {str(e).strip().splitlines()[0]}")
            continue
        problem = sk.kernel_disagreement(out, inputs, atol=SSM_ATOL)
        if problem is None and not mx.array_equal(out[2][:, -1], out[1]):
            problem = "the last slot is not the final state"
        if problem:
            failures.append(f"{name}: {problem}")
        n += 1
    print(f"ssm kernel vs reference: {n - len(failures)}/{n} cases passed")
    return failures


def _mild(model):
    """Mild decays, small block outputs: drafts often agree."""
    params = dict(tree_flatten(model.parameters()))
    for k, v in params.items():
        if k.endswith("A_log"):
            params[k] = mx.log(mx.random.uniform(0.02, 0.3, v.shape))
        elif k.endswith(
            ("o_proj.weight", "down_proj.weight", "out_proj.weight", "fc2.weight")
        ):
            params[k] = 0.1 * v
        elif k.endswith(("embed_tokens.weight", "embeddings.weight")):
            params[k] = mx.random.normal(v.shape)
    model.update(tree_unflatten(list(params.items())))


def _attach(trunk, reference, head, family, config, fuse):
    from mlx_mtp.loader import MTPModel
    from mlx_mtp.target import Target, output_head

    wrapped = Target(trunk)
    reference.update(trunk.parameters())
    d = config["hidden_size"]
    fuse.weight = mx.concatenate([mx.eye(d), 0.3 * mx.eye(d)], axis=1)
    head.bind(wrapped.embed_tokens, output_head(trunk))
    family.patch_trunk(trunk)
    for m in (trunk, reference, head):
        m.eval()  # as mlx-lm's load leaves them: the kernel serves inference
    mx.eval(trunk.parameters(), reference.parameters(), head.parameters())
    return MTPModel(target=wrapped, head=head, config=config), reference


def tiny_nemotron_h():
    """A tiny random Nemotron-H trunk (Mamba2 layers with Ds = 32) and MTP head,
    and an unpatched copy of the trunk for mlx-lm's own generation."""
    from mlx_lm.models import nemotron_h

    from mlx_mtp.heads import nemotron_h as family
    from mlx_mtp.target import find_backbone

    config = dict(
        model_type="nemotron_h", vocab_size=288, hidden_size=64,
        intermediate_size=96, tie_word_embeddings=False,
        max_position_embeddings=4096, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, attention_bias=False,
        mamba_num_heads=4, mamba_head_dim=16, mamba_proj_bias=False,
        ssm_state_size=32, conv_kernel=4, n_groups=2, mlp_bias=False,
        layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True,
        hybrid_override_pattern="M*ME", n_routed_experts=4, n_shared_experts=1,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
        num_experts_per_tok=2, n_group=1, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=1.5, num_nextn_predict_layers=1,
        mtp_hybrid_override_pattern="*E",
    )  # fmt: skip
    args = nemotron_h.ModelArgs.from_dict(config)
    mx.random.seed(0)
    trunk = nemotron_h.Model(args)
    _mild(trunk)
    head = family.build(args, config, find_backbone(trunk), {})
    _mild(head)
    reference = nemotron_h.Model(args)
    fuse = head.block.layers[0].eh_proj
    return _attach(trunk, reference, head, family, config, fuse)


def tiny_qwen3_next():
    """A tiny random Qwen3-Next trunk with an MTP head, and an unpatched copy
    of the trunk for mlx-lm's own generation."""
    from mlx_lm.models import qwen3_next

    from mlx_mtp.heads import qwen3_next as family
    from mlx_mtp.target import find_backbone

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
    _mild(trunk)
    head = family.build(
        args, config, find_backbone(trunk), {"mtp.layers.0.mlp.gate.weight": 0}
    )
    _mild(head)
    reference = qwen3_next.Model(args)
    return _attach(trunk, reference, head, family, config, head.fc)


def _argmax(logprobs):
    return mx.argmax(logprobs, axis=-1)


def check_greedy(label: str, make_model, op, max_tokens: int) -> list:
    """Greedy MTP generation of ``make_model()``, whose verify passes run ``op``'s
    kernel (gated_delta or ssm_keep), against mlx-lm's."""
    from mlx_lm.generate import generate_step

    from mlx_mtp.adaptive import FixedDraft
    from mlx_mtp.speculative import speculative_generate_step
    from mlx_mtp.stats import MTPStats

    model, reference = make_model()
    prompt = list(range(40, 70))
    expected = [
        int(t)
        for t, _ in generate_step(
            mx.array(prompt), reference, max_tokens=max_tokens, sampler=_argmax
        )
    ]
    stats = MTPStats()
    calls = 0
    build = op._build_kernel

    def counted(*variant):
        def kernel(**call):
            nonlocal calls
            calls += 1
            return build(*variant)(**call)

        return kernel

    op._build_kernel = counted
    try:
        got = [
            t
            for t, _ in speculative_generate_step(
                prompt, model, max_tokens=max_tokens, drafts=FixedDraft(3), stats=stats
            )
        ]
    finally:
        op._build_kernel = build
    print(
        f"{label} greedy MTP vs mlx-lm: {len(got)} tokens, "
        f"{stats.rounds} verify passes, "
        f"{stats.accepted}/{stats.drafted} drafts accepted, {calls} kernel calls"
    )
    failures = []
    if not op._verdicts or not all(op._verdicts.values()):
        failures.append(f"{label} self-check verdicts: {op._verdicts}")
    if calls <= 1:
        failures.append(f"{label}: the verify passes did not run the kernel")
    if got != expected:
        i = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), None)
        if i is None:
            failures.append(f"lengths differ: {len(got)} vs {len(expected)}")
        else:
            logits = reference(mx.array(prompt + expected[:i])[None])[0, -1]
            top2 = mx.sort(logits)[-2:]
            gap = (top2[1] - top2[0]).item()
            msg = f"{label} token {i}: {got[i]} vs {expected[i]} (top-2 gap {gap:.2e})"
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
    failures = (
        check_kernel(backend)
        + check_ssm_kernel(backend)
        + check_greedy("qwen3_next", tiny_qwen3_next, gd, args.max_tokens)
        + check_greedy("nemotron_h", tiny_nemotron_h, sk, args.max_tokens)
    )
    for f in failures:
        print(f"FAIL {f}")
    print(f"{'PASS' if not failures else 'FAIL'} ({time.perf_counter() - tic:.1f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
