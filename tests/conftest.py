"""Fixtures that keep multi-process tests honest and leave nothing behind.

- ``shm_guard`` (autouse): every ``fdcore-*`` object a test creates in /dev/shm
  is unlinked after it, and the test fails if it leaked one.
- ``spawn``: starts child processes (fork) in their own process group and
  SIGKILLs the group at teardown, even when the test failed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest

from fdcore.ipc import names

FORK = mp.get_context("fork")


def _our_entries() -> set[str]:
    return {e.filename for e in names.list_entries()}


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


@pytest.fixture(scope="session", autouse=True)
def _sweep_at_end():
    yield
    for entry in names.list_entries():
        if entry.owner_pid == os.getpid() or not names.pid_alive(entry.owner_pid):
            names.unlink_entry(entry)
