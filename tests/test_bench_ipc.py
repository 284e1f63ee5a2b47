"""The IPC benchmark runs end to end and prints its comparison table (a smoke run)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_ipc_quick_prints_a_table_with_ratios():
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_ipc.py"), "--quick",
         "--only", "fdcore", "mp.Pipe"],
        capture_output=True, text=True, timeout=240, check=True).stdout
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("workload"))
    assert "fdcore" in header and "mp.Pipe" in header and "vs best peer" in header
    rows = {line.split()[0]: line.split() for line in lines if line.split() and line.split()[0] in
            ("small", "batch64", "4KiB", "1MiB", "rtt", "idle")}
    assert set(rows) == {"small", "batch64", "4KiB", "1MiB", "rtt", "idle"}
    for row in rows.values():
        assert row[-1].endswith("x") and float(row[-1][:-1]) > 0
        assert all(float(v) == float(v) for v in row[-3:-1]), f"a cell failed: {row}"  # no NaN
