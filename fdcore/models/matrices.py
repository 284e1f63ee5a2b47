"""The projections' weights as the kernels take them: float32 panels, bfloat16 pairs, int8 rows with scales,
4-bit blocks (llama.cpp's Q4_1), their quantizers, and the products over them."""

from __future__ import annotations

import numpy as np

from fdcore.models import cpu_env  # noqa: F401  (before paddle: math-library settings)

# isort: split
import paddle

from fdcore.checkpoint.ggml_blocks import Blocks, concatenate_rows
from fdcore.models.kernels import DECODER_KINDS
from fdcore.models.tensors import as_paddle, on_huge_pages, packing_shared, zeros_on_huge_pages


class F32Matrix:
    """A float32 weight ``[out, in]`` packed for fdcore's kernel (linear_f32.cc): panels of 32 output rows,
    ``[panels, in, 32]`` (``packed[p, k, lane] = weight[32 p + lane, k]``; 16 rows per 64-byte load),
    the last panel zero-padded. The same values as the weight, in another order: a tied model's
    embedding reads its rows from here (``take_rows``) instead of keeping a second copy.

    NOTE: used for every float32 projection and the LM head at every batch size, where the CPU has
    AVX-512F or AVX2: no row count was found where MKL's matmul is faster, so there is no threshold to
    dispatch on (and a fallback would need the unpacked copy too: twice the memory). The figures:
    DESIGN.md, "Model", and ``benchmarks/bench_linear_f32.py``."""

    __slots__ = ("array", "packed", "rows")

    def __init__(self, array: np.ndarray, rows: int):
        self.array, self.rows = array, rows
        self.packed = as_paddle(array)  # shares the array's memory

    @classmethod
    def pack(cls, weight: np.ndarray) -> F32Matrix:
        rows, cols = weight.shape
        full, panels = rows // 32, -(-rows // 32)
        array = zeros_on_huge_pages((panels, cols, 32), np.float32)
        # NOTE: in slices of 64 panels, so the transposed copy's source stays in cache
        for start in range(0, full, 64):
            end = min(full, start + 64)
            array[start:end] = weight[start * 32 : end * 32].reshape(end - start, 32, cols).transpose(0, 2, 1)
        if full < panels:
            tail = np.zeros((32, cols), dtype=np.float32)
            tail[: rows - full * 32] = weight[full * 32 :]
            array[full] = tail.T
        return cls(array, rows)

    @property
    def inputs(self) -> int:
        """The inner dimension (x's width)."""
        return self.array.shape[1]

    def take_rows(self, ids: np.ndarray) -> np.ndarray:
        """``weight[ids]``, [len(ids), in] (a new array)."""
        return np.ascontiguousarray(self.array[ids // 32, :, ids % 32])

    def numel(self) -> int:
        """The float32 values held (padding included), as a tensor's ``numel``: memory accounting."""
        return self.array.size


class Bf16Matrix:
    """A weight ``[out, in]`` in bfloat16, packed for fdcore's kernel (linear_bf16.cc): groups of 32
    output rows, each ``[in / 2, 2, 16, 2]`` (16 rows x 2 inputs per 64-byte load), zero-padded.
    ``gated``: an MLP's gate and up projections for the kernel's SwiGLU (pack_gated, swiglu)."""

    __slots__ = ("packed", "rows", "gated")

    def __init__(self, packed: paddle.Tensor, rows: int, gated: bool = False):
        self.packed, self.rows, self.gated = packed, rows, gated

    @classmethod
    def pack_gated(cls, gate: np.ndarray, up: np.ndarray) -> Bf16Matrix:
        """The gate and up projections (``[I, in]`` each) with group g holding the gate's rows 16 g .. 16 g + 15,
        then the up projection's same rows (zeros past I): a group's two 16-output blocks are then one block's
        gate and up, and the kernel stores silu(gate) up from its registers (linear_bf16.cc, SwiGluOut) where the
        [rows, 2 I] product used to go through memory and a SwiGLU pass. ``rows``: 2 I, as a stacked gate_up's."""
        inner, cols = gate.shape
        blocks = -(-inner // 16)
        interleaved = np.zeros((blocks, 2, 16, cols), dtype=np.float32)
        for half, weight in enumerate((gate, up)):
            padded = np.zeros((blocks * 16, cols), dtype=np.float32)
            padded[:inner] = weight
            interleaved[:, half] = padded.reshape(blocks, 16, cols)
        return cls(cls.pack(interleaved.reshape(blocks * 32, cols)).packed, 2 * inner, gated=True)

    @classmethod
    def pack(cls, weight: np.ndarray) -> Bf16Matrix:
        rows, cols = weight.shape
        padded = np.zeros((-(-rows // 32) * 32, cols + cols % 2), dtype=np.float32)
        padded[:rows, :cols] = weight
        groups, pairs = padded.shape[0] // 32, padded.shape[1] // 2
        blocks = padded.reshape(groups, 2, 16, pairs, 2).transpose(0, 3, 1, 2, 4)
        bits = paddle.to_tensor(np.ascontiguousarray(blocks)).astype("bfloat16").numpy().view(np.int16)
        # int16 through DLPack, then viewed (no copy) as bfloat16: a uint16 array would come through
        # as a tensor Python calls bfloat16 but the kernels see as uint16
        return cls(as_paddle(on_huge_pages(bits)).view(paddle.bfloat16), rows)


class Int8Matrix:
    """A weight ``[out, in]`` quantized to 8 bits per output row and block of 32 inputs (wint8): ``w ~=
    scale[row, block] * u + minimum[row, block]``, u in [0, 255], scale and minimum in float16 (llama.cpp's
    Q4_1 form with 8-bit levels; a Q8_0 file's ``d * q`` is ``u = q + 128`` with ``minimum = -128 d``,
    exactly), packed for fdcore's kernel (linear_int8.cc): groups of 64 output rows (32 on AVX2:
    kernels.int8_group_rows), each ``[in / 4, rows / 16, 16, 4]`` (16 rows x 4 inputs per 64-byte load),
    zero-padded to whole groups and to a multiple of 32 inputs; scales ``[groups, in / 32, 2, group rows]``:
    per block the group's scales, then its minimums (float16 as int16 bits: 4 bytes a block where float32
    would add 12.5 % more to the bytes a batch-1 step streams).

    Why a minimum: a block's 256 levels span its range [min, max] rather than [-max |w|, max |w|], and a
    file's 4-bit blocks (Q4_1, Q4_0, Q4_K) are this form as they are (LlamaModel._matrix takes them).
    Quantized from SmolLM2's float weights (with 16-bit activations), symmetric int8 levels changed
    float32's greedy token on 2 of 9 golden prompts within 16 tokens (a float64 simulation), this grid on
    1 (a top-two gap of 0.002), the file's own levels on none (benchmarks/bench_quality.py)."""

    __slots__ = ("packed", "scales", "rows")

    def __init__(self, packed: paddle.Tensor, scales: paddle.Tensor, rows: int):
        self.packed, self.scales, self.rows = packed, scales, rows

    @property
    def inputs(self) -> int:
        """The inner dimension it was packed with (a multiple of 32, as x may be)."""
        return self.packed.shape[1] * 4

    @staticmethod
    def quantize(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(u uint8 [out, in'] in [0, 255], scale and minimum float32 [out, in' / 32], each a float16
        value) with weight ~= scale * u + minimum block by block, off by at most scale / 2 (in' = in
        rounded up to 32, padded with zeros)."""
        return _asymmetric_levels(weight, 255, "wint8")

    @classmethod
    def pack(cls, weight: np.ndarray) -> Int8Matrix:
        return cls.pack_levels(*cls.quantize(weight))

    @classmethod
    def from_blocks(cls, blocks: Blocks) -> Int8Matrix:
        """A GGUF file's Q8_0 weight, level for level (fdcore.checkpoint.ggml_blocks): ``u = q + 128`` and
        ``minimum = -128 scale`` (exact in float16 but for scales beyond 511, which are quantized again);
        or its 4-bit one (Q4_1, Q4_0, Q4_K), whose levels, scales and minimums are wint8's as they are."""
        if blocks.minimum is not None:
            return cls.pack_levels(blocks.levels, blocks.scale, blocks.minimum)
        minimum = np.float32(-128) * blocks.scale
        if not np.isfinite(minimum.astype(np.float16)).all():
            return cls.pack(blocks.dequantized())
        return cls.pack_levels((blocks.levels.astype(np.int16) + 128).astype(np.uint8), blocks.scale, minimum)

    @classmethod
    def pack_levels(cls, u: np.ndarray, scale: np.ndarray, minimum: np.ndarray) -> Int8Matrix:
        """Pack levels ``u`` (uint8 [out, in], in a multiple of 32) with their per-block scales and minimums."""
        from fdcore.models.kernels import int8_group_rows

        rows, cols = u.shape
        group = int8_group_rows()  # the kernel path's (64 rows for AVX512-VNNI, 32 for AVX2)
        padded = np.zeros((-(-rows // group) * group, cols), dtype=np.uint8)
        padded[:rows] = u
        groups, quads = padded.shape[0] // group, cols // 4
        blocks = padded.reshape(groups, group // 16, 16, quads, 4).transpose(0, 3, 1, 2, 4)
        values = np.zeros((padded.shape[0], cols // 32, 2), dtype=np.float32)
        values[:rows, :, 0], values[:rows, :, 1] = scale, minimum
        values = values.reshape(groups, group, cols // 32, 2).transpose(0, 2, 3, 1).astype(np.float16).view(np.int16)
        return cls(as_paddle(on_huge_pages(blocks)), as_paddle(on_huge_pages(values)), rows)


class Int4Matrix:
    """A weight ``[out, in]`` quantized to 4 bits per output row and block of 32 inputs (wint4, llama.cpp's
    Q4_1: ``w ~= scale[row, block] * q + minimum[row, block]``, q in [0, 15], scale and minimum in
    float16: 5 bits a weight), packed for fdcore's kernel (linear_int4.cc) as one uint8 tensor
    ``[groups, in / 32, 640]``: groups of 32 output rows (zero-padded), and per group and block of 32
    inputs one contiguous record of 512 bytes of nibbles ``[4, 2, 16, 4]`` (16 rows x 8 inputs per
    64-byte load: the low nibble holds input ``8 v + j``, the high one ``8 v + 4 + j``) followed by
    the 32 rows' float16 scales and then their 32 float16 minimums; the inner dimension is
    zero-padded to a multiple of 32."""

    __slots__ = ("packed", "rows")

    def __init__(self, packed: paddle.Tensor, rows: int):
        self.packed, self.rows = packed, rows

    @property
    def inputs(self) -> int:
        """The inner dimension it was packed with (a multiple of 32, as x may be)."""
        return self.packed.shape[1] * 32

    @staticmethod
    def quantize(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(q uint8 [out, in'] in [0, 15], scale and minimum float32 [out, in' / 32], each a float16
        value) with weight ~= scale * q + minimum block by block (in' = in rounded up to 32, padded
        with zeros). The minimum is rounded down and the scale up to float16, so that every weight
        lies within [minimum, minimum + 15 scale] and is off by at most scale / 2."""
        return _asymmetric_levels(weight, 15, "wint4")

    @classmethod
    def pack(cls, weight: np.ndarray) -> Int4Matrix:
        return cls._pack_slices(weight.shape[0], lambda part: cls.quantize(weight[part]))

    @classmethod
    def from_blocks(cls, blocks: Blocks) -> Int4Matrix:
        """A GGUF file's Q4_1, Q4_0 or Q4_K weight, level for level (fdcore.checkpoint.ggml_blocks)."""
        return cls._pack_slices(
            blocks.levels.shape[0], lambda part: (blocks.levels[part], blocks.scale[part], blocks.minimum[part])
        )

    @classmethod
    def _pack_slices(cls, rows: int, quantized) -> Int4Matrix:
        """Pack ``quantized(rows slice) -> (q, scale, minimum)`` (see :meth:`quantize`) slice by slice."""
        groups, packed = -(-rows // 32), None
        # NOTE: in slices of rows, so the temporaries stay small (and in cache) for the 49152-row head;
        # each slice's records go straight to their place in the packed matrix
        for start in range(0, rows, 2048):
            records = cls._records(*quantized(slice(start, start + 2048)))
            if packed is None:
                packed = zeros_on_huge_pages((groups, *records.shape[1:]), np.uint8)
            packed[start // 32 : start // 32 + records.shape[0]] = records
        return cls(as_paddle(packed), rows)

    @classmethod
    def _records(cls, q: np.ndarray, scale: np.ndarray, minimum: np.ndarray) -> np.ndarray:
        """The packed records [groups, in' / 32, 640] of a slice of rows (a multiple of 32 but the last)."""
        rows, cols = q.shape
        groups, blocks = -(-rows // 32), cols // 32
        if rows % 32:
            q = np.concatenate([q, np.zeros((groups * 32 - rows, cols), dtype=np.uint8)])
            scale, minimum = (
                np.concatenate([a, np.zeros((groups * 32 - rows, blocks), dtype=np.float32)]) for a in (scale, minimum)
            )
        halves = q.reshape(groups, 2, 16, blocks, 4, 2, 4)  # [g, b, lane, block, v, half, j]
        nibbles = (halves[:, :, :, :, :, 0] | (halves[:, :, :, :, :, 1] << 4)).transpose(0, 3, 4, 1, 2, 5)
        per_block = [nibbles.reshape(groups, blocks, 512)]
        for values in (scale, minimum):
            halfs = values.astype(np.float16).reshape(groups, 32, blocks).transpose(0, 2, 1)
            per_block.append(np.ascontiguousarray(halfs).view(np.uint8))
        return np.concatenate(per_block, axis=2)


def _asymmetric_levels(weight: np.ndarray, top: int, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(levels uint8 [out, in'] in [0, top], scale and minimum float32 [out, in' / 32], each a float16 value)
    with weight ~= scale * level + minimum block by block of 32 inputs (in' = in rounded up to 32, padded
    with zeros). The minimum is rounded down and the scale up to float16, so that every weight lies within
    [minimum, minimum + top scale] and is off by at most scale / 2."""
    rows, cols = weight.shape
    padded = np.zeros((rows, -(-cols // 32) * 32), dtype=np.float32)
    padded[:, :cols] = weight
    blocks = padded.reshape(rows, -1, 32)
    minimum = _float16_toward(_per_block(np.minimum, blocks), -np.inf)
    scale = _float16_toward((_per_block(np.maximum, blocks) - minimum) / np.float32(top), np.inf)
    if not (np.isfinite(minimum).all() and np.isfinite(scale).all()):
        raise ValueError(f"{name}: a weight block is beyond float16's range")
    inverse = np.divide(np.float32(1), scale, out=np.zeros_like(scale), where=scale > 0)
    levels = blocks - minimum[:, :, None]
    levels *= inverse[:, :, None]
    np.rint(levels, out=levels)
    np.clip(levels, 0, top, out=levels)
    return levels.astype(np.uint8).reshape(rows, -1), scale, minimum


def blocks_of(file_blocks: dict[str, Blocks], *names: str) -> Blocks | None:
    """The file's blocks of these weights stacked by rows (as the model stacks q, k and v), when it
    holds them all in one kind of block (fdcore.checkpoint.ggml_blocks); taken from ``file_blocks``."""
    return concatenate_rows([file_blocks.pop(name, None) for name in names])


def matrix_nbytes(matrix) -> int:
    """The bytes a pass over a packed matrix reads."""
    if isinstance(matrix, F32Matrix):
        return matrix.array.nbytes
    tensors = [matrix.packed] + ([matrix.scales] if isinstance(matrix, Int8Matrix) else [])
    return sum(int(t.numel()) * t.element_size() for t in tensors)


def _per_block(ufunc, blocks: np.ndarray) -> np.ndarray:
    """``ufunc`` reduced over the last axis of a contiguous ``[rows, blocks, 32]`` (reduceat: twice as
    fast as ``.max(axis=2)`` on rows this short, which matters for loading a model)."""
    flat = blocks.reshape(-1)
    return ufunc.reduceat(flat, np.arange(0, flat.size, blocks.shape[2])).reshape(blocks.shape[:2])


def _float16_toward(values: np.ndarray, direction: float) -> np.ndarray:
    """``values`` (float32) rounded to float16 and moved one step toward ``direction`` where that rounding
    went the other way; returned widened to float32."""
    rounded = values.astype(np.float16)
    wrong = rounded > values if direction < 0 else rounded < values
    rounded[wrong] = np.nextafter(rounded[wrong], np.float16(direction))
    return rounded.astype(np.float32)


def linear(x: paddle.Tensor, weight, bias: paddle.Tensor | None = None) -> paddle.Tensor:
    """``x @ weight.T (+ bias)`` for a weight stored ``[out, in]``: a plain tensor through Paddle's (MKL's)
    matmul, the packed kinds through fdcore's kernels (Paddle's CPU build has no bfloat16 matmul, and
    its float32 one is slower than F32Matrix's kernel at every batch size measured: F32Matrix). A gated
    Bf16Matrix's product comes out in its packed order (16 gate and 16 up outputs by turns): the same
    product, which is what a GEMM floor times; the model takes its SwiGLU (swiglu)."""
    if isinstance(weight, F32Matrix):
        out = _F32_LINEAR[0](x, weight.packed, weight.rows)
    elif isinstance(weight, Bf16Matrix):
        out = _BF16_LINEAR[0](x, weight.packed, weight.rows)
    elif isinstance(weight, Int8Matrix):
        out = _INT8_LINEAR[0](x, weight.packed, weight.scales, weight.rows)
    elif isinstance(weight, Int4Matrix):
        out = _INT4_LINEAR[0](x, weight.packed, weight.rows)
    else:
        out = paddle.matmul(x, weight, transpose_y=True)
    return out if bias is None else out + bias


def swiglu(x: paddle.Tensor, gate_up, bias: paddle.Tensor | None, silu_mul) -> paddle.Tensor:
    """The MLP's activations silu(gate) * up of x's gate and up products ([rows, I]): a gated Bf16Matrix's in its
    product's epilogue (Bf16Matrix.pack_gated), any other's product then ``silu_mul`` ([rows, 2 I] -> [rows, I])."""
    if isinstance(gate_up, Bf16Matrix) and gate_up.gated:
        if bias is None:
            if _NO_BIAS[0] is None:  # (one empty tensor for every call: each made its own, ~2 us a layer)
                _NO_BIAS[0] = paddle.empty([0], dtype="float32")
            bias = _NO_BIAS[0]
        return _BF16_SWIGLU[0](x, gate_up.packed, bias, gate_up.rows)
    return silu_mul(linear(x, gate_up, bias))


def paddle_silu_mul(gate_up: paddle.Tensor) -> paddle.Tensor:
    """SwiGLU of a [rows, 2 I] product with Paddle's ops (the Python path's)."""
    gate, up = paddle.split(gate_up, 2, axis=-1)
    return paddle.nn.functional.silu(gate) * up


_F32_LINEAR: list = [None]  # the compiled kernels, loaded by the first model that needs them


_BF16_LINEAR: list = [None]


_BF16_SWIGLU: list = [None]


_NO_BIAS: list = [None]  # the empty bias tensor swiglu() hands the gated kernel for a bias-less MLP


_INT8_LINEAR: list = [None]


_INT4_LINEAR: list = [None]


PACKED = {"bfloat16": Bf16Matrix, "wint8": Int8Matrix, "wint4": Int4Matrix}  # a matrix kind's packed form


# which files' blocks (fdcore.checkpoint.ggml_blocks.Blocks.kind) a matrix kind takes level for level: wint8's 256
# levels hold a 4-bit block's 16 with its scale and minimum, so a Q4_1 file run as wint8 multiplies the file's
# weights, where quantizing them again moved SmolLM2's logits enough to change a greedy token (bench_quality)
HOLDS_BLOCKS = {"wint8": ("wint8", "wint4"), "wint4": ("wint4",)}


KIND_CODES = {
    matrix: DECODER_KINDS.index(kind)
    for matrix, kind in ((F32Matrix, "float32"), (Bf16Matrix, "bfloat16"), (Int8Matrix, "int8"), (Int4Matrix, "int4"))
}


PROJECTIONS = ("qkv", "o", "gate_up", "down")  # a layer's matrices


def matrix_kind(dtype: str, quantization: str) -> str:
    """How the projections' weights are kept: float32; bfloat16 where the CPU multiplies it natively
    (AVX512-BF16); wint8 or wint4 where it has AVX512-VNNI or AVX2 (with either dtype: the weights are int8 or
    4-bit then). The kernel must have been built."""
    from fdcore.models.kernels import linear_bf16, linear_bf16_swiglu, linear_int4, linear_int8, missing_cpu_feature

    if quantization not in ("none", "wint8", "wint4"):
        raise ValueError(f"quantization {quantization!r}: none, wint8 or wint4")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype {dtype!r}: the CPU model computes in float32 or bfloat16")
    kind = dtype if quantization == "none" else quantization
    if kind == "float32":
        return kind
    table, build = {
        "bfloat16": (_BF16_LINEAR, linear_bf16),
        "wint8": (_INT8_LINEAR, linear_int8),
        "wint4": (_INT4_LINEAR, linear_int4),
    }[kind]
    missing = missing_cpu_feature(kind)
    if missing:
        raise ValueError(f"{kind} needs a CPU with {missing}; this one has none")
    table[0] = build()
    if kind == "wint4":
        _INT8_LINEAR[0] = linear_int8()  # for the LM head (see LlamaModel.__init__); the same library
    if kind == "bfloat16":
        _BF16_SWIGLU[0] = linear_bf16_swiglu()  # (gated gate_up: swiglu)
    if table[0] is None:
        raise ValueError(f"{kind} needs fdcore's C++ operators, which could not be built here")
    return kind


def f32_kernel() -> bool:
    """Whether float32 weights go to fdcore's kernel (as F32Matrix): on CPUs with AVX-512F or AVX2, when it was
    built (loaded here). Otherwise they stay plain tensors for MKL's matmul; float32 is never refused."""
    from fdcore.models.kernels import linear_f32

    op = linear_f32()
    if op is not None:
        _F32_LINEAR[0] = op
    return op is not None


def weight32(array: np.ndarray) -> np.ndarray:
    """A weight's float32 values as the model keeps them: the checkpoint's array itself where it is float32
    already (no second copy while the model is built), copied into the shared weight file when the model
    is packed into one."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    return on_huge_pages(array) if packing_shared() else array
