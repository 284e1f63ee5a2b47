"""The health board: one shared-memory slot per actor, written by the actor, read by the supervisor.

Each slot is eight native u64 words (one cache line), written with single
aligned stores (a memoryview cast, never ``struct.pack_into``, which zeroes
first)::

    0 pid   1 state   2 heartbeat (monotonic ns)   3 progress (messages handled)
    4 busy (1 while it has work queued)   5 generation (restarts)
    6 loading (permille of start-up done, e.g. weight files read)   7 restarts of this child

``heartbeat`` moves whenever the actor's loop turns (at least every
``heartbeat_interval`` when idle); ``progress`` moves whenever it finishes a
unit of work. The supervisor calls an actor hung when the heartbeat stops, or
when it is busy and progress stops (:func:`stall_reason`).
"""

from __future__ import annotations

import enum
import mmap

import posix_ipc

from fdcore.ipc.shm import map_segment, unlink_quietly

WORDS_PER_SLOT = 8
PID, STATE, HEARTBEAT, PROGRESS, BUSY, GENERATION, LOADING, RESTARTS = range(8)


class State(enum.IntEnum):
    EMPTY = 0
    STARTING = 1
    READY = 2
    STOPPING = 3
    STOPPED = 4


class HealthBoard:
    """The shared array of slots (the supervisor creates and unlinks it)."""

    def __init__(self, name: str, mm: mmap.mmap, owner: bool):
        self.name = name
        self.owner = owner
        self._mm = mm
        self._words = memoryview(mm).cast("Q")
        self.slots = len(self._words) // WORDS_PER_SLOT

    @classmethod
    def create(cls, name: str, slots: int) -> "HealthBoard":
        return cls(name, map_segment(name, slots * WORDS_PER_SLOT * 8), owner=True)

    @classmethod
    def attach(cls, name: str) -> "HealthBoard":
        return cls(name, map_segment(name, None), owner=False)

    def read(self, slot: int, word: int) -> int:
        return self._words[slot * WORDS_PER_SLOT + word]

    def write(self, slot: int, word: int, value: int) -> None:
        self._words[slot * WORDS_PER_SLOT + word] = value

    def reset(self, slot: int, generation: int) -> None:
        for word in range(WORDS_PER_SLOT):
            self.write(slot, word, 0)
        self.write(slot, GENERATION, generation)

    def close(self) -> None:
        self._words.release()
        self._mm.close()

    def unlink(self) -> None:
        unlink_quietly(posix_ipc.unlink_shared_memory, self.name)


def stall_reason(heartbeat_ns: int, progress: int, busy: bool, last_progress: int,
                 progress_since_ns: int, now_ns: int, hang_timeout_ns: int) -> str | None:
    """Why an actor counts as hung, or None. Pure: the supervisor passes what it saw."""
    if heartbeat_ns and now_ns - heartbeat_ns > hang_timeout_ns:
        return f"no heartbeat for {(now_ns - heartbeat_ns) / 1e9:.1f} s"
    if busy and progress == last_progress and now_ns - progress_since_ns > hang_timeout_ns:
        return f"busy without progress for {(now_ns - progress_since_ns) / 1e9:.1f} s"
    return None
