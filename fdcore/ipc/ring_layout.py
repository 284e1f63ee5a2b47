"""A ring's bytes in shared memory: the header's fields and offsets, a record's header, the errors a ring
raises and the statistics a handle keeps (fdcore.ipc.ring describes the protocol over them).

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
"""

from __future__ import annotations

import platform
import queue
import struct
from dataclasses import dataclass

MAGIC = b"FDCRING1"


HEADER_SIZE = 320


BELL_NAME_OFF, SPACE_NAME_OFF, NAME_FIELD = 64, 128, 64


TAIL_OFF, PRODUCER_WAITING_OFF = 192, 200


HEAD_OFF, CONSUMER_WAITING_OFF = 256, 264


RECORD_HEADER = 8


CHECK_MASK = 0xFFFFFFFF


DEFAULT_CAPACITY = 1 << 20


DEFAULT_SPIN = 20e-6


RECORD_STRUCT = struct.Struct("II")  # record header; published by the tail store, so need not be atomic


# NOTE: ``struct.pack_into`` zeroes its target before writing, so a reader can see a
# torn 0; head and tail go through a memoryview cast to u64 instead, whose item
# assignment is one aligned 8-byte store. TAIL and HEAD below are word indexes.
TAIL, HEAD = TAIL_OFF // 8, HEAD_OFF // 8


FIXED_STRUCT = struct.Struct("8sQ")


_STRONG_ORDER = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def _refuse_weak_ordering() -> None:
    if _STRONG_ORDER:
        return
    raise ImportError(
        "fdcore.ipc.ring relies on x86-64 memory ordering (total store order); "
        f"{platform.machine()} is not supported yet"
    )


_refuse_weak_ordering()  # pragma: no cover - refuse rather than corrupt silently


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

    written: int  # put_many: how many records were written (set where it raises)


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


def encode_name(name: str) -> bytes:
    raw = name.encode()
    if len(raw) >= NAME_FIELD:
        raise ValueError(f"name {name!r} longer than {NAME_FIELD - 1} bytes")
    return raw.ljust(NAME_FIELD, b"\0")
