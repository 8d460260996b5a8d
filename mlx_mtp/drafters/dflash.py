"""DFlash block drafters (z-lab, "Block Diffusion for Flash Speculative
Decoding"), as the published checkpoints lay them out.

A DFlash drafter is a few Qwen3-style layers with no embedding or output head
of its own. It reads the outputs of chosen target layers
(``dflash_config.target_layer_ids``), concatenated, through ``fc`` and
``hidden_norm``: that context enters every layer's keys and values (each
layer's own ``k_proj``/``v_proj``, ``k_norm``, RoPE at the context's
positions) and is kept in the layer's cache. A block ``[y, MASK x k]`` at the
positions that follow, embedded with the target's embedding, attends to the
context and to itself both ways (a sliding-window layer: causally, within its
window, unless the config says ``is_causal``), and the drafter's final norm
and the target's output head give ``k`` drafts in ONE forward.

The context's keys and values stay; the block's are written tentatively and
rolled back by the round. Pinned from z-lab/dflash ``dflash/model.py``
(``Qwen3DFlashAttention``, ``DFlashDraftModel``, ``dflash_generate``) and
``dflash/model_mlx.py`` (``DFlashAttention``, ``_draft_config``).
"""

import glob
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3 import MLP
from mlx_lm.models.rope_utils import initialize_rope

from ..drafter import Drafter, DraftView, Reads
from ..weights import read_safetensors
from ..sampling import Draft
from ..target import output_head

KINDS = {"DFlashDraftModel": "a DFlash block drafter (z-lab)"}

LAYER_TYPES = ("full_attention", "sliding_attention")


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> List[int]:
    """The published default taps: evenly spaced from layer 1 to ``n - 3``."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    step = (end - start) / (num_draft_layers - 1)
    return [int(round(start + i * step)) for i in range(num_draft_layers)]


@dataclass
class DFlashArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[Dict[str, Any]]
    max_position_embeddings: int
    block_size: int
    target_layer_ids: Tuple[int, ...]
    mask_token_id: int
    num_target_layers: Optional[int]
    layer_types: Tuple[str, ...]
    sliding_window: Optional[int]
    is_causal: Optional[bool]
    attention_bias: bool
    input_embedding_scale: float
    output_multiplier: float
    final_logit_softcapping: Optional[float]
    extra: Dict[str, Any]  # the rest of ``dflash_config`` (a subclass's own keys)

    @classmethod
    def from_config(cls, config: Dict[str, Any]) -> "DFlashArgs":
        """Both layouts: ``block_size`` at the top or in ``dflash_config``,
        ``rope_theta`` at the top or in ``rope_parameters``."""
        dflash = config.get("dflash_config") or {}

        def value(name, default=None):
            return dflash.get(name, config.get(name, default))

        if value("target_layer_ids") is None:
            raise ValueError("no dflash_config.target_layer_ids")
        if value("mask_token_id") is None:
            raise ValueError("no dflash_config.mask_token_id")
        heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
        rope = config.get("rope_parameters") or config.get("rope_scaling")
        theta = config.get("rope_theta", (rope or {}).get("rope_theta", 10000.0))
        types = tuple(config.get("layer_types") or _derived_layer_types(config))
        if len(types) != layers or set(types) - set(LAYER_TYPES):
            raise ValueError(f"layer_types {list(types)} for {layers} layers")
        if "sliding_attention" in types and not config.get("sliding_window"):
            raise ValueError("sliding_attention layers without a sliding_window")
        cap = value("final_logit_softcapping")
        return cls(
            hidden_size=config["hidden_size"],
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope,
            max_position_embeddings=config.get("max_position_embeddings", 32768),
            block_size=int(value("block_size", 16)),
            target_layer_ids=tuple(int(i) for i in value("target_layer_ids")),
            mask_token_id=int(value("mask_token_id")),
            num_target_layers=config.get("num_target_layers"),
            layer_types=types,
            sliding_window=config.get("sliding_window"),
            is_causal=config.get("is_causal"),
            attention_bias=bool(config.get("attention_bias", False)),
            input_embedding_scale=float(value("input_embedding_scale", 1.0)),
            output_multiplier=float(value("output_multiplier", 1.0)),
            final_logit_softcapping=None if cap is None else float(cap),
            extra=dict(dflash),
        )


def _derived_layer_types(config: Dict[str, Any]) -> List[str]:
    """transformers' Qwen3 rule where ``layer_types`` is absent: sliding from
    layer ``max_window_layers`` on, when ``use_sliding_window``."""
    n, window = config["num_hidden_layers"], config.get("sliding_window")
    first = config.get("max_window_layers", 28)
    sliding = bool(config.get("use_sliding_window")) and window
    return [
        "sliding_attention" if sliding and i >= first else "full_attention"
        for i in range(n)
    ]


class Attention(nn.Module):
    """Queries from the block; keys and values from the context (cached) and
    from the block (tentative)."""

    def __init__(self, args: DFlashArgs, sliding: bool):
        super().__init__()
        dim, hd = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads = (
            args.num_attention_heads,
            args.num_key_value_heads,
        )
        self.scale = hd**-0.5
        bias = args.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=bias)
        self.q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.sliding = sliding

    def _kv(self, x: mx.array, rope, offset) -> Tuple[mx.array, mx.array]:
        B, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1))
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1)
        return rope(k.transpose(0, 2, 1, 3), offset=offset), v.transpose(0, 2, 1, 3)

    def context(self, x: mx.array, rope, cache) -> None:
        """Write the context's keys and values (``x`` past ``fc`` and the norm)."""
        cache.update_and_fetch(*self._kv(x, rope, cache.offset))

    def __call__(self, x: mx.array, rope, cache, mask: mx.array) -> mx.array:
        B, L, _ = x.shape
        offset = cache.offset
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1))
        q = rope(q.transpose(0, 2, 1, 3), offset=offset)
        keys, values = cache.update_and_fetch(*self._kv(x, rope, offset))
        # (mlx-lm's: the quantized path where the cache is quantized, --kv-bits)
        out = scaled_dot_product_attention(
            q, keys, values, cache=cache, scale=self.scale, mask=mask
        )
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DecoderLayer(nn.Module):
    def __init__(self, args: DFlashArgs, sliding: bool):
        super().__init__()
        self.self_attn = Attention(args, sliding)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(
            args.hidden_size, eps=args.rms_norm_eps
        )

    def __call__(self, x, rope, cache, mask):
        h = x + self.self_attn(self.input_layernorm(x), rope, cache, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashModel(nn.Module):
    """The drafter's own weights, named as the checkpoint names them."""

    layer_class = DecoderLayer

    def __init__(self, args: DFlashArgs):
        super().__init__()
        self.args = args
        dim = args.hidden_size
        self.add_projection(args)
        self.layers = [
            self.layer_class(args, t == "sliding_attention") for t in args.layer_types
        ]
        self.norm = nn.RMSNorm(dim, eps=args.rms_norm_eps)
        self.rope = initialize_rope(
            args.head_dim,
            args.rope_theta,
            False,
            args.rope_scaling,
            args.max_position_embeddings,
        )

    def add_projection(self, args: DFlashArgs) -> None:
        """The modules that take the tapped layers' outputs to one hidden
        state (a kind whose checkpoint names them otherwise overrides this
        and ``project``)."""
        dim = args.hidden_size
        self.fc = nn.Linear(len(args.target_layer_ids) * dim, dim, bias=False)
        self.hidden_norm = nn.RMSNorm(dim, eps=args.rms_norm_eps)

    def project(self, features: mx.array) -> mx.array:
        return self.hidden_norm(self.fc(features))

    def context(self, features: mx.array, caches: List[Any]) -> mx.array:
        """Each layer's cache reads ``features`` (``[B, L, n_taps * D]``)."""
        h = self.project(features)
        for layer, c in zip(self.layers, caches):
            layer.self_attn.context(h, self.rope, c)
        return h

    def block(self, h: mx.array, valid: mx.array, caches: List[Any]) -> mx.array:
        """The block's hidden states after the final norm: ``h`` (``[B, L, D]``,
        embedded) at each stream's next positions, its first ``valid[b]``
        inputs real (the rest padding no real input sees)."""
        masks = self._masks(caches[0], valid, h.shape[1])
        for layer, c in zip(self.layers, caches):
            h = layer(h, self.rope, c, masks[layer.self_attn.sliding])
        return self.norm(h)

    def _masks(self, cache, valid: mx.array, L: int) -> Dict[bool, mx.array]:
        """``[B, 1, L, keys]`` per layer kind: a query sees the context and
        the block's real inputs (a sliding layer: those within its window,
        causally unless ``is_causal`` says otherwise), and itself."""
        lengths = _lengths(cache)
        start = mx.array(lengths, dtype=mx.int32)
        q = start[:, None] + mx.arange(L)[None]  # [B, L]
        k = mx.arange(max(lengths) + L)[None, None]  # [1, 1, keys]
        seen = k < (start + valid)[:, None, None]
        masks = {}
        for sliding in {layer.self_attn.sliding for layer in self.layers}:
            m = seen
            causal = self.args.is_causal
            if sliding:
                causal = True if causal is None else causal
                m = m & (mx.abs(q[..., None] - k) < self.args.sliding_window)
            if causal:
                m = m & (k <= q[..., None])
            masks[sliding] = (m | (k == q[..., None]))[:, None]
        return masks

    def logits(self, h: mx.array, lm_head) -> mx.array:
        logits = lm_head(h)
        if self.args.output_multiplier != 1.0:
            logits = logits * self.args.output_multiplier
        cap = self.args.final_logit_softcapping
        if cap:
            logits = mx.tanh(logits / cap) * cap
        return logits


def _lengths(cache) -> List[int]:
    """Where each stream's next entry goes in ``cache``."""
    lengths = getattr(cache, "lengths", None)  # a batch's ragged cache
    return list(lengths) if lengths is not None else [cache.offset]


class DFlashDrafter(Drafter):
    """A DFlash drafter attached to a target: the round's interface
    (``drafter.Drafter``) over ``DFlashModel``."""

    name = "dflash"
    flat_cost = True
    boundable = False  # its masks place the whole context (``_masks``)

    def __init__(self, model: DFlashModel, embed, lm_head, cost: float = 0.08):
        self.model = model
        args = model.args
        self.reads = Reads(hidden=False, layers=args.target_layer_ids)
        self.block_size = args.block_size
        self.kv_widths = (args.head_dim,)
        self.max_drafts = args.block_size - 1
        self.embed, self.lm_head = embed, lm_head
        self.cost = cost  # a block's cost in plain steps, before ``tune`` measures it

    def make_caches(self) -> List[Any]:
        return [KVCache() for _ in self.model.layers]

    def prior_cost(self, k: int, step: float = 0.08) -> float:
        return 0.0 if k == 0 else self.cost

    # -- the model ---------------------------------------------------------------

    def _absorb(self, features, tokens, caches):
        h = self.model.context(features.astype(self.dtype), caches)
        return h, h

    def _block(self, valid, tokens, caches):
        """``valid`` (``[B, L, 1]``: 1 at a real input, 0 at padding) says
        how long each stream's block is."""
        h = self.embed(tokens)
        scale = self.model.args.input_embedding_scale
        h = (h * scale if scale != 1.0 else h).astype(self.dtype)
        h = self.model.block(h, valid[..., 0].sum(axis=1).astype(mx.int32), caches)
        return h, h

    @property
    def dtype(self):
        return self.model.norm.weight.dtype  # norms stay unquantized

    def block_hidden(self, features: mx.array, token: int, k: int) -> mx.array:
        """Teacher-forced: the final hidden states ``[k, D]`` at positions
        1..k of the block ``[token, MASK x k]`` after the context
        ``features`` (``[1, L, F]``), on fresh caches."""
        caches = self.make_caches()
        if features.shape[1]:
            self._absorb(features, None, caches)
        tokens = mx.array([[token] + [self.model.args.mask_token_id] * k])
        h, _ = self._block(mx.ones((1, k + 1, 1)), tokens, caches)
        return h[0, 1:]

    def block_logits(self, features: mx.array, token: int, k: int) -> mx.array:
        """The logits ``[k, V]`` of ``block_hidden``."""
        return self.model.logits(self.block_hidden(features, token, k), self.lm_head)

    # -- the round ----------------------------------------------------------------

    def _read_pending(self, view: DraftView, streams, taking: Sequence[bool]) -> None:
        """Every stream in ``taking`` reads every feature it has not read."""
        queues = [self.state(s).pending[0] for s in streams]
        items = [
            (q.hidden, [0] * q.size) if t and q.size else None
            for q, t in zip(queues, taking)
        ]
        if any(items):
            view.ragged(self._absorb, items, view.caches(self))
            for q, it in zip(queues, items):
                if it is not None:
                    q.drop_first(q.size)

    def catch_up(self, view: DraftView, streams: Sequence[Any]) -> None:
        self._read_pending(view, streams, [True] * len(streams))

    def draft_block(self, stream, hidden, logits, p_min: float) -> List[Draft]:
        """``stream``'s drafts from its block's hidden states and logits at
        positions 1..k (``[k, D]``, ``[k, V]``): each its row's draft, until
        one's probability falls below ``p_min``."""
        drafts: List[Draft] = []
        for j in range(logits.shape[0]):
            d = stream.verifier.draft(logits[j : j + 1], stream.history, drafts)
            if p_min > 0 and d.p.item() < p_min:
                break
            d.source = self.name
            drafts.append(d)
        return drafts

    def propose(
        self, view: DraftView, streams: Sequence[Any], ks: Sequence[int], p_min: float
    ) -> Tuple[List[List[Draft]], List[List[int]]]:
        """1) each drafting stream reads its pending features; 2) ONE forward
        over each one's block ``[y, MASK x k_b]``; 3) its drafts from the
        target's output head at the block's positions 1..k_b
        (``draft_block``)."""
        ks = [min(k, self.max_drafts) for k in ks]
        drafts: List[List[Draft]] = [[] for _ in streams]
        tentative = [[0] for _ in streams]
        if not any(ks):
            return drafts, tentative
        self._read_pending(view, streams, [k > 0 for k in ks])
        mask = self.model.args.mask_token_id
        items = [
            (mx.ones((1, k + 1, 1)), [s.history[-1]] + [mask] * k) if k else None
            for s, k in zip(streams, ks)
        ]
        _, outs = view.ragged(self._block, items, view.caches(self))
        hidden = mx.concatenate([o[0, 1:] for o in outs if o is not None])
        logits = self.model.logits(hidden, self.lm_head)
        at = 0
        for b, (s, k) in enumerate(zip(streams, ks)):
            if not k:
                continue
            tentative[b][0] = k + 1
            rows = slice(at, at + k)
            drafts[b] = self.draft_block(s, hidden[rows], logits[rows], p_min)
            at += k
        # the drafter computes while the caller builds the verify graph
        mx.async_eval([d.token for ds in drafts for d in ds])
        return drafts, tentative


# -- loading ------------------------------------------------------------------------


def read_weights(
    folder: Path, drop: Tuple[str, ...] = ("embed_tokens", "lm_head")
) -> Dict[str, mx.array]:
    """The checkpoint's tensors, ``model.`` prefix dropped, and without
    ``drop`` (a DFlash drafter uses the target's embedding and output head,
    should it carry copies)."""
    files = glob.glob(str(Path(folder) / "*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors in {folder}")
    weights = read_safetensors(files)
    out = {}
    for k, v in weights.items():
        k = k[len("model.") :] if k.startswith("model.") else k
        if k.split(".")[0] in drop:
            continue
        out[k] = v
    return out


def target_shape(target) -> Tuple[int, int, int]:
    """(hidden size, vocabulary, decoder layers) of the loaded ``target``."""
    embed = target.target.embed_tokens
    if isinstance(embed, nn.QuantizedEmbedding):
        vocab, dims = embed.num_embeddings, embed.dims
    else:
        vocab, dims = embed.weight.shape
    return dims, vocab, target.target.num_layers


def check_fits(args: DFlashArgs, target) -> None:
    """A ``ValueError`` naming what of ``args`` does not fit ``target``."""
    dims, vocab, layers = target_shape(target)
    if args.hidden_size != dims:
        raise ValueError(f"hidden size {args.hidden_size}, the model's is {dims}")
    if args.vocab_size != vocab:
        raise ValueError(f"vocabulary of {args.vocab_size}, the model's is {vocab}")
    if not 0 <= args.mask_token_id < vocab:
        raise ValueError(f"mask_token_id {args.mask_token_id} past the vocabulary")
    if args.num_target_layers is not None and args.num_target_layers != layers:
        raise ValueError(
            f"made for a target of {args.num_target_layers} layers, the model has "
            f"{layers}"
        )
    past = [i for i in args.target_layer_ids if not 0 <= i < layers]
    if past:
        raise ValueError(f"target_layer_ids {past} past the model's {layers} layers")
    if args.block_size < 2:
        raise ValueError(f"block_size {args.block_size} drafts nothing")


def with_weights(model: nn.Module, weights: Dict[str, mx.array], config) -> None:
    """Load ``weights`` (checkpoint names) into ``model``; the modules that
    ``convert -q`` quantized (``config["quantization"]``) quantized alike."""
    quant = config.get("quantization")
    if quant:
        nn.quantize(
            model,
            group_size=quant["group_size"],
            bits=quant["bits"],
            class_predicate=lambda p, m: f"{p}.scales" in weights,
        )
    model.load_weights(list(weights.items()))


def build(model_class, folder, config, target) -> DFlashModel:
    """``model_class`` with the weights of ``folder``, checked against ``target``."""
    args = DFlashArgs.from_config(config)
    check_fits(args, target)
    model = model_class(args)
    with_weights(model, read_weights(folder), config)
    model.eval()
    mx.eval(model.parameters())
    return model


def relative_cost(model: nn.Module, target) -> float:
    """A block's cost in plain steps before ``tune`` measures it: the bytes it
    reads (its weights and the target's output head) over the target's."""

    def nbytes(m):
        return sum(v.nbytes for _, v in tree_flatten(m.parameters()))

    trunk = nbytes(target.target.model)
    head = output_head(target.target.model)
    head_bytes = nbytes(head) if isinstance(head, nn.Module) else 0
    return min(1.0, max(0.02, (nbytes(model) + head_bytes) / max(trunk, 1)))


def attach_parts(model: nn.Module, target):
    """The target's embedding and output head, and the prior block cost."""
    trunk = target.target
    return trunk.embed_tokens, output_head(trunk.model), relative_cost(model, target)


def load(folder, config: Dict[str, Any], target) -> DFlashDrafter:
    model = build(DFlashModel, folder, config, target)
    return DFlashDrafter(model, *attach_parts(model, target))


def make_model(config: Dict[str, Any]) -> nn.Module:
    """The drafter's module, its parameters named as the checkpoint's (convert)."""
    return DFlashModel(DFlashArgs.from_config(config))


def summary(config: Dict[str, Any]) -> Dict[str, Any]:
    """What ``info`` shows of a drafter folder."""
    args = DFlashArgs.from_config(config)
    sliding = args.layer_types.count("sliding_attention")
    return {
        "block_size": args.block_size,
        "target_layer_ids": list(args.target_layer_ids),
        "num_target_layers": args.num_target_layers,
        "mask_token_id": args.mask_token_id,
        "hidden_size": args.hidden_size,
        "sliding_window_layers": sliding,
    }
