"""StepFun Step-3.5/3.7-Flash MTP head (``step3p5``): three layers, layer j drafts depth j+1.

Checkpoint layout (``N = num_hidden_layers``, ``num_nextn_predict_layers`` = 3)::

    model.layers.{N+j}.enorm / hnorm / eh_proj            fuse, embedding FIRST
    model.layers.{N+j}.shared_head.norm / .output         each layer's own head
    model.layers.{N+j}.input_layernorm, self_attn.*, post_attention_layernorm,
        mlp.* (dense) or moe.* + share_expert.*
    (the shared head, or more, may sit under model.layers.{N+j}.transformer.:
    vLLM drops the infix, llama.cpp's conversion does too)

Wiring from vLLM ``models/step3p5_mtp.py`` and ``v1/spec_decode/step3p5.py``
(also SGLang ``models/step3p5_mtp.py``, llama.cpp ``src/models/step35.cpp``):
Gemma-style norms ``x * (1 + w)`` everywhere (stored zero-centred; we keep
the stored ``w`` and add the 1 at run time, so converted heads store what the
checkpoint stores); ``eh_proj(concat[enorm(e), hnorm(h)])``; the block is the
trunk's decoder layer at index ``N + j`` (``layer_types``, ``moe_layers_enum``
and the per-layer lists of the config reach past ``N``); logits
``shared_head.output(shared_head.norm(x))``; the embedding is the trunk's;
no position-0 zeroing. The trunk hands over its hidden state BEFORE its final
norm (vLLM's ``Step3p5Model`` returns it un-normed), and a chained depth reads
the block output BEFORE ``shared_head.norm`` (vLLM feeds the model's returned
hidden states back). vLLM picks layer ``step % 3`` and keeps a KV cache per
layer; transformers' generic ``MtpModel`` chains the layers the same way.
"""

from dataclasses import replace
from typing import Any, Dict

import mlx.core as mx
import mlx.nn as nn

from .base import MTPHead, MultiLayerHead
from .common import rollback_caches as patch_trunk  # noqa: F401  (loader hook)
from .common import windowed

# MTP layers stored as layers N.. past the trunk, as DeepSeek-V3 stores them
from .deepseek import is_mtp_key, num_layers, prefix  # noqa: F401  (loader hooks)
from .wiring import FusedHead, Wiring, ZeroCentredRMSNorm

MODEL_TYPES = {"step3p5": "Step-3.5/3.7-Flash"}
RELEASED_LAYERS = 3
DEFAULT_HIDDEN_TAP = "pre"
# per-layer config lists that reach past the trunk into the MTP layers: a head
# added to a trunk converted without it (--mtp-only) brings them along
HEAD_CONFIG_KEYS = (
    "layer_types",
    "moe_layers_enum",
    "partial_rotary_factors",
    "rope_theta",
    "swiglu_limits",
    "swiglu_limits_shared",
)
_LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")
_ATTN_NORMS = ("q_norm", "k_norm")
# mlx-lm's Step3p5 sanitize: Hugging Face MoE names -> its modules
_MOE_NAMES = (
    ("moe.gate_proj.", "mlp.switch_mlp.gate_proj."),
    ("moe.up_proj.", "mlp.switch_mlp.up_proj."),
    ("moe.down_proj.", "mlp.switch_mlp.down_proj."),
    ("moe.gate.", "mlp.gate.gate."),
    ("moe.router_bias", "mlp.gate.router_bias"),
    ("share_expert.", "mlp.share_expert."),
)


class Step3p5MTP(FusedHead):
    OWN = ("enorm", "hnorm", "eh_proj", "shared_head")
    WIRING = Wiring(norm=ZeroCentredRMSNorm)
    zero_first_embedding = False
    chain_hidden = "pre"

    def __init__(self, args: Any, block: nn.Module, has_head: bool):
        dims = args.hidden_size
        super().__init__(block, self.WIRING.modules(dims, args.rms_norm_eps))
        if has_head:  # Step's checkpoints call the projection ``output``
            self.shared_head.output = nn.Linear(dims, args.vocab_size, bias=False)

    def output(self):
        if "output" in self.shared_head:
            return self.shared_head.output
        return super().output()

    def load_weights(self, weights, strict: bool = True):
        # tensors nested under ``transformer.`` reach us as block tensors
        # (sanitize_block strips the infix); the head's own go back to it
        own = tuple(f"block.{name}." for name in self.OWN)
        weights = [
            (k[len("block.") :] if k.startswith(own) else k, v) for k, v in weights
        ]
        return super().load_weights(weights, strict)


def sanitize_block(weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """Checkpoint names -> mlx-lm's (no ``+ 1``: our norms add it at run time)."""
    out = {}
    for key, value in weights.items():
        key = key.removeprefix("transformer.")
        for src, dst in _MOE_NAMES:
            if key.startswith(src):
                key = dst + key[len(src) :]
                break
        out[key] = value
    return out


def _extended(args: Any, n: int) -> Any:
    """The trunk's args with per-layer lists long enough to index layer ``n``."""
    fields = {}
    for name in ("rope_theta", "partial_rotary_factors", "layer_types"):
        value = getattr(args, name)
        if isinstance(value, list) and value and len(value) <= n:
            fields[name] = value + [value[-1]] * (n + 1 - len(value))
    return replace(args, **fields) if fields else args


def _layer(args, config, backbone, weights, j: int) -> Step3p5MTP:
    return layer_for(args, config, backbone, weights, j, prefix(config, j))


def layer_for(args, config, backbone, weights, j: int, pre: str, n=None):
    """MTP layer ``j``: ``backbone``'s layer class at index ``n`` (the trunk's
    ``N + j`` by default), its tensors under ``pre`` (Step-3.7 reuses it)."""
    n = args.num_hidden_layers + j if n is None else n
    layer = type(backbone.layers[0])(_extended(args, n), n)
    eps = args.rms_norm_eps
    for name in _LAYER_NORMS:
        setattr(layer, name, ZeroCentredRMSNorm(args.hidden_size, eps))
    for name in _ATTN_NORMS:
        setattr(layer.self_attn, name, ZeroCentredRMSNorm(args.head_dim, eps))
    block = windowed(layer, args.sliding_window if layer.is_sliding else None)
    heads = (f"{pre}shared_head.output.", f"{pre}transformer.shared_head.output.")
    has_head = any(k.startswith(heads) for k in weights)
    return Step3p5MTP(args, block, has_head)


def build(
    args: Any, config: Dict[str, Any], backbone: nn.Module, weights: Dict[str, mx.array]
) -> MTPHead:
    # the config's per-layer lists win: a trunk converted alone may lack the MTP part
    args = replace(args, **{k: config[k] for k in HEAD_CONFIG_KEYS if k in config})
    n = max(1, num_layers(config))
    layers = [_layer(args, config, backbone, weights, j) for j in range(n)]
    return layers[0] if n == 1 else MultiLayerHead(layers)
