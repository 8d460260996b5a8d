"""GGUF tensor data -> MLX arrays.

Q8_0, Q4_0 and Q4_1 blocks are 32 values sharing one float16 scale (and, for
Q4_1, one float16 minimum). MLX's affine quantization with group size 32
stores ``w = scale * q + bias`` per group, so each block maps onto it exactly:

- Q8_0: ``w = d * q``, q signed 8-bit -> unsigned ``q + 128``, bias ``-128 d``;
- Q4_0: ``w = d * (q - 8)`` -> bias ``-8 d``;
- Q4_1: ``w = d * q + m`` -> bias ``m``.

No value is rounded a second time. Every other type is dequantized by the
``gguf`` package (numpy) and left as floats for the precision policy.
"""

from typing import Dict

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

from mlx_mtp.errors import MTPError

NATIVE = {T.Q8_0: 8, T.Q4_0: 4, T.Q4_1: 4}
FLOATS = {T.F32, T.F16, T.BF16}
GROUP = 32


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned ints ``[..., n]`` -> uint32 ``[..., n * bits / 32]``, MLX's order (low bits first)."""
    per = 32 // bits
    q = q.astype(np.uint32).reshape(*q.shape[:-1], -1, per)
    shifts = np.arange(per, dtype=np.uint32) * bits
    return np.bitwise_or.reduce(q << shifts, axis=-1)


def _blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    return raw.reshape(*raw.shape[:-1], raw.shape[-1] // block_bytes, block_bytes)


def _f16(b: np.ndarray, offset: int) -> np.ndarray:
    return np.ascontiguousarray(b[..., offset : offset + 2]).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    # a block's 16 bytes hold values 0..15 in their low nibbles, 16..31 in their high ones
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _affine(q: np.ndarray, scale: np.ndarray, bias: np.ndarray, bits: int):
    rows = q.shape[:-2]
    weight = _pack(q.reshape(*rows, -1), bits)
    return (
        mx.array(weight),
        mx.array(scale.astype(np.float16)),
        mx.array(bias.astype(np.float16)),
    )


def repack(raw: np.ndarray, qtype: T):
    """(weight, scales, biases) of a Q8_0 / Q4_0 / Q4_1 tensor given as raw block bytes."""
    if qtype == T.Q8_0:
        b = _blocks(raw, 34)
        d = _f16(b, 0)
        q = np.ascontiguousarray(b[..., 2:]).view(np.int8).astype(np.int16) + 128
        return _affine(q, d, d.astype(np.float32) * -128, 8)
    if qtype == T.Q4_0:
        b = _blocks(raw, 18)
        d = _f16(b, 0)
        return _affine(_nibbles(b[..., 2:]), d, d.astype(np.float32) * -8, 4)
    if qtype == T.Q4_1:
        b = _blocks(raw, 20)
        return _affine(_nibbles(b[..., 4:]), _f16(b, 0), _f16(b, 2), 4)
    raise ValueError(f"not a natively mapped type: {qtype.name}")


def read_tensor(name: str, data: np.ndarray, qtype: T) -> Dict[str, mx.array]:
    """``{name.weight: ...}`` or, for natively mapped types, weight/scales/biases."""
    base = name[: -len(".weight")] if name.endswith(".weight") else None
    if qtype in FLOATS:
        if qtype == T.BF16:
            return {name: mx.array(data.view(np.uint16)).view(mx.bfloat16)}
        return {name: mx.array(np.ascontiguousarray(data))}
    if qtype in NATIVE and base is not None:
        w, s, b = repack(np.asarray(data), qtype)
        return {f"{base}.weight": w, f"{base}.scales": s, f"{base}.biases": b}
    try:
        values = quants.dequantize(np.asarray(data), qtype)
    except (NotImplementedError, ValueError, KeyError) as e:
        raise MTPError(
            f"{name}: unsupported quantization type {qtype.name} ({e})"
        ) from None
    return {name: mx.array(values.astype(np.float32))}
