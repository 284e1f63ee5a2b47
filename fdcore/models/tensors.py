"""Numpy arrays as Paddle tensors, without a copy.

fdcore keeps its arrays (KV cache, activations, sampling inputs) in numpy, where
the small operations are cheapest, and hands them to Paddle ops and fdcore's C++
kernels only where those are faster. The hand-over must not copy:
``paddle.to_tensor`` would copy megabytes per layer and step.
"""

from __future__ import annotations

import mmap
import os
from collections import OrderedDict
from contextlib import contextmanager

import numpy as np

from fdcore.models import cpu_env  # noqa: F401  (before paddle: math-library settings)

# isort: split
import paddle


def as_paddle(array: np.ndarray) -> paddle.Tensor:
    """A zero-copy Paddle view of a numpy array (DLPack): writes through either are seen by both,
    so the array must outlive the tensor and stay as it is (contiguous, same dtype) meanwhile."""
    return paddle.utils.dlpack.from_dlpack(array)


class StepInputs:
    """Paddle views of reused numpy buffers, for a step's small inputs (the one-call decoder's embeddings,
    rotary rows, cache slots, block tables, lengths and last rows).

    Why: a DLPack view (``as_paddle``) costs ~10 us warm and up to ~0.1 ms as the first Paddle call after
    a forward has streamed the weights through the caches, and a batch-1 decode step took seven. A step
    whose inputs have the shapes of a recent one's has them copied into that step's buffers and passes
    the same tensors. Inputs past ``largest`` bytes in all (prefills) get fresh views: copying them would
    cost more than viewing them.
    """

    def __init__(self, capacity: int = 8, largest: int = 1 << 18):
        self.capacity, self.largest = capacity, largest
        self._recent: OrderedDict[tuple, tuple[list[np.ndarray], list[paddle.Tensor]]] = OrderedDict()

    def views(self, arrays) -> list[paddle.Tensor]:
        """Tensors holding the values of ``arrays`` (C-contiguous); they change at the next call."""
        if sum(array.nbytes for array in arrays) > self.largest:
            return [as_paddle(array) for array in arrays]
        key = tuple((array.shape, array.dtype) for array in arrays)
        entry = self._recent.get(key)
        if entry is None:
            buffers = [np.empty_like(array) for array in arrays]
            entry = self._recent[key] = (buffers, [as_paddle(buffer) for buffer in buffers])
            if len(self._recent) > self.capacity:
                self._recent.popitem(last=False)
        else:
            self._recent.move_to_end(key)
        for buffer, array in zip(entry[0], arrays, strict=True):
            buffer[...] = array
        return entry[1]


HUGE_PAGE = 2 << 20  # x86-64's transparent huge page


def zeros_on_huge_pages(shape, dtype) -> np.ndarray:
    """A zeroed array in private anonymous memory advised for transparent huge pages (2 MiB), for what
    the kernels stream: packed weights and the KV cache. A 4 KiB page is a TLB miss every 64 cache
    lines, and the hardware prefetchers stop at its edge (DESIGN.md, "Huge pages for what the kernels
    stream", has the figures).

    Inside :func:`packing_weights`, arrays are carved one after another from shared 64 MiB regions, so
    a model's small matrices share huge pages too; otherwise an array of at least 2 MiB gets its own
    region, of which only the whole 2 MiB pages are advised (no memory is wasted on a partly used huge
    page), and a smaller one is ``np.zeros``'s. Pages are zero and faulted in on first touch, as
    ``np.zeros``'s are; a region is unmapped when the last array in it is gone. Where the kernel does
    not offer madvise (or THP is ``never``), the pages are simply small."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if _ARENAS:
        raw = _ARENAS[-1].take(nbytes)
    elif nbytes >= HUGE_PAGE:
        raw = _huge_region(nbytes)
    else:
        return np.zeros(shape, dtype)
    return raw.view(dtype).reshape(shape)


def on_huge_pages(array: np.ndarray) -> np.ndarray:
    """``array``'s values in memory from :func:`zeros_on_huge_pages` (a small array outside
    :func:`packing_weights`: as it is, made contiguous)."""
    if array.nbytes < HUGE_PAGE and not _ARENAS:
        return np.ascontiguousarray(array)
    out = zeros_on_huge_pages(array.shape, array.dtype)
    out[...] = array
    return out


def packing_shared() -> bool:
    """Inside :func:`packing_weights` with an external source (a shared weight file): an array the model
    keeps as it is must be copied there too, or the file would not hold it."""
    return bool(_ARENAS) and _ARENAS[-1].external is not None


def arrays_in_file(fd: int, shapes, dtype) -> list[np.ndarray]:
    """Arrays of ``shapes`` carved one after another (each at a page boundary) from a shared file, mapped
    read-write: what one process writes, every process that maps the file reads, and it outlives them all
    while the file is open somewhere. A file shorter than the arrays is grown (zeros); one longer was made
    for other arrays, and is refused."""
    dtype = np.dtype(dtype)
    sizes = [int(np.prod(shape)) * dtype.itemsize for shape in shapes]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
    held = os.fstat(fd).st_size
    if held > total:
        raise ValueError(f"the shared file holds {held} bytes; these arrays take {total}: it was made for others")
    if held < total:
        os.ftruncate(fd, total)  # (two processes growing it at once grow it to the same size)
    region = mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return [
        np.frombuffer(region, dtype, count=size // dtype.itemsize, offset=at).reshape(shape)
        for shape, size, at in zip(shapes, sizes, offsets, strict=True)
    ]


def release_pages(array: np.ndarray) -> bool:
    """Hand an array's memory back to the kernel, keeping the mapping (``MADV_DONTNEED``): it reads as
    zeros again and costs nothing until written. Only for an array with a region of its own from
    :func:`zeros_on_huge_pages` (2 MiB or more, outside :func:`packing_weights`); False for any other."""
    region = array.base
    while region is not None and not isinstance(region, mmap.mmap):
        region = getattr(region, "base", None) if isinstance(region, np.ndarray) else getattr(region, "obj", None)
    if region is None or len(region) - array.nbytes > HUGE_PAGE:  # (another array's region, or none)
        return False
    region.madvise(mmap.MADV_DONTNEED)
    return True


@contextmanager
def packing_weights(take=None):
    """Within: the arrays :func:`zeros_on_huge_pages` gives share huge-page regions (a model's weights).
    ``take(nbytes)``: where they come from instead, a uint8 array of zeros (a rank's shared weight file:
    fdcore.models.shared_weights), or None once it has no room: private regions from then on."""
    _ARENAS.append(_Arena(take))
    try:
        yield
    finally:
        _ARENAS.pop()


def _huge_region(nbytes: int) -> np.ndarray:
    """``nbytes`` of zeroed memory (uint8) starting on a 2 MiB boundary, its whole 2 MiB pages advised."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -np.frombuffer(region, np.uint8, count=1).ctypes.data % HUGE_PAGE
    if nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE * HUGE_PAGE)
        except OSError:
            pass  # a kernel built without THP: small pages, as np.zeros gives
    # the array's buffer holds the region: it is unmapped when the last view of it is gone
    return np.frombuffer(region, np.uint8, count=nbytes, offset=start)


class _Arena:
    """Consecutive 64-byte-aligned pieces of 64 MiB huge-page regions (a larger request: its own), or of
    an external source (a shared weight file) for as long as it has room."""

    CHUNK = 64 << 20

    def __init__(self, external=None):
        self.external = external
        self.chunk: np.ndarray | None = None
        self.used = 0

    def take(self, nbytes: int) -> np.ndarray:
        piece = None if self.external is None else self.external(nbytes)
        if piece is not None:
            return piece
        size = -(-nbytes // 64) * 64
        if size > self.CHUNK // 4:
            return _huge_region(nbytes)
        if self.chunk is None or self.used + size > self.chunk.size:
            self.chunk, self.used = _huge_region(self.CHUNK), 0
        piece = self.chunk[self.used : self.used + nbytes]
        self.used += size
        return piece


_ARENAS: list[_Arena] = []
