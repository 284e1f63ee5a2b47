"""The health board: one shared-memory slot per actor, written by the actor, read by the supervisor.

Each slot is sixteen native u64 words (two cache lines), written with single
aligned stores (a memoryview cast, never ``struct.pack_into``, which zeroes
first)::

    0 pid   1 state   2 heartbeat (monotonic ns)   3 progress (messages handled)
    4 busy (1 while it has work queued)   5 generation (restarts)
    6 loading (permille of start-up done, e.g. weight files read)   7 restarts of this child
    8 grace (monotonic ns): until then the actor is inside one call that may run long without a tick
      (a worker's forward pass, allowed what fdcore.core.step_cost expects of it); 9-15 unused

``heartbeat`` moves whenever the actor's loop turns (at least every
``heartbeat_interval`` when idle); ``progress`` moves whenever it finishes a
unit of work. The supervisor calls an actor hung when the heartbeat stops, or
when it is busy and progress stops (:class:`StallWatch`), for ``hang_timeout``
counted from the end of its grace.

After the slots, one word per slot says how its warm spare stands (a worker's
standby writes it, the slot's own words being the active actor's): none,
loading or warm (``SPARE_*``); then one word the supervisor sets once the tree
is ready (its first spares warm among it), which ``/health`` waits for.
"""

from __future__ import annotations

import enum
import mmap

import posix_ipc

from fdcore.ipc.shm import map_segment, unlink_quietly

WORDS_PER_SLOT = 16
PID, STATE, HEARTBEAT, PROGRESS, BUSY, GENERATION, LOADING, RESTARTS, GRACE = range(9)
SPARE_NONE, SPARE_LOADING, SPARE_WARM = 0, 1, 2
SPARE_NAMES = {SPARE_NONE: "none", SPARE_LOADING: "loading", SPARE_WARM: "warm"}


class State(enum.IntEnum):
    EMPTY = 0
    STARTING = 1
    READY = 2
    STOPPING = 3
    STOPPED = 4


def board_bytes(slots: int) -> int:
    """The board's size: the slots, a spare word per slot, the tree's ready word."""
    return (slots * (WORDS_PER_SLOT + 1) + 1) * 8


class HealthBoard:
    """The shared array of slots (the supervisor creates and unlinks it)."""

    def __init__(self, name: str, mm: mmap.mmap, owner: bool):
        self.name = name
        self.owner = owner
        self._mm = mm
        self._words = memoryview(mm).cast("Q")
        self.slots = len(self._words) // (WORDS_PER_SLOT + 1)

    @classmethod
    def create(cls, name: str, slots: int) -> HealthBoard:
        return cls(name, map_segment(name, board_bytes(slots)), owner=True)

    @classmethod
    def attach(cls, name: str) -> HealthBoard:
        return cls(name, map_segment(name, None), owner=False)

    def read(self, slot: int, word: int) -> int:
        return self._words[slot * WORDS_PER_SLOT + word]

    def write(self, slot: int, word: int, value: int) -> None:
        self._words[slot * WORDS_PER_SLOT + word] = value

    def spare(self, slot: int) -> int:
        """How the slot's warm spare stands (SPARE_NONE, SPARE_LOADING, SPARE_WARM)."""
        return self._words[self.slots * WORDS_PER_SLOT + slot]

    def set_spare(self, slot: int, state: int) -> None:
        self._words[self.slots * WORDS_PER_SLOT + slot] = state

    def tree_ready(self) -> bool:
        """Whether the supervisor has said the tree is ready (set once, at its start)."""
        return bool(self._words[self.slots * (WORDS_PER_SLOT + 1)])

    def set_tree_ready(self) -> None:
        self._words[self.slots * (WORDS_PER_SLOT + 1)] = 1

    def reset(self, slot: int, generation: int) -> None:
        for word in range(WORDS_PER_SLOT):
            self.write(slot, word, 0)
        self.write(slot, GENERATION, generation)

    def close(self) -> None:
        self._words.release()
        self._mm.close()

    def unlink(self) -> None:
        unlink_quietly(posix_ipc.unlink_shared_memory, self.name)


def silence_ns(heartbeat_ns: int, grace_ns: int, now_ns: int) -> int:
    """How long an actor has been silent: 0 inside its grace, else since its last tick or the end of its
    grace, whichever came later."""
    return 0 if now_ns < grace_ns else now_ns - max(heartbeat_ns, grace_ns)


class StallWatch:
    """Hang detection's memory of one actor between looks (pure: the supervisor passes what it
    reads and the time). Busy-without-progress is counted from the last look that saw progress *or
    saw the actor idle*: an actor idle for a minute that has just taken a message owes nothing yet
    (counting from its last progress called a cache manager hung the moment its first message
    arrived after a long model load). The first look only sets the baseline: an actor's start-up
    (the supervisor does not look before it is ready, and a tree may take a minute to load) owes
    nothing either."""

    def __init__(self, now_ns: int):
        self.progress: int | None = None  # not looked at yet
        self.owed_since = now_ns

    def look(
        self, heartbeat_ns: int, progress: int, busy: bool, now_ns: int, hang_timeout_ns: int, grace_ns: int = 0
    ) -> str | None:
        """Why the actor counts as hung now, or None. Inside its grace (``now_ns < grace_ns``) it owes
        nothing; past it, its silence counts from the grace's end at the earliest."""
        if progress != self.progress or not busy or now_ns < grace_ns:  # (None, the first look, differs from any count)
            self.progress, self.owed_since = progress, now_ns
        if heartbeat_ns and (quiet := silence_ns(heartbeat_ns, grace_ns, now_ns)) > hang_timeout_ns:
            return f"no heartbeat for {quiet / 1e9:.1f} s"
        if busy and (owed := now_ns - max(self.owed_since, grace_ns)) > hang_timeout_ns:
            return f"busy without progress for {owed / 1e9:.1f} s"
        return None
