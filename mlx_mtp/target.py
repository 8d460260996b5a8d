"""The target: what the runtime needs of the main model, as one object.

The loop, the scheduler, the drafters, the heads, the cache policies and the
prompt-cache files see the main model only through a ``Target``: a forward
over a chunk of tokens, some of its positions read as input embeddings (a
prompt's media segments, ``prompt.Segment``), that returns the logits and the
taps drafters read (``Taps``); its caches; its token embedding and output
head; its layers. ``Target`` runs any model built like mlx-lm's (a backbone
owning the token embedding, ``layers`` and a final norm; mlx-vlm's language
models are too) with no change in behaviour; a target for another kind of
model, or one that reads a new medium (``embed_segment``), is a subclass
(``loader.load_model(..., target=CLASS)``).

Drafters read the target's hidden states. mlx-lm models return only logits,
so we tap modules of the backbone, one mechanism for every family mlx-lm
loads: the final norm (its output, post-norm, the default; or its input,
pre-norm), which the MTP heads read, and the decoder layers a drafter asks
for (``tap_layers``: each records its output, the hidden state it hands the
next layer), which block drafters and EAGLE-style heads read. A tap swaps the
module's class for a subclass that records and returns what the original
returns; the module keeps its parameter path, so the trunk's weights load and
save unchanged.
"""

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from .errors import MTPError
from .prompt import Piece, Segment

HIDDEN_TAPS = ("post", "pre")


# mlx-lm's names for the token embedding and the final norm: most families use
# the first; Nemotron-H ``embeddings`` / ``norm_f``, Bailing ``word_embeddings``,
# LongCat-Flash-Ngram ``ngram_embeddings`` (which holds ``word_embeddings``).
# Qwen3.8-Flash-Next (mlx-vlm's ``qwen4_exp``) closes with no norm but the
# mixer of its hyper-connection streams: its input ("pre") is what the head reads.
_EMBEDDINGS = ("embed_tokens", "embeddings", "word_embeddings", "ngram_embeddings")
_FINAL_NORMS = ("norm", "norm_f", "hyper_connection_mixer")


def _first(m: nn.Module, names) -> Optional[str]:
    return next((n for n in names if hasattr(m, n)), None)


def find_backbone(model: nn.Module) -> nn.Module:
    """The module that owns the token embedding, ``layers`` and the final norm."""
    candidates = [
        model,
        getattr(model, "model", None),
        getattr(model, "backbone", None),
    ]
    lm = getattr(model, "language_model", None)
    if lm is not None:
        candidates += [lm, getattr(lm, "model", None)]
    for m in candidates:
        if (
            m is not None
            and hasattr(m, "layers")
            and _first(m, _EMBEDDINGS)
            and _first(m, _FINAL_NORMS)
        ):
            return m
    raise ValueError(f"cannot find the backbone of {type(model).__name__}")


def embedding(backbone: nn.Module) -> nn.Module:
    """The token embedding (an n-gram embedding's plain token part)."""
    found = getattr(backbone, _first(backbone, _EMBEDDINGS))
    return getattr(found, "word_embeddings", found)


def final_norm(backbone: nn.Module) -> nn.Module:
    return getattr(backbone, _first(backbone, _FINAL_NORMS))


def output_head(model: nn.Module):
    """The trunk's output projection as a callable from hidden states to logits."""
    for m in (model, getattr(model, "language_model", None)):
        if m is not None and "lm_head" in m:
            return m.lm_head
    return embedding(find_backbone(model)).as_linear


class _Tap:
    """Holds the hidden state recorded by a tapped norm."""

    def __init__(self, where: str):
        if where not in HIDDEN_TAPS:
            raise ValueError(f"hidden tap must be one of {HIDDEN_TAPS}, not {where!r}")
        self.where = where
        self.value: Optional[mx.array] = None


def _wrap_call(module: nn.Module, marker: str, wrap: Callable) -> Callable:
    """Swap ``module``'s class for a subclass whose ``__call__`` is
    ``wrap(call)``, ``call`` the class's own (returned); the module keeps its
    parameter path, so weights load and save unchanged. A module ``marker``
    wrapped before is wrapped afresh, not twice."""
    base = type(module)
    if getattr(base, marker, False):
        base = base.__mro__[1]
    attrs = {marker: True, "__call__": wrap(base.__call__)}
    module.__class__ = type(base.__name__, (base,), attrs)
    return base.__call__


def _install_tap(norm: nn.Module, tap: _Tap) -> None:
    def wrap(call):
        def __call__(self, x, *args, **kwargs):
            y = call(self, x, *args, **kwargs)
            tap.value = y if tap.where == "post" else x
            return y

        return __call__

    _wrap_call(norm, "_mtp_tapped", wrap)


@dataclass
class Taps:
    """What one trunk forward left for drafters: the final hidden state and
    the outputs of the tapped layers (``[B, T, D]`` each)."""

    hidden: mx.array
    layers: Dict[int, mx.array] = field(default_factory=dict)


def _install_layer_tap(layer: nn.Module, i: int, taken: Dict[int, mx.array]) -> None:
    """Record ``layer``'s output (the first array of a tuple) in ``taken[i]``."""

    def wrap(call):
        def __call__(self, *args, **kwargs):
            out = call(self, *args, **kwargs)
            taken[i] = out[0] if isinstance(out, (tuple, list)) else out
            return out

        return __call__

    _wrap_call(layer, "_mtp_layer_tap", wrap)


class _Feed:
    """Input embeddings the token embedding hands on in place of its own, for
    one forward (media read as embeddings: ``Target.forward``)."""

    def __init__(self):
        self.value: Optional[mx.array] = None
        self.plain: Any = None  # the embedding's own lookup


def _install_feed(embed: nn.Module, feed: _Feed) -> None:
    def wrap(call):
        def __call__(self, x, *args, **kwargs):
            if feed.value is not None and feed.value.shape[:2] == x.shape[:2]:
                return feed.value
            return call(self, x, *args, **kwargs)

        return __call__

    call = _wrap_call(embed, "_mtp_fed", wrap)
    feed.plain = lambda x: call(embed, x)


class Target:
    """The main model as the runtime sees it: ``forward`` over a chunk, its
    caches (``make_cache``), ``embed_tokens``, ``output_head``, its layers.

    ``model`` is the module itself (mlx-lm's model), which mlx-lm's own
    functions take; ``embed_segment`` turns a media segment into the input
    embeddings read at its positions (none here: a text model)."""

    # segments' embeddings kept for the chunks that read them (a segment split
    # over chunks is embedded once)
    KEPT_SEGMENTS = 4
    # a tapped layer's output as a drafter reads it (None: as the layer gives
    # it); a family whose layers carry several streams sets it (``layer_view``)
    layer_view: Optional[Callable[[mx.array], mx.array]] = None

    def __init__(self, model: nn.Module, hidden_tap: str = "post"):
        self.model = model
        self.backbone = find_backbone(model)
        self._tap = _Tap(hidden_tap)
        _install_tap(final_norm(self.backbone), self._tap)
        self.tapped: Tuple[int, ...] = ()  # decoder layers whose outputs are kept
        self._taken: Dict[int, mx.array] = {}
        self._feed = _Feed()
        _install_feed(getattr(self.backbone, _first(self.backbone, _EMBEDDINGS)), self._feed)
        self._segments: Dict[str, mx.array] = {}

    @property
    def num_layers(self) -> int:
        return len(self.backbone.layers)

    def tap_layers(self, ids) -> None:
        """Keep the outputs of decoder layers ``ids`` (0-based) on every
        forward (``forward`` returns them); layers tapped before stay tapped."""
        for i in ids:
            if not 0 <= i < self.num_layers:
                raise ValueError(
                    f"layer {i} is past the target's {self.num_layers} layers"
                )
            if i not in self.tapped:
                _install_layer_tap(self.backbone.layers[i], i, self._taken)
        self.tapped = tuple(sorted(set(self.tapped) | set(ids)))

    @property
    def hidden_tap(self) -> str:
        return self._tap.where

    @hidden_tap.setter
    def hidden_tap(self, where: str) -> None:
        self._tap.where = _Tap(where).where

    @property
    def embed_tokens(self) -> nn.Module:
        return embedding(self.backbone)

    def make_cache(self) -> List[Any]:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model)

    def __call__(
        self, tokens: mx.array, cache: List[Any], **kwargs
    ) -> Tuple[mx.array, mx.array]:
        """The logits and the tapped final hidden state over ``tokens``."""
        logits, taps = self.forward(tokens, cache, **kwargs)
        return logits, taps.hidden

    @property
    def output_head(self):
        """The output projection, from hidden states to logits."""
        return output_head(self.model)

    def embed_segment(self, segment: Segment) -> mx.array:
        """The input embeddings ``[segment.length, D]`` read at ``segment``'s
        positions. A text model reads no media: a one-line error."""
        name = getattr(self.model, "model_type", type(self.model).__name__)
        raise MTPError(
            f"the model ({name}) reads text only: it cannot read a prompt's "
            f"{segment.kind}"
        )

    def _embedded(self, segment: Segment) -> mx.array:
        found = self._segments.get(segment.digest)
        if found is None:
            found = self.embed_segment(segment)
            if found.shape[0] != segment.length:
                raise MTPError(
                    f"a {segment.kind} of {segment.length} positions was embedded "
                    f"as {found.shape[0]}"
                )
            while len(self._segments) >= self.KEPT_SEGMENTS:
                self._segments.pop(next(iter(self._segments)))
            self._segments[segment.digest] = found
        return found

    def input_embeddings(
        self, tokens: mx.array, pieces: Sequence[Sequence[Piece]]
    ) -> mx.array:
        """The embeddings the backbone reads over ``tokens`` (``[B, T]``):
        the tokens', with row ``b``'s media ``pieces[b]`` in their places."""
        rows = []
        for b, row in enumerate(pieces):
            e = self._feed.plain(tokens[b : b + 1])
            for p in row:
                part = self._embedded(p.segment)[p.lo : p.hi].astype(e.dtype)
                e[0, p.at : p.at + p.hi - p.lo] = part
            rows.append(e)
        return mx.concatenate(rows)

    def _logits(self, tokens: mx.array, cache: List[Any], **kwargs) -> mx.array:
        """The model's logits over ``tokens`` (a target whose model returns
        more than logits, or takes more, overrides this)."""
        return self.model(tokens, cache=cache, **kwargs)

    def forward(
        self,
        tokens: mx.array,
        cache: List[Any],
        pieces=None,
        keep_layers: bool = True,
        **kwargs,
    ):
        """The logits and every tap (``Taps``: the final hidden state, the
        tapped layers' outputs) over ``tokens`` (``[B, T]``); ``pieces[b]``:
        the media row ``b`` reads in place of its placeholder tokens
        (``prompt.Piece``, at positions within the chunk). ``keep_layers=False``:
        no drafter reads the tapped layers this forward, and none is kept
        (``Taps.layers`` empty)."""
        if pieces is not None and any(pieces):
            self._feed.value = self.input_embeddings(tokens, pieces)
        try:
            logits = self._logits(tokens, cache, **kwargs)
        finally:
            self._feed.value = None
        hidden, self._tap.value = self._tap.value, None
        layers = {i: self._taken.pop(i) for i in self.tapped if i in self._taken}
        if not keep_layers:
            layers = {}
        if self.layer_view is not None:  # layers of several streams (GLM-5.3)
            layers = {i: self.layer_view(x) for i, x in layers.items()}
        return logits, Taps(hidden, layers)
