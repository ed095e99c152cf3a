"""Reads a GGUF file: its metadata, its tensor table, and tensors dequantized to float32.

The header is parsed directly with ``struct`` (string arrays such as a 50k-token vocabulary
take milliseconds this way); tensor data is memory-mapped and dequantized by the ``gguf``
package. Only little-endian GGUF v2/v3 files are read.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

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
_STRING, _ARRAY = 8, 9
_MISSING = object()


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (slowest dim first; ggml lists them the other way)
    ggml_type: int
    offset: int  # bytes from the start of the file


class GGUFFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self._data)  # cheap slicing while parsing the header
        try:
            self.metadata, self.tensors = self._parse()
        except (struct.error, UnicodeDecodeError, IndexError) as e:
            raise ValueError(f"{self.path} is not a valid GGUF file: {e}") from e
        self.arch: str = self.get("general.architecture")

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """Metadata value; ``{arch}`` in ``key`` stands for the model's architecture name."""
        key = key.replace("{arch}", getattr(self, "arch", ""))
        if key in self.metadata:
            return self.metadata[key]
        if default is _MISSING:
            raise ValueError(f"{self.path}: the GGUF metadata lacks {key!r}")
        return default

    def tensor(self, name: str) -> GGUFTensorInfo | None:
        return next((t for t in self.tensors if t.name == name), None)

    def dequantize(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor as float32 with ``info.shape`` (a fresh, writable array)."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize, quant_shape_to_byte_shape

        qtype = GGMLQuantizationType(info.ggml_type)
        block_size, block_bytes = GGML_QUANT_SIZES[qtype]
        num_bytes = int(np.prod(info.shape)) // block_size * block_bytes
        raw = self._data[info.offset : info.offset + num_bytes]
        raw = np.asarray(raw).reshape(quant_shape_to_byte_shape(info.shape, qtype))
        return np.array(dequantize(raw, qtype), dtype=np.float32).reshape(info.shape)

    # -- header parsing ------------------------------------------------------------------

    def _parse(self) -> tuple[dict[str, Any], list[GGUFTensorInfo]]:
        buf = self._buf
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError(f"{self.path} is not a GGUF file (no GGUF magic bytes)")
        version, num_tensors, num_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        pos, metadata = 24, {}
        for _ in range(num_kv):
            key, pos = self._string(pos)
            (value_type,) = struct.unpack_from("<I", buf, pos)
            metadata[key], pos = self._value(pos + 4, value_type)
        raw_infos = []
        for _ in range(num_tensors):
            name, pos = self._string(pos)
            (ndim,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{ndim}Q", buf, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * ndim)
            pos += 4 + 8 * ndim + 12
            raw_infos.append((name, tuple(int(d) for d in reversed(dims)), ggml_type, offset))
        alignment = int(metadata.get("general.alignment", 32))
        data_start = -(-pos // alignment) * alignment
        tensors = [GGUFTensorInfo(n, s, t, data_start + off) for n, s, t, off in raw_infos]
        return metadata, tensors

    def _string(self, pos: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", self._buf, pos)
        start = pos + 8
        return str(self._buf[start : start + length], "utf-8"), start + length

    def _value(self, pos: int, value_type: int) -> tuple[Any, int]:
        if value_type == _STRING:
            return self._string(pos)
        if value_type == _ARRAY:
            item_type, count = struct.unpack_from("<IQ", self._buf, pos)
            return self._array(pos + 12, item_type, count)
        fmt = _SCALARS[value_type]
        return struct.unpack_from(fmt, self._buf, pos)[0], pos + struct.calcsize(fmt)

    def _array(self, pos: int, item_type: int, count: int) -> tuple[list[Any], int]:
        if item_type in _NUMPY:
            dtype = np.dtype(_NUMPY[item_type])
            values = np.frombuffer(self._buf, dtype=dtype, count=count, offset=pos)
            return values.tolist(), pos + dtype.itemsize * count
        values = []
        for _ in range(count):
            value, pos = self._value(pos, item_type)
            values.append(value)
        return values, pos
