"""A bounded single-producer / single-consumer ring of byte records in POSIX shared memory.

The segment's bytes (the header, the records) are described in :mod:`fdcore.ipc.ring_layout`.

Ordering invariants:

1. Only the producer writes ``tail`` and the data area between ``tail`` and
   ``head + capacity``; only the consumer writes ``head``.
2. The producer writes a record's header and payload *before* it publishes the
   new ``tail``; the consumer reads ``tail`` *before* the records below it.
   (x86-64 keeps stores in order and loads in order, which this relies on;
   see ``fdcore.ipc.ring_layout``.)
3. So a record is visible only once it is whole: a producer killed at any
   instruction leaves at most an unpublished partial record, which no one
   reads. Nothing is ever locked, so a dead peer can wedge nothing.
4. ``0 <= tail - head <= capacity`` always; the consumer validates it (and each
   header) and raises :class:`RingCorrupted` instead of reading out of bounds.
5. The consumer publishes ``head`` after each ``get`` (once per batch for
   ``get_many``), so the producer never sees less room than there is once a
   call has returned.
6. A peer that is not trusted (a client process on its own link) can write any
   byte of the segment. The other end opens the ring as its creator made it
   (:meth:`Ring.attach` with ``trust_header=False``: the header is not read),
   checks every shared word before use (invariant 4), and on
   :class:`RingCorrupted` empties the ring from its side: a consumer sets
   ``tail`` to its head (:meth:`Ring.drop_published`), a producer ``head`` to its
   tail (:meth:`Ring.drop_unread`). That is the one place where an end writes
   the other's word: the peer broke the protocol, so what it wrote is void, and
   the link is consistent again for its next user.

Waking: the consumer sleeps on a :class:`~fdcore.ipc.doorbell.Doorbell` (its
own, or one shared by every ring of an :class:`~fdcore.ipc.inbox.Inbox`); a
producer blocked on a full ring sleeps on the ring's ``space`` semaphore.
"""

from __future__ import annotations

import mmap
import struct
import time
from typing import TYPE_CHECKING, NoReturn, cast

import posix_ipc

from fdcore.ipc import names
from fdcore.ipc.doorbell import Doorbell
from fdcore.ipc.ring_layout import (
    BELL_NAME_OFF,
    CHECK_MASK,
    CONSUMER_WAITING_OFF,
    DEFAULT_CAPACITY,
    DEFAULT_SPIN,
    FIXED_STRUCT,
    HEAD,
    HEAD_OFF,
    HEADER_SIZE,
    MAGIC,
    NAME_FIELD,
    PRODUCER_WAITING_OFF,
    RECORD_HEADER,
    RECORD_STRUCT,
    SPACE_NAME_OFF,
    TAIL,
    TAIL_OFF,
    RingClosed,
    RingCorrupted,
    RingEmpty,
    RingError,
    RingStatistics,
    encode_name,
    round_capacity,
)
from fdcore.ipc.ring_producer import Producer
from fdcore.ipc.shm import map_segment, open_semaphore, unlink_quietly

if TYPE_CHECKING:
    from collections.abc import Callable


class Ring(Producer):
    r"""One end (producer or consumer) of a shared-memory ring.

    Create with :meth:`create` (the owner, who finally :meth:`unlink`\ s) and
    open the other end with :meth:`attach`. Any handle may produce or consume,
    but at most one process may produce and one consume at a time.
    """

    _head_word = HEAD  # the consumer's head (a BroadcastRing's readers each have their own)

    def __init__(
        self,
        name: str,
        mm: mmap.mmap,
        bell: Doorbell,
        close_bell: bool,
        space: posix_ipc.Semaphore,
        owner: bool,
        spin: float,
        capacity: int | None = None,
    ):
        self.name = name
        self.owner = owner
        self.spin = spin
        self._mm = mm
        self._words = words = memoryview(mm).cast("Q")
        self._bell = bell
        self._bell_mm, self._bell_off = bell.mm, bell.offset
        self._close_bell = close_bell
        self._space = space
        self._capacity = capacity = capacity or FIXED_STRUCT.unpack_from(mm, 0)[1]
        self._mask = capacity - 1
        self.max_record = capacity - RECORD_HEADER
        self._closed = False
        # Producer state: ``_tail`` is authoritative, ``_head_seen`` a lower bound of head.
        self._tail = words[TAIL]
        self._head_seen = self._peek_head()
        # Consumer state: ``_head`` is authoritative, ``_tail_seen`` the last tail read.
        self._head = self._head_published = words[self._head_word]
        self._tail_seen = self._head
        self._producer_waits = self._consumer_waits = 0
        self._puts = self._gets = 0

    # ----------------------------------------------------------------- set-up
    @classmethod
    def create(
        cls,
        capacity: int = DEFAULT_CAPACITY,
        *,
        name: str | None = None,
        doorbell: Doorbell | None = None,
        spin: float = DEFAULT_SPIN,
    ) -> Ring:
        """Create a new ring; this handle owns it and must :meth:`unlink` it.

        ``capacity`` is rounded up to a power of two. ``name`` defaults to a
        fresh ``/fdcore-<instance id>-ring``; ``doorbell`` lets several rings
        share one consumer wake-up (see :class:`~fdcore.ipc.inbox.Inbox`).
        """
        capacity = round_capacity(capacity)
        name = name or names.object_name(names.new_instance_id(), "ring")
        mm = map_segment(name, HEADER_SIZE + capacity)
        created: list[Callable[[], None]] = [lambda: posix_ipc.unlink_shared_memory(name)]
        try:
            space = open_semaphore(name, create=True)
            created.append(lambda: posix_ipc.unlink_semaphore(name))
            bell, close_bell = doorbell, False
            if bell is None:
                bell = Doorbell.embedded(mm, CONSUMER_WAITING_OFF, name + ".bell", create=True)
                close_bell = True
            FIXED_STRUCT.pack_into(mm, 0, MAGIC, capacity)
            mm[BELL_NAME_OFF : BELL_NAME_OFF + NAME_FIELD] = encode_name(bell.name)
            mm[SPACE_NAME_OFF : SPACE_NAME_OFF + NAME_FIELD] = encode_name(name)
        except BaseException:
            mm.close()
            for undo in created:
                undo()
            raise
        return cls(name, mm, bell, close_bell, space, owner=True, spin=spin)

    @classmethod
    def attach(
        cls,
        name: str,
        *,
        doorbell: Doorbell | None = None,
        spin: float = DEFAULT_SPIN,
        trust_header: bool = True,
        bell_name: str | None = None,
    ) -> Ring:
        """Open an existing ring by name (validated first; never unlinks it).

        With ``trust_header=False`` the peer may not be trusted (invariant 6): the header is not read
        but the ring is opened as its creator made it, its capacity the largest power of two the
        segment holds, its doorbell ``doorbell`` or the semaphore ``bell_name``; a head and tail that
        do not fit each other are cleared.
        """
        mm = map_segment(name, None)
        try:
            if trust_header:
                bell_name, space_name = cls._validate_header(name, mm)
                capacity = None  # (the header's)
            elif len(mm) < HEADER_SIZE + 64:
                raise RingCorrupted(f"{name}: segment of {len(mm)} bytes is too small for a ring")
            else:
                space_name, capacity = name, 1 << ((len(mm) - HEADER_SIZE).bit_length() - 1)
            space = open_semaphore(space_name, create=False)
            close_bell = doorbell is None
            if doorbell is None and bell_name == name + ".bell":
                doorbell = Doorbell.embedded(mm, CONSUMER_WAITING_OFF, bell_name, create=False)
            elif doorbell is None:
                doorbell = Doorbell.standalone(bell_name, create=False)  # type: ignore[arg-type]  # (an attach without a doorbell names its bell)
        except BaseException:
            mm.close()
            raise
        ring = cls(name, mm, doorbell, close_bell, space, owner=False, spin=spin, capacity=capacity)
        if not trust_header:
            ring.resync()
        return ring

    def resync(self) -> None:
        """Take this end's position from the shared words again: after the other end emptied the ring
        (invariant 6), so that a producer writes where its consumer reads. No change when nothing
        happened (each end's words are its own); words that do not fit each other are cleared first."""
        words = self._words
        tail, head = words[TAIL], words[self._head_word]
        if not 0 <= tail - head <= self._capacity or (tail | head) & 7:
            words[self._head_word] = words[TAIL] = head & ~7
        self._tail = self._words[TAIL]
        self._head_seen = self._peek_head()
        self._head = self._head_published = self._tail_seen = self._words[self._head_word]

    def rewrite_header(self) -> None:
        """Write the header as the creator did (magic, capacity, the semaphores' names): repair of a
        ring whose untrusted peer wrote over it, for whoever uses it next."""
        FIXED_STRUCT.pack_into(self._mm, 0, MAGIC, self._capacity)
        self._mm[BELL_NAME_OFF : BELL_NAME_OFF + NAME_FIELD] = encode_name(self._bell.name)
        self._mm[SPACE_NAME_OFF : SPACE_NAME_OFF + NAME_FIELD] = encode_name(self.name)

    def drop_published(self) -> int:
        """Consumer side, after :class:`RingCorrupted` (invariant 6): drop whatever the producer
        published, and make the ring empty and consistent again (``tail := head``). Returns the bytes
        dropped (0 where the producer's tail made no sense)."""
        head = self._head & ~7
        published = self._words[TAIL]
        self._head = self._head_published = self._tail_seen = head
        self._words[self._head_word] = head
        self._words[TAIL] = head
        return published - head if 0 <= published - head <= self._capacity else 0

    def drop_unread(self) -> None:
        """Producer side, after :class:`RingCorrupted` (invariant 6): give up whatever the consumer has
        not read, and make the ring empty and consistent again (``head := tail``)."""
        tail = self._tail & ~7
        self._tail = self._head_seen = tail
        self._words[TAIL] = tail
        self._words[self._head_word] = tail

    @staticmethod
    def _validate_header(name: str, mm: mmap.mmap) -> tuple[str, str]:
        if len(mm) < HEADER_SIZE + 64:
            raise RingCorrupted(f"{name}: segment of {len(mm)} bytes is too small for a ring")
        magic, capacity = FIXED_STRUCT.unpack_from(mm, 0)
        if magic != MAGIC:
            raise RingCorrupted(f"{name}: bad magic {magic!r} (expected {MAGIC!r})")
        if capacity < 64 or capacity & (capacity - 1) or HEADER_SIZE + capacity > len(mm):
            raise RingCorrupted(f"{name}: capacity {capacity} does not fit a {len(mm)}-byte segment")
        tail, head = (struct.unpack_from("Q", mm, off)[0] for off in (TAIL_OFF, HEAD_OFF))
        if not 0 <= tail - head <= capacity or (tail | head) & 7:
            raise RingCorrupted(f"{name}: head {head} and tail {tail} are inconsistent")
        fields = [bytes(mm[o : o + NAME_FIELD]).rstrip(b"\0") for o in (BELL_NAME_OFF, SPACE_NAME_OFF)]
        try:
            bell, space = (f.decode("ascii") for f in fields)
        except UnicodeDecodeError:
            raise RingCorrupted(f"{name}: semaphore names are not text") from None
        if space != name or not (bell == name + ".bell" or name.startswith(bell + ".")):
            raise RingCorrupted(f"{name}: semaphore names {bell!r}, {space!r} do not belong to it")
        return bell, space

    # --------------------------------------------------------------- consumer
    def get_nowait(self) -> bytes:
        """Take the oldest record or raise :class:`RingEmpty` at once."""
        data = self._try_get()
        if data is None:
            raise RingEmpty(self.name)
        return data

    def get(self, timeout: float | None = None) -> bytes:
        """Take the oldest record, waiting up to ``timeout`` seconds (None: forever)."""
        data = self._try_get()
        while data is None:
            if not self.wait_readable(timeout):
                raise RingEmpty(f"{self.name}: no record within {timeout} s")
            data = self._try_get()
        return data

    def get_many_nowait(self, max_records: int | None = None) -> list[bytes]:
        """Take every available record (at most ``max_records``); [] when empty. Records before a
        corrupted one are returned; the call after them raises :class:`RingCorrupted`.

        Reads ``tail`` once and publishes ``head`` once: ``_try_get`` inlined.
        """
        head = self._head
        tail = self._read_tail()
        if head == tail:
            return []
        mm, cap, mask, unpack = self._mm, self._capacity, self._mask, RECORD_STRUCT.unpack_from
        limit = (1 << 62) if max_records is None else max_records
        out: list[bytes] = []
        while head < tail and len(out) < limit:
            pos = head & mask
            off = HEADER_SIZE + pos
            n, check = unpack(mm, off)
            size = (n + 15) & ~7
            if check != (head >> 3) & CHECK_MASK or head + size > tail:
                if out:  # the whole records before it first; the next call raises
                    break
                self._head = head
                self._raise_corrupted(head, n, check)
            if pos + size <= cap:
                out.append(mm[off + 8 : off + 8 + n])
            else:
                out.append(self._read_split(pos + 8, n))
            head += size
        self._head = head
        self._gets += len(out)
        self._publish_head()
        return out

    def get_many(self, max_records: int | None = None, timeout: float | None = None) -> list[bytes]:
        """Wait up to ``timeout`` for at least one record, then drain like ``get_many_nowait``."""
        out = self.get_many_nowait(max_records)
        while not out:
            if not self.wait_readable(timeout):
                raise RingEmpty(f"{self.name}: no record within {timeout} s")
            out = self.get_many_nowait(max_records)
        return out

    def readable(self) -> bool:
        """True when a record is waiting."""
        return self._head != self._tail_seen or self._read_tail() != self._head

    def wait_readable(self, timeout: float | None = None) -> bool:
        """Spin for ``spin`` seconds, then sleep on the doorbell until a record is readable."""
        if self.readable():
            return True
        self._publish_head()
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        spin_end = now + min(self.spin, timeout if timeout is not None else self.spin)
        while time.monotonic() < spin_end:
            if self.readable():
                return True
        self._consumer_waits += 1
        return self._bell.wait(self.readable, deadline)

    def _try_get(self) -> bytes | None:
        """Read one record; None when empty. The hot path: kept flat."""
        head = self._head
        if head == self._tail_seen and head == self._read_tail():
            return None
        mm = self._mm
        pos = head & self._mask
        off = HEADER_SIZE + pos
        n, check = RECORD_STRUCT.unpack_from(mm, off)
        size = (n + 15) & ~7
        if check != (head >> 3) & CHECK_MASK or head + size > self._tail_seen:
            self._raise_corrupted(head, n, check)
        if pos + size <= self._capacity:
            data = mm[off + 8 : off + 8 + n]
        else:
            data = self._read_split(pos + 8, n)
        self._head = self._head_published = head = head + size
        self._words[self._head_word] = head
        self._gets += 1
        if mm[PRODUCER_WAITING_OFF]:
            self._wake_producer()
        return data

    def _read_split(self, start: int, n: int) -> bytes:
        """Read a payload that runs past the end of the data area on from offset 0."""
        first = self._capacity - start
        mm = self._mm
        return mm[HEADER_SIZE + start : HEADER_SIZE + self._capacity] + mm[HEADER_SIZE : HEADER_SIZE + n - first]

    def _raise_corrupted(self, head: int, n: int, check: int) -> NoReturn:
        raise RingCorrupted(
            f"{self.name}: bad record header at data offset {head & self._mask} (length {n}, "
            f"check {check:#x}, expected {(head >> 3) & CHECK_MASK:#x}; "
            f"{self._tail_seen - head} bytes published)"
        )

    def _read_tail(self) -> int:
        tail = self._words[TAIL]
        if not 0 <= tail - self._head <= self._capacity or tail & 7:
            raise RingCorrupted(
                f"{self.name}: tail {tail} inconsistent with head {self._head} (capacity {self._capacity})"
            )
        self._tail_seen = tail
        return tail

    def _publish_head(self) -> None:
        """Make consumed space visible to the producer, waking it if it waits."""
        if self._head != self._head_published:
            self._words[self._head_word] = self._head_published = self._head
            if self._mm[PRODUCER_WAITING_OFF]:
                self._wake_producer()

    def _wake_producer(self) -> None:
        self._mm[PRODUCER_WAITING_OFF] = 0
        self._space.release()

    # ------------------------------------------------------------- lifecycle
    def statistics(self) -> RingStatistics:
        tail = self._words[TAIL]
        head = self._peek_head()
        return RingStatistics(
            self.name,
            self._capacity,
            self.max_record,
            tail - head,
            self._puts,
            self._gets,
            self._producer_waits,
            self._consumer_waits,
            self._bell.rings,
        )

    def close(self) -> None:
        """Release this handle (a consumer publishes its head first). Idempotent."""
        if self._closed:
            return
        self._publish_head()
        self._closed = True
        self._space.close()
        if self._close_bell:
            self._bell.close()
        cast("memoryview[int]", self._words).release()  # (not closed yet: still the memoryview)
        self._mm.close()
        # Any later call trips over these instead of touching unmapped memory.
        self._words = _Closed(self.name)
        self._head_seen = -(1 << 62)
        self._tail_seen = self._head

    def unlink(self) -> None:
        """Remove the ring's names (owner only); open handles stay usable until closed."""
        if not self.owner:
            raise RingError(f"{self.name}: only the creating handle may unlink the ring")
        unlink_quietly(posix_ipc.unlink_shared_memory, self.name)
        unlink_quietly(posix_ipc.unlink_semaphore, self.name)
        if self._close_bell:
            self._bell.unlink()

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self.owner:
            self.unlink()

    def __repr__(self) -> str:
        return f"<Ring {self.name} capacity={self._capacity} owner={self.owner}>"


class _Closed:
    """Stands in for a closed handle's shared words: every access raises RingClosed."""

    def __init__(self, name: str):
        self.name = name

    def __getitem__(self, index: int) -> NoReturn:
        raise RingClosed(f"{self.name}: the handle is closed")

    def __setitem__(self, index: int, value: int) -> NoReturn:
        raise RingClosed(f"{self.name}: the handle is closed")
