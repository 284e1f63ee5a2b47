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

Layout: two sets, each of one 64-byte line per rank (the generation it published there, the byte
count and shape of what it wrote: no two ranks write one cache line) and one slot of ``capacity``
bytes per rank. Generation g uses set g % 2: a rank writes set g % 2 only after it has read
generation g - 1, for which every rank had published g - 1, that is had finished reading g - 2, the
last user of that set. So one barrier per collective is enough, not two.

NOTE: the data is written before the generation number, and read after it, by ordinary stores and
loads: x86-64's total store order keeps them in that order (fdcore's kernels are x86-64 only).
Waiting spins (a collective takes microseconds, and a sleep costs more than it saves) and yields the
core after ``SPINS`` checks; a rank that waits longer than ``timeout`` (a peer died or hangs) raises
:class:`PeerGone`, so the supervisor restarts the group instead of leaving it stuck.
"""

from __future__ import annotations

import mmap
import os
import time

import numpy as np
import posix_ipc

from fdcore.ipc.shm import map_segment, unlink_quietly

LINE = 64                    # bytes of a rank's header line
LINE_WORDS = LINE // 8       # gen, nbytes, ndim, up to MAX_DIMS dims
MAX_DIMS = 4
SPINS = 2000                 # checks before each yield of the core


class PeerGone(RuntimeError):
    """A peer rank did not take part in a collective within the timeout."""


class ShmCommunicator:
    def __init__(self, name: str, mm: mmap.mmap, rank: int, world: int, capacity: int, timeout: float):
        self.name, self.rank, self.world, self.capacity, self.timeout = name, rank, world, capacity, timeout
        self._mm = mm
        header = np.frombuffer(mm, dtype=np.int64, count=2 * world * LINE_WORDS).reshape(2, world, LINE_WORDS)
        self._header = header            # [set, rank, (generation, nbytes, ndim, dims...)]
        self._data = np.frombuffer(mm, dtype=np.uint8, offset=2 * world * LINE).reshape(2, world, capacity)
        self._generation: int | None = None  # read at the first collective (see reset)

    @staticmethod
    def segment_size(world: int, capacity: int) -> int:
        return 2 * world * (LINE + capacity)

    @classmethod
    def create(cls, name: str, world: int, capacity: int, timeout: float = 30.0) -> "ShmCommunicator":
        """Create the group's segment (mode 0600) and take rank 0's place in it."""
        capacity = -(-capacity // LINE) * LINE
        mm = map_segment(name, cls.segment_size(world, capacity))
        return cls(name, mm, 0, world, capacity, timeout)

    @classmethod
    def attach(cls, name: str, rank: int, world: int, capacity: int, timeout: float = 30.0) -> "ShmCommunicator":
        capacity = -(-capacity // LINE) * LINE
        mm = map_segment(name, None)
        size = len(mm)
        if size != cls.segment_size(world, capacity):
            mm.close()
            raise ValueError(f"{name}: {size} bytes, not the segment of {world} ranks x {capacity} bytes")
        return cls(name, mm, rank, world, capacity, timeout)

    # ------------------------------------------------------------ collectives
    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        """Every rank's float32 ``x`` summed (in rank order: the same bits on every rank)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        part = self._exchange(x)
        total = self._view(part, 0).copy()
        for rank in range(1, self.world):
            total += self._view(part, rank)
        return total

    def gather(self, x: np.ndarray) -> np.ndarray:
        """Every rank's ``x`` joined along the last axis, rank 0's first (widths may differ)."""
        part = self._exchange(np.ascontiguousarray(x))
        return np.concatenate([self._view(part, rank, x.dtype) for rank in range(self.world)], axis=-1)

    def broadcast(self, x: np.ndarray | None) -> np.ndarray:
        """Rank 0's ``x`` on every rank (the others pass anything: None, or an array of the dtype)."""
        if self.rank == 0:
            self._exchange(np.ascontiguousarray(x))
            return x
        part = self._exchange(np.zeros(0, dtype=np.uint8))
        return self._view(part, 0, np.dtype(np.int64) if x is None else x.dtype).copy()

    # ---------------------------------------------------------------- barrier
    def _exchange(self, x: np.ndarray) -> int:
        """Publish ``x`` for the next generation and wait for every rank's; the set it used."""
        if x.nbytes > self.capacity:
            raise ValueError(f"{x.nbytes} bytes do not fit the communicator's {self.capacity}-byte slots")
        if x.ndim > MAX_DIMS:
            raise ValueError(f"an array of {x.ndim} dimensions; at most {MAX_DIMS}")
        if self._generation is None:  # a rank attached before the group's reset (a warm spare) counts from it
            self._generation = int(self._header[:, self.rank, 0].max())
        generation = self._generation + 1
        part = generation % 2
        self._data[part, self.rank, :x.nbytes] = x.reshape(-1).view(np.uint8)
        line = self._header[part, self.rank]
        line[1], line[2] = x.nbytes, x.ndim
        line[3:3 + x.ndim] = x.shape
        line[0] = generation  # last: publishes the line and the slot
        self._generation = generation
        self._wait(self._header[part, :, 0], generation)
        return part

    def _wait(self, gens: np.ndarray, generation: int) -> None:
        deadline, spins = None, 0
        while gens.min() < generation:
            spins += 1
            if spins % SPINS == 0:
                os.sched_yield()
                now = time.monotonic()
                deadline = deadline or now + self.timeout
                if now > deadline:
                    late = [rank for rank in range(self.world) if gens[rank] < generation]
                    raise PeerGone(f"{self.name}: rank(s) {late} missed generation {generation} for {self.timeout:g} s")

    def _view(self, part: int, rank: int, dtype=np.float32) -> np.ndarray:
        line = self._header[part, rank]
        shape = tuple(int(d) for d in line[3:3 + int(line[2])])
        return self._data[part, rank, :int(line[1])].view(dtype).reshape(shape)

    # ------------------------------------------------------------------- life
    def reset(self) -> None:
        """Zero every rank's generation: a new group starts counting (only while no rank runs)."""
        self._header[:] = 0

    def close(self) -> None:
        self._header = self._data = None
        self._mm.close()

    def unlink(self) -> None:
        unlink_quietly(posix_ipc.unlink_shared_memory, self.name)
