"""A bounded single-producer / single-consumer ring of byte records in POSIX shared memory.

Byte layout of the segment (all integers native-endian, 8-byte aligned so that
each is read and written by one machine instruction)::

    0    +--------------------------------------------------------------+
         | magic "FDCRING1" | capacity u64 | (reserved)                  |  header
    64   +--------------------------------------------------------------+
         | bell semaphore name (NUL-padded, 64 B)                        |
    128  | space semaphore name (NUL-padded, 64 B)                       |
    192  +--------------------------------------------------------------+
         | tail u64 | producer_waiting u8 | (pad to 64 B)              |  producer's line
    256  +--------------------------------------------------------------+
         | head u64 | consumer_waiting u8 | (pad to 64 B)              |  consumer's line
    320  +--------------------------------------------------------------+
         | data: capacity bytes (a power of two)                         |
         +--------------------------------------------------------------+

A record at data offset ``pos`` is an 8-byte header ``(length u32, check u32)``
followed by ``length`` payload bytes, padded to a multiple of 8. Headers never
straddle the end of the data area (both are 8-aligned); a payload that does
continues at offset 0, so a record fits exactly when ``used + 8 + length``
(rounded up) ``<= capacity`` — an empty ring takes any record up to
``capacity - 8`` bytes, wherever its head stands. ``check`` is the record's start
counter ``/ 8`` modulo 2**32: the consumer knows which value to expect, so a
header overwritten with garbage, or left from an earlier lap, is detected rather
than trusted, and a restarted producer or consumer needs no state beyond
``tail`` and ``head`` to carry on.

``head`` and ``tail`` are monotonic byte counters (never wrapped); the position
in the data area is ``counter & (capacity - 1)``.

Ordering invariants:

1. Only the producer writes ``tail`` and the data area between ``tail`` and
   ``head + capacity``; only the consumer writes ``head``.
2. The producer writes a record's header and payload *before* it publishes the
   new ``tail``; the consumer reads ``tail`` *before* the records below it.
   (x86-64 keeps stores in order and loads in order, which this relies on;
   see ``_STRONG_ORDER``.)
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
import platform
import queue
import struct
import time
from dataclasses import dataclass

import posix_ipc

from fdcore.ipc import names
from fdcore.ipc.doorbell import Doorbell, full_barrier, sleep_until
from fdcore.ipc.shm import map_segment, open_semaphore, unlink_quietly

MAGIC = b"FDCRING1"
HEADER_SIZE = 320
BELL_NAME_OFF, SPACE_NAME_OFF, NAME_FIELD = 64, 128, 64
TAIL_OFF, PRODUCER_WAITING_OFF = 192, 200
HEAD_OFF, CONSUMER_WAITING_OFF = 256, 264
RECORD_HEADER = 8
CHECK_MASK = 0xFFFFFFFF
DEFAULT_CAPACITY = 1 << 20
DEFAULT_SPIN = 20e-6

_HDR = struct.Struct("II")  # record header; published by the tail store, so need not be atomic
# NOTE: ``struct.pack_into`` zeroes its target before writing, so a reader can see a
# torn 0; head and tail go through a memoryview cast to u64 instead, whose item
# assignment is one aligned 8-byte store. TAIL and HEAD below are word indexes.
TAIL, HEAD = TAIL_OFF // 8, HEAD_OFF // 8
_FIXED = struct.Struct("8sQ")
_STRONG_ORDER = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
if not _STRONG_ORDER:  # pragma: no cover - refuse rather than corrupt silently
    raise ImportError("fdcore.ipc.ring relies on x86-64 memory ordering (total store order); "
                      f"{platform.machine()} is not supported yet")


class RingError(Exception):
    """Base of the ring's errors."""


class RingCorrupted(RingError):
    """The shared memory does not hold a valid ring (overwritten, or not a ring)."""


class RingClosed(RingError):
    """The handle was closed."""


class RingEmpty(RingError, queue.Empty):
    """No record arrived (``get_nowait``, or ``get`` past its timeout)."""


class RingFull(RingError, queue.Full):
    """No room for the record (``put_nowait``, or ``put`` past its timeout)."""


class RecordTooLarge(RingError, ValueError):
    """A record larger than the ring can ever hold."""


@dataclass(frozen=True)
class RingStatistics:
    """A snapshot of one ring handle (trio-style ``statistics()``)."""

    name: str
    capacity: int
    max_record: int
    used_bytes: int
    records_put: int
    records_got: int
    producer_waits: int
    consumer_waits: int
    wakeups_sent: int


def round_capacity(capacity: int) -> int:
    """The smallest power of two >= ``capacity`` (and >= 64)."""
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    return max(64, 1 << (capacity - 1).bit_length())


def _encode_name(name: str) -> bytes:
    raw = name.encode()
    if len(raw) >= NAME_FIELD:
        raise ValueError(f"name {name!r} longer than {NAME_FIELD - 1} bytes")
    return raw.ljust(NAME_FIELD, b"\0")


class Ring:
    r"""One end (producer or consumer) of a shared-memory ring.

    Create with :meth:`create` (the owner, who finally :meth:`unlink`\ s) and
    open the other end with :meth:`attach`. Any handle may produce or consume,
    but at most one process may produce and one consume at a time.
    """

    _head_word = HEAD  # the consumer's head (a BroadcastRing's readers each have their own)

    def __init__(self, name: str, mm: mmap.mmap, bell: Doorbell, close_bell: bool,
                 space: posix_ipc.Semaphore, owner: bool, spin: float, capacity: int | None = None):
        self.name = name
        self.owner = owner
        self.spin = spin
        self._mm = mm
        self._words = words = memoryview(mm).cast("Q")
        self._bell = bell
        self._bell_mm, self._bell_off = bell.mm, bell.offset
        self._close_bell = close_bell
        self._space = space
        self._capacity = capacity = capacity or _FIXED.unpack_from(mm, 0)[1]
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
    def create(cls, capacity: int = DEFAULT_CAPACITY, *, name: str | None = None,
               doorbell: Doorbell | None = None, spin: float = DEFAULT_SPIN) -> "Ring":
        """Create a new ring; this handle owns it and must :meth:`unlink` it.

        ``capacity`` is rounded up to a power of two. ``name`` defaults to a
        fresh ``/fdcore-<instance id>-ring``; ``doorbell`` lets several rings
        share one consumer wake-up (see :class:`~fdcore.ipc.inbox.Inbox`).
        """
        capacity = round_capacity(capacity)
        name = name or names.object_name(names.new_instance_id(), "ring")
        mm = map_segment(name, HEADER_SIZE + capacity)
        created = [lambda: posix_ipc.unlink_shared_memory(name)]
        try:
            space = open_semaphore(name, create=True)
            created.append(lambda: posix_ipc.unlink_semaphore(name))
            bell, close_bell = doorbell, False
            if bell is None:
                bell = Doorbell.embedded(mm, CONSUMER_WAITING_OFF, name + ".bell", create=True)
                close_bell = True
            _FIXED.pack_into(mm, 0, MAGIC, capacity)
            mm[BELL_NAME_OFF:BELL_NAME_OFF + NAME_FIELD] = _encode_name(bell.name)
            mm[SPACE_NAME_OFF:SPACE_NAME_OFF + NAME_FIELD] = _encode_name(name)
        except BaseException:
            mm.close()
            for undo in created:
                undo()
            raise
        return cls(name, mm, bell, close_bell, space, owner=True, spin=spin)

    @classmethod
    def attach(cls, name: str, *, doorbell: Doorbell | None = None, spin: float = DEFAULT_SPIN,
               trust_header: bool = True, bell_name: str | None = None) -> "Ring":
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
                doorbell = Doorbell.standalone(bell_name, create=False)
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
        _FIXED.pack_into(self._mm, 0, MAGIC, self._capacity)
        self._mm[BELL_NAME_OFF:BELL_NAME_OFF + NAME_FIELD] = _encode_name(self._bell.name)
        self._mm[SPACE_NAME_OFF:SPACE_NAME_OFF + NAME_FIELD] = _encode_name(self.name)

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
        magic, capacity = _FIXED.unpack_from(mm, 0)
        if magic != MAGIC:
            raise RingCorrupted(f"{name}: bad magic {magic!r} (expected {MAGIC!r})")
        if capacity < 64 or capacity & (capacity - 1) or HEADER_SIZE + capacity > len(mm):
            raise RingCorrupted(f"{name}: capacity {capacity} does not fit a {len(mm)}-byte segment")
        tail, head = (struct.unpack_from("Q", mm, off)[0] for off in (TAIL_OFF, HEAD_OFF))
        if not 0 <= tail - head <= capacity or (tail | head) & 7:
            raise RingCorrupted(f"{name}: head {head} and tail {tail} are inconsistent")
        fields = [bytes(mm[o:o + NAME_FIELD]).rstrip(b"\0") for o in (BELL_NAME_OFF, SPACE_NAME_OFF)]
        try:
            bell, space = (f.decode("ascii") for f in fields)
        except UnicodeDecodeError:
            raise RingCorrupted(f"{name}: semaphore names are not text") from None
        if space != name or not (bell == name + ".bell" or name.startswith(bell + ".")):
            raise RingCorrupted(f"{name}: semaphore names {bell!r}, {space!r} do not belong to it")
        return bell, space

    # --------------------------------------------------------------- producer
    def put_nowait(self, data) -> None:
        """Append one record or raise :class:`RingFull` at once."""
        if not self._try_put(data):
            raise RingFull(f"{self.name}: no room for a {len(data)}-byte record")

    def put(self, data, timeout: float | None = None) -> None:
        """Append one record, waiting up to ``timeout`` seconds (None: forever) for room."""
        if self._try_put(data):
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._try_put(data):
            if not self._wait_for_space(deadline):
                raise RingFull(f"{self.name}: no room for a {len(data)}-byte record "
                               f"within {timeout} s")

    def put_many(self, records, timeout: float | None = None) -> int:
        """Append every record of the sequence ``records``, publishing once per batch.

        Returns how many were written; raises :class:`RingFull` (with
        ``.written`` set) when the rest did not fit within ``timeout``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        written, total = 0, len(records)
        while written < total:
            written += self._try_put_batch(records, written)
            if written < total and not self._wait_for_space(deadline):
                err = RingFull(f"{self.name}: only {written} of {total} records fit within {timeout} s")
                err.written = written
                raise err
        return written

    def _try_put(self, data) -> bool:
        """Write one record (and ring the doorbell); False when there is no room now.

        The hot path: kept flat, every extra call here costs ~5% of throughput.
        """
        n = len(data)
        size = (n + 15) & ~7
        tail = self._tail
        if tail + size - self._head_seen > self._capacity and not self._refresh_head(tail, n, size):
            return False
        mm = self._mm
        pos = tail & self._mask
        off = HEADER_SIZE + pos
        _HDR.pack_into(mm, off, n, (tail >> 3) & CHECK_MASK)
        if pos + size <= self._capacity:
            mm[off + 8:off + 8 + n] = data
        else:
            self._write_split(pos + 8, data)
        self._tail = tail = tail + size
        self._puts += 1
        self._words[TAIL] = tail
        full_barrier()  # the tail's store before the waiting byte's load (see fdcore.ipc.doorbell)
        if self._bell_mm[self._bell_off]:
            self._bell.ring()
        return True

    def _write_split(self, start: int, data) -> None:
        """Write a payload that runs past the end of the data area on at offset 0."""
        first = self._capacity - start
        view = memoryview(data)
        self._mm[HEADER_SIZE + start:HEADER_SIZE + self._capacity] = view[:first]
        self._mm[HEADER_SIZE:HEADER_SIZE + len(view) - first] = view[first:]

    def _try_put_batch(self, records, start: int) -> int:
        """Write records from ``start`` until one does not fit; publish and ring once.

        ``_try_put`` inlined: this loop is the engine's per-step hot path.
        """
        mm, cap, mask, pack = self._mm, self._capacity, self._mask, _HDR.pack_into
        tail, head_seen, count = self._tail, self._head_seen, 0
        for data in records[start:] if start else records:
            n = len(data)
            size = (n + 15) & ~7
            if tail + size - head_seen > cap:
                if not self._refresh_head(tail, n, size):
                    break
                head_seen = self._head_seen
            pos = tail & mask
            off = HEADER_SIZE + pos
            pack(mm, off, n, (tail >> 3) & CHECK_MASK)
            if pos + size <= cap:
                mm[off + 8:off + 8 + n] = data
            else:
                self._write_split(pos + 8, data)
            tail += size
            count += 1
        if count:
            self._tail = tail
            self._puts += count
            self._words[TAIL] = tail
            full_barrier()
            if self._bell_mm[self._bell_off]:
                self._bell.ring()
        return count

    def _refresh_head(self, tail: int, n: int, size: int) -> bool:
        """Re-read the consumer's head; False when the record still does not fit."""
        if self._closed:
            raise RingClosed(self.name)
        if n > self.max_record:
            raise RecordTooLarge(f"{self.name}: record of {n} bytes exceeds the limit of "
                                 f"{self.max_record} bytes (ring capacity {self._capacity})")
        head = self._peek_head()
        if head > tail or tail - head > self._capacity or head & 7:
            raise RingCorrupted(f"{self.name}: head {head} inconsistent with tail {tail}")
        self._head_seen = head
        return tail + size - head <= self._capacity

    def _wait_for_space(self, deadline: float | None) -> bool:
        """Sleep until the consumer publishes a new head; False once ``deadline`` passes."""
        head_seen, peek = self._head_seen, self._peek_head
        spin_end = time.monotonic() + self.spin
        while time.monotonic() < spin_end:
            if peek() != head_seen:
                return True
        self._producer_waits += 1
        return sleep_until(self._mm, PRODUCER_WAITING_OFF, self._space,
                           lambda: peek() != head_seen, deadline)

    def _peek_head(self) -> int:
        """Producer side: the head that bounds its room (one consumer's; the slowest of several)."""
        return self._words[HEAD]

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
        mm, cap, mask, unpack = self._mm, self._capacity, self._mask, _HDR.unpack_from
        limit = (1 << 62) if max_records is None else max_records
        out = []
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
                out.append(mm[off + 8:off + 8 + n])
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

    def _try_get(self):
        """Read one record; None when empty. The hot path: kept flat."""
        head = self._head
        if head == self._tail_seen and head == self._read_tail():
            return None
        mm = self._mm
        pos = head & self._mask
        off = HEADER_SIZE + pos
        n, check = _HDR.unpack_from(mm, off)
        size = (n + 15) & ~7
        if check != (head >> 3) & CHECK_MASK or head + size > self._tail_seen:
            self._raise_corrupted(head, n, check)
        if pos + size <= self._capacity:
            data = mm[off + 8:off + 8 + n]
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
        return mm[HEADER_SIZE + start:HEADER_SIZE + self._capacity] + mm[HEADER_SIZE:HEADER_SIZE + n - first]

    def _raise_corrupted(self, head: int, n: int, check: int):
        raise RingCorrupted(
            f"{self.name}: bad record header at data offset {head & self._mask} (length {n}, "
            f"check {check:#x}, expected {(head >> 3) & CHECK_MASK:#x}; "
            f"{self._tail_seen - head} bytes published)")

    def _read_tail(self) -> int:
        tail = self._words[TAIL]
        if not 0 <= tail - self._head <= self._capacity or tail & 7:
            raise RingCorrupted(f"{self.name}: tail {tail} inconsistent with head {self._head} "
                                f"(capacity {self._capacity})")
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
        return RingStatistics(self.name, self._capacity, self.max_record, tail - head,
                              self._puts, self._gets, self._producer_waits,
                              self._consumer_waits, self._bell.rings)

    def close(self) -> None:
        """Release this handle (a consumer publishes its head first). Idempotent."""
        if self._closed:
            return
        self._publish_head()
        self._closed = True
        self._space.close()
        if self._close_bell:
            self._bell.close()
        self._words.release()
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

    def __enter__(self) -> "Ring":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        if self.owner:
            self.unlink()

    def __repr__(self) -> str:
        return f"<Ring {self.name} capacity={self._capacity} owner={self.owner}>"


class _Closed:
    """Stands in for a closed handle's shared words: every access raises RingClosed."""

    def __init__(self, name: str):
        self.name = name

    def __getitem__(self, index):
        raise RingClosed(f"{self.name}: the handle is closed")

    __setitem__ = __getitem__
