"""What every MTP head shares: the forward skeleton and weight loading.

A head is one MTP ("NextN") layer. At position ``i`` it pairs the trunk's hidden
state ``h_i`` with the embedding of the next token ``t_{i+1}``, runs one
decoder block of the trunk's own type, and predicts ``t_{i+2}``. A family
says how the two inputs are fused, which norm closes the block, where its
tensors live in a checkpoint, and whether it has its own embedding and
output head (it falls back to the trunk's otherwise).
"""

from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache


class MTPHead(nn.Module):
    """One MTP layer. Subclasses define ``fuse``, ``final_norm`` and naming.

    A head of several layers (``MultiLayerHead``) drafts depth ``j + 1`` with
    ``layer(j)``; a single layer drafts every depth.
    """

    # Top-level module names that belong to the head itself; every other
    # tensor under the layer's prefix belongs to the decoder block.
    OWN: Tuple[str, ...] = ()
    # vLLM's DeepSeek-style and MiMo heads zero the embedding at position 0.
    zero_first_embedding: bool = True
    # The hidden state a chained draft feeds back: "post" the closing norm's
    # output (DeepSeek, vLLM), "pre" the block's output before it (Step-3.5).
    chain_hidden: str = "post"
    # whether ``tune`` may try drafting from a subset of the vocabulary
    takes_draft_vocab: bool = True

    def __init__(self):
        super().__init__()
        self._shared = SimpleNamespace(embed=None, lm_head=None)

    def bind(self, embed: nn.Module, lm_head: Callable[[mx.array], mx.array]):
        """Share the trunk's embedding and output head (used where the head has none)."""
        self._shared = SimpleNamespace(embed=embed, lm_head=lm_head, rows=None)
        self._cut_rows()

    # -- family hooks ------------------------------------------------------
    def fuse(self, embedded: mx.array, hidden: mx.array) -> mx.array:
        raise NotImplementedError

    def final_norm(self, x: mx.array) -> mx.array:
        raise NotImplementedError

    def embed(self, tokens: mx.array) -> mx.array:
        return self._shared.embed(tokens)

    def output(self) -> Callable[[mx.array], mx.array]:
        """The output projection this layer drafts through (the trunk's by default)."""
        return self._shared.lm_head

    def logits(self, h: mx.array) -> mx.array:
        if "draft_vocab" in self:
            return self._subset_logits(h)
        return self.output()(h)

    # -- draft vocabulary ---------------------------------------------------
    # A head may draft from a subset of the vocabulary, its most frequent
    # tokens (EAGLE-3, FR-Spec): the output projection is often the largest
    # part of a draft (a quarter of SmolLM2's forward, most of a draft with
    # Qwen3.5's 248K tokens), and a draft only needs the argmax. The trunk's
    # verify stays over the whole vocabulary, so the output does not change;
    # a draft outside the subset is only never proposed.

    def set_draft_vocab(self, tokens: Optional[mx.array]) -> None:
        """Draft from ``tokens`` only (token ids), or from every token (None)."""
        if tokens is None:
            if "draft_vocab" in self:
                del self["draft_vocab"]
        else:
            self.draft_vocab = mx.array(tokens, dtype=mx.int32)
        self._cut_rows()

    def _cut_rows(self) -> None:
        """Cut the output projection to the draft vocabulary's rows now (once
        the head is bound), so the first draft costs no more than a later one."""
        self._shared.rows = None
        if "draft_vocab" in self and self.output() is not None:
            self._shared.rows = _output_rows(self.output(), self.draft_vocab)

    def _subset_logits(self, h: mx.array) -> mx.array:
        """Full-size logits, -inf outside ``draft_vocab``, from a subset matmul."""
        if getattr(self._shared, "rows", None) is None:  # weights set after binding
            self._cut_rows()
        if self._shared.rows:
            matmul, vocab = self._shared.rows
            sub = matmul(h)
        else:  # an output head that cannot be sliced: full logits, then pick
            full = self.output()(h)
            sub, vocab = mx.take(full, self.draft_vocab, axis=-1), full.shape[-1]
        full = mx.full((*h.shape[:-1], vocab), -mx.inf, sub.dtype)
        idx = mx.broadcast_to(self.draft_vocab, sub.shape)
        return mx.put_along_axis(full, idx, sub, axis=-1)

    # -- forward -----------------------------------------------------------
    def __call__(
        self, hidden: mx.array, tokens: mx.array, cache: List[Any]
    ) -> Tuple[mx.array, mx.array]:
        """Logits for ``t_{i+2}`` and the normed output hidden state.

        ``hidden``: [B, L, D] hidden states ``h_i..h_{i+L-1}``; ``tokens``:
        [B, L] the tokens ``t_{i+1}..t_{i+L}``. The output hidden state is what
        the next draft in a chain feeds back in place of ``h``.
        """
        h, out = self.states(hidden, tokens, cache)
        return self.logits(h), out

    def states(
        self, hidden: mx.array, tokens: mx.array, cache: List[Any]
    ) -> Tuple[mx.array, mx.array]:
        """``__call__`` before the output projection: the states ``logits``
        takes, and the output hidden state. A draft needs the logits at one
        position of the L: the projection (a large share of a draft) is
        then applied to that one alone."""
        # cache=None runs the block without a cache from position 0 (training).
        c = cache[0] if cache is not None else None
        e = self.embed(tokens)
        if self.zero_first_embedding:
            e = zero_position_0(e, 0 if c is None else c.offset)
        x = self.fuse(e, hidden.astype(e.dtype))
        mask = create_attention_mask(x, c, return_array=True)
        x = self.block(x, mask, c)
        h = self.final_norm(x)
        return h, (h if self.chain_hidden == "post" else x)

    def make_cache(self) -> List[Any]:
        return [KVCache()]

    # -- layers ------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return 1

    def layer(self, j: int) -> "MTPHead":
        """The layer that drafts depth ``j + 1``."""
        return self

    def layer_cache(self, cache: List[Any], j: int) -> List[Any]:
        """Layer ``j``'s part of the head's flat cache list."""
        return cache

    # -- checkpoint naming -------------------------------------------------
    def module_path(self, rel: str) -> str:
        """Map a tensor name relative to the layer's prefix to this module's path."""
        top = rel.split(".", 1)[0]
        return rel if top in self.OWN else f"block.{rel}"


def zero_position_0(e: mx.array, offset) -> mx.array:
    """``e`` with the embedding at sequence position 0 zeroed.

    ``offset`` is the position of ``e``'s first row: an int, or one per
    sequence (an array) when a batch holds sequences at different positions.
    """
    if isinstance(offset, mx.array):
        first = (offset.reshape(-1, 1) + mx.arange(e.shape[1])) == 0
        return mx.where(first[..., None], mx.zeros_like(e), e)
    if offset == 0:
        return mx.concatenate([mx.zeros_like(e[:, :1]), e[:, 1:]], axis=1)
    return e


class MultiLayerHead(MTPHead):
    """MTP layers trained so that layer ``j`` drafts depth ``j + 1``.

    Each layer keeps its own cache. Layer ``j`` reads, at chain position
    ``i``, layer ``j - 1``'s output at ``i - 1`` with the token ``t_{i+1}``
    (the loop feeds it); called directly, the head is its first layer.
    """

    def __init__(self, layers: List[MTPHead]):
        super().__init__()
        self.layers = layers
        # position-0 zeroing is about the sequence's first token, which only
        # layer 0 reads (vLLM zeroes where the position is 0)
        for layer in layers[1:]:
            layer.zero_first_embedding = False
        ends = [0]
        for layer in layers:
            ends.append(ends[-1] + len(layer.make_cache()))
        # a plain attribute (a list would be taken for a parameter tree)
        object.__setattr__(self, "_cache_ends", ends)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer(self, j: int) -> MTPHead:
        return self.layers[j]

    def bind(self, embed: nn.Module, lm_head: Callable[[mx.array], mx.array]):
        for layer in self.layers:
            layer.bind(embed, lm_head)

    def set_draft_vocab(self, tokens: Optional[mx.array]) -> None:
        for layer in self.layers:
            layer.set_draft_vocab(tokens)

    def __call__(self, hidden, tokens, cache):
        return self.layers[0](hidden, tokens, self.layer_cache(cache, 0))

    def states(self, hidden, tokens, cache):
        return self.layers[0].states(hidden, tokens, self.layer_cache(cache, 0))

    def make_cache(self) -> List[Any]:
        return [c for layer in self.layers for c in layer.make_cache()]

    def layer_cache(self, cache: List[Any], j: int) -> List[Any]:
        return cache[self._cache_ends[j] : self._cache_ends[j + 1]]


def _output_rows(lm_head, vocab: mx.array):
    """``(matmul, vocab_size)``: the output projection cut to the rows ``vocab``.

    The rows come straight from the weights of an ``nn.Linear`` or of the tied
    embedding's ``as_linear`` (quantized ones store packed weights, scales and
    biases per output row), so the first draft costs no more than a later one.
    ``()`` for any other kind of output head.
    """
    module = getattr(lm_head, "__self__", lm_head)  # embed_tokens.as_linear
    if not isinstance(module, nn.Module) or "weight" not in module:
        return ()
    names = ("weight", "scales", "biases", "bias")
    r = {k: module[k][vocab] for k in names if k in module}
    mx.eval(r)

    def matmul(h: mx.array) -> mx.array:
        if "scales" in r:
            out = mx.quantized_matmul(
                h,
                r["weight"],
                r["scales"],
                r.get("biases"),
                transpose=True,
                group_size=module.group_size,
                bits=module.bits,
                mode=getattr(module, "mode", "affine"),
            )
        else:
            out = h @ r["weight"].T
        return out + r["bias"] if "bias" in r else out

    return matmul, module["weight"].shape[0]


def load_head_weights(
    head: MTPHead,
    prefix: str,
    weights: Dict[str, mx.array],
    sanitize_block: Callable[[Dict[str, mx.array]], Dict[str, mx.array]],
    quantization: Optional[Dict[str, Any]],
) -> None:
    """Load the tensors under ``prefix`` into ``head``, quantizing as the config says.

    ``sanitize_block`` turns raw block tensors (names relative to the block)
    into the form the trunk's block class expects (stacked experts, split
    MLA projections); it is the trunk's own ``sanitize``.
    """
    rel = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
    own = {k: v for k, v in rel.items() if k.split(".", 1)[0] in head.OWN}
    block = sanitize_block({k: v for k, v in rel.items() if k not in own})
    params = {**own, **{f"block.{k}": v for k, v in block.items()}}

    if quantization is not None or any(k.endswith(".scales") for k in params):
        from mlx_lm.utils import infer_quant_config

        per_module = {}
        for key, value in (quantization or {}).items():
            if isinstance(value, dict) and key.startswith(prefix):
                per_module[head.module_path(key[len(prefix) :])] = value

        def predicate(path, module):
            if path in per_module:
                return per_module[path]
            if not hasattr(module, "to_quantized") or f"{path}.scales" not in params:
                return False
            return infer_quant_config(path, module, params)

        defaults = quantization or {"group_size": 64, "bits": 4}
        nn.quantize(
            head,
            group_size=defaults.get("group_size", 64),
            bits=defaults.get("bits", 4),
            mode=defaults.get("mode", "affine"),
            class_predicate=predicate,
        )
    head.load_weights(list(params.items()), strict=True)
    mx.eval(head.parameters())
