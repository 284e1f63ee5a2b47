"""Small helpers over posix_ipc: map a segment, open a semaphore, unlink quietly."""

from __future__ import annotations

import mmap

import posix_ipc

MODE = 0o600


def open_semaphore(name: str, create: bool) -> posix_ipc.Semaphore:
    """Open (or create, mode 0600, value 0) a named POSIX semaphore."""
    if create:
        return posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=MODE, initial_value=0)
    return posix_ipc.Semaphore(name)


def map_segment(name: str, create_size: int | None) -> mmap.mmap:
    """Map a POSIX shared-memory segment (creating it, mode 0600, when a size is given)."""
    if create_size is None:
        shm = posix_ipc.SharedMemory(name)
    else:
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=MODE, size=create_size)
    try:
        return mmap.mmap(shm.fd, shm.size)
    finally:
        shm.close_fd()


def unlink_quietly(unlink, name: str) -> None:
    """``unlink(name)``, ignoring a name that is already gone."""
    try:
        unlink(name)
    except posix_ipc.ExistentialError:
        pass
