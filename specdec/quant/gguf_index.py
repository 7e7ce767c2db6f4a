"""A GGUF file's tensor table and scalar metadata, read in milliseconds, its tensors as views of the mapped file.

The gguf package's ``GGUFReader`` turns every metadata value into numpy arrays, the tokenizer's ~49k
strings and ~48k merges included: ~3 s for the default model, more than the rest of a packed load. A
packed load needs none of that (the tokenizer and config come from the cache folder): only the file's
architecture and its tensors. ``GGUFIndex`` walks the same header, steps over arrays without building
them (a string array is a run of length-prefixed strings: one length read per element), keeps scalar and
string values, and maps the tensors as ``GGUFReader`` does: a quantized tensor is uint8 [rows, row bytes],
a float one its own dtype, each a view of one read-only ``np.memmap`` of the file (no copy).

Layout (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor count, u64 metadata count;
per metadata entry a string key, a u32 value type and the value (an array: u32 element type, u64 count,
elements); per tensor a string name, u32 n_dims, u64 dims (innermost first), u32 GGML type, u64 offset
from the data section, which starts at the next multiple of ``general.alignment`` (32 unless set). A
string is a u64 byte length and UTF-8 bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GGUF_MAGIC = b"GGUF"
# metadata value type -> struct format of a scalar (8: string, 9: array; gguf.constants.GGUFValueType)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# GGML float and integer types mapped element by element, as GGUFReader maps them (others: bytes)
_ELEMENT_DTYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


class Value:
    """A metadata value with ``GGUFReader``'s ``ReaderField.contents()``, for code that reads either."""

    def __init__(self, value) -> None:
        self.value = value

    def contents(self):
        return self.value


@dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType (an IntEnum: int() is the file's type number)
    shape: np.ndarray  # [n_dims] uint64, innermost first (as GGUFReader's)
    data: np.ndarray  # a view of the mapped file: quantized [rows, row bytes] uint8, else its dtype, outermost first


class GGUFIndex:
    """``fields`` (key -> ``Value``: scalars and strings; arrays are stepped over, absent) and ``tensors``
    (in file order) of a GGUF file; a ValueError names what is wrong with a file that is not one."""

    def __init__(self, path: str | Path) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = Path(path)
        self.data = np.memmap(self.path, mode="r")  # the pages are the file's: nothing here writes them
        buf = memoryview(self.data)
        if bytes(buf[:4]) != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):  # a byte-swapped (big-endian) file reads as a huge version too
            raise ValueError(f"GGUF version {version} is not read here")
        self._buf, offset = buf, 24
        self.fields: dict[str, Value] = {}
        for _ in range(kv_count):
            key, offset = self._string(offset)
            (kind,), offset = struct.unpack_from("<I", buf, offset), offset + 4
            value, offset = self._value(kind, offset)
            if kind != _ARRAY:
                self.fields[key] = Value(value)
        table = []
        for _ in range(tensor_count):
            name, offset = self._string(offset)
            (n_dims,) = struct.unpack_from("<I", buf, offset)
            dims = np.frombuffer(buf, np.uint64, n_dims, offset + 4).copy()
            ggml_type, start = struct.unpack_from("<IQ", buf, offset + 4 + 8 * n_dims)
            offset += 4 + 8 * n_dims + 12
            table.append((name, dims, ggml_type, start))
        alignment = self.fields.get("general.alignment", Value(32)).value
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"invalid general.alignment {alignment!r}: must be a power of two")
        self.data_offset = -(-offset // alignment) * alignment
        self.tensors: list[Tensor] = []
        names = set()
        for name, dims, ggml_type, start in table:
            if name in names:
                raise ValueError(f"Found duplicated tensor with name {name}")
            names.add(name)
            kind = GGMLQuantizationType(ggml_type)
            block, size = GGML_QUANT_SIZES[kind]
            outer = tuple(int(d) for d in reversed(dims))  # outermost first
            begin = self.data_offset + int(start)
            if ggml_type in _ELEMENT_DTYPES:
                dtype, shape = np.dtype(_ELEMENT_DTYPES[ggml_type]), outer
            else:
                if outer[-1] % block:
                    raise ValueError(f"tensor {name}: a row of {outer[-1]} weights is not whole {kind.name} blocks")
                dtype, shape = np.dtype(np.uint8), (*outer[:-1], outer[-1] // block * size)
            count = int(np.prod(shape, dtype=np.int64))
            if begin + count * dtype.itemsize > len(self.data):
                raise ValueError(f"tensor {name} runs past the end of the file (truncated?)")
            view = np.ndarray(shape, dtype, self.data, begin) if count else np.empty(shape, dtype)
            self.tensors.append(Tensor(name, kind, dims, view))
        del self._buf

    def _string(self, offset: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._buf, offset)
        end = offset + 8 + n
        if end > len(self._buf):
            raise ValueError("a string runs past the end of the file (truncated?)")
        return str(self._buf[offset + 8:end], "utf-8"), end

    def _value(self, kind: int, offset: int):
        """(the value, or None for an array; the offset after it)."""
        if kind in _SCALARS:
            fmt = _SCALARS[kind]
            return struct.unpack_from(fmt, self._buf, offset)[0], offset + struct.calcsize(fmt)
        if kind == _STRING:
            return self._string(offset)
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        element, count = struct.unpack_from("<IQ", self._buf, offset)
        offset += 12
        if element in _SCALARS:
            return None, offset + count * struct.calcsize(_SCALARS[element])
        if element == _STRING:  # one length read per string: the tokenizer's vocabulary and merges
            unpack, buf = struct.Struct("<Q").unpack_from, self._buf
            for _ in range(count):
                offset += 8 + unpack(buf, offset)[0]
            if offset > len(buf):
                raise ValueError("a string array runs past the end of the file (truncated?)")
            return None, offset
        for _ in range(count):  # arrays of arrays: none in files llama.cpp writes, read all the same
            _, offset = self._value(element, offset)
        return None, offset


def open_index(gguf_path: str | Path) -> GGUFIndex:
    """``GGUFIndex`` of the file; a truncated or corrupt file is named (as ``gguf.open_reader`` names it)."""
    try:
        return GGUFIndex(gguf_path)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"could not read GGUF file {gguf_path}: {e}") from e
