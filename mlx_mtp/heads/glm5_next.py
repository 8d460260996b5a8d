"""GLM-5.3-Flash (``glm5_next``) MTP head: one DSA layer after the trunk's last.

The source of truth is mlx-vlm 0.7.10 (``speculative/drafters/glm5_next_mtp/
{glm5_next_mtp.py, split.py}``, ``models/glm5_next/language.py``); mlx-lm 0.32
has no such model, and the trunk loads through mlx-vlm's classes
(``mlx_mtp.vlm_text``).

The checkpoint keeps the head as decoder layer ``N = num_hidden_layers`` of
the language model (``model.language_model.layers.{N}.``): ``enorm``,
``hnorm``, ``eh_proj``, ``shared_head.norm`` and a decoder block
(``input_layernorm``, ``self_attn.*``: DSA, MLA with its own full indexer,
``post_attention_layernorm``, ``mlp.*``: routed experts and a shared one).
The trunk carries ``hc_mult`` hyper-connection streams and closes with
``norm(mean over the streams)``; that normed state, what ``lm_head`` reads,
is what the head reads (the "post" tap). At position ``i``, with the
embedding ``e`` of ``t_{i+1}``::

    x = eh_proj(concat[enorm(e), hnorm(h)])      embedding first
    x = x + attn(input_layernorm(x)); x = x + mlp(post_attention_layernorm(x))
    h' = shared_head_norm(x)

plain residuals (the block has no hyper-connections), ``h'`` both what the
trunk's ``lm_head`` reads and the hidden state the next draft feeds back.
Positions are the head's own (its cache offset, from 0 at the prompt); the
embedding is zeroed where that position is 0. Attention is NoPE: positions
reach the layer only through its cache (the indexer's causal pools). Released
checkpoints have one MTP layer (``num_nextn_predict_layers`` 1), which drafts
every depth, as mlx-vlm's drafter runs it.

The attention and MoE are mlx-vlm's own classes (``Glm5NextAttention``,
``Glm5NextMoE``): the family needs mlx-vlm, which the loader checks first
(``vlm_text.require``), so that its absence is one line.
"""

from dataclasses import replace
from typing import Any, Dict, List

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.cache import KVCache
from mlx_vlm.models.glm5_next.language import Glm5NextAttention, Glm5NextMoE

from ..recurrent.glm5_cache import DSACacheList, RaggedDSAAttention
from ..recurrent.glm5_cache import patch_trunk  # noqa: F401  (the loader's hook)
from ..recurrent.vlm_cache import TrimmablePoolingCache
from .base import zero_position_0
from .wiring import FusedHead

MODEL_TYPES = {
    "glm5_next": "GLM-5.3-Flash (source of truth: mlx-vlm 0.7.10 glm5_next_mtp)"
}
# Over several processes: why ``mlx_mtp.distributed`` refuses it (one line)
NO_SPLIT = (
    "mlx-mtp has no tensor split written for its mlx-vlm layers (Kimi-style "
    "delta attention with a shared low-rank gate, DSA attention with its "
    "indexer), and mlx-vlm has none"
)


class _Block(nn.Module):
    """The MTP decoder layer: DSA attention and MoE, plain residuals."""

    def __init__(self, args: Any):
        super().__init__()
        # (mlx-vlm's, reading a batch of ragged streams too: ``glm5_cache``)
        self.self_attn = RaggedDSAAttention(args, args.num_hidden_layers - 1)
        self.mlp = Glm5NextMoE(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(
            args.hidden_size, eps=args.rms_norm_eps
        )

    def __call__(self, x: mx.array, cache: Any) -> mx.array:
        a, _ = self.self_attn(self.input_layernorm(x), cache=cache)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x))


class Glm5NextMTP(FusedHead):
    OWN = ("enorm", "hnorm", "eh_proj", "shared_head")
    zero_first_embedding = True
    chain_hidden = "post"

    def __init__(self, args: Any):
        n = args.num_hidden_layers
        # the layer after the trunk's: DSA with a full indexer, routed experts
        one = replace(
            args,
            num_hidden_layers=n + 1,
            layer_types=[*args.layer_types, "deepseek_sparse_attention"],
            mlp_layer_types=[*args.mlp_layer_types, "sparse"],
            indexer_types=[*args.indexer_types, "full"],
        )
        modules = self.WIRING.modules(args.hidden_size, args.rms_norm_eps)
        super().__init__(_Block(one), modules)

    def states(self, hidden, tokens, cache):
        c = cache[0] if cache is not None else None
        e = self.embed(tokens)
        if self.zero_first_embedding:
            e = zero_position_0(e, 0 if c is None else c.offset)
        x = self.block(self.fuse(e, hidden.astype(e.dtype)), c)
        h = self.final_norm(x)
        return h, h

    def make_cache(self) -> List[Any]:
        kpool = self.block.self_attn.indexer.index_kpool
        return [
            DSACacheList(
                KVCache(), KVCache(), TrimmablePoolingCache(kpool), KVCache()
            )
        ]


def layer_view(x: mx.array) -> mx.array:
    """A decoder layer's output ``[B, L, hc, H]`` as a drafter (DFlash) reads
    it: the mean of its streams, the trunk's own collapse before its final
    norm. Unverified: no public runtime taps GLM-5.3's layers for a drafter
    (mlx-vlm 0.7.10's ``glm5_next`` ignores ``capture_layer_ids``)."""
    return x.mean(axis=2)


def _text(config: Dict[str, Any]) -> Dict[str, Any]:
    return config.get("text_config", config)


def num_layers(config: Dict[str, Any]) -> int:
    return int(_text(config).get("num_nextn_predict_layers", 1) or 0)


def _layer_index(config: Dict[str, Any]) -> int:
    return int(_text(config)["num_hidden_layers"])


def prefix(config: Dict[str, Any], j: int = 0) -> str:
    return f"model.language_model.layers.{_layer_index(config) + j}."


def is_mtp_key(key: str, config: Dict[str, Any]) -> bool:
    head = "model.language_model.layers."
    if not key.startswith(head):
        return False
    index = key[len(head) :].split(".", 1)[0]
    return index.isdigit() and int(index) >= _layer_index(config)


def TRUNK_LAYER_PREFIX(model: nn.Module) -> str:
    """A trunk layer of the head block's kind (DSA with its own indexer, MoE):
    the trunk's sanitize fuses its tensors as the block holds them."""
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        if isinstance(attn, Glm5NextAttention) and isinstance(layer.mlp, Glm5NextMoE):
            if attn.indexer is not None:
                return f"language_model.model.layers.{i}."
    raise ValueError("the trunk has no DSA layer with routed experts, as the head")


def build(
    args: Any, config: Dict[str, Any], backbone: nn.Module, weights: Dict[str, mx.array]
):
    if any(k.startswith(prefix(config, 1)) for k in weights):
        raise ValueError(
            "this head has more than one MTP layer; mlx-vlm's drafter (the "
            "source of truth) runs one"
        )
    return Glm5NextMTP(args)
