"""DeepSeek-V4.1 MTP head (``deepseek_v41``, the trunk mlx-lm 0.32.2 loads).

No public engine runs V4.1's MTP layers yet: mlx-lm 0.32.2's
``deepseek_v41.sanitize`` and mlx-vlm 0.7.10's ``models/deepseek_v41`` both
drop every ``mtp.`` tensor. The head follows mlx-vlm 0.7.10's DeepSeek-V4 MTP
drafter (``speculative/drafters/deepseek_v4_mtp``), which V4.1 resembles, in
the checkpoint layout of V4.1's trunk (``layers.{i}.*`` as mlx-lm 0.32.2
renames them)::

    mtp.{j}.enorm / hnorm / e_proj / h_proj    the fuse (V4's names)
    mtp.{j}.attn.*, ffn.*, attn_norm, ffn_norm, hc_attn_{fn,base,scale},
        hc_ffn_{fn,base,scale}                 the block: a trunk layer's tensors
    mtp.{j}.norm                               the closing norm
    mtp.{j}.hc_head_{fn,base,scale}            optional: V4's hyper-connection head

- the head reads the trunk's hyper-connection streams as the last decoder
  layer hands them on (``[B, T, hc_mult, D]``), before the trunk collapses
  them and before its final norm (mlx-vlm's V4 drafter takes the trunk's
  ``skip_final_norm`` output, the streams before ``hc_head`` and ``norm``);
- the fuse is per stream, embedding and hidden summed, not concatenated:
  ``e_proj(enorm(embed(t)))`` broadcast over the streams plus
  ``h_proj(hnorm(h_s))`` for each stream ``s``; the embedding and the output
  projection are the trunk's; no position-0 zeroing;
- the block is a trunk decoder layer (mlx-lm's ``DecoderLayer``) with only
  the sliding window (V4's drafter builds its block with
  ``compress_ratios=[0]``; V4.1's layer at an index past the trunk's ratios
  has ratio 0 and the base RoPE theta without YaRN), its own window cache;
  RoPE position ``i`` for the pair ``(h_i, t_{i+1})``;
- V4.1 differs from V4 in its hyper-connections: a layer's mixer output is
  consumed by the next sublayer (single-pass mHC), and the trunk has no
  ``hc_head``: it collapses its streams with the last layer's FFN mix. So the
  block reads the one-hot mix the trunk's first layer reads, and its streams
  are collapsed with the block's own FFN mix, then ``norm``, then the trunk's
  ``lm_head``; where a checkpoint carries V4's ``hc_head_*``, that mixer
  collapses them instead (V4: ``sigmoid(mix * scale + base) + hc_eps`` over
  the normed flattened streams);
- a chained draft feeds back the block's output streams (V4's drafter feeds
  ``h``, before ``hc_head``); layer ``j`` of ``num_nextn_predict_layers``
  drafts depth ``j + 1`` (V4 releases one).

The trunk's caches roll back through ``recurrent.layer_cache``.
"""

from dataclasses import replace
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.deepseek_v41 import DecoderLayer, LayerCache, _window_indices

from ..recurrent.layer_cache import patch_trunk  # noqa: F401  (loader hook)
from .base import MTPHead, MultiLayerHead

MODEL_TYPES = {"deepseek_v41": "DeepSeek-V4.1"}
# sanitized as a trunk layer (mlx-lm's names come out under ``model.``)
TRUNK_LAYER_PREFIX = "layers.0."
_HC_HEAD = ("hc_head_fn", "hc_head_base", "hc_head_scale")


def _text(config: Dict[str, Any]) -> Dict[str, Any]:
    return config.get("text_config") or config


def num_layers(config: Dict[str, Any]) -> int:
    return int(_text(config).get("num_nextn_predict_layers", 0) or 0)


def prefix(config: Dict[str, Any], j: int = 0) -> str:
    return f"mtp.{j}."


def is_mtp_key(key: str, config: Dict[str, Any]) -> bool:
    return key.startswith("mtp.")


class HeadWindowCache(LayerCache):
    """The head block's cache: mlx-lm's ``LayerCache`` keeping every row (the
    window is the indices' to apply), so that tentative entries trim away."""

    def update_window(self, kv: mx.array) -> mx.array:
        self.window = (
            kv if self.window is None else mx.concatenate([self.window, kv], 1)
        )
        self.offset += kv.shape[1]
        return self.window

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(n, self.offset)
        self.offset -= n
        self.window = self.window[:, : self.offset] if self.offset else None
        return n


class DeepSeekV41MTP(MTPHead):
    OWN = ("enorm", "hnorm", "e_proj", "h_proj", "norm") + _HC_HEAD
    zero_first_embedding = False

    def __init__(self, args: Any, block: nn.Module, hc_head: bool):
        super().__init__()
        d, eps = args.hidden_size, args.rms_norm_eps
        self.args = args
        self.enorm = nn.RMSNorm(d, eps=eps)
        self.hnorm = nn.RMSNorm(d, eps=eps)
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.block = block
        self.norm = nn.RMSNorm(d, eps=eps)
        if hc_head:
            hc = args.hc_mult
            self.hc_head_fn = mx.zeros((hc, hc * d), dtype=mx.float32)
            self.hc_head_base = mx.zeros((hc,), dtype=mx.float32)
            self.hc_head_scale = mx.ones((1,), dtype=mx.float32)

    @property
    def reads_layers(self) -> tuple:
        """The trunk layer whose output the head reads: the last one hands on
        the streams before the trunk collapses them."""
        return (self.args.num_hidden_layers - 1,)

    def make_cache(self) -> List[Any]:
        return [HeadWindowCache(self.args.sliding_window)]

    def _collapse(self, streams: mx.array, ffn_mix: mx.array) -> mx.array:
        if "hc_head_fn" not in self:
            mix = ffn_mix
        else:
            flat = streams.reshape(*streams.shape[:2], -1).astype(mx.float32)
            flat = mx.fast.rms_norm(flat, None, self.args.rms_norm_eps)
            mix = flat @ self.hc_head_fn.T
            mix = mx.sigmoid(mix * self.hc_head_scale + self.hc_head_base)
            mix = mix + self.args.hc_eps
        out = mx.sum(mix[..., None] * streams.astype(mx.float32), axis=2)
        return out.astype(streams.dtype)

    def fuse(self, embedded: mx.array, hidden: mx.array) -> mx.array:
        """``[B, L, hc, D]``: per stream, ``e_proj(enorm(e)) + h_proj(hnorm(h_s))``
        (``hidden``: the streams flattened, ``[B, L, hc * D]``)."""
        B, L = embedded.shape[:2]
        h = hidden.reshape(B, L, self.args.hc_mult, -1).astype(embedded.dtype)
        return self.e_proj(self.enorm(embedded))[:, :, None, :] + self.h_proj(
            self.hnorm(h)
        )

    def states(self, hidden: mx.array, tokens: mx.array, cache: Optional[List[Any]]):
        c = cache[0] if cache is not None else self.make_cache()[0]
        hc, d = self.args.hc_mult, self.args.hidden_size
        B, L = tokens.shape
        streams = self.fuse(self.embed(tokens), hidden)
        first = mx.zeros((B, L, hc), dtype=mx.float32)
        first[..., 0] = 1.0
        previous = 0 if c.window is None else c.window.shape[1]
        window = _window_indices(
            previous=previous, length=L, window=self.args.sliding_window
        )
        streams, ffn_mix = self.block(
            streams,
            first,
            start_pos=c.offset,
            window_idx=mx.broadcast_to(window, (B, *window.shape)),
            cache=c,
            shared={},
        )
        out = self.norm(self._collapse(streams, ffn_mix))
        return out, streams.reshape(B, L, hc * d)


def _layer(args: Any, weights: Dict[str, mx.array], j: int) -> DeepSeekV41MTP:
    n = args.num_hidden_layers
    # a layer past the trunk's ratios attends to its window only
    window_only = replace(args, compress_ratios=tuple(args.compress_ratios[:n]))
    block = DecoderLayer(window_only, n + j)
    pre = prefix({}, j)
    return DeepSeekV41MTP(args, block, hc_head=f"{pre}hc_head_fn" in weights)


def unusable_head(weights: Dict[str, mx.array]) -> Optional[str]:
    """Why ``mtp.*`` holds no MTP layers, where it holds DSpark stages (a
    block drafter: ``main_proj`` over several target layers, a
    ``markov_head``): vLLM's ``config/speculative.py`` says V4.1 releases ship
    those, and mlx-vlm 0.7.10 runs them as ``deepseek_v4_dspark``. This head
    would misread them; the loader then generates without MTP."""
    if any(".main_proj." in k or k.startswith("mtp.markov_head.") for k in weights):
        return (
            "its mtp.* tensors are DSpark stages (main_proj, markov_head: a block "
            "drafter), not MTP layers, and mlx-mtp does not run DSpark drafters yet"
        )
    return None


def build(
    args: Any, config: Dict[str, Any], backbone: nn.Module, weights: Dict[str, mx.array]
) -> MTPHead:
    n = max(1, num_layers(config))
    layers = [_layer(args, weights, j) for j in range(n)]
    return layers[0] if n == 1 else MultiLayerHead(layers)
