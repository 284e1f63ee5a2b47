"""A GGUF file's key/value metadata and tensor directory, read in one pass.

NOTE: ``gguf.GGUFReader`` (the format's reference reader, still used for its enums, block sizes and
``dequantize``) builds a numpy view object for every element of every metadata array: for
SmolLM2's 49,152-token vocabulary and 48,900 merges that is ~250,000 views, seconds per open, and
the engine opens the file three times at start (config, eos ids, tokenizer): every engine restart's
pause. Here the metadata is decoded straight into Python values (the vocabulary with one ``struct`` call
per string), and tensors are only located (their data is a view of the memory map, made when asked for),
as the reference reader lays them out.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import numpy.typing as npt
    from gguf import GGMLQuantizationType

GGUF_MAGIC = 0x46554747  # "GGUF", little-endian
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# GGUFValueType: id -> struct format of a scalar (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
STRING, ARRAY = 8, 9
# element types the reference reader gives as typed arrays (the rest as bytes, by quantization blocks)
_TYPED = {
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}


class GgufFormatError(ValueError):
    """Bytes that are not a GGUF file this reader handles."""


@dataclass
class GgufTensor:
    """One tensor's directory entry; ``data`` as gguf.GGUFReader gives it (shape in numpy order)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # ggml order (innermost first), as the reference reader's
    offset: int  # of its data in the file
    _file: GgufFile

    @cached_property
    def data(self) -> np.ndarray:
        from gguf import GGML_QUANT_SIZES
        from gguf.quants import quant_shape_to_byte_shape

        dims = tuple(int(n) for n in reversed(self.shape.tolist()))
        count = int(np.prod(self.shape))
        typed = _TYPED.get(self.tensor_type.name)
        if typed is not None:
            return self._file.array(self.offset, typed, count).reshape(dims)
        block, size = GGML_QUANT_SIZES[self.tensor_type]
        raw = self._file.array(self.offset, np.uint8, count * size // block)
        return raw.reshape(quant_shape_to_byte_shape(dims, self.tensor_type))


class GgufFile:
    """``fields``: metadata key -> value (str, int, float, bool, or a list of those); ``tensors``:
    the directory, in file order. Raises GgufFormatError for bytes it cannot read."""

    def __init__(self, path: str):
        self.map = np.memmap(path, mode="r")
        self.buffer = memoryview(self.map)  # type: ignore[arg-type]  # (numpy stubs: __buffer__ on Python 3.12+ only)
        try:
            self._read()
        except (struct.error, IndexError, UnicodeDecodeError, ValueError) as exc:
            raise GgufFormatError(str(exc) or type(exc).__name__) from None

    def array(self, offset: int, dtype: npt.DTypeLike, count: int) -> np.ndarray:
        return np.frombuffer(self.buffer, dtype=dtype, count=count, offset=offset)

    def _read(self) -> None:
        magic, version = struct.unpack_from("<II", self.buffer, 0)
        if magic != GGUF_MAGIC:
            raise GgufFormatError("GGUF magic invalid")
        if version not in VERSIONS:
            raise GgufFormatError(f"GGUF version {version} (big-endian, or not {VERSIONS})")
        tensor_count, kv_count = struct.unpack_from("<QQ", self.buffer, 8)
        self.at = 24
        self.fields: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            self.fields[key] = self._value(self._scalar("<I"))
        directory = [self._tensor_entry() for _ in range(tensor_count)]
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GgufFormatError(f"general.alignment is {alignment!r}, not a power of two")
        start = -(-self.at // alignment) * alignment
        names = [name for name, _, _, _ in directory]
        if len(set(names)) != len(names):
            raise GgufFormatError("a tensor name appears twice")
        self.tensors = [GgufTensor(name, kind, shape, start + offset, self) for name, kind, shape, offset in directory]

    def _scalar(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buffer, self.at)[0]
        self.at += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._scalar("<Q")
        if self.at + length > len(self.buffer):
            raise GgufFormatError("a string runs past the end of the file")
        text = bytes(self.buffer[self.at : self.at + length]).decode("utf-8")
        self.at += length
        return text

    def _value(self, kind: int) -> Any:
        if kind == STRING:
            return self._string()
        if kind == ARRAY:
            element, count = self._scalar("<I"), self._scalar("<Q")
            if element == STRING:
                return [self._string() for _ in range(count)]
            if element not in _NUMPY:
                raise GgufFormatError(f"array of value type {element}")
            values = self.array(self.at, _NUMPY[element], count)
            self.at += values.nbytes
            return values.tolist()
        if kind not in _SCALARS:
            raise GgufFormatError(f"value type {kind}")
        return self._scalar(_SCALARS[kind])

    def _tensor_entry(self) -> tuple[str, GGMLQuantizationType, np.ndarray, int]:
        from gguf import GGMLQuantizationType

        name = self._string()
        dims = self._scalar("<I")
        shape = np.asarray(struct.unpack_from(f"<{dims}Q", self.buffer, self.at), dtype=np.uint64)
        self.at += 8 * dims
        kind = GGMLQuantizationType(self._scalar("<I"))
        return name, kind, shape, self._scalar("<Q")
