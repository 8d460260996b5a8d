"""A tiny random DeepSeek-V4-Flash (``deepseek_v4``), published layout, MTP layer in.

Written in DeepSeek's original inference layout (the names mlx-vlm 0.7.10's
``deepseek_v4.LanguageModel.sanitize`` reads): ``embed``, ``head``, ``norm``,
``hc_head_{fn,base,scale}``, ``layers.{i}.attn.*`` (``wo_a`` joined to 2-D,
``compressor.*``, ``indexer.*``), ``layers.{i}.ffn.gate.{weight,bias,tid2eid}``,
experts one tensor each (``ffn.experts.{e}.w1/w2/w3``), ``shared_experts.w1..3``,
``hc_attn_*`` / ``hc_ffn_*``; the head under ``mtp.0.`` (``enorm``, ``hnorm``,
``e_proj``, ``h_proj``, ``norm``, ``hc_head_*`` and a window-only block's
tensors). Weights come from mlx-vlm's own classes (the trunk's ``Model``, the
drafter ``DeepseekV4MTPDraftModel``) at random init, with the parameters they
start at zero (gates, hyper-connection mixes, sinks, pooling offsets) drawn too.

Four layers: a window-only hash-routed one, a sparse compressed one (groups of
4, an indexer of its own), a compressed one (groups of 128) and another
sparse one; a window of 8 and an index top-k of 4, so prompts of a few dozen
tokens roll the window over, close groups and attend sparsely. float32 (MLX's
CPU MoE kernel). ``agreeable=True`` shrinks the blocks' outputs (the trunk is
then near a bigram model) and makes the head's ``e_proj`` read the embedding
nearly as it is, so drafts are often, not always, accepted.
"""

import re
from pathlib import Path
from typing import Dict

import mlx.core as mx
from mlx.utils import tree_flatten
from tiny import VOCAB, save_folder, special_id

EOS = special_id("<|im_end|>")
CONFIG = dict(
    model_type="deepseek_v4",
    architectures=["DeepseekV4ForCausalLM"],
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    qk_rope_head_dim=8,
    q_lora_rank=16,
    o_groups=2,
    o_lora_rank=16,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    num_hash_layers=1,
    compress_ratios=[0, 4, 128, 4],
    compress_rope_theta=160000.0,
    rope_scaling={
        "type": "yarn",
        "factor": 4,
        "original_max_position_embeddings": 1024,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    hc_mult=4,
    hc_sinkhorn_iters=20,
    sliding_window=8,
    index_n_heads=2,
    index_head_dim=16,
    index_topk=4,
    num_nextn_predict_layers=1,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    torch_dtype="float32",
    eos_token_id=EOS,
)

_W = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def _published_block(params: Dict[str, mx.array], cfg) -> Dict[str, mx.array]:
    """One decoder block's mlx-vlm names and layouts -> the checkpoint's."""
    out = {}
    for k, v in params.items():
        m = re.fullmatch(r"ffn\.switch_mlp\.(\w+)\.weight", k)
        if m:  # stacked experts -> one tensor per expert
            for e in range(v.shape[0]):
                out[f"ffn.experts.{e}.{_W[m.group(1)]}.weight"] = v[e]
            continue
        if k == "attn.wo_a.weight":
            v = v.reshape(-1, v.shape[-1])  # [groups, rank, in] -> [groups * rank, in]
        k = re.sub(r"^(attn|ffn)_hc\.(fn|base|scale)$", r"hc_\1_\2", k)
        k = k.replace("ffn.gate.e_score_correction_bias", "ffn.gate.bias")
        for name, w in _W.items():
            k = k.replace(f"shared_experts.{name}.", f"shared_experts.{w}.")
        out[k] = v
    return out


def _draw(params: Dict[str, mx.array], cfg: dict) -> None:
    """Random values for the parameters mlx-vlm starts at zero or one."""
    for k, v in list(params.items()):
        if k.endswith("gate.weight"):
            params[k] = 0.5 * mx.random.normal(v.shape)
        elif k.endswith("tid2eid"):
            draws = mx.random.uniform(shape=(v.shape[0], cfg["n_routed_experts"]))
            order = mx.argsort(draws)
            params[k] = order[:, : v.shape[1]].astype(mx.int32)
        elif re.search(r"(_hc|hc_head)\.fn$", k):
            params[k] = 0.05 * mx.random.normal(v.shape)
        elif re.search(r"(_hc|hc_head)\.base$|attn_sink$|\.ape$|correction_bias$", k):
            params[k] = 0.1 * mx.random.normal(v.shape)
        elif k.endswith("norm.weight"):
            params[k] = 1.0 + 0.1 * mx.random.normal(v.shape)


def _shrink(params: Dict[str, mx.array], factor: float) -> None:
    for k in list(params):
        if k.endswith(("wo_b.weight", "down_proj.weight")):
            params[k] = params[k] * factor


def config_for(**overrides) -> dict:
    return {**CONFIG, **overrides}


def build_weights(seed: int = 0, agreeable: bool = True, **overrides):
    """(config, trunk tensors, ``mtp.0.*`` tensors), named as published."""
    from mlx_vlm.models.deepseek_v4 import Model, ModelConfig
    from mlx_vlm.speculative.drafters.deepseek_v4_mtp import Model as Drafter
    from mlx_vlm.speculative.drafters.deepseek_v4_mtp import ModelConfig as DConfig

    config = config_for(**overrides)
    mx.random.seed(seed)
    model = Model(ModelConfig.from_dict(config))
    lm = dict(tree_flatten(model.language_model.parameters()))
    _draw(lm, config)
    if agreeable:
        _shrink(lm, 0.1)
    trunk = {
        "embed.weight": mx.random.normal(lm.pop("model.embed_tokens.weight").shape),
        "head.weight": lm.pop("lm_head.weight"),
        "norm.weight": lm.pop("model.norm.weight"),
    }
    for p in ("fn", "base", "scale"):
        trunk[f"hc_head_{p}"] = lm.pop(f"model.hc_head.{p}")
    for i in range(config["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        block = {k[len(pre) :]: v for k, v in lm.items() if k.startswith(pre)}
        for k, v in _published_block(block, config).items():
            trunk[f"layers.{i}.{k}"] = v

    drafter = Drafter(DConfig.from_dict({"text_config": config}))
    head = dict(tree_flatten(drafter.parameters()))
    _draw(head, config)
    if agreeable:
        _shrink(head, 0.1)
        d = config["hidden_size"]
        head["e_proj.weight"] = mx.eye(d) + 0.05 * mx.random.normal((d, d))
        head["h_proj.weight"] = 0.3 * head["h_proj.weight"]
    mtp = {}
    for p in ("fn", "base", "scale"):
        mtp[f"hc_head_{p}"] = head.pop(f"hc_head.{p}")
    block = {k[8:]: v for k, v in head.items() if k.startswith("decoder.")}
    mtp.update({k: v for k, v in head.items() if not k.startswith("decoder.")})
    mtp.update(_published_block(block, config))
    return config, trunk, {f"mtp.0.{k}": v for k, v in mtp.items()}


def build_folder(path: Path, seed: int = 0, agreeable: bool = True, **overrides):
    """A folder with trunk + ``mtp.0.*`` head, and ``path-trunk`` without the head."""
    config, trunk, mtp = build_weights(seed, agreeable, **overrides)
    full = save_folder(Path(path), config, trunk, mtp)
    trunk_only = save_folder(Path(str(path) + "-trunk"), config, trunk)
    return full, trunk_only
