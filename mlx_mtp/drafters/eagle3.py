"""EAGLE-3 heads, in the speculators format (``Eagle3Speculator``) or the
original one (``LlamaForCausalLMEagle3``), chained as the MTP head is.

The head reads three of the target's hidden states, fused by ``fc`` (the
inputs of layers ``eagle_aux_hidden_state_layer_ids``, by default 2, n/2 and
n-3: the outputs of the layers before them). At position ``i`` its first
layer takes ``cat[input_layernorm(embed(t_{i+1})), hidden_norm(h_i)]`` (its
attention's projections read ``2 x hidden``), keeps ``h_i`` (or its norm,
``norm_before_residual``) as the residual, and predicts ``t_{i+2}`` through
its own ``norm`` and ``lm_head`` over a draft vocabulary mapped to the
target's (``d2t``: target id = draft id + ``d2t[id]``). Later layers are
plain decoder layers. A chain feeds back the output before ``norm``, with the
token it drafted. The head keeps its own key/value cache.

Pinned from vLLM ``model_executor/models/llama_eagle3.py`` (the layer, the
residual, ``d2t``, ``midlayer.`` names), ``v1/spec_decode/eagle.py`` (the
chain reads the pre-norm output), ``models/llama.py``
(``get_eagle3_aux_hidden_state_layers``) and speculators
``models/eagle3/{config,core}.py`` (the config).
"""

from types import SimpleNamespace
from typing import Any, Dict, List, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3 import MLP  # SwiGLU without biases, as llama's
from mlx_lm.models.rope_utils import initialize_rope

from ..drafter import Reads
from . import dflash
from .dflash import target_shape
from .head import HeadDrafter

KINDS = {
    "Eagle3Speculator": "an EAGLE-3 head (speculators format)",
    "LlamaForCausalLMEagle3": "an EAGLE-3 head",
}


def layer_config(config: Dict[str, Any]) -> Dict[str, Any]:
    """The decoder layer's settings: speculators nest them in
    ``transformer_layer_config``, the original format keeps them at the top."""
    return {**config, **(config.get("transformer_layer_config") or {})}


def aux_layers(config: Dict[str, Any], layers: int) -> Tuple[int, ...]:
    """The target layers whose INPUTS the head fuses (vLLM's default: 2,
    n // 2, n - 3)."""
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    ids = ids or (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    return tuple(ids) if ids else (2, layers // 2, layers - 3)


class Attention(nn.Module):
    def __init__(self, c: Dict[str, Any], in_dims: int):
        super().__init__()
        dim, heads = c["hidden_size"], c["num_attention_heads"]
        self.heads, self.kv_heads = heads, c.get("num_key_value_heads", heads)
        hd = c.get("head_dim") or dim // heads
        bias = bool(c.get("attention_bias", False))
        self.q_proj = nn.Linear(in_dims, heads * hd, bias=bias)
        self.k_proj = nn.Linear(in_dims, self.kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(in_dims, self.kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(heads * hd, dim, bias=bias)
        self.scale = hd**-0.5
        if c.get("model_type") == "qwen3":  # speculators' Qwen3 layers
            self.q_norm = nn.RMSNorm(hd, eps=c["rms_norm_eps"])
            self.k_norm = nn.RMSNorm(hd, eps=c["rms_norm_eps"])

    def __call__(self, x, rope, cache, mask):
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.heads, -1)
        k = self.k_proj(x).reshape(B, L, self.kv_heads, -1)
        v = self.v_proj(x).reshape(B, L, self.kv_heads, -1).transpose(0, 2, 1, 3)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rope(q.transpose(0, 2, 1, 3), offset=cache.offset)
        k = rope(k.transpose(0, 2, 1, 3), offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
        # (mlx-lm's: the quantized path where the cache is quantized, --kv-bits)
        out = scaled_dot_product_attention(q, k, v, cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class Layer(nn.Module):
    """A decoder layer; the first reads the embedding beside the hidden state."""

    def __init__(self, c: Dict[str, Any], first: bool):
        super().__init__()
        dim, eps = c["hidden_size"], c["rms_norm_eps"]
        self.first = first
        self.self_attn = Attention(c, 2 * dim if first else dim)
        self.mlp = MLP(dim, c["intermediate_size"])
        self.input_layernorm = nn.RMSNorm(dim, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(dim, eps=eps)
        if first:
            self.hidden_norm = nn.RMSNorm(dim, eps=eps)
        self.norm_before_residual = bool(c.get("norm_before_residual", False))

    def __call__(self, h, e, rope, cache, mask):
        if self.first:
            normed = self.hidden_norm(h)
            residual = normed if self.norm_before_residual else h
            x = mx.concatenate([self.input_layernorm(e), normed], axis=-1)
        else:
            residual, x = h, self.input_layernorm(h)
        h = residual + self.self_attn(x, rope, cache, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Model(nn.Module):
    """The head's weights, named as the checkpoint names them (``midlayer.``
    read as ``layers.0.``)."""

    def __init__(self, config: Dict[str, Any]):
        super().__init__()
        c = layer_config(config)
        dim = c["hidden_size"]
        self.vocab = c["vocab_size"]
        draft_vocab = config.get("draft_vocab_size") or self.vocab
        target = config.get("target_hidden_size") or dim
        self.fc = nn.Linear(3 * target, dim, bias=False)
        self.layers = [Layer(c, i == 0) for i in range(c.get("num_hidden_layers", 1))]
        self.norm = nn.RMSNorm(dim, eps=c["rms_norm_eps"])
        self.lm_head = nn.Linear(dim, draft_vocab, bias=False)
        self.d2t = mx.zeros((draft_vocab,), dtype=mx.int32)
        self.logit_scale = float(c.get("logit_scale", 1.0))
        hd = self.head_dim = c.get("head_dim") or dim // c["num_attention_heads"]
        theta = c.get("rope_theta") or (c.get("rope_parameters") or {}).get(
            "rope_theta", 10000.0
        )
        self.rope = initialize_rope(
            hd, theta, False, c.get("rope_scaling"), c.get("max_position_embeddings")
        )
        # the target's embedding, where the head has no ``embed_tokens``
        self._shared = SimpleNamespace(embed=None)

    def states(self, hidden, tokens, cache) -> Tuple[mx.array, mx.array]:
        """The output before ``norm`` at each position (a chain feeds it back):
        ``hidden`` the fused target states or a chained output, ``tokens``
        the successors."""
        embed = self.embed_tokens if "embed_tokens" in self else self._shared.embed
        e = embed(tokens)
        h = hidden.astype(e.dtype)
        mask = create_attention_mask(h, cache[0], return_array=True)
        for layer, c in zip(self.layers, cache):
            h = layer(h, e, self.rope, c, mask)
        return h, h

    def logits(self, h: mx.array) -> mx.array:
        """Over the target's vocabulary (``-inf`` outside the draft's)."""
        small = self.lm_head(self.norm(h)) * self.logit_scale
        full = mx.full((*small.shape[:-1], self.vocab), -mx.inf, dtype=small.dtype)
        targets = mx.arange(small.shape[-1]) + self.d2t
        idx = mx.broadcast_to(targets, small.shape)
        return mx.put_along_axis(full, idx, small, axis=-1)


class Eagle3Head:
    """The head as ``HeadDrafter`` drives one: a single layer (its decoder
    layers run together) chained on its own output."""

    num_layers = 1

    def __init__(self, model: Eagle3Model):
        self.model = model

    def make_cache(self) -> List[Any]:
        return [KVCache() for _ in self.model.layers]

    def layer_cache(self, caches: List[Any], j: int) -> List[Any]:
        return caches

    def layer(self, j: int) -> Eagle3Model:
        return self.model


class Eagle3Drafter(HeadDrafter):
    """An EAGLE-3 head attached to a target: the MTP head's chain, its
    inputs the target's three layers fused by ``fc``."""

    name = "eagle3"

    def __init__(self, model: Eagle3Model, taps: Tuple[int, ...]):
        super().__init__(Eagle3Head(model))
        self.reads = Reads(hidden=False, layers=taps)
        self.kv_widths = (model.head_dim,)
        self.fc = model.fc

    def features(self, taps) -> mx.array:
        return self.fc(self.reads.features(taps).astype(self.fc.weight.dtype))


def read_weights(folder) -> Dict[str, mx.array]:
    """The checkpoint's tensors: ``midlayer.`` as ``layers.0.``, ``d2t`` as
    int32, ``t2d`` (the reverse map) dropped."""
    out = {}
    for k, v in dflash.read_weights(folder, drop=("t2d",)).items():
        k = "layers.0." + k[len("midlayer.") :] if k.startswith("midlayer.") else k
        out[k] = v.astype(mx.int32) if k == "d2t" else v
    if "d2t" not in out and "lm_head.weight" in out:  # the whole vocabulary
        out["d2t"] = mx.zeros((out["lm_head.weight"].shape[0],), dtype=mx.int32)
    return out


def make_model(config: Dict[str, Any]) -> Eagle3Model:
    return Eagle3Model(config)


def with_weights(model: Eagle3Model, weights: Dict[str, mx.array], config) -> None:
    """``dflash.with_weights``, with the head's own embedding where it has one."""
    if "embed_tokens.weight" in weights and "embed_tokens" not in model:
        c = layer_config(config)
        model.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
    dflash.with_weights(model, weights, config)


def load(folder, config: Dict[str, Any], target) -> Eagle3Drafter:
    dims, vocab, layers = target_shape(target)
    c = layer_config(config)
    if c["vocab_size"] != vocab:
        raise ValueError(f"vocabulary of {c['vocab_size']}, the model's is {vocab}")
    reads = config.get("target_hidden_size") or c["hidden_size"]
    if reads != dims:
        raise ValueError(f"reads hidden size {reads}, the model's is {dims}")
    ids = aux_layers(config, layers)
    if len(ids) != 3 or not all(1 <= i < layers for i in ids):
        raise ValueError(
            f"aux hidden state layers {list(ids)} for the model's {layers}"
        )
    model = make_model(config)
    with_weights(model, read_weights(folder), config)
    if "embed_tokens" not in model and c["hidden_size"] != dims:
        raise ValueError(
            "no embed_tokens of its own, and the target's is another width"
        )
    model._shared.embed = target.target.embed_tokens
    d2t = model.d2t + mx.arange(model.d2t.shape[0])
    if d2t.size and (int(d2t.max().item()) >= vocab or int(d2t.min().item()) < 0):
        raise ValueError("d2t maps draft tokens past the model's vocabulary")
    model.eval()
    mx.eval(model.parameters())
    return Eagle3Drafter(model, tuple(i - 1 for i in ids))


def summary(config: Dict[str, Any]) -> Dict[str, Any]:
    c = layer_config(config)
    return {
        "hidden_size": c["hidden_size"],
        "draft_vocab_size": config.get("draft_vocab_size") or c["vocab_size"],
        "aux_hidden_state_layer_ids": config.get("eagle_aux_hidden_state_layer_ids"),
        "norm_before_residual": bool(config.get("norm_before_residual", False)),
    }
