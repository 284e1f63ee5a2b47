"""The worker group's shared-memory all-reduce beside one round trip of fdcore's ring, in one run.

Two processes (ranks) sum a float32 vector with ``ShmCommunicator.all_reduce`` over and over; the
latency of each call on rank 0 (from the call to the sum in hand: the partner's arrival included)
is reported as p50 / p99, for hidden sizes of the tiny model (256), SmolLM2 (576), and a 7B model
(4096), and a batch of 32 SmolLM2 rows. Beside it, in the same run, a small message's round trip
over two of fdcore's rings (bench_ipc's rtt cell: what one scheduler -> worker -> scheduler exchange
costs at least). Issue 17's target: an all-reduce within 2x of one ring round trip.

Then how a step reaches the group: the scheduler's publish of a 600-byte step to 2 ranks, by one
broadcast ring (fdcore.ipc.broadcast: one copy, one publish, each rank woken by its own doorbell)
beside two plain rings (one put each, as before the broadcast ring), each rank answering on its own
link: the producer's cost per publish, and the time until both ranks have the step in hand.

Usage: python benchmarks/bench_allreduce.py [--calls 20000]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_ipc import FdcoreRing, bench_rtt

from fdcore.ipc import BroadcastRing, Doorbell, Inbox, Ring, names
from fdcore.ipc.allreduce import ShmCommunicator

SHAPES = {
    "tiny hidden (256)": (1, 256),
    "SmolLM2 hidden (576)": (1, 576),
    "7B hidden (4096)": (1, 4096),
    "SmolLM2 x 32 rows": (32, 576),
}
CAPACITY = 1 << 20


def _rank(name: str, rank: int, shape: tuple, calls: int, out) -> None:
    comm = ShmCommunicator.attach(name, rank, 2, CAPACITY)
    x = np.random.default_rng(rank).standard_normal(shape).astype(np.float32)
    samples = []
    clock = time.perf_counter
    for i in range(calls + 500):
        t0 = clock()
        comm.all_reduce(x)
        if i >= 500:
            samples.append((clock() - t0) * 1e6)
    comm.close()
    if rank == 0:
        out.put(sorted(samples))


def all_reduce_latency(shape: tuple, calls: int) -> tuple[float, float]:
    name = names.object_name(names.new_instance_id(), "tp")
    ShmCommunicator.create(name, 2, CAPACITY).close()
    try:
        ctx = mp.get_context("fork")
        out = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(name, rank, shape, calls, out)) for rank in (0, 1)]
        for proc in procs:
            proc.start()
        samples = out.get(timeout=300)
        for proc in procs:
            proc.join(timeout=60)
    finally:
        import posix_ipc

        from fdcore.ipc.shm import unlink_quietly

        unlink_quietly(posix_ipc.unlink_shared_memory, name)
    return samples[len(samples) // 2], samples[int(len(samples) * 0.99)]


STEP_BYTES = 600  # a decode step of a few dozen sequences, msgpack-encoded


def _step_rank(how: str, name: str, rank: int, reply: str, calls: int) -> None:
    source = BroadcastRing.attach(name, reader=rank) if how == "broadcast" else Ring.attach(f"{name}.r{rank}")
    answer = Ring.attach(reply)
    for _ in range(calls + 500):
        answer.put(source.get()[:8])
    source.close()
    answer.close()


def step_fan_out(how: str, calls: int, ranks: int = 2) -> tuple[float, float]:
    """p50 of the producer's publish, and of publish-to-every-rank-has-it (µs)."""
    instance = names.new_instance_id()
    bells = [Doorbell.standalone(names.object_name(instance, f"bell{r}"), create=True) for r in range(ranks)]
    name = names.object_name(instance, "steps")
    rings = (
        [BroadcastRing.create([b.name for b in bells], CAPACITY, name=name)]
        if how == "broadcast"
        else [Ring.create(CAPACITY, name=f"{name}.r{r}") for r in range(ranks)]
    )
    replies = Inbox.create(names.object_name(instance, "replies"), [f"r{r}" for r in range(ranks)])
    ctx = mp.get_context("fork")
    procs = [
        ctx.Process(target=_step_rank, args=(how, name, r, replies.link_name(f"r{r}"), calls)) for r in range(ranks)
    ]
    try:
        for proc in procs:
            proc.start()
        step, publish, arrival, clock = os.urandom(STEP_BYTES), [], [], time.perf_counter
        for i in range(calls + 500):
            t0 = clock()
            for ring in rings:
                ring.put(step)
            t1 = clock()
            for _ in range(ranks):
                replies.get(timeout=60)
            if i >= 500:
                publish.append(t1 - t0)
                arrival.append(clock() - t0)
        for proc in procs:
            proc.join(timeout=60)
    finally:
        for handle in [*rings, replies]:
            handle.close()
            handle.unlink()
        for bell in bells:
            bell.close()
            bell.unlink()
    return float(np.median(publish)) * 1e6, float(np.median(arrival)) * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args(argv)
    rtt50, rtt99 = bench_rtt(FdcoreRing(), args.calls)
    print(f"\n2 ranks, {args.calls} calls each (after 500 warm-up); {os.cpu_count()} cores")
    print(f"{'operation':34s} {'p50 us':>8s} {'p99 us':>8s}  {'p50 / ring rtt':>14s}")
    print("-" * 70)
    print(f"{'fdcore ring round trip (small msg)':34s} {rtt50:8.1f} {rtt99:8.1f}  {'1.00':>14s}")
    for label, shape in SHAPES.items():
        p50, p99 = all_reduce_latency(shape, args.calls)
        print(f"{'all_reduce ' + label:34s} {p50:8.1f} {p99:8.1f}  {p50 / rtt50:14.2f}")
    print(f"\nA {STEP_BYTES}-byte step to 2 ranks, {args.calls} steps (p50, us)")
    print(f"{'how':34s} {'publish':>8s} {'both have it':>13s}")
    print("-" * 58)
    for how, label in (("rings", "2 plain rings, one put each"), ("broadcast", "1 broadcast ring, one put")):
        publish, arrival = step_fan_out(how, args.calls)
        print(f"{label:34s} {publish:8.2f} {arrival:13.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
