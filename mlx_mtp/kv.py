"""Long contexts: the attention caches' policy (quantized or bounded), one
setting that every cache of a stream follows.

A policy is a ``KVSettings``; it enters in one place: ``stream.open_stream``
hands it the stream's caches (``KVSettings.apply``), which swaps every plain
attention cache (mlx-lm's ``KVCache``: the trunk's layers, the MTP head's and
any drafter's) for the policy's own. Recurrent layers keep their states (a
hybrid quantizes its attention layers only). The round never asks which kind
it holds: both kinds roll back with ``trim`` like any attention cache, and
say how many tokens one forward may write (``width_limit``), which caps a round.

- ``QuantizingKVCache``: mlx-lm's ``KVCache`` until it holds ``start``
  tokens, then its ``QuantizedKVCache`` (keys and values in groups of
  ``group_size`` along the head dimension, ``bits`` bits each). It turns at
  its first write at or past ``start``: what mlx-lm's
  ``maybe_quantize_kv_cache`` does after the call that got there, so a token
  before ``start`` is read in full precision and one after it over quantized
  keys, as in mlx-lm's ``generate`` (where the first call is in full
  precision even with ``start`` 0). Each position is quantized on its own,
  so a verify over ``k + 1`` tokens writes what ``k + 1`` single steps
  write; ``width_limit`` keeps a verify from straddling ``start``.
- ``RollingKVCache``: at most ``max_size`` tokens seen by each query (the
  first ``keep`` and the last ``max_size - keep``, as mlx-lm's
  ``RotatingKVCache``), holding ``slack`` more so that a round's rejected
  drafts can be taken back (mlx-lm's rotating cache cannot trim once full).
"""

import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import mlx.core as mx
from mlx.utils import tree_map, tree_reduce
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from .defaults import DEFAULT_KV_GROUP_SIZE, DEFAULT_QUANTIZED_KV_START, MAX_DRAFT_MAX
from .errors import MTPError

KV_BITS = (2, 3, 4, 5, 6, 8)  # what ``mx.quantize`` takes
KV_GROUP_SIZES = (32, 64, 128)
# the first tokens a bounded cache always keeps (mlx-lm's ``keep=4``)
ROLLING_KEEP = 4
# positions a bounded cache holds past its window: the widest forward that
# decoding may write and take back (a verify of the most drafts, or a lookup
# proposal, capped to it by ``width_limit``)
ROLLING_SLACK = 2 * MAX_DRAFT_MAX


class QuantizingKVCache(KVCache):
    """A ``KVCache`` that turns into mlx-lm's ``QuantizedKVCache`` form at its
    first write at or past ``start`` tokens (see the module doc). Quantized,
    it has ``bits`` (mlx-lm's attention then takes the quantized path)."""

    def __init__(self, bits: int, group_size: int = DEFAULT_KV_GROUP_SIZE, start=0):
        super().__init__()
        self.kv_bits, self.group_size, self.start = bits, group_size, start

    @property
    def quantized(self) -> bool:
        return "bits" in self.__dict__

    def quantize(self) -> None:
        """Turn quantized now (mlx-lm's ``to_quantized`` of what it holds)."""
        if self.quantized:
            return
        if self.keys is not None:
            n = self.offset
            try:
                self.keys, self.values = (
                    tuple(mx.quantize(x[..., :n, :], self.group_size, self.kv_bits))
                    for x in (self.keys, self.values)
                )
            except ValueError:
                raise group_misfit(self.keys.shape[-1], self.group_size) from None
        self.bits = self.kv_bits

    @property
    def turn(self) -> int:
        """The length at which it turns: ``start``, and never before its
        first write (mlx-lm quantizes after a call)."""
        return max(self.start, 1)

    def update_and_fetch(self, keys, values):
        if not self.quantized and self.offset >= self.turn:
            self.quantize()
        if self.quantized:
            return QuantizedKVCache.update_and_fetch(self, keys, values)
        return KVCache.update_and_fetch(self, keys, values)

    def keys_and_values(self):
        if self.quantized:
            return QuantizedKVCache.keys_and_values(self)
        return KVCache.keys_and_values(self)

    def width_limit(self) -> Optional[int]:
        """Tokens the next forward may write before the form changes (None: any)."""
        if self.quantized or self.offset >= self.turn:
            return None
        return self.turn - self.offset

    def dequantized(self):
        """Keys and values held, in full precision (``[B, H, offset, D]`` each):
        for a drafter that reads them (a Gemma 4 assistant)."""
        k, v = self.keys_and_values()
        if not self.quantized:
            return k, v
        return tuple(mx.dequantize(*x, self.group_size, self.kv_bits) for x in (k, v))

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> QuantizedKVCache:
        if not self.quantized:
            return KVCache.to_quantized(self, group_size, bits)
        if (group_size, bits) != (self.group_size, self.kv_bits):
            raise ValueError("this cache is quantized with other settings already")
        out = QuantizedKVCache(group_size, bits)
        out.keys, out.values, out.offset = self.keys, self.values, self.offset
        return out

    @property
    def state(self):
        return self.keys, self.values, self.offset

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset = v

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return tree_reduce(lambda a, x: a + x.nbytes, (self.keys, self.values), 0)

    def blank(self) -> "QuantizingKVCache":
        """An empty cache of the same settings, in the same form."""
        new = QuantizingKVCache(self.kv_bits, self.group_size, self.start)
        if self.quantized:
            new.bits = self.kv_bits
        return new

    def copy(self) -> "QuantizingKVCache":
        new = self.blank()
        if self.keys is not None:
            new.keys, new.values = tree_map(mx.array, (self.keys, self.values))
        new.offset = self.offset
        return new


class RollingKVCache(KVCache):
    """At most ``max_size`` tokens seen per query (see the module doc).

    The buffer holds the first ``keep`` tokens, then a contiguous run of the
    latest ones (``dropped`` positions after the kept ones are gone). Once
    the run passes its window plus ``slack`` by more than a step, the oldest
    of it go at once, so a trim of up to ``slack`` tokens is always possible.
    """

    def __init__(self, max_size: int, keep: int = ROLLING_KEEP, slack=ROLLING_SLACK):
        super().__init__()
        self.max_size, self.keep, self.slack = max_size, min(keep, max_size - 1), slack
        self.dropped = 0

    @property
    def window(self) -> int:
        return self.max_size - self.keep

    def _drop(self) -> int:
        """Positions the next write drops (the same for the mask before it)."""
        excess = self.offset - self.dropped - self.keep - (self.window + self.slack)
        return excess if excess > self.step else 0

    def update_and_fetch(self, keys, values):
        drop = self._drop()
        held = self.offset - self.dropped
        if drop:
            self.keys, self.values = (
                mx.concatenate(
                    [x[..., : self.keep, :], x[..., self.keep + drop : held, :]], axis=2
                )
                for x in (self.keys, self.values)
            )
            self.dropped += drop
            held -= drop
        T = keys.shape[2]
        if self.keys is None or held + T > self.keys.shape[2]:
            grow = -(-(held + T) // self.step) * self.step
            B, H, _, _ = keys.shape
            new_k = mx.zeros((B, H, grow, keys.shape[3]), keys.dtype)
            new_v = mx.zeros((B, H, grow, values.shape[3]), values.dtype)
            if self.keys is not None:
                new_k[..., :held, :] = self.keys[..., :held, :]
                new_v[..., :held, :] = self.values[..., :held, :]
            self.keys, self.values = new_k, new_v
        self.keys[..., held : held + T, :] = keys
        self.values[..., held : held + T, :] = values
        self.offset += T
        return self.keys_and_values()

    def keys_and_values(self):
        n = self.offset - self.dropped
        return self.keys[..., :n, :], self.values[..., :n, :]

    def size(self) -> int:
        return min(self.offset, self.max_size)

    def width_limit(self) -> Optional[int]:
        return self.slack

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens: all of them while nothing was dropped,
        else as many as leave every later query its window."""
        most = self.offset
        if self.dropped:
            most = self.offset - self.dropped - self.keep - self.window
        n = max(0, min(n, most))
        self.offset -= n
        return n

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kw):
        """Query ``t`` (at ``offset + t``) sees the kept tokens and the latest
        ``window`` up to it (a sliding layer: its own window, if narrower,
        and no kept tokens)."""
        end = self.offset + N
        if end <= self.max_size and window_size is None:
            return create_causal_mask(N, self.offset) if N > 1 else None
        dropped = self.dropped + self._drop()
        kept = min(end, self.keep)
        pos = mx.concatenate([mx.arange(kept), mx.arange(kept + dropped, end)])
        queries = mx.arange(self.offset, end)[:, None]
        window = min(self.window, window_size or self.window)
        causal = pos <= queries
        seen = causal & (pos > queries - window)
        if window_size is None:
            seen = seen | (causal & (pos < kept))
        return seen

    @property
    def state(self):
        return self.keys, self.values, self.offset

    def copy(self) -> "RollingKVCache":
        new = RollingKVCache(self.max_size, self.keep, self.slack)
        if self.keys is not None:
            new.keys, new.values = mx.array(self.keys), mx.array(self.values)
        new.offset, new.dropped = self.offset, self.dropped
        return new


@dataclass(frozen=True)
class KVSettings:
    """How attention caches hold long contexts: ``bits`` (None: full
    precision) with ``group_size`` from ``quantized_start`` tokens on, or at
    most ``max_size`` tokens (None: unbounded). mlx-lm's names:
    ``kv_bits``, ``kv_group_size``, ``quantized_kv_start``, ``max_kv_size``."""

    bits: Optional[int] = None
    group_size: int = DEFAULT_KV_GROUP_SIZE
    quantized_start: int = DEFAULT_QUANTIZED_KV_START
    max_size: Optional[int] = None

    @classmethod
    def from_mlx_lm(
        cls,
        kv_bits: Optional[int] = None,
        kv_group_size: int = DEFAULT_KV_GROUP_SIZE,
        quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
        max_kv_size: Optional[int] = None,
    ) -> "KVSettings":
        return cls(kv_bits, kv_group_size, quantized_kv_start, max_kv_size)

    @property
    def active(self) -> bool:
        return self.bits is not None or self.max_size is not None

    def validate(self) -> "KVSettings":
        if self.bits is not None and self.bits not in KV_BITS:
            raise MTPError(f"kv_bits must be one of {KV_BITS}, not {self.bits}")
        if self.group_size not in KV_GROUP_SIZES:
            raise MTPError(
                f"kv_group_size must be one of {KV_GROUP_SIZES}, not {self.group_size}"
            )
        if self.quantized_start < 0:
            raise MTPError(
                f"quantized_kv_start must be 0 or more, not {self.quantized_start}"
            )
        if self.max_size is not None and self.max_size <= ROLLING_KEEP:
            raise MTPError(
                f"max_kv_size must be more than {ROLLING_KEEP}, not {self.max_size}"
            )
        if self.bits is not None and self.max_size is not None:
            raise MTPError(
                "kv_bits and max_kv_size together are not supported (as in mlx-lm):"
                " choose one"
            )
        return self

    def check_model(self, model) -> None:
        """A one-line ``MTPError`` where ``model``'s heads do not take the
        quantization groups, or where it cannot bound its caches; before any
        work."""
        # (a model split over processes is not probed: its forward is a
        # collective; a group that does not fit is found at the first write)
        if self.bits is not None:
            widths = [w for d in model.drafters for w in d.kv_widths]
            if getattr(model, "sharding", None) is None:
                widths += head_widths(model)
            for width in sorted(set(widths)):
                if width % self.group_size:
                    raise group_misfit(width, self.group_size)
            if not any(isinstance(c, QuantizingKVCache) for c in self._trunk(model)):
                raise MTPError(
                    f"kv_bits: {model.model_type} has no plain attention cache to "
                    "quantize (its caches are its own)"
                )
        if self.max_size is None:
            return
        if any(d.reads.kv for d in model.drafters):
            raise MTPError(
                "max_kv_size: this model's drafter reads the target's whole cache "
                "(a Gemma 4 assistant); it cannot be bounded"
            )
        for d in model.drafters:
            if not d.boundable:
                raise MTPError(
                    f"max_kv_size: the {d.name} drafter keeps the whole context in "
                    "its own caches; it cannot be bounded (draft with the MTP head "
                    "or prompt lookup, or leave out max_kv_size)"
                )
        if not any(isinstance(c, RollingKVCache) for c in self._trunk(model)):
            raise MTPError(
                f"max_kv_size: {model.model_type} has no plain attention cache to bound"
            )

    def _trunk(self, model) -> List[Any]:
        return [self.layer(c) for c in model.target.make_cache()]

    def layer(self, c: Any) -> Any:
        """The policy's cache for one layer's ``c`` (``c`` itself when it is
        not a plain attention cache, or the policy is off)."""
        if type(c) is not KVCache or not self.active:
            return c
        if self.bits is not None:
            new = QuantizingKVCache(self.bits, self.group_size, self.quantized_start)
        else:
            new = RollingKVCache(self.max_size)
        if c.keys is not None:  # what it holds already stays, full precision
            n = c.offset
            new.keys, new.values = c.keys[..., :n, :], c.values[..., :n, :]
            new.offset = n
        return new

    def apply(self, cache) -> None:
        """Every plain attention cache of ``cache`` (an ``StreamCache``: the
        trunk's and each drafter's) follows this policy. A cache that follows
        another policy already is an error."""
        if not self.active:
            return
        for c in cache.state_list():
            if not self.follows(c):
                raise MTPError(
                    f"the prompt cache holds {describe_layer(c)}; this generation "
                    f"asks for {self.describe()}"
                )
        cache.trunk[:] = [self.layer(c) for c in cache.trunk]
        for state in cache.drafts.values():
            state.caches[:] = [self.layer(c) for c in state.caches]
        cache.link()

    def follows(self, c: Any) -> bool:
        """Whether ``c`` is not a policy cache of other settings."""
        if isinstance(c, QuantizingKVCache):
            return (c.kv_bits, c.group_size) == (self.bits, self.group_size)
        if isinstance(c, RollingKVCache):
            return c.max_size == self.max_size
        return True

    def describe(self) -> str:
        if self.bits is not None:
            return (
                f"{self.bits}-bit keys and values (group size {self.group_size}, "
                f"from token {self.quantized_start})"
            )
        if self.max_size is not None:
            return f"at most {self.max_size} tokens of keys and values"
        return "full-precision keys and values"

    def as_mlx_lm(self) -> Dict[str, Any]:
        """mlx-lm's ``generate_step`` keywords for the same policy."""
        return {
            "kv_bits": self.bits,
            "kv_group_size": self.group_size,
            "quantized_kv_start": self.quantized_start,
            "max_kv_size": self.max_size,
        }

    def metadata(self) -> Dict[str, str]:
        """What a saved cache records of the policy (strings, as safetensors'
        metadata holds them)."""
        return {
            "kv_bits": str(self.bits or 0),
            "kv_group_size": str(self.group_size),
            "quantized_kv_start": str(self.quantized_start),
            "max_kv_size": str(self.max_size or 0),
        }


_WIDTHS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def head_widths(model) -> List[int]:
    """The widths of the keys and values ``model``'s plain attention caches
    hold (one forward of one token finds them, once per model)."""
    widths = _WIDTHS.get(model.target)
    if widths is None:
        cache = model.target.make_cache()
        model.target(mx.array([[0]]), cache)
        plain = [c for c in cache if type(c) is KVCache and c.keys is not None]
        widths = sorted({x.shape[-1] for c in plain for x in (c.keys, c.values)})
        _WIDTHS[model.target] = widths
    return widths


def group_misfit(width: int, group_size: int) -> MTPError:
    """The one-line error where heads ``width`` wide do not take the groups."""
    return MTPError(
        f"cannot quantize this model's keys and values: its heads are {width} "
        f"wide, not a multiple of the group size {group_size} (kv_group_size "
        f"{', '.join(map(str, KV_GROUP_SIZES[:-1]))} or {KV_GROUP_SIZES[-1]})"
    )


def describe_layer(c: Any) -> str:
    if isinstance(c, QuantizingKVCache):
        return f"{c.kv_bits}-bit keys and values (group size {c.group_size})"
    if isinstance(c, RollingKVCache):
        return f"at most {c.max_size} tokens of keys and values"
    return "full-precision keys and values"


def width_limit(caches: List[Any]) -> Optional[int]:
    """The most tokens one forward may write to ``caches`` and stay exact and
    able to roll back (None: any)."""
    rooms = [r for c in caches if (r := getattr(c, "width_limit", lambda: None)())]
    return min(rooms, default=None)


def cuttable(c: Any) -> bool:
    """Whether ``c`` can still be cut back to any earlier length (a bounded
    cache that has dropped tokens cannot)."""
    return not getattr(c, "dropped", 0)


def quantizes_later(caches: List[Any]) -> bool:
    """Whether one of ``caches`` holds full precision and will turn quantized."""
    return any(isinstance(c, QuantizingKVCache) and not c.quantized for c in caches)
