"""Collectives of a tensor-parallel worker group over one shared-memory segment (issue 17).

The ranks of a group run on one machine, so a sum across them needs no network: each rank writes
its part into its own slot of a shared segment, publishes a generation number, waits until every
rank has published that generation, and reads what it needs (vLLM's CPU backend does the same).
No pickles, no sockets, no copies through a third process.

- ``all_reduce(x)``: the sum of every rank's ``x``, added in rank order on every rank, so every rank
  holds the same bits (a row-parallel projection's partial products summed).
- ``gather(x)``: every rank's ``x`` joined along the last axis, in rank order (vocabulary-parallel
  logits gathered for sampling); ranks may hold different widths.
- ``broadcast(x)``: rank 0's array on every rank (the tokens it sampled).

Layout: two sets, each of one 64-byte line per rank (the generation it published there and the byte
count it wrote: no two ranks write one cache line) and one slot of ``capacity``
bytes per rank. Generation g uses set g % 2: a rank writes set g % 2 only after it has read
generation g - 1, for which every rank had published g - 1, that is had finished reading g - 2, the
last user of that set. So one barrier per collective is enough, not two.

NOTE: the data is written before the generation number, and read after it, by ordinary stores and
loads: x86-64's total store order keeps them in that order (fdcore's kernels are x86-64 only).
Waiting spins ``SPINS`` checks (a collective whose peers are there takes microseconds), then naps
between checks (a peer still computing its share needs the core more than the waiter does); a rank that waits longer
than ``timeout`` (a peer died or hangs) raises
:class:`PeerGone`, so the supervisor restarts the group instead of leaving it stuck.
"""

from __future__ import annotations

import mmap
import time
from typing import TYPE_CHECKING

import numpy as np
import posix_ipc

from fdcore.ipc.shm import map_segment, unlink_quietly

if TYPE_CHECKING:
    from collections.abc import Callable

LINE = 64  # bytes of a rank's header line
LINE_WORDS = LINE // 8  # generation, byte count (the rest: padding to the cache line)
SPINS = 2000  # checks (~100 us) before each nap
NAP = 20e-6  # a nap between checks once spinning has not paid: the core goes to others
_NOTHING = np.zeros(0, dtype=np.uint8)


class PeerGone(RuntimeError):
    """A peer rank did not take part in a collective within the timeout."""


class GroupAborted(PeerGone):
    """The supervisor aborted the group (a rank died): the waiting ranks stop, to be restarted with it."""


ABORT_WORD = 2  # in set 0 rank 0's line: the supervisor's abort flag (decoder.cc reads it too)


class ShmCommunicator:
    def __init__(self, name: str, mm: mmap.mmap, rank: int, world: int, capacity: int, timeout: float):
        self.name, self.rank, self.world, self.capacity, self.timeout = name, rank, world, capacity, timeout
        self._mm = mm
        # Control words through a memoryview (an item is one aligned 8-byte load or store, ~50 ns
        # from Python, where a numpy scalar access costs a microsecond): [set, rank, line word].
        self._words = memoryview(mm)[: 2 * world * LINE].cast("q")
        self._data = np.frombuffer(mm, dtype=np.uint8, offset=2 * world * LINE).reshape(2, world, capacity)
        self._bytes = [[self._data[part, rank] for rank in range(world)] for part in (0, 1)]  # each slot, flat
        self._floats = [[slot.view(np.float32) for slot in slots] for slots in self._bytes]
        self._lines = [[(part * world + rank) * LINE_WORDS for rank in range(world)] for part in (0, 1)]

    @staticmethod
    def segment_size(world: int, capacity: int) -> int:
        return 2 * world * (LINE + capacity)

    @classmethod
    def create(cls, name: str, world: int, capacity: int, timeout: float = 30.0) -> ShmCommunicator:
        """Create the group's segment (mode 0600) and take rank 0's place in it."""
        capacity = -(-capacity // LINE) * LINE
        mm = map_segment(name, cls.segment_size(world, capacity))
        return cls(name, mm, 0, world, capacity, timeout)

    @classmethod
    def attach(cls, name: str, rank: int, world: int, capacity: int, timeout: float = 30.0) -> ShmCommunicator:
        capacity = -(-capacity // LINE) * LINE
        mm = map_segment(name, None)
        size = len(mm)
        if size != cls.segment_size(world, capacity):
            mm.close()
            raise ValueError(f"{name}: {size} bytes, not the segment of {world} ranks x {capacity} bytes")
        return cls(name, mm, rank, world, capacity, timeout)

    # ------------------------------------------------------------ collectives
    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        """Every rank's float32 ``x`` (the same shape on every rank) summed, in rank order: the same
        bits on every rank."""
        if x.dtype != np.float32 or not x.flags.c_contiguous:
            x = np.ascontiguousarray(x, dtype=np.float32)
        floats, count = self._floats[self._exchange(x)], x.size
        total: np.ndarray = np.add(floats[0][:count], floats[1][:count]) if self.world > 1 else floats[0][:count].copy()
        for rank in range(2, self.world):
            total += floats[rank][:count]
        return total.reshape(x.shape)

    def gather(self, x: np.ndarray) -> np.ndarray:
        """Every rank's ``x`` joined along the last axis, rank 0's first (the leading dimensions the
        same on every rank; the widths may differ)."""
        x = np.ascontiguousarray(x)
        part = self._exchange(x)
        rows = x.size // x.shape[-1] if x.shape[-1] else 0
        pieces: list[np.ndarray] = []
        for rank in range(self.world):
            count = self._words[self._lines[part][rank] + 1]
            piece = self._data[part, rank, :count].view(x.dtype)
            pieces.append(piece.reshape(x.shape[:-1] + (piece.size // rows if rows else 0,)))
        return np.concatenate(pieces, axis=-1)

    def broadcast(
        self, x: np.ndarray | None, patience: float | None = None, waiting: Callable[[], object] | None = None
    ) -> np.ndarray:
        """Rank 0's int64 ``x`` on every rank (the others pass None). ``patience``: how long to wait for
        a peer this time, instead of the communicator's timeout (rank 0 may be building a grammar while
        the others wait for its tokens); ``waiting()`` is called at each nap meanwhile (a heartbeat)."""
        if self.rank == 0:
            self._exchange(np.ascontiguousarray(x, dtype=np.int64), patience, waiting)
            return x  # type: ignore[return-value]  # (rank 0 passes x; the others get it filled)
        part = self._exchange(_NOTHING, patience, waiting)
        return self._data[part, 0, : self._words[self._lines[part][0] + 1]].view(np.int64).copy()

    # ---------------------------------------------------------------- barrier
    def _exchange(
        self, x: np.ndarray, patience: float | None = None, waiting: Callable[[], object] | None = None
    ) -> int:
        """Publish ``x`` for the next generation and wait for every rank's; the set it used."""
        if x.nbytes > self.capacity:
            raise ValueError(f"{x.nbytes} bytes do not fit the communicator's {self.capacity}-byte slots")
        words = self._words
        # The rank's own words are the count (the C++ decoder's collectives advance them too; a warm
        # spare attached before the group's reset reads them after it)
        generation = max(words[self._lines[0][self.rank]], words[self._lines[1][self.rank]]) + 1
        part = generation & 1
        self._bytes[part][self.rank][: x.nbytes] = x.reshape(-1).view(np.uint8)
        line = self._lines[part][self.rank]
        words[line + 1] = x.nbytes
        words[line] = generation  # last: publishes the byte count and the slot
        for other in self._lines[part]:
            if words[other] < generation:
                self._wait(other, generation, self.timeout if patience is None else patience, waiting)
        return part

    def _wait(self, word: int, generation: int, timeout: float, waiting: Callable[[], object] | None = None) -> None:
        words, deadline, spins = self._words, None, 0
        while words[word] < generation:
            spins += 1
            if spins >= SPINS:  # the peer is computing: nap, leaving the core to it and the other actors
                if words[ABORT_WORD]:
                    raise GroupAborted(f"{self.name}: the group was aborted (a rank is gone)")
                time.sleep(NAP)
                if waiting is not None:
                    waiting()
                now = time.monotonic()
                deadline = deadline or now + timeout
                if now > deadline:
                    late = [rank for rank, line in enumerate(self._lines[generation & 1]) if words[line] < generation]
                    raise PeerGone(f"{self.name}: rank(s) {late} missed generation {generation} for {timeout:g} s")

    # ------------------------------------------------------------------- life
    def segment(self) -> np.ndarray:
        """The whole segment as bytes (zero-copy): what the C++ decoder's collectives run on."""
        return np.frombuffer(self._mm, dtype=np.uint8)

    def aborted(self) -> bool:
        return bool(self._words[ABORT_WORD])

    def abort(self) -> None:
        """Tell every waiting rank to give up (the supervisor, when a rank of the group died)."""
        self._words[ABORT_WORD] = 1

    def reset(self) -> None:
        """Zero every rank's generation: a new group starts counting (only while no rank runs)."""
        for index in range(len(self._words)):
            self._words[index] = 0

    def close(self) -> None:
        self._words.release()
        self._data = self._bytes = self._floats = None  # type: ignore[assignment]  # (closed: None)
        self._mm.close()

    def unlink(self) -> None:
        unlink_quietly(posix_ipc.unlink_shared_memory, self.name)
