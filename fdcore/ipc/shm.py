"""Small helpers over posix_ipc: map a segment, open a semaphore, unlink quietly, measure /dev/shm.

A segment is committed when it is created (``posix_fallocate``): /dev/shm is a tmpfs, and a segment
made only with ``ftruncate`` is sparse, so a full /dev/shm (too small, or filled by someone else later)
would surface as SIGBUS in whichever process first touches a page, long after start-up said ready.
Committed, every page exists from the start, and a lack of room is one clear error at creation.
"""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Callable

import posix_ipc

MODE = 0o600
SHM_DIR = "/dev/shm"
PAGE = mmap.PAGESIZE


class NoSharedMemory(OSError):
    """/dev/shm has no room for a segment."""


def open_semaphore(name: str, create: bool) -> posix_ipc.Semaphore:
    """Open (or create, mode 0600, value 0) a named POSIX semaphore."""
    if create:
        return posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=MODE, initial_value=0)
    return posix_ipc.Semaphore(name)


def map_segment(name: str, create_size: int | None) -> mmap.mmap:
    """Map a POSIX shared-memory segment; with a size, create it (mode 0600) with every page committed,
    or raise :class:`NoSharedMemory` (nothing left behind) when /dev/shm cannot hold it."""
    if create_size is None:
        shm = posix_ipc.SharedMemory(name)
    else:
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=MODE, size=create_size)
        try:
            os.posix_fallocate(shm.fd, 0, create_size)
        except OSError as exc:
            shm.close_fd()
            unlink_quietly(posix_ipc.unlink_shared_memory, name)
            if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise NoSharedMemory(
                    errno.ENOSPC, f"{SHM_DIR} has no room for {name} ({create_size:,} bytes; {free_bytes():,} free)"
                ) from None
            raise
    try:
        return mmap.mmap(shm.fd, shm.size)
    finally:
        shm.close_fd()


def segment_bytes(size: int) -> int:
    """What a segment of ``size`` bytes takes from /dev/shm (whole pages)."""
    return -(-size // PAGE) * PAGE


def free_bytes(shm_dir: str = SHM_DIR) -> int:
    """Bytes an unprivileged process may still create in ``shm_dir``."""
    stat = os.statvfs(shm_dir)
    return stat.f_bavail * stat.f_frsize


def unlink_quietly(unlink: Callable[[str], object], name: str) -> None:
    """``unlink(name)``, ignoring a name that is already gone."""
    try:
        unlink(name)
    except posix_ipc.ExistentialError:
        pass
