"""The worker group's shared-memory collectives, between real processes: sums with the same bits on
every rank (in rank order), gathers of unequal widths, broadcasts, and a dead peer reported, not
waited for forever."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import numpy as np
import posix_ipc
import pytest

from fdcore.ipc import names
from fdcore.ipc.allreduce import PeerGone, ShmCommunicator
from fdcore.ipc.shm import unlink_quietly

pytestmark = pytest.mark.tree

RANK = textwrap.dedent("""
    import sys
    import numpy as np
    from fdcore.ipc.allreduce import ShmCommunicator

    name, rank, world, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    comm = ShmCommunicator.attach(name, rank, world, 1 << 16, timeout=20)

    def part(r, i):  # what rank r contributes in round i: every rank can compute everybody's
        rng = np.random.default_rng(1000 * i + r)
        return rng.standard_normal((1 + i % 3, 1 + (7 * i) % 300)).astype(np.float32)

    for i in range(rounds):
        want = part(0, i)
        for r in range(1, world):
            want = want + part(r, i)
        got = comm.all_reduce(part(rank, i))
        assert got.shape == want.shape and np.array_equal(got, want), f"round {i}: the sum differs"
        widths = [1 + (i + r) % 5 for r in range(world)]
        mine = np.full((2, widths[rank]), rank * 10 + i, dtype=np.int32)
        joined = comm.gather(mine)
        assert joined.tolist() == np.concatenate([np.full((2, w), r * 10 + i, dtype=np.int32)
                                                  for r, w in enumerate(widths)], axis=1).tolist(), i
        tokens = comm.broadcast(np.arange(i % 7, dtype=np.int64) + i if rank == 0 else None)
        assert tokens.tolist() == list(range(i, i + i % 7)), f"round {i}: broadcast {tokens}"
    comm.close()
    print("ok", rank)
""")


@pytest.fixture
def segment():
    name = names.object_name(names.new_instance_id(), "tp")
    made = []

    def make(world: int) -> str:
        ShmCommunicator.create(name, world, 1 << 16).close()
        made.append(name)
        return name

    yield make
    for each in made:
        unlink_quietly(posix_ipc.unlink_shared_memory, each)


def run_ranks(name: str, world: int, rounds: int) -> list[str]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, name, str(rank), str(world), str(rounds)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for rank in range(world)
    ]
    try:
        outs = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, (_out, err) in zip(procs, outs, strict=True):
        assert proc.returncode == 0, err[-2000:]
    return [out.strip() for out, _ in outs]


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_between_processes(segment, world):
    assert run_ranks(segment(world), world, 300) == [f"ok {rank}" for rank in range(world)]


def test_a_peer_that_never_comes_is_reported(segment):
    comm = ShmCommunicator.attach(segment(2), 0, 2, 1 << 16, timeout=0.3)
    try:
        with pytest.raises(PeerGone, match=r"rank\(s\) \[1\] missed generation 1"):
            comm.all_reduce(np.ones(4, dtype=np.float32))
    finally:
        comm.close()


def test_a_segment_of_another_shape_is_refused(segment):
    with pytest.raises(ValueError, match="not the segment of 3 ranks"):
        ShmCommunicator.attach(segment(2), 0, 3, 1 << 16)


def test_a_rank_waits_longer_for_rank_0_when_told_and_ticks_meanwhile(segment):
    """What a rank above 0 does while rank 0 builds a grammar (worker._follow): a wait past the
    communicator's timeout, calling ``waiting`` (its heartbeat) at each nap; without the extra
    patience the same wait is a PeerGone."""
    import threading

    name = segment(2)
    slow = ShmCommunicator.attach(name, 0, 2, 1 << 16, timeout=20)
    waiter = ShmCommunicator.attach(name, 1, 2, 1 << 16, timeout=0.3)
    started = threading.Event()

    def rank0():
        started.wait()
        time.sleep(1.0)
        slow.broadcast(np.array([7, 8], dtype=np.int64))
        time.sleep(1.0)
        slow.broadcast(np.array([9], dtype=np.int64))

    thread = threading.Thread(target=rank0)
    thread.start()
    try:
        started.set()
        with pytest.raises(PeerGone, match=r"rank\(s\) \[0\] missed generation 1 for 0.3 s"):
            waiter.broadcast(None)
        ticks = []
        assert waiter.broadcast(None, patience=10, waiting=lambda: ticks.append(1)).tolist() == [9]
        assert len(ticks) > 10
    finally:
        thread.join(10)
        slow.close()
        waiter.close()
