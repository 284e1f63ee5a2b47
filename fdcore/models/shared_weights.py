"""A model's packed weights in one shared-memory file that every worker process of a rank maps.

The worker that finds the file empty packs the weights into it (its packing arena takes its memory from
here: fdcore.models.tensors.packing_weights) and publishes a manifest of where each tensor lies; its warm
spare, a restarted worker and the other replicas of the rank then map the file read-only and build their
model over it, with no checkpoint read and nothing packed: the weights exist once, and a restart costs
no load.

The file is one the supervisor makes at start, one per tensor-parallel rank, and hands to each worker
process as an inherited descriptor: a nameless ``O_TMPFILE`` in ``$FDCORE_HOME`` (a disk filesystem's page
cache maps it on large folios, where a memfd gets 4 KiB pages unless the kernel's shmem setting allows
huge ones), or a memfd where that filesystem cannot make one. Neither has a name in /dev/shm (nor its
size limit), and the kernel frees it with the last descriptor or mapping, so nothing outlives the tree.
Layout::

    [0, 4096)         header: magic, state, where the manifest lies, a reason
    [2 MiB, ...)      the arrays, each 64-byte aligned, in the order the model packed them
    manifest          msgspec, the model's own format (LlamaModel.weights_manifest)

``flock`` on a descriptor of one's own arbitrates: whoever holds it exclusively and finds the state EMPTY
(nobody built it, or a builder died before publishing) builds; PUBLISHED is immutable from then on;
PRIVATE says every process keeps a copy of its own, and why (the memory would not hold the file, or shared
pages measured slower than private huge pages here: see :func:`shared_pages_cost`).
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import struct

import msgspec
import numpy as np

from fdcore.models.tensors import HUGE_PAGE, zeros_on_huge_pages
from fdcore.models.tuning import fastest

EMPTY, PUBLISHED, PRIVATE = 0, 1, 2
_MAGIC = b"FDCWGT01"
_HEADER = struct.Struct("<8sIIQQQ")  # magic, state, reason length, data end, manifest offset, manifest length
_REASON_AT, _REASON_MAX = 64, 1024
DATA_START = HUGE_PAGE  # the arrays start on a huge-page boundary of the file
ALIGN = 64
# "auto" shares unless the probe finds shared pages this much slower than private huge pages: its noise on a
# busy 2-core host reached +-11 %, and a full SmolLM2 float32 pass cost 1.8-2.4 % more on 4 KiB shared pages there
SLOWER_MARGIN = 0.20


class Stored(msgspec.Struct, tag="a", array_like=True):
    """Where one array lies in the file: byte offset, numpy dtype name ("bfloat16": int16 bits that the
    model holds as a bfloat16 tensor), shape, and whether the model holds it as a Paddle tensor."""

    offset: int
    dtype: str
    shape: list[int]
    tensor: bool = False


class WeightFile:
    """One process's handle on a rank's weight file (see the module's docstring)."""

    def __init__(self, inherited_fd: int):
        # a description of our own: flock locks belong to an open file description, and every worker
        # inherits the same one from the supervisor
        self.fd = os.open(f"/proc/self/fd/{inherited_fd}", os.O_RDWR | os.O_CLOEXEC)
        self.region: mmap.mmap | None = None
        self.manifest: bytes | None = None  # a published file's, once attached
        self.used = DATA_START
        self.full: str | None = None  # why the builder stopped placing arrays here (the memory ran out)

    def close(self) -> None:
        os.close(self.fd)

    # ---------------------------------------------------------------- the lock and the header
    def lock(self) -> None:
        """Exclusive: the state cannot change under us (a builder holds it from check to publish)."""
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def unlock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def state(self) -> tuple[int, str]:
        """(EMPTY, PUBLISHED or PRIVATE, the reason a PRIVATE file gives)."""
        header = os.pread(self.fd, _REASON_AT + _REASON_MAX, 0)
        if len(header) < _HEADER.size:
            return EMPTY, ""
        magic, state, reason_len, *_ = _HEADER.unpack_from(header)
        if magic != _MAGIC or state not in (PUBLISHED, PRIVATE):
            return EMPTY, ""
        return state, header[_REASON_AT : _REASON_AT + reason_len].decode()

    def keep_private(self, reason: str) -> None:
        """Mark the file: every process of the rank keeps its own copy, for ``reason`` (a builder whose
        memory ran out keeps using what it placed here: the file is not shrunk under it)."""
        text = reason.encode()[:_REASON_MAX]
        os.pwrite(self.fd, _HEADER.pack(_MAGIC, PRIVATE, len(text), 0, 0, 0).ljust(_REASON_AT, b"\0") + text, 0)

    # ---------------------------------------------------------------- building
    def begin(self, reserve: int) -> None:
        """Start building (the lock held, the state EMPTY): a writable mapping of ``reserve`` bytes of
        address space; memory is committed piece by piece as :meth:`take` hands it out."""
        os.ftruncate(self.fd, 0)  # (what a builder that died left)
        os.ftruncate(self.fd, reserve)
        self.region = mmap.mmap(self.fd, reserve, flags=mmap.MAP_SHARED)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:  # honoured where shmem huge pages are "advise" or "within_size"
                self.region.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass

    def take(self, nbytes: int) -> np.ndarray | None:
        """``nbytes`` of zeroed memory (uint8) in the file, committed now (a full memory fails here with
        None, never later with SIGBUS); None from then on too: the caller takes private memory."""
        if self.full is not None:
            return None
        start = -(-self.used // ALIGN) * ALIGN
        try:
            os.posix_fallocate(self.fd, start, max(nbytes, 1))
        except OSError as exc:
            self.full = f"the shared weights could not grow past {start >> 20} MiB ({exc.strerror})"
            return None
        self.used = start + nbytes
        return np.frombuffer(self.region, np.uint8, count=nbytes, offset=start)

    def stored(self, array: np.ndarray, tensor: bool = False, dtype: str | None = None) -> Stored:
        """Where ``array`` (a view of memory from :meth:`take`) lies; ValueError for one that is not here."""
        offset = array.ctypes.data - self._address()
        if not (array.flags.c_contiguous and DATA_START <= offset and offset + array.nbytes <= self.used):
            raise ValueError(f"an array of shape {array.shape} is not in the weight file")
        return Stored(offset, dtype or array.dtype.name, list(array.shape), tensor)

    def publish(self, manifest: bytes) -> None:
        """Write the manifest, shrink the file to what it holds, say PUBLISHED; the arrays become read-only
        in this process too (a stray write would change every process's weights: it faults instead)."""
        at = -(-self.used // ALIGN) * ALIGN
        os.ftruncate(self.fd, at + len(manifest))
        os.pwrite(self.fd, manifest, at)
        os.pwrite(self.fd, _HEADER.pack(_MAGIC, PUBLISHED, 0, self.used, at, len(manifest)), 0)
        libc = ctypes.CDLL(None, use_errno=True)
        length = -(-(self.used - DATA_START) // mmap.PAGESIZE) * mmap.PAGESIZE
        if libc.mprotect(ctypes.c_void_p(self._address() + DATA_START), ctypes.c_size_t(length), mmap.PROT_READ) != 0:
            raise OSError(ctypes.get_errno(), "mprotect of the published weights failed")

    # ---------------------------------------------------------------- mapping a published file
    def attach(self) -> bytes:
        """Map a PUBLISHED file read-only; its manifest."""
        magic, state, _, data_end, at, length = _HEADER.unpack(os.pread(self.fd, _HEADER.size, 0))
        if magic != _MAGIC or state != PUBLISHED:
            raise RuntimeError("the weight file is not published")
        self.region = mmap.mmap(self.fd, at + length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        self.used = data_end
        self.manifest = os.pread(self.fd, length, at)
        return self.manifest

    def array(self, stored: Stored) -> np.ndarray:
        """The array ``stored`` describes, over the file's memory (bfloat16: its int16 bits)."""
        dtype = np.dtype(np.int16 if stored.dtype == "bfloat16" else stored.dtype)
        count = int(np.prod(stored.shape, dtype=np.int64))
        return np.frombuffer(self.region, dtype, count=count, offset=stored.offset).reshape(stored.shape)

    def _address(self) -> int:
        return np.frombuffer(self.region, np.uint8, count=1).ctypes.data


def shared_pages_cost(stream, nbytes: int, fd: int | None = None) -> float:
    """How much slower ``stream(array)`` (one pass of a kernel over a float32 array, as a decode step
    streams its weights) runs over the pages of shared file ``fd`` (an EMPTY weight file, locked: the probe
    borrows its first ``nbytes`` and truncates it back to nothing; None: a memfd of its own) than over
    private huge pages (what a private copy gets): the ratio of medians minus one. The file's own pages are
    what counts: a memfd gets huge pages only where the kernel's shmem setting allows them, a disk file's
    page cache large folios on most Linux 6 filesystems, and 4 KiB pages cost some CPUs a lot and others little
    (DESIGN.md, "Weights that exist once", under issue 44): so it is measured, here."""
    count = nbytes // 4
    private = zeros_on_huge_pages((count,), np.float32)
    own = fd is None
    if own:
        fd = os.memfd_create("fdcore-probe", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 0)
        os.posix_fallocate(fd, 0, nbytes)
        region = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                region.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        shared = np.frombuffer(region, np.float32, count=count)
        private[:] = 1.0
        shared[:] = 1.0
        medians = _stream_medians(stream, {"private": private, "shared": shared})
        del shared  # (the mapping closes only once no array views it)
        region.close()
    finally:
        os.ftruncate(fd, 0)
        if own:
            os.close(fd)
    return medians["shared"] / medians["private"] - 1.0


def _stream_medians(stream, arrays: dict[str, np.ndarray]) -> dict[str, float]:
    """The median time of ``stream`` over each of ``arrays``, alternating (fdcore.models.tuning.fastest)."""
    chosen: dict[str, np.ndarray] = {}
    _, medians = fastest(
        tuple(arrays), lambda name: chosen.update(array=arrays[name]), lambda: stream(chosen["array"]), 7
    )
    return medians
