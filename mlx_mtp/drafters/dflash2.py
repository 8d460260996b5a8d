"""DFlash 2 block drafters (z-lab): DFlash (``dflash.py``) with a local
convolution around each sublayer and a candidate selector.

- Around the attention and the MLP of every layer, a grouped causal
  convolution over the block (``conv_kernel_size`` taps, channels in groups
  of ``conv_group_size``): a static kernel plus one computed from the
  sublayer's normed input, applied to that input (``prepare``) and, with a
  second pair of kernels, to the sublayer's output (``finish``).
- The drafts are a path through each slot's ``selector_top_k`` most likely
  tokens: slot ``j``'s candidate ``c`` scores its logit plus the low-rank
  pair score ``<pred[d_{j-1}] * P h_j, succ[c]>`` (``d_0`` the block's first
  token), and the path takes the best (greedy) or samples the scores'
  distribution slot by slot. Each draft carries that distribution (the
  scores over the candidates), so rejection sampling stays exact against it.

Pinned from z-lab/dflash ``dflash/model.py`` (``_grouped_dynamic_convolve``,
``GroupedDynamicCausalConv``, ``CandidateSelector``, ``DFlash2DraftModel``)
and ``dflash/model_mlx.py``; the checkpoint layout from its
``tests/fixtures/dflash2-*.json`` (codebooks stored without ``.weight``).
"""

from typing import Any, Dict, List

import mlx.core as mx
import mlx.nn as nn

from ..sampling import Draft
from . import dflash
from .dflash import DFlashArgs, DFlashDrafter, DFlashModel
from .dflash import read_weights, with_weights  # noqa: F401  (convert reads them)

KINDS = {"DFlash2DraftModel": "a DFlash 2 block drafter with a candidate selector"}

OWN_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def convolve(h: mx.array, dynamic: mx.array, base: mx.array, group: int) -> mx.array:
    """``sum_o (base[o] + dynamic[:, :, o]) * h[t - o]`` over the block's
    positions (zeros before its first), channels in groups of ``group`` (one
    dynamic weight per group). ``h [B, L, H]``, ``dynamic [B, L, K, G]``,
    ``base [K, H]``."""
    B, L, H = h.shape
    x = h.reshape(B, L, H // group, group)
    out = mx.zeros_like(x)
    for o in range(base.shape[0]):
        if o >= L:
            break
        past = (
            x if o == 0 else mx.concatenate([mx.zeros_like(x[:, :o]), x[:, : L - o]], 1)
        )
        kernel = base[o].reshape(1, 1, H // group, group).astype(h.dtype)
        out = out + (kernel + dynamic[:, :, o, :, None]) * past
    return out.reshape(B, L, H)


class DynamicConv(nn.Module):
    def __init__(self, dims: int, kernel: int, group: int):
        super().__init__()
        if dims % group:
            raise ValueError(f"conv_group_size {group} does not divide {dims}")
        self.kernel, self.group = kernel, group
        self.base_kernel = mx.zeros((2, kernel, dims))
        self.kernel_projection = nn.Linear(
            dims, 2 * kernel * (dims // group), bias=False
        )

    def prepare(self, h: mx.array):
        """The convolved input, and the kernels ``finish`` applies."""
        B, L, H = h.shape
        dynamic = self.kernel_projection(h).reshape(
            B, L, 2, self.kernel, H // self.group
        )
        first = convolve(h, dynamic[:, :, 0], self.base_kernel[0], self.group)
        return first, dynamic[:, :, 1]

    def finish(self, h: mx.array, dynamic: mx.array) -> mx.array:
        return convolve(h, dynamic, self.base_kernel[1], self.group)


class DecoderLayer(dflash.DecoderLayer):
    def __init__(self, args: DFlashArgs, sliding: bool):
        super().__init__(args, sliding)
        kernel, group = args.extra["conv_kernel_size"], args.extra["conv_group_size"]
        self.attention_conv = DynamicConv(args.hidden_size, kernel, group)
        self.mlp_conv = DynamicConv(args.hidden_size, kernel, group)

    def __call__(self, x, rope, cache, mask):
        h, kernel = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(h, rope, cache, mask), kernel)
        h, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), kernel)


class CandidateSelector(nn.Module):
    def __init__(self, args: DFlashArgs):
        super().__init__()
        rank = args.extra["selector_rank"]
        self.top_k = args.extra["selector_top_k"]
        self.predecessor_codebook = mx.zeros((args.vocab_size, rank))
        self.successor_codebook = mx.zeros((args.vocab_size, rank))
        self.hidden_projection = nn.Linear(args.hidden_size, rank, bias=False)

    def slots(self, hidden: mx.array, logits: mx.array):
        """Per slot: its candidates ``[k, K]``, their logits and their
        successor codes times the projected hidden state ``[k, K, rank]``."""
        candidates = mx.argpartition(logits, -self.top_k, axis=-1)[..., -self.top_k :]
        unary = mx.take_along_axis(logits, candidates, axis=-1)
        pairs = (
            self.successor_codebook[candidates]
            * self.hidden_projection(hidden)[:, None]
        )
        return candidates, unary, pairs

    def scores(self, unary, pairs, predecessor: mx.array) -> mx.array:
        """``[K]``: the slot's candidates scored after ``predecessor`` (``[1]``)."""
        return unary + (pairs * self.predecessor_codebook[predecessor]).sum(-1)


class DFlash2Model(DFlashModel):
    layer_class = DecoderLayer

    def __init__(self, args: DFlashArgs):
        missing = [k for k in OWN_KEYS if not args.extra.get(k)]
        if missing:
            raise ValueError(f"no dflash_config.{missing[0]}")
        super().__init__(args)
        self.candidate_selector = CandidateSelector(args)


class DFlash2Drafter(DFlashDrafter):
    """A DFlash 2 drafter: the block's forward as DFlash's, the drafts a path
    through the candidate selector."""

    name = "dflash2"

    def draft_block(self, stream, hidden, logits, p_min: float) -> List[Draft]:
        """Slot by slot: the candidates' scores after the previous draft (the
        block's first token before the first), as a row over the vocabulary
        (``-inf`` off the candidates) the verifier draws the draft from
        (greedy: the best; sampled: from the scores' filtered distribution,
        which the draft carries)."""
        selector = self.model.candidate_selector
        candidates, unary, pairs = selector.slots(hidden, logits)
        vocab = logits.shape[-1]
        previous = mx.array([stream.history[-1]])
        drafts: List[Draft] = []
        for j in range(logits.shape[0]):
            scores = selector.scores(unary[j], pairs[j], previous)
            row = mx.full((1, vocab), -mx.inf, dtype=mx.float32)
            row = mx.put_along_axis(
                row, candidates[j][None], scores[None].astype(mx.float32), axis=-1
            )
            d = stream.verifier.draft(row, stream.history, drafts)
            if p_min > 0 and d.p.item() < p_min:
                break
            d.source = self.name
            drafts.append(d)
            previous = d.token.reshape(1)
        return drafts


def load(folder, config: Dict[str, Any], target) -> DFlash2Drafter:
    model = dflash.build(DFlash2Model, folder, config, target)
    return DFlash2Drafter(model, *dflash.attach_parts(model, target))


def make_model(config: Dict[str, Any]) -> nn.Module:
    return DFlash2Model(DFlashArgs.from_config(config))


def summary(config: Dict[str, Any]) -> Dict[str, Any]:
    extra = DFlashArgs.from_config(config).extra
    return {**dflash.summary(config), **{k: extra.get(k) for k in OWN_KEYS}}
