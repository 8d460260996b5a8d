"""The main model ("trunk"): mlx-lm's own model class, with its hidden states tapped.

Drafters read the trunk's hidden states. mlx-lm models return only logits,
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
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

HIDDEN_TAPS = ("post", "pre")


# mlx-lm's names for the token embedding and the final norm: most families use
# the first; Nemotron-H ``embeddings`` / ``norm_f``, Bailing ``word_embeddings``,
# LongCat-Flash-Ngram ``ngram_embeddings`` (which holds ``word_embeddings``).
_EMBEDDINGS = ("embed_tokens", "embeddings", "word_embeddings", "ngram_embeddings")
_FINAL_NORMS = ("norm", "norm_f")


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


def _install_tap(norm: nn.Module, tap: _Tap) -> None:
    base = type(norm)
    if getattr(base, "_mtp_tapped", False):
        base = base.__mro__[1]

    class Tapped(base):
        _mtp_tapped = True

        def __call__(self, x, *args, **kwargs):
            y = base.__call__(self, x, *args, **kwargs)
            tap.value = y if tap.where == "post" else x
            return y

    Tapped.__name__ = base.__name__
    norm.__class__ = Tapped


@dataclass
class Taps:
    """What one trunk forward left for drafters: the final hidden state and
    the outputs of the tapped layers (``[B, T, D]`` each)."""

    hidden: mx.array
    layers: Dict[int, mx.array] = field(default_factory=dict)


def _install_layer_tap(layer: nn.Module, i: int, taken: Dict[int, mx.array]) -> None:
    """Record ``layer``'s output (the first array of a tuple) in ``taken[i]``."""
    base = type(layer)
    if getattr(base, "_mtp_layer_tap", False):
        base = base.__mro__[1]

    class TappedLayer(base):
        _mtp_layer_tap = True

        def __call__(self, *args, **kwargs):
            out = base.__call__(self, *args, **kwargs)
            taken[i] = out[0] if isinstance(out, (tuple, list)) else out
            return out

    TappedLayer.__name__ = base.__name__
    layer.__class__ = TappedLayer


class Trunk:
    """Runs the main model and returns logits together with the tapped hidden state."""

    def __init__(self, model: nn.Module, hidden_tap: str = "post"):
        self.model = model
        self.backbone = find_backbone(model)
        self._tap = _Tap(hidden_tap)
        _install_tap(final_norm(self.backbone), self._tap)
        self.tapped: Tuple[int, ...] = ()  # decoder layers whose outputs are kept
        self._taken: Dict[int, mx.array] = {}

    @property
    def num_layers(self) -> int:
        return len(self.backbone.layers)

    def tap_layers(self, ids) -> None:
        """Keep the outputs of decoder layers ``ids`` (0-based) on every
        forward (``forward`` returns them); layers tapped before stay tapped."""
        for i in ids:
            if not 0 <= i < self.num_layers:
                raise ValueError(
                    f"layer {i} is past the trunk's {self.num_layers} layers"
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

    def forward(self, tokens: mx.array, cache: List[Any], **kwargs):
        """The logits and every tap (``drafter.Taps``: the final hidden state,
        the tapped layers' outputs) over ``tokens``."""
        logits = self.model(tokens, cache=cache, **kwargs)
        hidden, self._tap.value = self._tap.value, None
        layers = {i: self._taken.pop(i) for i in self.tapped if i in self._taken}
        return logits, Taps(hidden, layers)
