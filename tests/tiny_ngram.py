"""A tiny random LongCat-Flash-Ngram (mlx-lm 0.32's ``longcat_flash_ngram``) in
its published layout, with LongCat-Flash's MTP layer.

The trunk comes from mlx-lm's own classes at random init; its token table is
written as ``model.embed_tokens`` (the published name, which mlx-lm's sanitize
moves under ``ngram_embeddings.word_embeddings``) and its n-gram tables as
``model.ngram_embeddings.{embedders,post_projs}.*``. The MTP layer is written
under the names vLLM's ``longcat_flash_mtp.py`` reads (``model.mtp.*``), as
``tiny_own_layout`` writes LongCat-Flash's. A window of 3 tokens
(``emb_neighbor_num`` 4), two hashes per n-gram length. float32 (MLX's CPU MoE
kernel takes float32 only).

``agreeable=True`` shrinks the blocks' outputs and wires the head's fuse to
the token embedding, so the head often, not always, agrees with the trunk.
"""

from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from tiny import VOCAB, _shrink_outputs, _unsanitize, save_folder, special_id
from tiny_own_layout import _fuse, _norm

CONFIG = dict(
    model_type="longcat_flash_ngram",
    vocab_size=VOCAB,
    hidden_size=64,
    ffn_hidden_size=96,
    moe_topk=2,
    expert_ffn_hidden_size=32,
    n_routed_experts=4,
    zero_expert_num=2,
    num_layers=2,
    max_position_embeddings=4096,
    num_attention_heads=4,
    kv_lora_rank=32,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    routed_scaling_factor=1.5,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    mla_scale_q_lora=True,
    mla_scale_kv_lora=True,
    ngram_vocab_size_ratio=2,
    emb_neighbor_num=4,
    emb_split_num=2,
    num_nextn_predict_layers=1,
    torch_dtype="float32",
    eos_token_id=special_id("<|im_end|>"),
)
WINDOW = CONFIG["emb_neighbor_num"] - 1
WORDS = "model.ngram_embeddings.word_embeddings.weight"


def build_weights(seed: int = 0, agreeable: bool = True):
    from mlx_lm.models.longcat_flash import LongcatFlashMLA, LongcatFlashMLP
    from mlx_lm.utils import _get_classes

    mx.random.seed(seed)
    model_class, args_class = _get_classes(CONFIG)
    args = args_class.from_dict(CONFIG)
    params = dict(tree_flatten(model_class(args).parameters()))
    if agreeable:
        _shrink_outputs(params, 0.1)
    d = args.hidden_size
    embed = mx.random.normal((args.vocab_size, d))
    params[WORDS] = embed
    trunk = _unsanitize(params, CONFIG)
    trunk["model.embed_tokens.weight"] = trunk.pop(WORDS)
    block = {}
    for name, module in (
        ("self_attn", LongcatFlashMLA(args)),
        ("transformer_layer.mlp", LongcatFlashMLP(args)),
    ):
        for k, v in tree_flatten(module.parameters()):
            block[f"{name}.{k}"] = v
    if agreeable:
        _shrink_outputs(block, 0.1)
    pre = "model.mtp."
    mtp = {
        f"{pre}embed_tokens.weight": embed,
        f"{pre}layers.0.enorm.m.weight": _norm(d),
        f"{pre}layers.0.hnorm.m.weight": _norm(d),
        f"{pre}layers.0.eh_proj.weight": _fuse(d, agreeable),
        f"{pre}layers.0.input_layernorm.weight": _norm(d),
        f"{pre}layers.0.post_attention_layernorm.weight": _norm(d),
        f"{pre}norm.weight": _norm(d),
    }
    mtp.update({f"{pre}layers.0.{k}": v for k, v in _unsanitize(block, CONFIG).items()})
    return trunk, mtp


def build_folder(path: Path, seed: int = 0, agreeable: bool = True):
    """A folder with trunk + MTP layer, and ``<path>-trunk`` without it."""
    trunk, mtp = build_weights(seed, agreeable)
    full = save_folder(Path(path), CONFIG, trunk, mtp)
    trunk_only = save_folder(Path(str(path) + "-trunk"), CONFIG, trunk)
    return full, trunk_only
