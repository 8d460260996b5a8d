"""Meituan LongCat-Flash MTP head (``longcat_flash``).

Checkpoint layout (vLLM ``longcat_flash_mtp.py``, its ``new_to_old_names_mapping``)::

    model.mtp.embed_tokens                        the head's own embedding
    model.mtp.layers.0.enorm.m / hnorm.m / eh_proj    fuse, embedding FIRST
    model.mtp.layers.0.input_layernorm, self_attn.* (MLA, kv_b_proj joined),
        post_attention_layernorm, transformer_layer.mlp.* (dense, ffn_hidden_size)
    model.mtp.norm                                closing norm

vLLM builds the block as a DeepSeek-V2 decoder layer with no experts: one MLA
attention (with LongCat's ``mla_scale_q_lora`` / ``mla_scale_kv_lora``, which
mlx-lm's ``LongcatFlashMLA`` applies) and a dense MLP. Plain RMSNorms, no
position-0 zeroing, the trunk's ``lm_head``, the trunk's final-norm output in;
one layer (``num_mtp_layers = 1``). The MLA caches ``[latent, rope keys]``.
"""

from typing import Any, Dict, List

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.longcat_flash import LongcatFlashMLA, LongcatFlashMLP

from .base import MTPHead
from .common import rollback_caches as patch_trunk  # noqa: F401  (loader hook)
from .wiring import FusedHead, Wiring

MODEL_TYPES = {"longcat_flash": "LongCat-Flash"}
PREFIX = "model.mtp."


class _Layer(nn.Module):
    """The block; the fuse's modules sit in it too (``enorm.m``, ``eh_proj``)."""

    def __init__(self, args: Any):
        super().__init__()
        dims, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = nn.RMSNorm(dims, eps=eps)
        self.self_attn = LongcatFlashMLA(args)
        self.post_attention_layernorm = nn.RMSNorm(dims, eps=eps)
        self.transformer_layer = nn.Module()
        self.transformer_layer.mlp = LongcatFlashMLP(args)

    def __call__(self, x: mx.array, mask: Any, cache: Any) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.transformer_layer.mlp(self.post_attention_layernorm(h))


class _Layers(nn.Module):
    def __init__(self, layer: _Layer):
        super().__init__()
        self.layers = [layer]

    def __call__(self, x: mx.array, mask: Any, cache: Any) -> mx.array:
        return self.layers[0](x, mask, cache)


class LongcatMTP(FusedHead):
    OWN = ("embed_tokens", "norm")
    WIRING = Wiring(
        "block.layers.0.enorm.m",
        "block.layers.0.hnorm.m",
        "block.layers.0.eh_proj",
        "norm",
    )
    zero_first_embedding = False  # vLLM's longcat_flash_mtp keeps position 0

    def __init__(self, args: Any):
        modules = self.WIRING.modules(args.hidden_size, args.rms_norm_eps)
        super().__init__(_Layers(_Layer(args)), modules)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self._dims = (args.num_attention_heads, args.qk_nope_head_dim)

    def embed(self, tokens: mx.array) -> mx.array:
        return self.embed_tokens(tokens)

    def load_weights(self, weights: List, strict: bool = True):
        # a Hugging Face checkpoint joins the MLA up-projection as kv_b_proj;
        # mlx-lm's MLA splits it (as its trunk sanitize does for layers.*)
        return super().load_weights(_split_kv_b(dict(weights), *self._dims), strict)


def _split_kv_b(weights: Dict[str, mx.array], heads: int, nope: int) -> List:
    key = "block.layers.0.self_attn.kv_b_proj.weight"
    if key not in weights:
        return list(weights.items())
    pre = key[: -len("kv_b_proj.weight")]
    v = weights.pop(key)
    v = v.reshape(heads, -1, v.shape[-1])
    weights[pre + "embed_q.weight"] = mx.contiguous(v[:, :nope, :].swapaxes(-1, -2))
    weights[pre + "unembed_out.weight"] = mx.contiguous(v[:, nope:, :])
    return list(weights.items())


def num_layers(config: Dict[str, Any]) -> int:
    return 1 if config.get("num_nextn_predict_layers", 1) else 0


def prefix(config: Dict[str, Any], j: int = 0) -> str:
    return PREFIX


def is_mtp_key(key: str, config: Dict[str, Any]) -> bool:
    return key.startswith(PREFIX)


def sanitize_block(weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    return weights  # kv_b_proj is split in LongcatMTP.load_weights


def build(
    args: Any, config: Dict[str, Any], backbone: nn.Module, weights: Dict[str, mx.array]
) -> MTPHead:
    return LongcatMTP(args)
