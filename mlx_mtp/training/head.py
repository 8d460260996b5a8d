"""A new DeepSeek-style MTP head for a trunk that has none: build, chain, save.

The head is one MTP layer (enorm, hnorm, eh_proj, one decoder block of the
trunk's own class, shared_head.norm) sharing the trunk's embedding and output
head; ``mlx_mtp.load(BASE, mtp=OUT)`` attaches what ``save_head`` writes.
"""

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten

from ..config import HEAD_CONFIG_FILE
from ..errors import MTPError
from ..heads import deepseek
from ..heads.base import MTPHead
from ..loader import MTPModel
from ..target import find_backbone, output_head

HEAD_FILE = "mtp.safetensors"
EH_INITS = ("hidden", "embedding")


def init_head(
    mtp_model: MTPModel, eh_init: str = "hidden", sample: list[int] | None = None
) -> MTPHead:
    """A head initialised from the trunk.

    The block copies the trunk's last decoder layer; ``eh_proj`` starts as the
    identity on the hidden half (or the embedding half), so the untrained head
    continues the trunk's last layer; shared_head.norm copies the final norm.
    With a ``sample`` of tokens, hnorm is scaled to the RMS of the trunk's
    residual stream before its final norm, the scale the copied block expects
    (a unit-RMS input lets the block's update swamp it).
    """
    if eh_init not in EH_INITS:
        raise MTPError(f"eh_proj init must be one of {EH_INITS}, not {eh_init!r}")
    model = mtp_model.target.model
    backbone = find_backbone(model)
    args = model.args
    block = deepseek.make_block(backbone, args, args.num_hidden_layers)
    block.update(float_parameters(backbone.layers[-1]))
    head = deepseek.DeepSeekMTP(args, block, has_embed=False, has_head=False)
    d = args.hidden_size
    eye, zero = mx.eye(d), mx.zeros((d, d))
    halves = [zero, eye] if eh_init == "hidden" else [eye, zero]
    head.eh_proj.weight = mx.concatenate(halves, axis=1)
    head.shared_head.norm.weight = mx.array(backbone.norm.weight)
    if sample is not None:
        head.hnorm.weight = head.hnorm.weight * residual_rms(mtp_model, sample)
    head.set_dtype(mx.float32)
    head.bind(backbone.embed_tokens, output_head(model))
    mx.eval(head.parameters())
    return head


def float_parameters(layer: nn.Module) -> dict[str, Any]:
    """``layer``'s parameters with its quantized linears dequantized: a plain
    ``convert`` of a quantized GGUF keeps the trunk quantized, the head trains
    in float."""
    flat = dict(tree_flatten(layer.parameters()))
    for name, m in layer.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            mode = {"mode": m.mode} if hasattr(m, "mode") else {}
            flat[f"{name}.weight"] = mx.dequantize(
                m.weight, m.scales, m.get("biases"), m.group_size, m.bits, **mode
            )
            flat.pop(f"{name}.scales")
            flat.pop(f"{name}.biases", None)
    return tree_unflatten(list(flat.items()))


def residual_rms(mtp_model: MTPModel, tokens: list[int]) -> float:
    """Mean RMS of the trunk's last residual state (before its final norm)."""
    trunk = mtp_model.target
    where, trunk.hidden_tap = trunk.hidden_tap, "pre"
    try:
        _, pre = trunk(mx.array([tokens]), trunk.make_cache())
    finally:
        trunk.hidden_tap = where
    return mx.sqrt(mx.mean(pre.astype(mx.float32) ** 2, axis=-1)).mean().item()


def output_rows(head: MTPHead, vocab: mx.array | None = None) -> mx.array:
    """The output projection's rows (all, or those of ``vocab``), tied or not."""
    d = head.eh_proj.weight.shape[0]
    rows = head.logits(mx.eye(d, dtype=mx.float32)).T
    return rows if vocab is None else rows[vocab]


class _ChainKV:
    """A stand-in KV cache: keeps every key it is given, at a chosen RoPE offset.

    The block of depth ``d`` runs with ``offset = d``, so chain entry ``d`` of
    the chain that starts at position ``p`` sits at ``p + d``, where the
    runtime's head cache puts it; its attention sees the keys of all depths
    so far, and ``chain_mask`` says which of them it may use.
    """

    def __init__(self):
        self.offset, self.keys, self.values = 0, [], []

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.keys.append(keys)
        self.values.append(values)
        return mx.concatenate(self.keys, axis=2), mx.concatenate(self.values, axis=2)


def chain_mask(length: int, depth: int) -> mx.array:
    """[L, (depth+1) L]: a depth-``depth`` query at ``p`` sees the true (depth-0)
    entries at positions <= p and its own chain's entries of depths 1..depth."""
    causal = mx.tril(mx.ones((length, length), dtype=mx.bool_))
    eye = mx.eye(length, dtype=mx.bool_)
    return mx.concatenate([causal] + [eye] * depth, axis=1)


def shift(x: mx.array, d: int, fill=0) -> mx.array:
    """``x[:, i + d]`` at ``i`` (padded with ``fill`` past the end)."""
    if d == 0:
        return x
    pad = mx.full((x.shape[0], d, *x.shape[2:]), fill, dtype=x.dtype)
    return mx.concatenate([x[:, d:], pad], axis=1)


def chain_forward(
    head: MTPHead, hidden: mx.array, tokens: mx.array, depth: int
) -> list[mx.array]:
    """The head's normed output states at depths 1..``depth``, teacher-forced.

    Depth 1 at ``p`` reads ``(h_p, t_{p+1})``, as the runtime's first draft;
    depth ``j + 1`` reads the head's own output state from depth ``j`` at the
    same ``p`` and the token ``t_{p+j+1}`` (the accepted draft ``j``), as the
    runtime chains drafts (``mlx_mtp/speculative.py``). Positions past a
    window's end get padding; the caller masks them.
    """
    kv = _ChainKV()
    outs, h = [], hidden
    length = hidden.shape[1]
    for d in range(depth):
        e = head.embed(shift(tokens, d))
        if d == 0 and head.zero_first_embedding:
            e = mx.concatenate([mx.zeros_like(e[:, :1]), e[:, 1:]], axis=1)
        x = head.fuse(e, h.astype(e.dtype))
        kv.offset = d
        h = head.final_norm(head.block(x, chain_mask(length, d), kv))
        outs.append(h)
    return outs


def save_head(
    head: MTPHead, config: dict[str, Any], out: Path, dtype: str, info: dict[str, Any]
) -> None:
    """Write ``mtp.safetensors`` and ``mtp_config.json`` into ``out`` atomically."""
    out.mkdir(parents=True, exist_ok=True)
    pre = deepseek.prefix(config)
    weights = {}
    for name, value in tree_flatten(head.trainable_parameters()):
        rel = name.removeprefix("block.")
        floating = mx.issubdtype(value.dtype, mx.floating)
        weights[f"{pre}{rel}"] = value.astype(getattr(mx, dtype)) if floating else value
    tmp = out / f".{HEAD_FILE}.tmp.safetensors"
    mx.save_safetensors(str(tmp), weights, metadata={"mtp_family": "deepseek"})
    tmp.replace(out / HEAD_FILE)
    meta = {"family": "deepseek", "prefix": pre, "num_nextn_predict_layers": 1, **info}
    tmp = out / f".{HEAD_CONFIG_FILE}.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    tmp.replace(out / HEAD_CONFIG_FILE)
