"""A tiny random DeepSeek-V4.1 (mlx-lm 0.32.2's ``deepseek_v41``) in its
published checkpoint layout, with an MTP layer.

The trunk comes from mlx-lm's own classes at random init and is written back
under the published names (``embed``, ``layers.{i}.attn.wq_a``, ``hc_attn_fn``,
experts one tensor each, ``wo_a`` joined), so loading runs mlx-lm's sanitize.
The MTP layer is a trunk decoder layer written under ``mtp.0.`` with the head's
own tensors (``enorm``, ``hnorm``, ``e_proj``, ``h_proj``, ``norm``; with
``hc_head=True`` also V4's ``hc_head_{fn,base,scale}``). Five layers: a
window-only one, two of 4-token groups (the first compresses and indexes, the
second reads its groups), two of 1-token groups (the first compresses, indexes
and selects candidate blocks, the second indexes with them); a window of 8,
so prompts of a few dozen tokens roll the window over and close groups.
float32 throughout (MLX's CPU MoE kernel takes float32 only).

``agreeable=True`` shrinks the blocks' outputs (the trunk is then near a
bigram model) and wires the head's fuse to the token embedding, so the head
often, not always, agrees with the trunk.
"""

from dataclasses import replace
from pathlib import Path
from typing import Dict

import mlx.core as mx
from mlx.utils import tree_flatten
from tiny import VOCAB, save_folder, special_id

CONFIG = dict(
    model_type="deepseek_v41",
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=5,
    num_attention_heads=4,
    head_dim=64,
    q_lora_rank=32,
    qk_rope_head_dim=16,
    o_groups=2,
    o_lora_rank=16,
    moe_intermediate_size=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    rms_norm_eps=1e-6,
    sliding_window=8,
    # the trunk's five, then the MTP layer's (published configs list it too)
    compress_ratios=[0, 4, 4, 1, 1, 0],
    kv_source_layer_ids=[1, 3],
    index_source_layer_ids=[1, 3, 4],
    candidate_source_layer_id=3,
    candidate_topk_blocks=2,
    candidate_block_size=2,
    index_n_heads=2,
    index_head_dim=32,
    index_topk=3,
    hc_sinkhorn_iters=4,
    num_nextn_predict_layers=1,
    torch_dtype="float32",
    eos_token_id=special_id("<|im_end|>"),
)

# mlx-lm 0.32.2's ``_rename`` in reverse: its name -> the published one
_PUBLISHED = (
    (".self_attn.", ".attn."),
    (".mlp.", ".ffn."),
    (".input_layernorm.", ".attn_norm."),
    (".post_attention_layernorm.", ".ffn_norm."),
    (".attn_hc.", ".hc_attn_"),
    (".ffn_hc.", ".hc_ffn_"),
    (".sinks", ".attn_sink"),
    (".shared_experts.gate_proj.", ".shared_experts.w1."),
    (".shared_experts.down_proj.", ".shared_experts.w2."),
    (".shared_experts.up_proj.", ".shared_experts.w3."),
    (".q_a_proj.", ".wq_a."),
    (".q_b_proj.", ".wq_b."),
    (".kv_proj.", ".wkv."),
    (".gate_proj.", ".wgate."),
    (".o_a_proj.", ".wo_a."),
    (".o_b_proj.", ".wo_b."),
    (".q_a_norm.", ".q_norm."),
    (".compressor.kv_norm.", ".compressor.norm."),
    (".indexer.k_proj.", ".indexer.wk."),
    (".gate.e_score_correction_bias", ".gate.bias"),
)
_EXPERTS = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def published(params: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """mlx-lm's parameter names and shapes -> the published checkpoint's."""
    out = {}
    for key, value in params.items():
        if key == "lm_head.weight":
            out["head.weight"] = value
            continue
        if key == "model.embed_tokens.weight":
            out["embed.weight"] = value
            continue
        key = key.removeprefix("model.")
        if ".experts.switch_mlp." in key:
            layer, rest = key.split(".mlp.experts.switch_mlp.")
            proj, kind = rest.split(".")
            for e in range(value.shape[0]):
                out[f"{layer}.ffn.experts.{e}.{_EXPERTS[proj]}.{kind}"] = value[e]
            continue
        for mine, theirs in _PUBLISHED:
            key = key.replace(mine, theirs)
        if key.endswith(".wo_a.weight"):
            value = value.reshape(-1, value.shape[-1])
        out[key] = value
    return out


def _randomize(params: Dict[str, mx.array], agreeable: bool) -> None:
    """Hyper-connection mixers off their zero init; block outputs shrunk."""
    for k in list(params):
        if k.endswith(("_hc.fn", "_hc.base")):
            params[k] = 0.05 * mx.random.normal(params[k].shape)
        elif k.endswith(".sinks"):
            params[k] = 0.5 * mx.random.normal(params[k].shape)
        elif agreeable and k.endswith(("o_b_proj.weight", "down_proj.weight")):
            params[k] = params[k] * 0.1


def build_weights(seed: int = 0, agreeable: bool = True, hc_head: bool = False):
    from mlx_lm.models import deepseek_v41

    config = dict(CONFIG)
    mx.random.seed(seed)
    args = deepseek_v41.ModelArgs.from_dict(config)
    trunk = deepseek_v41.Model(args)
    params = dict(tree_flatten(trunk.parameters()))
    _randomize(params, agreeable)
    d, n = args.hidden_size, args.num_hidden_layers
    params["model.embed_tokens.weight"] = mx.random.normal((args.vocab_size, d))
    window_only = replace(args, compress_ratios=tuple(args.compress_ratios[:n]))
    block = deepseek_v41.DecoderLayer(window_only, n)
    block_params = {
        f"model.layers.{n}.{k}": v for k, v in tree_flatten(block.parameters())
    }
    _randomize(block_params, agreeable)
    eye = mx.eye(d)
    own = {
        "enorm.weight": mx.ones((d,)),
        "hnorm.weight": mx.ones((d,)),
        "e_proj.weight": eye if agreeable else mx.random.normal((d, d)) * d**-0.5,
        "h_proj.weight": 0.3 * eye if agreeable else mx.random.normal((d, d)) * d**-0.5,
        "norm.weight": 1.0 + 0.1 * mx.random.normal((d,)),
    }
    if hc_head:
        hc = args.hc_mult
        own["hc_head_fn"] = 0.05 * mx.random.normal((hc, hc * d))
        own["hc_head_base"] = 0.1 * mx.random.normal((hc,))
        own["hc_head_scale"] = mx.array([0.8])
    mtp = {"mtp.0." + k: v for k, v in own.items()}
    for k, v in published(block_params).items():
        mtp[k.replace(f"layers.{n}.", "mtp.0.", 1)] = v
    return config, published(params), mtp


def build_folder(path: Path, seed: int = 0, agreeable: bool = True, **kw):
    """A folder with trunk + MTP layer, and ``<path>-trunk`` without it."""
    config, trunk_w, mtp_w = build_weights(seed, agreeable, **kw)
    full = save_folder(Path(path), config, trunk_w, mtp_w)
    trunk_only = save_folder(Path(str(path) + "-trunk"), config, trunk_w)
    return full, trunk_only
