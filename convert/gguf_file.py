"""A small GGUF reader: metadata as Python values, tensors as numpy views of a memmap.

``gguf.GGUFReader`` builds numpy views for every element of every metadata
array; on SmolLM2's 98k-entry vocabulary that alone takes 8 s. This reads the
same header (GGUF v2/v3: key-values, tensor infos, aligned data) in a fraction
of that, and checks every tensor lies inside the file, so a truncated file
fails here, by name.
"""

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Tuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from mlx_mtp.errors import NOT_GGUF, MTPError

_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NUMPY = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
STRING, ARRAY = 8, 9
_DTYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.BF16: np.uint16,
}


@dataclass
class Tensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: Tuple[int, ...]  # numpy order (GGUF's dims reversed)
    n_bytes: int
    data: np.ndarray  # floats, or raw blocks uint8 [..., row bytes]


class _CutShort(Exception):
    """The header runs past the end of the file."""


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise _CutShort

    def take(self, fmt: str):
        self.need(struct.calcsize(fmt))
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        self.need(n)
        text = bytes(self.buf[self.pos : self.pos + n]).decode(
            "utf-8", errors="replace"
        )
        self.pos += n
        return text

    def value(self, vtype: int) -> Any:
        if vtype == STRING:
            return self.string()
        if vtype == ARRAY:
            etype, count = self.take("<I"), self.take("<Q")
            if etype in _NUMPY:
                size = np.dtype(_NUMPY[etype]).itemsize * count
                self.need(size)
                arr = np.frombuffer(self.buf, _NUMPY[etype], count, self.pos)
                self.pos += size
                return arr.tolist()
            return [self.value(etype) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ValueError(f"unknown metadata type {vtype}")
        return self.take(_SCALARS[vtype])


class GGUFFile:
    """Metadata (``fields``) and tensors (``tensors``) of a GGUF file."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                magic = f.read(4)
            if magic != b"GGUF":
                raise MTPError(f"{self.path}: {NOT_GGUF}")
            self._memmap = np.memmap(self.path, dtype=np.uint8, mode="r")
            self.fields, self.tensors = self._parse(memoryview(self._memmap))
        except MTPError:
            raise
        except _CutShort:
            raise MTPError(
                f"{self.path}: cut short inside its header ({size} bytes)"
            ) from None
        except (ValueError, struct.error, OSError, KeyError, IndexError) as e:
            text = (str(e).strip() or type(e).__name__).splitlines()[0]
            raise MTPError(f"{self.path}: not a valid GGUF file ({text})") from None

    def _parse(self, buf: memoryview) -> Tuple[Dict[str, Any], List[Tensor]]:
        cur = _Cursor(buf)
        cur.pos = 4  # past the magic, checked before
        version = cur.take("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (2 or 3 supported)")
        n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
        fields = {}
        for _ in range(n_kv):
            key = cur.string()
            fields[key] = cur.value(cur.take("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
            infos.append(
                (name, dims, GGMLQuantizationType(cur.take("<I")), cur.take("<Q"))
            )
        align = int(fields.get("general.alignment", 32))
        start = (cur.pos + align - 1) // align * align
        return fields, [self._tensor(start, *info) for info in infos]

    def _tensor(self, start, name, dims, qtype, offset) -> Tensor:
        block, type_size = GGML_QUANT_SIZES[qtype]
        count = int(np.prod(dims)) if dims else 1
        n_bytes = count // block * type_size
        begin = start + offset
        if begin + n_bytes > self._memmap.size:
            raise MTPError(
                f"{self.path}: truncated (tensor {name} ends past the end of the file)"
            )
        raw = self._memmap[begin : begin + n_bytes]
        shape = tuple(reversed(dims))
        if qtype in _DTYPES:
            data = raw.view(_DTYPES[qtype]).reshape(shape)
        else:
            data = raw.reshape(*shape[:-1], dims[0] // block * type_size)
        return Tensor(name, qtype, shape, n_bytes, data)
