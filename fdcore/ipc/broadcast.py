"""A ring written once and read by several consumers: how a worker group gets its steps.

A :class:`~fdcore.ipc.ring.Ring` has one head; a group of N ranks would need N rings and N copies
of every step. A :class:`BroadcastRing` keeps the producer's side (one tail, one copy of each record,
one publish) and gives each reader its own head, on its own cache line. The producer's room is
what the *slowest* reader has freed: ``capacity - (tail - min(heads))``.

Byte layout (the ring's own, so its record format and hot paths apply unchanged; readers after the
data area)::

    0    | magic "FDCBCST1" | capacity u64 | readers u64 |                 header
    128  | space semaphore name (NUL-padded, 64 B)                          |
    192  | tail u64 | producer_waiting u8 |                                 producer's line
    320  | data: capacity bytes (a power of two)                           |
         | reader 0's head u64 (64 B line) ... reader N-1's head            |
         | reader 0's doorbell name (64 B) ... reader N-1's doorbell name  |

Waking: each reader sleeps on its own :class:`~fdcore.ipc.doorbell.Doorbell` (a worker's is its
inbox's, shared with its other links), whose name the ring records. After publishing, the producer
reads each reader's ``waiting`` byte and posts only to those asleep: one publish, N wake-ups at
most, and no system call for a reader that is spinning or busy. A reader that advances its head
wakes a producer waiting for room (it re-checks the minimum and sleeps again if another reader is
still behind).

Crashes: a reader killed at any instruction leaves its head where it last published it; its
successor attaches with the same index and carries on from there, and the other readers never
notice. A dead reader's head stops the producer only once the ring is full, exactly as a dead
consumer of a plain ring does.
"""

from __future__ import annotations

import mmap
import struct
from typing import Any

import posix_ipc

from fdcore.ipc.doorbell import Doorbell
from fdcore.ipc.ring import Ring
from fdcore.ipc.ring_layout import (
    DEFAULT_CAPACITY,
    DEFAULT_SPIN,
    HEADER_SIZE,
    NAME_FIELD,
    SPACE_NAME_OFF,
    TAIL_OFF,
    RingCorrupted,
    encode_name,
    round_capacity,
)
from fdcore.ipc.shm import map_segment, open_semaphore

MAGIC = b"FDCBCST1"
LINE = 64  # a reader's head line, and a reader's doorbell name field
_FIXED = struct.Struct("8sQQ")


def segment_size(capacity: int, readers: int) -> int:
    return HEADER_SIZE + capacity + 2 * LINE * readers


def _head_word(capacity: int, reader: int) -> int:
    return (HEADER_SIZE + capacity + LINE * reader) // 8


def _bell_name_off(capacity: int, readers: int, reader: int) -> int:
    return HEADER_SIZE + capacity + LINE * readers + NAME_FIELD * reader


class _FanOut:
    """The producer's doorbell: every reader's. Ring's put asks its bell's ``waiting`` byte before
    ringing; a fan-out's byte always says yes, and :meth:`ring` asks each reader's own."""

    mm, offset = b"\x01", 0

    def __init__(self, bells: list[Doorbell]):
        self.bells = bells

    @property
    def rings(self) -> int:
        return sum(bell.rings for bell in self.bells)

    def ring(self) -> None:
        for bell in self.bells:
            bell.ring()

    def close(self) -> None:
        for bell in self.bells:
            bell.close()

    def unlink(self) -> None:
        """Nothing: the readers' doorbells belong to them (their inboxes)."""


class BroadcastRing(Ring):
    """One handle on a broadcast ring: the producer's (``reader is None``) or reader ``reader``'s.

    The producer puts as into a :class:`Ring`; a reader gets as from one (and an
    :class:`~fdcore.ipc.inbox.Inbox` takes a reader as one of its links). A reader handle must not
    put. At most one process may produce and one read each index at a time.
    """

    def __init__(
        self,
        name: str,
        mm: mmap.mmap,
        bell: Doorbell | _FanOut,
        close_bell: bool,
        space: posix_ipc.Semaphore,
        owner: bool,
        spin: float,
        reader: int | None,
    ):
        _, capacity, readers = _FIXED.unpack_from(mm, 0)
        self.reader = reader
        self.readers = readers
        self._head_words = [_head_word(capacity, i) for i in range(readers)]
        self._head_word = self._head_words[reader or 0]
        super().__init__(name, mm, bell, close_bell, space, owner, spin)  # type: ignore[arg-type]  # (a producer's bell fans out)

    # ----------------------------------------------------------------- set-up
    @classmethod
    def create(  # type: ignore[override]  # (a broadcast ring takes its readers)
        cls, reader_bells: list[str], capacity: int = DEFAULT_CAPACITY, *, name: str, spin: float = DEFAULT_SPIN
    ) -> BroadcastRing:
        """Create a ring read by ``len(reader_bells)`` readers, reader i woken through the doorbell
        named ``reader_bells[i]`` (which must exist). This handle owns the ring and may produce."""
        if not reader_bells:
            raise ValueError(f"{name}: a broadcast ring needs at least one reader")
        capacity = round_capacity(capacity)
        readers = len(reader_bells)
        mm = map_segment(name, segment_size(capacity, readers))
        try:
            space = open_semaphore(name, create=True)
        except BaseException:
            mm.close()
            posix_ipc.unlink_shared_memory(name)
            raise
        try:
            _FIXED.pack_into(mm, 0, MAGIC, capacity, readers)
            mm[SPACE_NAME_OFF : SPACE_NAME_OFF + NAME_FIELD] = encode_name(name)
            for i, bell in enumerate(reader_bells):
                off = _bell_name_off(capacity, readers, i)
                mm[off : off + NAME_FIELD] = encode_name(bell)
            fan_out = _FanOut([Doorbell.standalone(bell, create=False) for bell in reader_bells])
        except BaseException:
            mm.close()
            space.close()
            posix_ipc.unlink_shared_memory(name)
            posix_ipc.unlink_semaphore(name)
            raise
        return cls(name, mm, fan_out, True, space, owner=True, spin=spin, reader=None)

    @classmethod
    def attach(  # type: ignore[override]  # (a broadcast ring takes its readers)
        cls, name: str, *, reader: int | None = None, doorbell: Doorbell | None = None, spin: float = DEFAULT_SPIN
    ) -> BroadcastRing:
        """Open an existing ring as its producer (``reader=None``) or as reader ``reader``, woken
        through ``doorbell`` (default: the doorbell the ring names for that reader)."""
        mm = map_segment(name, None)
        opened: list[Any] = [mm]  # closed again if the handle cannot be made
        try:
            bell_names = cls._validate(name, mm)
            if reader is not None and not 0 <= reader < len(bell_names):
                raise ValueError(
                    f"{name}: reader {reader} out of range: the ring has "
                    f"{len(bell_names)} readers (0..{len(bell_names) - 1})"
                )
            space = open_semaphore(name, create=False)
            opened.append(space)
            bell: Doorbell | _FanOut
            if reader is None:
                for bell_name in bell_names:
                    opened.append(Doorbell.standalone(bell_name, create=False))
                bell, close_bell = _FanOut(opened[2:]), True
            elif doorbell is None:
                bell, close_bell = Doorbell.standalone(bell_names[reader], create=False), True
            else:
                bell, close_bell = doorbell, False
        except BaseException:
            for handle in reversed(opened):
                handle.close()
            raise
        return cls(name, mm, bell, close_bell, space, owner=False, spin=spin, reader=reader)

    @staticmethod
    def _validate(name: str, mm: mmap.mmap) -> list[str]:
        """Check the header and the counters; the readers' doorbell names."""
        if len(mm) < HEADER_SIZE:
            raise RingCorrupted(f"{name}: segment of {len(mm)} bytes is too small for a broadcast ring")
        magic, capacity, readers = _FIXED.unpack_from(mm, 0)
        if magic != MAGIC:
            raise RingCorrupted(f"{name}: bad magic {magic!r} (expected {MAGIC!r})")
        if (
            capacity < 64
            or capacity & (capacity - 1)
            or not 0 < readers < 1 << 16
            or segment_size(capacity, readers) > len(mm)
        ):
            raise RingCorrupted(
                f"{name}: capacity {capacity} and {readers} readers do not fit a {len(mm)}-byte segment"
            )
        tail = struct.unpack_from("Q", mm, TAIL_OFF)[0]
        for i in range(readers):
            head = struct.unpack_from("Q", mm, _head_word(capacity, i) * 8)[0]
            if not 0 <= tail - head <= capacity or (tail | head) & 7:
                raise RingCorrupted(f"{name}: reader {i}'s head {head} and tail {tail} are inconsistent")
        fields = [
            bytes(mm[o : o + NAME_FIELD]).rstrip(b"\0")
            for o in [SPACE_NAME_OFF, *(_bell_name_off(capacity, readers, i) for i in range(readers))]
        ]
        try:
            space, *bells = (field.decode("ascii") for field in fields)
        except UnicodeDecodeError:
            raise RingCorrupted(f"{name}: semaphore names are not text") from None
        if space != name or not all(bells):
            raise RingCorrupted(f"{name}: semaphore names {space!r}, {bells!r} do not belong to it")
        return bells

    # -------------------------------------------------------------- producer
    def _peek_head(self) -> int:
        """The slowest reader's head: what bounds the producer's room."""
        words = self._words
        return min(words[i] for i in self._head_words)

    def heads(self) -> list[int]:
        """Every reader's published head (statistics, tests)."""
        return [self._words[i] for i in self._head_words]

    def __repr__(self) -> str:
        role = "producer" if self.reader is None else f"reader {self.reader}"
        return f"<BroadcastRing {self.name} {role} of {self.readers} capacity={self._capacity}>"
