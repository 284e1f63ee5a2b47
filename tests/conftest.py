"""Fixtures that keep multi-process tests honest and leave nothing behind.

- The session tags every instance id its processes make (``FDCORE_INSTANCE_TAG``,
  inherited by every child), so the guards below judge and remove only what this
  session's tests made: a server or another test session on the machine is left alone.
- ``shm_guard`` (autouse): every ``fdcore-*`` object a test creates in /dev/shm
  is unlinked after it, and the test fails if it leaked one.
- At the end of the session, an object of ours still there fails the run (a
  module-scoped tree that leaked is caught here).
- ``spawn``: starts child processes (fork) in their own process group and
  SIGKILLs the group at teardown, even when the test failed.
- ``on_threads``: runs a script in a fresh python with another OMP_NUM_THREADS (OpenMP reads it
  once, at start), for "T threads give one thread's results to the bit" tests.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import signal
import subprocess
import sys

import pytest

from fdcore.ipc import names

FORK = mp.get_context("fork")
os.environ[names.TAG_ENV] = SESSION_TAG = secrets.token_hex(2)


def _our_entries() -> set[str]:
    return {e.filename for e in names.list_entries() if e.instance_id.startswith(SESSION_TAG)}


@pytest.fixture(autouse=True)
def shm_guard():
    before = _our_entries()
    yield
    leaked = sorted(_our_entries() - before)
    for entry in names.list_entries():
        if entry.filename in leaked:
            names.unlink_entry(entry)
    assert not leaked, f"test left shared memory behind: {leaked}"


def _in_own_group(target, args):
    os.setpgid(0, 0)
    target(*args)


class Spawner:
    def __init__(self):
        self.procs: list[mp.Process] = []

    def __call__(self, target, *args) -> mp.Process:
        proc = FORK.Process(target=_in_own_group, args=(target, args), daemon=True)
        proc.start()
        self.procs.append(proc)
        return proc

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.pid is None:
                continue
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.join(5)


@pytest.fixture
def spawn():
    spawner = Spawner()
    yield spawner
    spawner.kill_all()


@pytest.fixture
def on_threads(tmp_path):
    """``run(script, arrays, threads, env)``: runs ``python -c script IN OUT`` with OMP_NUM_THREADS=threads
    (and ``env``'s variables), IN an .npz of ``arrays``; the script writes its results to OUT (np.savez),
    returned as a dict."""
    import numpy as np

    def run(script: str, arrays: dict, threads: int = 2, env: dict | None = None) -> dict:
        inputs, outputs = tmp_path / "threads-in.npz", tmp_path / "threads-out.npz"
        np.savez(inputs, **arrays)
        done = subprocess.run(
            [sys.executable, "-c", script, str(inputs), str(outputs)],
            env={**os.environ, "OMP_NUM_THREADS": str(threads), **(env or {})},
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return dict(np.load(outputs))

    return run


@pytest.fixture(params=["tiles", "avx512"])
def bf16_path(request):
    """Each bfloat16 path this CPU has (the products, and attention over a bfloat16 cache): AMX tiles (where it has
    AMX-BF16) and AVX512-BF16."""
    from fdcore.models.kernels import bf16_tiles, kernel_path, operators, set_bf16_tiles

    if kernel_path("bfloat16") is None or operators() is None:
        pytest.skip("bfloat16 compute is refused on CPUs without AVX512-BF16")
    if request.param == "tiles" and not bf16_tiles():
        pytest.skip("no AMX-BF16 here")
    set_bf16_tiles(request.param == "tiles")
    yield request.param
    set_bf16_tiles(True)


@pytest.fixture(scope="session", autouse=True)
def _nothing_left_at_end():
    yield
    left = [e for e in names.list_entries() if e.instance_id.startswith(SESSION_TAG)]
    for entry in left:
        names.unlink_entry(entry)
    assert not left, f"the test session left shared memory behind: {[e.filename for e in left]}"
