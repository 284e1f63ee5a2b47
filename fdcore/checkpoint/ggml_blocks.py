"""Weights a GGUF file holds in a block quantization that fdcore's packed matrices take as they are.

llama.cpp's Q8_0 (per output row and block of 32 inputs, ``w = d * q``, d in float16, q in [-128, 127])
is fdcore's wint8 (``w = d * u + m``, u in [0, 255]) with ``u = q + 128`` and ``m = -128 d``, and its
Q4_1 fdcore's wint4 (``w = d * q + m``, d and m in float16, q in [0, 15]); its Q4_0 (``w = d * (q - 8)``) is Q4_1
with ``m = -8 d``, which float16 holds exactly. A
file's block of one of these kinds is repacked for fdcore's kernels level for level, so a model run
with the matching ``model.quantization`` multiplies exactly the file's weights, as llama.cpp does.
Quantizing the dequantized file again would not: its scale and minimum are recomputed from the block's
extremes, which moves the grid (by up to half a step) wherever a block does not use both of its
end levels.

Q4_K (what Q4_K_M files mostly hold) keeps its levels too, its per-32 scale and minimum rounded to
float16 (see :func:`_from_q4_k`). Other types (Q5_*, Q6_K, and every type under another
``model.quantization``) are dequantized and, where asked, quantized at load as any checkpoint is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np

BLOCK = 32  # inputs per block, in every kind here
_LAYOUTS = {  # ggml type -> (bytes per block, fdcore quantization)
    "Q8_0": (2 + BLOCK, "wint8"),
    "Q4_0": (2 + BLOCK // 2, "wint4"),
    "Q4_1": (4 + BLOCK // 2, "wint4"),
}


@dataclass(frozen=True)
class Blocks:
    """A weight ``[out, in]`` as levels and per-block float16 values (held as float32)."""

    kind: str  # the model.quantization whose matrices take these levels: "wint8" or "wint4"
    levels: np.ndarray  # [out, in]: int8 in [-128, 127] (Q8_0's q: wint8), uint8 in [0, 15] (wint4)
    scale: np.ndarray  # float32 [out, in / 32]
    minimum: np.ndarray | None = None  # float32 [out, in / 32] (wint4)

    def dequantized(self) -> np.ndarray:
        """The weight as float32 (what the levels stand for)."""
        rows, cols = self.levels.shape
        weight: np.ndarray = self.levels.reshape(rows, -1, BLOCK).astype(np.float32) * self.scale[:, :, None]
        if self.minimum is not None:
            weight += self.minimum[:, :, None]
        return weight.reshape(rows, cols)

    def take_rows(self, part: slice | np.ndarray) -> Blocks:
        return Blocks(
            self.kind, self.levels[part], self.scale[part], None if self.minimum is None else self.minimum[part]
        )

    def take_columns(self, part: slice) -> Blocks | None:
        """Inputs ``part`` (a tensor-parallel rank's share); None when it does not cut at block bounds."""
        start, stop, _ = part.indices(self.levels.shape[1])
        if start % BLOCK or stop % BLOCK:
            return None
        blocks = slice(start // BLOCK, stop // BLOCK)
        return Blocks(
            self.kind,
            self.levels[:, part],
            self.scale[:, blocks],
            None if self.minimum is None else self.minimum[:, blocks],
        )


def concatenate_rows(pieces: list[Blocks | None]) -> Blocks | None:
    """Several weights stacked by rows (q, k and v as one product); None unless all are of one kind."""
    if any(piece is None for piece in pieces) or len({cast(Blocks, piece).kind for piece in pieces}) != 1:
        return None
    if len(pieces) == 1:
        return pieces[0]
    minimum = (
        None if cast(Blocks, pieces[0]).minimum is None else np.concatenate([cast(Blocks, p).minimum for p in pieces])
    )
    return Blocks(
        cast(Blocks, pieces[0]).kind,
        np.concatenate([cast(Blocks, p).levels for p in pieces]),
        np.concatenate([cast(Blocks, p).scale for p in pieces]),
        minimum,
    )


def from_ggml(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> Blocks | None:
    """A 2-D tensor's blocks (``raw``: its bytes, rows of blocks) as :class:`Blocks`; None for a type
    no fdcore matrix takes as it is."""
    if type_name == "Q4_K" and len(shape) == 2 and shape[1] % SUPER_BLOCK == 0:
        return _from_q4_k(raw, shape)
    if type_name not in _LAYOUTS or len(shape) != 2 or shape[1] % BLOCK:
        return None
    size, kind = _LAYOUTS[type_name]
    rows, cols = shape
    data = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, cols // BLOCK, size)
    scale = data[:, :, :2].copy().view(np.float16)[:, :, 0].astype(np.float32)
    if type_name == "Q8_0":
        return Blocks(kind, data[:, :, 2:].copy().view(np.int8).reshape(rows, cols), scale)
    if type_name == "Q4_1":
        minimum = data[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float32)
        packed = data[:, :, 4:]
    else:
        minimum = (scale.astype(np.float16) * np.float16(-8)).astype(np.float32)
        if not np.isfinite(minimum).all():
            return None
        packed = data[:, :, 2:]
    # ggml's 4-bit block: byte j holds input j (low nibble) and input j + 16 (high nibble)
    levels = np.concatenate([packed & 0x0F, packed >> 4], axis=2).reshape(rows, cols)
    return Blocks(kind, levels, scale, minimum)


SUPER_BLOCK = 256  # a K-quant's block: 8 sub-blocks of 32
_Q4_K_BYTES = 2 + 2 + 12 + SUPER_BLOCK // 2


def _from_q4_k(raw: np.ndarray, shape: tuple[int, int]) -> Blocks | None:
    """Q4_K (llama.cpp's 4-bit K-quant, what Q4_K_M files mostly hold): per sub-block of 32,
    ``w = (d * sc) q - (dmin * m)`` with d and dmin float16 per 256 and sc, m 6-bit. Repacked as
    wint4 level for level; the sub-block's scale ``d * sc`` and minimum ``-dmin * m`` are rounded to
    float16 (wint4's), a relative change of at most 2**-11, where quantizing the dequantized weights
    again would move the levels of every sub-block whose 16 levels are not all used (K-quants fit
    their scales to the weights, so most are not). None when a product is beyond float16's range."""
    rows, cols = shape
    data = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, cols // SUPER_BLOCK, _Q4_K_BYTES)
    d, dmin = (data[:, :, o : o + 2].copy().view(np.float16)[:, :, 0].astype(np.float32) for o in (0, 2))
    packed = data[:, :, 4:16]  # 8 six-bit scales and 8 six-bit minimums (llama.cpp's get_scale_min_k4)
    low, mid, high = packed[:, :, 0:4], packed[:, :, 4:8], packed[:, :, 8:12]
    sc = np.concatenate([low & 0x3F, (high & 0x0F) | ((low >> 2) & 0x30)], axis=2).astype(np.float32)
    m = np.concatenate([mid & 0x3F, (high >> 4) | ((mid >> 2) & 0x30)], axis=2).astype(np.float32)
    scale = (d[:, :, None] * sc).astype(np.float16).astype(np.float32)
    minimum = (-(dmin[:, :, None] * m)).astype(np.float16).astype(np.float32)
    if not (np.isfinite(scale).all() and np.isfinite(minimum).all()):
        return None
    # 4 chunks of 32 bytes: low nibbles are sub-block 2c, high nibbles sub-block 2c + 1
    qs = data[:, :, 16:].reshape(rows, cols // SUPER_BLOCK, 4, 1, 32)
    levels = np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(rows, cols)
    return Blocks("wint4", levels, scale.reshape(rows, -1), minimum.reshape(rows, -1))
