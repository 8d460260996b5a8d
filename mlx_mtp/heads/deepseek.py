"""DeepSeek-style MTP head: DeepSeek-V3/R1/V3.2, GLM-4.5-4.7, GLM-4.7-Flash, GLM-5.

Checkpoint layout (``N = num_hidden_layers``)::

    model.layers.{N}.enorm / hnorm / eh_proj          fuse, embedding FIRST
    model.layers.{N}.embed_tokens                     optional (GLM-4.6 omits it)
    model.layers.{N}.shared_head.norm / .head         head optional likewise
    model.layers.{N}.input_layernorm, self_attn.*, post_attention_layernorm, mlp.*

The block is the trunk's own decoder layer class built at index ``N``, so it
is MoE exactly where the trunk's layer ``N`` would be.

DeepSeek-V3.2 (``deepseek_v32``) and GLM-5 (``glm_moe_dsa``) keep this layout
with an MLA block that carries the sparse-attention indexer
(``self_attn.indexer.*``). vLLM's ``deepseek_mtp.py`` (its DeepSeek-V2 layer
carries the indexer) zeroes the embedding at position 0 and takes the trunk's
final-norm output; SGLang and llama.cpp
(``src/models/glm-dsa.cpp``, whose head leaves the indexer out) do not zero.
We follow vLLM. Such a block caches ``[MLA latent, indexer keys]`` in one
``CacheList``, which the trunk's layers use too.
"""

import inspect
from typing import Any, Dict, List

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from .base import MTPHead, MultiLayerHead
from .common import OffsetCacheList
from .common import rollback_caches as patch_trunk  # noqa: F401  (loader hook)
from .wiring import FusedHead

MODEL_TYPES = {
    "deepseek_v3": "DeepSeek-V3/R1",
    "deepseek_v32": "DeepSeek-V3.2",
    "glm4_moe": "GLM-4.5/4.6/4.7",
    "glm4_moe_lite": "GLM-4.7-Flash",
    "glm_moe_dsa": "GLM-5",
}


class DeepSeekMTP(FusedHead):
    OWN = ("enorm", "hnorm", "eh_proj", "embed_tokens", "shared_head", "draft_vocab")

    def __init__(
        self,
        args: Any,
        block: nn.Module,
        has_embed: bool,
        has_head: bool,
        draft_vocab: int = 0,
    ):
        dims = args.hidden_size
        super().__init__(block, self.WIRING.modules(dims, args.rms_norm_eps))
        if has_head:
            self.shared_head.head = nn.Linear(dims, args.vocab_size, bias=False)
        if has_embed:
            self.embed_tokens = nn.Embedding(args.vocab_size, dims)
        if draft_vocab:  # a head trained by train-head drafts from its subset
            self.draft_vocab = mx.zeros((draft_vocab,), mx.int32)

    def make_cache(self) -> List[Any]:
        if "indexer" in self.block.self_attn:  # DSA: [MLA latent, indexer keys]
            return [OffsetCacheList(KVCache(), KVCache())]
        return [KVCache()]

    def embed(self, tokens: mx.array) -> mx.array:
        if "embed_tokens" in self:
            return self.embed_tokens(tokens)
        return super().embed(tokens)

    def output(self):
        if "head" in self.shared_head:
            return self.shared_head.head
        return super().output()


def make_block(backbone: nn.Module, args: Any, index: int) -> nn.Module:
    """A new decoder block of the trunk's own class, built as layer ``index``.

    DeepSeek-family blocks take ``(args, layer_idx)``; llama-like blocks take
    ``(args)`` and a second argument that means something else (llama's
    ``use_sliding``), so the index is passed only where it is asked for.
    """
    cls = type(backbone.layers[0])
    params = list(inspect.signature(cls.__init__).parameters)[2:]
    if params and params[0] in ("layer_idx", "layer_id", "layer_index", "idx"):
        return cls(args, index)
    return cls(args)


def num_layers(config: Dict[str, Any]) -> int:
    return int(config.get("num_nextn_predict_layers", 0) or 0)


def prefix(config: Dict[str, Any], j: int = 0) -> str:
    return f"model.layers.{config['num_hidden_layers'] + j}."


def is_mtp_key(key: str, config: Dict[str, Any]) -> bool:
    parts = key.split(".")
    return (
        len(parts) > 3
        and parts[:2] == ["model", "layers"]
        and parts[2].isdigit()
        and int(parts[2]) >= config["num_hidden_layers"]
    )


def _layer(args, config, backbone, weights, j: int) -> DeepSeekMTP:
    pre = prefix(config, j)
    block = make_block(backbone, args, args.num_hidden_layers + j)
    vocab = weights.get(f"{pre}draft_vocab")
    return DeepSeekMTP(
        args,
        block,
        has_embed=f"{pre}embed_tokens.weight" in weights,
        has_head=any(k.startswith(f"{pre}shared_head.head.") for k in weights),
        draft_vocab=0 if vocab is None else vocab.shape[0],
    )


def build(
    args: Any, config: Dict[str, Any], backbone: nn.Module, weights: Dict[str, mx.array]
) -> MTPHead:
    # vLLM's deepseek_mtp runs layer ``spec_step_idx % n``: layer j drafts depth j+1
    n = max(1, num_layers(config))
    layers = [_layer(args, config, backbone, weights, j) for j in range(n)]
    return layers[0] if n == 1 else MultiLayerHead(layers)
