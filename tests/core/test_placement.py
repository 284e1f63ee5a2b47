"""CPU placement: the pure plan (fdcore.core.placement), and a tree that follows it."""

from __future__ import annotations

import os

import pytest

from fdcore import LLM, SamplingParams
from fdcore.checkpoint import tiny
from fdcore.core import placement
from fdcore.core.placement import Placement, plan
from fdcore.supervisor import actor_processes
from tests.supervised import tree_config

pytestmark = pytest.mark.tree


@pytest.mark.parametrize(
    "cpus, ranks, threads, expected",
    [
        # 2 cores, one worker of 2 threads (the default there): its main thread alone, the rest beside it
        ([0, 1], 1, 2, Placement(frozenset({1}), (0,), (frozenset({1}),))),
        # one math thread (the tests' OMP_NUM_THREADS=1): the second core is the control plane's
        ([0, 1], 1, 1, Placement(frozenset({1}), (0,), (frozenset({1}),))),
        # 4 cores, 2 ranks of 2: each rank's second core is shared with the control plane
        ([0, 1, 2, 3], 2, 2, Placement(frozenset({1, 3}), (0, 2), (frozenset({1}), frozenset({3})))),
        # spare cores: the control plane gets them alone, a rank's helpers their own
        ([0, 1, 2, 3, 4, 5, 6, 7], 1, 4, Placement(frozenset({4, 5, 6, 7}), (0,), (frozenset({1, 2, 3}),))),
        # more threads than cores: the share is capped at an even split
        ([0, 1, 2], 1, 8, Placement(frozenset({1, 2}), (0,), (frozenset({1, 2}),))),
        # the CPUs a cgroup or taskset left, not 0..n-1
        ([7, 2, 5], 1, 1, Placement(frozenset({5, 7}), (2,), (frozenset({5, 7}),))),
        ([0, 1, 2], 2, 1, Placement(frozenset({2}), (0, 1), (frozenset({2}), frozenset({2})))),
    ],
)
def test_the_plan(cpus, ranks, threads, expected):
    assert plan(cpus, ranks, threads) == expected


@pytest.mark.parametrize("cpus, ranks", [([0], 1), ([0, 1], 2), ([0, 1], 3), ([0, 1, 2], 3)])
def test_nothing_is_pinned_where_every_cpu_would_hold_a_main_thread(cpus, ranks):
    assert plan(cpus, ranks, 1) is None


def test_the_control_plane_never_shares_a_cpu_with_a_main_thread():
    for n in range(2, 17):
        for ranks in range(1, n):
            for threads in range(1, 2 * n):
                p = plan(range(n), ranks, threads)
                assert len(set(p.mains)) == ranks and not p.control & set(p.mains)
                assert p.control and all(h and not h & set(p.mains) for h in p.helpers)


def test_the_cpu_list_travels_and_a_bad_one_names_the_variable():
    assert placement.decode_cpus(placement.encode_cpus({3, 0, 12})) == [0, 3, 12]
    with pytest.raises(ValueError, match="FDCORE_CPUS='0,a': expected CPU numbers"):
        placement.decode_cpus("0,a")
    assert placement.inherited_plan(1, 2, {}) is None
    assert placement.inherited_plan(1, 2, {placement.CPUS_ENV: "0,1"}) == plan([0, 1], 1, 2)


def _affinities(pid: int) -> dict[int, set[int]]:
    return {int(tid): os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.parametrize("pin", [True, False])
def test_a_tree_follows_the_plan(tmp_path, pin):
    """Every actor on the control CPUs, the worker's main thread alone on its CPU and its other threads
    beside the control plane, and the client's reader thread with the control plane; with
    ``workers.pin_cpus = false`` nothing is bound."""
    cpus = os.sched_getaffinity(0)
    expected = plan(cpus, 1, int(os.environ.get("OMP_NUM_THREADS") or len(cpus))) if pin else None
    model = tiny.make_tiny_model(str(tmp_path / "tiny"))
    with LLM(tree_config(model, workers={"pin_cpus": pin, "standby": False})) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert len(out[0].outputs.token_ids) == 4  # the worker ran steps: its threads are placed
        processes = actor_processes(llm._tree.proc.pid)
        reader = llm._router.thread.native_id
        supervisor = llm._tree.proc.pid
        if expected is None:
            for pids in [[supervisor], *processes.values()]:
                assert all(mask == cpus for mask in _affinities(pids[0]).values())
            assert os.sched_getaffinity(reader) == cpus
            return
        for title, pids in processes.items():
            (pid,) = pids
            for tid, mask in _affinities(pid).items():
                if title != "fdcore:worker:0":
                    assert mask == expected.control, (title, tid)
                elif tid == pid:
                    assert mask == {expected.mains[0]}
                else:
                    assert mask == expected.helpers[0], tid
        assert all(mask == expected.control for mask in _affinities(supervisor).values())
        assert os.sched_getaffinity(reader) == expected.control
        assert os.sched_getaffinity(0) == cpus  # the program's own threads are not ours to bind
