"""DeepSeek's MTP wiring, written once: the fuse before the block, the norm after it.

Most families fuse the two inputs as DeepSeek-V3 does,
``proj(concat[embed_norm(e), hidden_norm(h)])``, and close the block with one
more norm. They differ only in where those four modules sit (their
checkpoint names), which RMSNorm they are (plain ``w`` or zero-centred
``1 + w``) and the concat order (MiMo puts the hidden state first): a
``Wiring`` says that, a ``FusedHead`` runs it. Position-0 zeroing and the
hidden state a chain feeds back stay ``MTPHead`` attributes.
"""

from dataclasses import dataclass
from typing import Any, Dict, Optional

import mlx.core as mx
import mlx.nn as nn

from .base import MTPHead


class ZeroCentredRMSNorm(nn.Module):
    """RMSNorm ``rms_norm(x) * (1 + w)`` (Qwen, Step-3.5), ``w`` as stored.

    mlx-lm's trunks instead add 1 to such weights in ``sanitize``; the heads keep
    the stored ``w`` so that converted heads store what the checkpoint stores.
    """

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)


@dataclass(frozen=True)
class Wiring:
    """Where a DeepSeek-style layer keeps its fuse and closing norm.

    Each is a module path in the layer, as the checkpoint names it under the
    layer's prefix: ``"enorm"``, ``"enorm.m"`` one level down,
    ``"mtp_emb_norm.0"`` the first of a list, ``"block.layers.0.enorm"``
    inside the block (``-1``: the last). ``final_norm`` None: the family
    closes with a norm that is not its own (it overrides ``final_norm``).
    """

    embed_norm: str = "enorm"
    hidden_norm: str = "hnorm"
    proj: str = "eh_proj"
    final_norm: Optional[str] = "shared_head.norm"
    hidden_first: bool = False
    norm: type = nn.RMSNorm

    def modules(self, dims: int, eps: float) -> Dict[str, nn.Module]:
        """Fresh fuse and closing-norm modules by path, for ``FusedHead``."""
        out = {
            self.embed_norm: self.norm(dims, eps=eps),
            self.hidden_norm: self.norm(dims, eps=eps),
            self.proj: nn.Linear(2 * dims, dims, bias=False),
        }
        if self.final_norm is not None:
            out[self.final_norm] = self.norm(dims, eps=eps)
        return out


class FusedHead(MTPHead):
    """An MTP layer wired as ``WIRING`` says.

    ``modules`` (``WIRING.modules(...)``, or one set that several layers
    share) are put at their paths: the head's own first, then ``block``,
    then those inside the block.
    """

    WIRING = Wiring()

    def __init__(self, block: nn.Module, modules: Dict[str, nn.Module]):
        super().__init__()
        inside = {p: m for p, m in modules.items() if p.startswith("block.")}
        for path, module in modules.items():
            if path not in inside:
                _put(self, path, module)
        self.block = block
        for path, module in inside.items():
            _put(self, path, module)

    def fuse(self, embedded: mx.array, hidden: mx.array) -> mx.array:
        w = self.WIRING
        x = [_at(self, w.embed_norm)(embedded), _at(self, w.hidden_norm)(hidden)]
        if w.hidden_first:
            x.reverse()
        return _at(self, w.proj)(mx.concatenate(x, axis=-1))

    def final_norm(self, x: mx.array) -> mx.array:
        return _at(self, self.WIRING.final_norm)(x)


def _index(part: str) -> Optional[int]:
    return int(part) if part.lstrip("-").isdigit() else None


def _at(root: Any, path: str) -> Any:
    """The module at ``path`` (resolved on each call: quantizing swaps modules)."""
    node = root
    for part in path.split("."):
        i = _index(part)
        node = getattr(node, part) if i is None else node[i]
    return node


def _put(root: nn.Module, path: str, module: nn.Module) -> None:
    """Set ``module`` at ``path``, making the containers above it that are missing."""
    *parents, last = path.split(".")
    node = root
    for part, below in zip(parents, parents[1:] + [last]):
        i = _index(part)
        if i is None and part not in node:
            setattr(node, part, [] if _index(below) is not None else nn.Module())
        node = getattr(node, part) if i is None else node[i]
    i = _index(last)
    if i is None:
        setattr(node, last, module)
    elif i == len(node):
        node.append(module)
    else:
        node[i] = module
