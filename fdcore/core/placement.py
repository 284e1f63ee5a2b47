"""Which CPUs each thread of the tree runs on: a pure policy, applied by each actor to itself.

Why: a worker's matrix products run on OpenMP threads that meet at a barrier several times a layer,
so one of them descheduled for a moment stalls them all. Every token also wakes the control plane
(scheduler, engine, client, a few hundred microseconds of CPU between them), and on a machine whose
cores all run math threads Linux lets a woken actor preempt whichever thread is on the CPU it picks:
often the worker's main thread, in the middle of its step. The worker's main thread alone on one CPU
and everything else on the other decodes a few percent faster at batch 1 (DESIGN.md, "CPU placement").

The plan, from the CPUs the supervisor may use, the worker ranks and each rank's math threads:

- each rank gets ``share`` CPUs (its threads, at most an even split), in order; its *main* thread
  (the one that runs Python and the serial parts of each step) the first of them, alone;
- the control plane (supervisor, cache, scheduler, engine, api, and the client's reader thread when
  the client started the tree) the CPUs left over, or when there are none, every CPU that is no
  rank's main;
- a rank's other threads (its OpenMP helpers, the grammar-mask thread) the rest of its share, or
  the control CPUs when its share is one CPU.

Nothing is pinned where every CPU would run a rank's main thread (e.g. 2 ranks on 2 cores): the
control plane would have nowhere to go. ``workers.pin_cpus = false`` turns it off.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from fdcore import envs

CPUS_ENV = envs.CPUS  # the CPUs the supervisor started with, "0,1,..." (set for its children)


@dataclass(frozen=True)
class Placement:
    control: frozenset[int]
    mains: tuple[int, ...]  # per rank: its main thread's CPU
    helpers: tuple[frozenset[int], ...]  # per rank: where its other threads run


def plan(cpus: Iterable[int], ranks: int, threads: int) -> Placement | None:
    """The placement of ``ranks`` workers of ``threads`` math threads each on ``cpus``; None when
    there is nothing to separate (one CPU, or as many ranks as CPUs)."""
    cpus = sorted(set(cpus))
    if len(cpus) < 2 or ranks >= len(cpus) or ranks < 1:
        return None
    share = max(1, min(threads, len(cpus) // ranks))
    mains = tuple(cpus[r * share] for r in range(ranks))
    spare = cpus[ranks * share :]
    control = frozenset(spare or (c for c in cpus if c not in mains))
    helpers = tuple(frozenset(cpus[r * share + 1 : (r + 1) * share]) or control for r in range(ranks))
    return Placement(control, mains, helpers)


def encode_cpus(cpus: Iterable[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def decode_cpus(text: str) -> list[int]:
    """``encode_cpus``' inverse; ValueError naming the variable on anything else."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{CPUS_ENV}={text!r}: expected CPU numbers separated by commas") from None


def inherited_plan(ranks: int, threads: int, environ: Mapping[str, str] = os.environ) -> Placement | None:
    """The placement the supervisor's children follow (None: the supervisor set none)."""
    text = envs.get(CPUS_ENV, environ)
    return plan(decode_cpus(text), ranks, threads) if text else None


def rank_cpus(placement: Placement, rank: int) -> frozenset[int]:
    """Every CPU a rank's threads may use."""
    return placement.helpers[rank] | {placement.mains[rank]}


def pin_this_thread(cpus: Iterable[int]) -> None:
    """Bind the calling thread (Linux: pid 0 of sched_setaffinity is the caller) to ``cpus``; threads
    it starts afterwards inherit them."""
    os.sched_setaffinity(0, cpus)


def thread_count() -> int:
    """Threads of this process, from one stat() (a task directory's link count is threads + 2)."""
    return os.stat("/proc/self/task").st_nlink - 2


def set_idle(idle: bool, pid: int | str = "self") -> None:
    """Every thread of process ``pid`` at SCHED_IDLE (a spare that loads beside a serving tree: it may only
    use a CPU nothing else wants), or back to the normal policy (the threads it made meanwhile, OpenMP's
    among them, inherit what their creator had). Raises OSError where the policy cannot be set (RLIMIT_NICE
    forbids the way back)."""
    policy = os.SCHED_IDLE if idle else os.SCHED_OTHER
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setscheduler(int(task), policy, os.sched_param(0))
        except ProcessLookupError:
            pass  # (a thread that ended meanwhile)


def pin_process_threads(main_cpu: int | None, others: Iterable[int]) -> None:
    """This process's main thread onto ``main_cpu`` alone (None: onto ``others`` too), every other
    thread onto ``others``."""
    main = os.getpid()
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        try:
            os.sched_setaffinity(tid, {main_cpu} if tid == main and main_cpu is not None else others)
        except ProcessLookupError:
            pass  # a thread that ended meanwhile
