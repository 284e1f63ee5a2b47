"""The IPC benchmark runs end to end and prints its comparison table (a smoke run)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests import ROOT

pytestmark = pytest.mark.tree


def test_bench_ipc_quick_prints_a_table_with_ratios():
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_ipc.py"), "--quick", "--only", "fdcore", "mp.Pipe"],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    ).stdout
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("workload"))
    assert "fdcore" in header and "mp.Pipe" in header and "vs best peer" in header
    rows = {
        line.split()[0]: line.split()
        for line in lines
        if line.split() and line.split()[0] in ("small", "batch64", "4KiB", "1MiB", "rtt", "idle")
    }
    assert set(rows) == {"small", "batch64", "4KiB", "1MiB", "rtt", "idle"}
    for row in rows.values():
        assert row[-1].endswith("x") and float(row[-1][:-1]) > 0
        assert all(float(v) == float(v) for v in row[-3:-1]), f"a cell failed: {row}"  # no NaN


def test_the_best_peer_ignores_a_failed_cell_wherever_it_stands():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_ipc

    nan = float("nan")
    args = {"small_n": 1, "4k_n": 1, "1m_n": 1, "rtt_n": 1}
    kinds = [kind for kind, _, _ in bench_ipc.WORKLOADS]
    ratios = set()
    for peers in ([nan, 2.0], [2.0, nan]):
        table = {
            "fdcore": dict.fromkeys(kinds, 4.0),
            "a": dict.fromkeys(kinds, peers[0]),
            "b": dict.fromkeys(kinds, peers[1]),
        }
        small = next(line for line in bench_ipc.render(table, args).splitlines() if line.startswith("small "))
        ratios.add(small.split()[-1])
    assert ratios == {"2.00x"}
    table = {"fdcore": dict.fromkeys(kinds, 4.0), "a": dict.fromkeys(kinds, nan)}
    assert bench_ipc.render(table, args).splitlines()[3].endswith("n/a")
