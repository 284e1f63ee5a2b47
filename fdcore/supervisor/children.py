"""A child process as the supervisor sees it, and the ways one ends."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from fdcore.actors import health
from fdcore.supervision import ChildSpec

POLL = 0.05  # seconds between looks at the health board when nothing else happens


class StartFailure(Exception):
    """A child that did not become ready."""


class ShutdownRequested(Exception):
    """SIGINT or SIGTERM arrived while waiting for something else."""


class Child:
    """A running child: its spec, process, slot and what hang detection last saw."""

    def __init__(self, spec: ChildSpec, slot: int, proc: subprocess.Popen):
        self.spec = spec
        self.slot = slot
        self.proc = proc
        self.stall = health.StallWatch(time.monotonic_ns())


def killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def exit_reason(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"
