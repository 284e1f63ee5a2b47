"""The paged KV cache: per layer, keys and values in blocks of ``block_size`` tokens, laid out for the kernels."""

from __future__ import annotations

import numpy as np

from fdcore.models import cpu_env  # noqa: F401  (before paddle: math-library settings)

# isort: split
import paddle

from fdcore.checkpoint import ModelArgs
from fdcore.models.tensors import arrays_in_file, as_paddle, release_pages, zeros_on_huge_pages


class PagedKVCache:
    """K and V of every layer: numpy ``[kv_heads, num_blocks, block_size, head_dim]``, in float32 or (``dtype
    "bfloat16"``, held as int16 bits) bfloat16: half the memory a token, and attention's products in
    AVX512-BF16's ``vdpbf16ps`` (attention_bf16.h's AttendHeadsBf16; only fdcore's C++ operators read it).

    A float32 cache's keys are transposed within each block, ``[kv_heads, num_blocks, head_dim, block_size]``:
    a key a vector lane, so attention's scores are one FMA chain per key (attention_avx512.h's ScoreRuns) with no
    reduction across lanes. (The bfloat16 cache keeps its keys as rows: its kernel multiplies them in pairs of
    values along head_dim, and this machine's CPU, without AVX512-BF16, could not run a re-laid one.)

    With ``fd`` (the rank's KV file, which the supervisor holds: ``cache.shared_memory``) the arrays live in
    that shared file instead of private huge pages, and outlive the worker: its successor finds every block
    its predecessor computed, and the cache manager's prefix cache still points at them."""

    def __init__(
        self, args: ModelArgs, num_blocks: int, block_size: int, dtype: str = "float32", fd: int | None = None
    ):
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"PagedKVCache: dtype {dtype!r}: 'float32' or 'bfloat16'")
        self.num_blocks, self.block_size, self.dtype, self.shared = num_blocks, block_size, dtype, fd is not None
        storage = np.float32 if dtype == "float32" else np.int16
        shape = (args.num_kv_heads, num_blocks, block_size, args.head_dim)
        k_shape = (args.num_kv_heads, num_blocks, args.head_dim, block_size) if dtype == "float32" else shape
        if fd is not None:
            arrays = arrays_in_file(fd, [k_shape, shape] * args.num_layers, storage)
            self.k, self.v = arrays[0::2], arrays[1::2]
        else:
            self.k = [zeros_on_huge_pages(k_shape, storage) for _ in range(args.num_layers)]
            self.v = [zeros_on_huge_pages(shape, storage) for _ in range(args.num_layers)]
        self._k_buffer = self._v_buffer = self._kt_buffer = np.empty(0, dtype=storage)
        self._views: tuple[list[paddle.Tensor], list[paddle.Tensor]] | None = None

    def release(self) -> None:
        """The arrays' memory back to the kernel until they are written again (a warm spare's cache, which
        its warm-up touched): their contents are lost, which no sequence reads before it writes them. A
        shared cache is never released: its contents are the rank's, which the serving worker reads."""
        if self.shared:
            return
        for array in self.k + self.v:
            release_pages(array)

    def all_tensors(self) -> tuple[list[paddle.Tensor], list[paddle.Tensor]]:
        """Paddle views (no copy, made once) of every layer's K arrays, and of its V arrays."""
        if self._views is None:
            view = as_paddle if self.dtype == "float32" else (lambda bits: as_paddle(bits).view(paddle.bfloat16))
            self._views = [view(k) for k in self.k], [view(v) for v in self.v]
        return self._views

    def tensors(self, layer: int) -> tuple[paddle.Tensor, paddle.Tensor]:
        """One layer's K and V views, for the paged attention op."""
        k, v = self.all_tensors()
        return k[layer], v[layer]

    def slots(self, block_table: list[int], start: int, end: int) -> np.ndarray:
        """Slot index (block * block_size + offset) of each position in [start, end)."""
        positions = np.arange(start, end)
        table = np.asarray(block_table, dtype=np.int64)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def write(self, layer: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Store new K/V rows ([tokens, kv_heads, head_dim]) at their slots."""
        self._float32_only()
        blocks, offsets = np.divmod(slots, self.block_size)
        self.k[layer][:, blocks, :, offsets] = k  # (indexed [tokens, kv_heads, head_dim]: the arrays' axes first)
        self.v[layer][:, blocks, offsets] = v.transpose(1, 0, 2)

    def gather(self, layer: int, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The listed blocks, contiguous: [kv_heads, len(blocks) * block_size, head_dim].

        NOTE: the result lives in buffers that the next call overwrites (use it
        first). Fresh multi-megabyte arrays per layer cost more in page faults
        than the copy itself (measured: 20 ms vs 5 ms per step at batch 64), and
        ``mode="clip"`` keeps np.take from staging ``out`` through a temporary.
        """
        self._float32_only()
        heads, _, size, dim = self.v[layer].shape
        shape = (heads, len(blocks), size, dim)
        need = heads * len(blocks) * size * dim
        if self._k_buffer.size < need:
            self._k_buffer, self._v_buffer, self._kt_buffer = (np.empty(need, dtype=np.float32) for _ in range(3))
        k = self._k_buffer[:need].reshape(shape)
        v = self._v_buffer[:need].reshape(shape)
        kt = self._kt_buffer[:need].reshape(heads, len(blocks), dim, size)
        np.take(self.k[layer], blocks, axis=1, out=kt, mode="clip")
        np.copyto(k, kt.transpose(0, 1, 3, 2))  # the blocks' keys as rows again
        np.take(self.v[layer], blocks, axis=1, out=v, mode="clip")
        return k.reshape(heads, -1, dim), v.reshape(heads, -1, dim)

    def _float32_only(self) -> None:
        if self.dtype != "float32":  # (the Python path's; a bfloat16 model has fdcore's operators or is refused)
            raise RuntimeError("a bfloat16 KV cache is read and written by fdcore's C++ operators only")
