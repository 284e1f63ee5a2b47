"""The producer side of a ring: writing records and publishing the tail."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from fdcore.ipc.doorbell import full_barrier, sleep_until
from fdcore.ipc.ring_layout import (
    CHECK_MASK,
    HEAD,
    HEADER_SIZE,
    PRODUCER_WAITING_OFF,
    RECORD_STRUCT,
    TAIL,
    RecordTooLarge,
    RingClosed,
    RingCorrupted,
    RingFull,
)

if TYPE_CHECKING:
    import mmap
    from collections.abc import Sequence

    import posix_ipc

    from fdcore.ipc.doorbell import Doorbell
    from fdcore.ipc.ring import _Closed


class Producer:
    """A ring's producer end (a mixin of fdcore.ipc.ring.Ring, whose fields these methods read and set): records
    written below the tail and published by one tail store; a full ring waits on its space semaphore."""

    # The ring's fields these methods use (set by Ring.__init__; declared here for the type checker).
    name: str
    spin: float
    max_record: int
    _mm: mmap.mmap
    _words: memoryview[int] | _Closed  # _Closed once the handle is closed
    _bell: Doorbell
    _bell_mm: mmap.mmap | bytes  # the bell's ``waiting`` byte (a broadcast producer's: a constant)
    _bell_off: int
    _space: posix_ipc.Semaphore
    _capacity: int
    _mask: int
    _closed: bool
    _tail: int
    _head_seen: int
    _puts: int
    _producer_waits: int

    # --------------------------------------------------------------- producer
    def put_nowait(self, data: bytes | bytearray | memoryview) -> None:
        """Append one record or raise :class:`RingFull` at once."""
        if not self._try_put(data):
            raise RingFull(f"{self.name}: no room for a {len(data)}-byte record")

    def put(self, data: bytes | bytearray | memoryview, timeout: float | None = None) -> None:
        """Append one record, waiting up to ``timeout`` seconds (None: forever) for room."""
        if self._try_put(data):
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._try_put(data):
            if not self._wait_for_space(deadline):
                raise RingFull(f"{self.name}: no room for a {len(data)}-byte record within {timeout} s")

    def put_many(self, records: Sequence[bytes | bytearray | memoryview], timeout: float | None = None) -> int:
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

    def _try_put(self, data: bytes | bytearray | memoryview) -> bool:
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
        RECORD_STRUCT.pack_into(mm, off, n, (tail >> 3) & CHECK_MASK)
        if pos + size <= self._capacity:
            mm[off + 8 : off + 8 + n] = data
        else:
            self._write_split(pos + 8, data)
        self._tail = tail = tail + size
        self._puts += 1
        self._words[TAIL] = tail
        full_barrier()  # the tail's store before the waiting byte's load (see fdcore.ipc.doorbell)
        if self._bell_mm[self._bell_off]:
            self._bell.ring()
        return True

    def _write_split(self, start: int, data: bytes | bytearray | memoryview) -> None:
        """Write a payload that runs past the end of the data area on at offset 0."""
        first = self._capacity - start
        view = memoryview(data)
        self._mm[HEADER_SIZE + start : HEADER_SIZE + self._capacity] = view[:first]
        self._mm[HEADER_SIZE : HEADER_SIZE + len(view) - first] = view[first:]

    def _try_put_batch(self, records: Sequence[bytes | bytearray | memoryview], start: int) -> int:
        """Write records from ``start`` until one does not fit; publish and ring once.

        ``_try_put`` inlined: this loop is the engine's per-step hot path.
        """
        mm, cap, mask, pack = self._mm, self._capacity, self._mask, RECORD_STRUCT.pack_into
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
                mm[off + 8 : off + 8 + n] = data
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
            raise RecordTooLarge(
                f"{self.name}: record of {n} bytes exceeds the limit of "
                f"{self.max_record} bytes (ring capacity {self._capacity})"
            )
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
        return sleep_until(self._mm, PRODUCER_WAITING_OFF, self._space, lambda: peek() != head_seen, deadline)

    def _peek_head(self) -> int:
        """Producer side: the head that bounds its room (one consumer's; the slowest of several)."""
        return self._words[HEAD]
