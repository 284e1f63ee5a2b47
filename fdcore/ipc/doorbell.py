"""A doorbell: how a sleeping consumer is woken by producers that never lock.

A doorbell is a ``waiting`` byte in shared memory plus a POSIX semaphore. The
consumer announces it is about to sleep by setting ``waiting``, re-checks its
rings, and only then blocks on the semaphore. A producer, after publishing a
record, reads ``waiting``; when it is set it clears it and posts the semaphore.
Producers that see ``waiting == 0`` pay one byte read and a barrier, and no
system call.

NOTE: this is Dekker's pattern (each side stores its own word, then loads the
other's). It needs a full barrier between the store and the load on *both*
sides, because a store may still sit in the CPU's store buffer while a later
load runs. Python has no barrier instruction; an uncontended lock round trip
runs locked instructions, which are one (``full_barrier``, ~150 ns). The
sleeper issues it after setting ``waiting``, and a record's producer
(``Ring.put``) after publishing its tail: then one of the two always sees the
other's store, no post is lost, and a sleeper blocks until it is woken
(``first_nap=MAX_NAP``). Before, only the sleeper paid and its first nap was a
short ``SETTLE`` wait to catch a raced post; every sleep longer than that cost
a second wake-up, ~6 a step of the actor tree, far more than the producers'
barriers. The reverse direction (a consumer freeing space for a producer that
waits on a full ring: rare, and ``get`` is hotter than ``put``) keeps the
sleeper-only barrier and the ``SETTLE`` nap. Naps stay bounded (``MAX_NAP``)
either way, so an idle consumer wakes once a second, ~0.01% of a core.
"""

from __future__ import annotations

import mmap
import threading
import time
from collections.abc import Callable

import posix_ipc

from fdcore.ipc.shm import map_segment, open_semaphore, unlink_quietly

SETTLE = 200e-6  # first nap: longer than any store-buffer drain
MAX_NAP = 1.0  # longest nap; the sleeper re-checks after each
SEGMENT_SIZE = 64
_barrier_lock = threading.Lock()


def full_barrier() -> None:
    """A full memory barrier: a lock round trip runs locked (serialising) instructions."""
    _barrier_lock.acquire()
    _barrier_lock.release()


def sleep_until(
    mm: mmap.mmap,
    offset: int,
    semaphore: posix_ipc.Semaphore,
    ready: Callable[[], bool],
    deadline: float | None,
    first_nap: float = SETTLE,
) -> bool:
    """Sleep on ``semaphore`` with the ``waiting`` byte at ``mm[offset]`` set.

    Returns True as soon as ``ready()`` holds, False once ``deadline``
    (``time.monotonic()`` seconds; None: never) has passed. ``first_nap``: SETTLE
    where the waker issues no barrier before reading ``waiting``, MAX_NAP where it does.
    """
    nap = first_nap
    try:
        while True:
            mm[offset] = 1
            full_barrier()
            if ready():
                return True
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            try:
                semaphore.acquire(nap if remaining is None else min(nap, remaining))
            except (posix_ipc.BusyError, posix_ipc.SignalError):
                pass  # timed out, or a signal whose handler returned (posix_ipc ran it; only a
                # KeyboardInterrupt it raised comes through, every other exception is lost)
            nap = MAX_NAP
            if ready():
                return True
    finally:
        mm[offset] = 0


class Doorbell:
    """The ``waiting`` word (one byte at ``offset`` of ``mm``) and its semaphore."""

    __slots__ = ("mm", "offset", "semaphore", "name", "owns_mapping", "rings")

    def __init__(self, mm: mmap.mmap, offset: int, semaphore: posix_ipc.Semaphore, owns_mapping: bool):
        self.mm = mm
        self.offset = offset
        self.semaphore = semaphore
        self.name: str = semaphore.name
        self.owns_mapping = owns_mapping  # close() also unmaps ``mm``
        self.rings = 0  # posts made through this handle (statistics)

    @classmethod
    def embedded(cls, mm: mmap.mmap, offset: int, sem_name: str, create: bool) -> Doorbell:
        """A doorbell whose word lives in someone else's segment (a ring's)."""
        return cls(mm, offset, open_semaphore(sem_name, create), owns_mapping=False)

    @classmethod
    def standalone(cls, name: str, create: bool) -> Doorbell:
        """A doorbell with its own small segment (shared by an inbox's rings)."""
        mm = map_segment(name, SEGMENT_SIZE if create else None)
        try:
            return cls(mm, 0, open_semaphore(name, create), owns_mapping=True)
        except BaseException:
            mm.close()
            if create:
                posix_ipc.unlink_shared_memory(name)
            raise

    def ring(self) -> None:
        """Producer side, after publishing and a full_barrier(): wake the consumer if it sleeps."""
        if self.mm[self.offset]:
            self.mm[self.offset] = 0
            self.rings += 1
            self.semaphore.release()

    def wait(self, ready: Callable[[], bool], deadline: float | None) -> bool:
        """Consumer side: sleep until ``ready()`` or ``deadline`` (see :func:`sleep_until`)."""
        return sleep_until(self.mm, self.offset, self.semaphore, ready, deadline, first_nap=MAX_NAP)

    def close(self) -> None:
        self.semaphore.close()
        if self.owns_mapping:
            self.mm.close()

    def unlink(self) -> None:
        """Remove the semaphore's name (and the segment's, for a standalone bell)."""
        unlink_quietly(posix_ipc.unlink_semaphore, self.name)
        if self.owns_mapping:
            unlink_quietly(posix_ipc.unlink_shared_memory, self.name)
