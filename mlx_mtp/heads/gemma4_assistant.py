"""Gemma 4 assistant drafters (``model_type: gemma4_assistant``).

Google ships each Gemma 4 model with a small "assistant" checkpoint that
drafts for it. It is not an MTP layer inside the checkpoint but it drafts
like one: per step it reads the target's last hidden state (or its own
previous output) and the embedding of the last token, and it has no
key/value cache of its own. Its layers are Gemma 4 decoder layers with
queries only; they attend to the target's keys and values: each layer to the
cache of the target's last full-attention layer or last sliding-attention
layer that computes K/V, by the layer's type. Nothing it drafts is written to
any cache, so rolling a round back is the target's rollback alone.

What was pinned, and from where:

- tensors and config (``backbone_hidden_size``, ``text_config``,
  ``use_ordered_embeddings``, ``num_centroids``,
  ``centroid_intermediate_top_k``): Hugging Face transformers
  ``models/gemma4_assistant/modeling_gemma4_assistant.py`` and vLLM
  ``model_executor/models/gemma4_mtp.py``;
- a step: ``pre_projection([target_embed(token) * sqrt(backbone_hidden),
  hidden])`` (embedding first), the layers, ``model.norm``; the logits come
  from the normed state through the assistant's own tied embedding (or the
  centroid head below) and the next step's hidden state is
  ``post_projection`` of it (mlx-vlm ``speculative/drafters/gemma4_assistant``
  ``draft_block``);
- the query position is the same for every step of a round: the position of
  the round's first token, i.e. the target's cache length (transformers'
  ``SinglePositionMultiTokenCandidateGenerator``, mlx-vlm ``set_shared_kv``);
- masks: every cached key of a full-attention layer; on a sliding layer the
  keys less than ``sliding_window`` positions before the query (mlx-vlm
  ``masks.py``);
- the hidden state of the round's first step is the target's final-norm
  output, transformers' ``hidden_states[-1]`` (the trunk's "post" tap);
- E2B/E4B's centroid head (``masked_embedding``): the hidden state scores
  ``num_centroids`` clusters of ``vocab / num_centroids`` tokens
  (``token_ordering`` lists them), and only the tokens of the
  ``centroid_intermediate_top_k`` best clusters get logits. Elsewhere
  transformers writes the smallest selected logit minus one and vLLM -inf; we
  write -inf, so a draft's distribution is zero outside the selected tokens
  (the verifier's rejection sampling uses the same distribution, so it stays
  exact).

The target's sliding-window caches are swapped for plain caches with
windowed masks (``common.rollback_caches``): they roll back, and the assistant
reads a sliding layer's keys in order, all positions present.

A converted model keeps the assistant as ``mtp.safetensors`` (tensors under
``assistant.``) with its config in ``mtp_config.json``
(``mlx-mtp convert ASSISTANT --mtp-only --into MODEL``); ``--mtp ASSISTANT``
loads the assistant's own folder as it is.
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma4_text

from ..cache import cache_length
from .base import MTPHead
from .common import rollback_caches as patch_trunk  # noqa: F401  (loader hook)

ASSISTANT_TYPE = "gemma4_assistant"
MODEL_TYPES = {
    "gemma4": "Gemma 4 + assistant drafter",
    "gemma4_text": "Gemma 4 (text) + assistant drafter",
}
TARGET_TYPES = tuple(MODEL_TYPES)
# what the loader says of a Gemma 4 without its assistant
NO_HEAD_NOTICE = "no assistant drafter beside it (--mtp ASSISTANT_FOLDER)"
PREFIX = "assistant."


class SharedKV:
    """The assistant's place in the head caches: it holds no keys or values,
    only the count of positions it has read (so the round's bookkeeping of
    head caches holds for it as for any other head), and the target's caches,
    which it reads (``StreamCache`` links them)."""

    # it holds nothing per position: a batch's rows may be padded before
    # their inputs, so that each row's last input is the call's last
    pads_left = True

    def __init__(self, offset: int = 0):
        self.offset = offset
        self.trunk: Optional[List[Any]] = None

    def link(self, trunk: List[Any]) -> None:
        self.trunk = trunk

    def positions(self) -> List[int]:
        """Where the round's first token sits: the trunk's length."""
        return [cache_length(self.trunk)]

    def count(self, n: int) -> None:
        self.offset += n

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    @property
    def state(self) -> List[mx.array]:
        return []

    @property
    def nbytes(self) -> int:
        return 0

    def __deepcopy__(self, memo) -> "SharedKV":
        return SharedKV(self.offset)  # the copy is linked to its own trunk

    @staticmethod
    def merge_batch(caches: Sequence["SharedKV"]) -> "BatchSharedKV":
        """The batch form (``batch_cache.merge``)."""
        return BatchSharedKV([c.offset for c in caches])


class BatchSharedKV:
    """``SharedKV`` of a batch of streams (``decoder.Decoder``): each stream's
    count, linked to the batch's trunk caches (``batch_cache.RaggedKVCache``),
    whose rows the assistant reads, each at its stream's own length."""

    pads_left = True

    def __init__(self, lengths: Sequence[int] = ()):
        self.lengths = list(lengths)
        self.trunk: Optional[List[Any]] = None

    def link(self, trunk: List[Any]) -> None:
        self.trunk = trunk

    def positions(self) -> List[int]:
        return list(next(c.lengths for c in self.trunk if hasattr(c, "lengths")))

    def count(self, n: int) -> None:
        self.lengths = [m + n for m in self.lengths]

    def rollback(self, n) -> None:
        n = [n] * len(self.lengths) if isinstance(n, int) else list(n)
        self.lengths = [m - k for m, k in zip(self.lengths, n)]
        if self.lengths and min(self.lengths) < 0:
            raise ValueError("rolled back past the start of a stream")

    def extend(self, other: "BatchSharedKV") -> None:
        self.lengths = self.lengths + other.lengths

    def filter(self, keep: Sequence[int]) -> None:
        self.lengths = [self.lengths[i] for i in keep]

    def extract(self, b: int) -> SharedKV:
        return SharedKV(self.lengths[b])  # linked to the stream's trunk by it

    @property
    def state(self) -> List[mx.array]:
        return []

    @property
    def nbytes(self) -> int:
        return 0


class CentroidHead(nn.Module):
    """E2B/E4B's output over the tokens of the best-scoring clusters only."""

    def __init__(self, dims: int, vocab: int, n_centroids: int, top_k: int):
        super().__init__()
        if vocab % n_centroids:
            raise ValueError(f"vocab {vocab} is not a multiple of {n_centroids}")
        self.centroids = nn.Linear(dims, n_centroids, bias=False)
        self.token_ordering = mx.zeros((vocab,), mx.int32)
        self.top_k = top_k

    def __call__(self, h: mx.array, table: mx.array) -> mx.array:
        scores = self.centroids(h)  # [B, L, C]
        n = scores.shape[-1]
        best = mx.argpartition(-scores, kth=self.top_k - 1, axis=-1)[..., : self.top_k]
        clusters = self.token_ordering.reshape(n, -1)
        ids = clusters[best].reshape(*h.shape[:-1], -1)  # [B, L, top_k * V / C]
        rows = table[ids]  # [B, L, S, D]
        picked = (rows @ h[..., None]).squeeze(-1)
        out = mx.full((*h.shape[:-1], table.shape[0]), -mx.inf, picked.dtype)
        return mx.put_along_axis(out, ids, picked, axis=-1)


class _Inner(nn.Module):
    def __init__(self, args: Any, layers: List[nn.Module]):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = layers
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


def text_args(config: Dict[str, Any]):
    """mlx-lm's Gemma 4 text arguments for the assistant's layers: every layer
    shares K/V (it has none), no per-layer inputs."""
    text = dict(config.get("text_config") or {})
    text.setdefault("vocab_size", config.get("vocab_size", 262144))
    n = int(text.get("num_hidden_layers", 4))
    text.update(
        num_hidden_layers=n,
        num_kv_shared_layers=n,
        hidden_size_per_layer_input=0,
        use_double_wide_mlp=False,
        enable_moe_block=False,
    )
    return gemma4_text.ModelArgs.from_dict(text)


class Gemma4Assistant(MTPHead):
    OWN = ("model", "pre_projection", "post_projection", "masked_embedding", "lm_head")
    zero_first_embedding = False
    takes_draft_vocab = False  # its output head is its own (E2B/E4B: clustered)
    # it reads the trunk's hidden state at its last input alone (``states``):
    # a prompt's are not computed for it (``Drafter.reads_last``)
    reads_last_input = True

    def __init__(self, config: Dict[str, Any], kv_layers: Dict[str, int]):
        super().__init__()
        args = text_args(config)
        backbone = int(config["backbone_hidden_size"])
        self.args = args
        self.model = _Inner(
            args,
            [gemma4_text.DecoderLayer(args, i) for i in range(args.num_hidden_layers)],
        )
        self.pre_projection = nn.Linear(2 * backbone, args.hidden_size, bias=False)
        self.post_projection = nn.Linear(args.hidden_size, backbone, bias=False)
        if config.get("use_ordered_embeddings"):
            self.masked_embedding = CentroidHead(
                args.hidden_size,
                args.vocab_size,
                int(config.get("num_centroids", 2048)),
                int(config.get("centroid_intermediate_top_k", 32)),
            )
        if not config.get("tie_word_embeddings", True):
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        missing = {t for t in args.layer_types if t not in kv_layers}
        if missing:
            raise ValueError(f"the target has no {sorted(missing)[0]} layer to read")
        self._kv_layers = kv_layers  # layer type -> index of the target's cache
        self._embed_scale = backbone**0.5

    def make_cache(self) -> List[Any]:
        return [SharedKV()]

    def output(self):
        if "masked_embedding" in self:
            table, head = self.model.embed_tokens.weight, self.masked_embedding
            return lambda h: head(h, table)
        if "lm_head" in self:
            return self.lm_head
        return self.model.embed_tokens.as_linear

    def set_draft_vocab(self, tokens) -> None:
        if tokens is not None:
            raise ValueError("a Gemma 4 assistant drafts from its own output head")

    def _shared_kv(self, trunk: List[Any], positions: List[int]):
        """Per layer type, the target's keys and values the query of stream
        ``b`` at ``positions[b]`` sees (the window's on a sliding layer), and
        the mask that keeps each stream to its own (None for one position)."""
        first, last = min(positions), max(positions)
        window = self.args.sliding_window
        out, masks = {}, {}
        for kind, i in self._kv_layers.items():
            c = trunk[i]
            start = 0
            if kind == "sliding_attention":
                start = max(0, first - window + 1)
            if hasattr(c, "dequantized"):  # a quantized cache: read in full
                keys, values = c.dequantized()
            else:
                keys, values = c.keys, c.values
            out[kind] = (keys[..., start:last, :], values[..., start:last, :])
            masks[kind] = None
            if first != last:  # each stream sees the keys before its position
                at = mx.array(positions)[:, None]
                keys_at = mx.arange(start, last)[None]
                # (a stream at 0 reads nothing of its own: its row is padding)
                seen = (keys_at < mx.maximum(at, start + 1))
                if kind == "sliding_attention":
                    seen = seen & (keys_at > at - window)
                masks[kind] = seen[:, None, None, :]  # [B, 1, 1, keys]
        return out, masks

    def __call__(
        self, hidden: mx.array, tokens: mx.array, cache: List[Any]
    ) -> Tuple[mx.array, mx.array]:
        """The draft after the last of ``tokens``: logits ``[B, 1, V]`` and the
        next step's hidden state ``[B, 1, backbone]``. Earlier pairs only
        advance the count of positions read: the assistant keeps nothing of
        them (the target's caches hold the context)."""
        h, out = self.states(hidden, tokens, cache)
        return self.logits(h), out

    def states(
        self, hidden: mx.array, tokens: mx.array, cache: List[Any]
    ) -> Tuple[mx.array, mx.array]:
        """``__call__`` before the output projection (``MTPHead.states``).
        In a batch each row's last input is its own (rows are padded before
        their inputs: ``SharedKV.pads_left``) and each reads its stream's
        rows of the batch's trunk caches at that stream's length."""
        if cache is None or cache[0].trunk is None:
            raise ValueError(
                "a Gemma 4 assistant drafts only beside its target's caches"
            )
        c = cache[0]
        positions = c.positions()  # each round's first token's position
        e = self.embed(tokens[:, -1:]) * self._embed_scale
        x = mx.concatenate([e, hidden[:, -1:].astype(e.dtype)], axis=-1)
        h = self.pre_projection(x)
        kv, masks = self._shared_kv(c.trunk, positions)
        offset = mx.array(positions if len(set(positions)) > 1 else positions[0])
        for layer in self.model.layers:
            kind = layer.layer_type
            h, _, _ = layer(h, masks[kind], None, shared_kv=kv[kind], offset=offset)
        h = self.model.norm(h)
        c.count(tokens.shape[1])
        return h, self.post_projection(h)


def kv_layers(backbone: nn.Module) -> Dict[str, int]:
    """Per layer type, the target's last layer that computes K/V: its cache is
    what the assistant's layers of that type read."""
    out = {}
    for i, layer in enumerate(backbone.layers):
        if layer.self_attn.has_kv:
            out[layer.layer_type] = i
    return out


def num_layers(config: Dict[str, Any]) -> int:
    return 1 if config.get("assistant") else 0


def prefix(config: Dict[str, Any], j: int = 0) -> str:
    return PREFIX


def is_mtp_key(key: str, config: Dict[str, Any]) -> bool:
    return key.startswith(PREFIX)


def build(
    args, config: Dict[str, Any], backbone: nn.Module, weights
) -> Gemma4Assistant:
    """The assistant whose config the model's MTP config carries (``assistant``)."""
    if config.get("model_type") not in TARGET_TYPES:
        raise ValueError(
            f"a Gemma 4 assistant drafts for Gemma 4, not {config.get('model_type')!r}"
        )
    assistant = config["assistant"]
    width = backbone.norm.weight.shape[0]  # (a quantized embedding is packed)
    if int(assistant["backbone_hidden_size"]) != width:
        raise ValueError(
            f"the assistant is for a {assistant['backbone_hidden_size']}-wide "
            f"Gemma 4, this one is {width} wide"
        )
    return Gemma4Assistant(assistant, kv_layers(backbone))


def sanitize(
    config: Dict[str, Any], weights: Dict[str, mx.array]
) -> Dict[str, mx.array]:
    """The assistant checkpoint's tensors as the head loads them, under ``assistant.``:
    the tied ``lm_head`` goes, the centroid ordering becomes int32."""
    out = {}
    for k, v in weights.items():
        if k == "lm_head.weight" and config.get("tie_word_embeddings", True):
            continue
        if k == "masked_embedding.token_ordering":
            v = v.astype(mx.int32)
        out[PREFIX + k] = v
    return out
