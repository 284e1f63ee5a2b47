"""Warm spare workers: one per worker, loaded beside it and promoted in its place when it dies."""

from __future__ import annotations

import signal
import subprocess
import time

import posix_ipc

from fdcore.actors import health
from fdcore.core import placement
from fdcore.ipc import names
from fdcore.supervision import Backoff, ChildSpec
from fdcore.supervisor.children import POLL, ShutdownRequested, exit_reason, killpg
from fdcore.supervisor.events import log


class Spares:
    """The Supervisor's spares (a mixin of fdcore.supervisor.tree.Supervisor, whose state these methods read and
    set): each loads, then waits on its semaphore to take over; the first ones warm before the tree says ready,
    later ones load at idle priority; one that crashes is respawned after a growing pause."""

    def _wait_for_spares(self) -> None:
        """Ready means ready: the first spares load at the normal priority and warm before the tree says
        so, so that no request of the first minutes shares the CPUs with a spare's load (a spare that loads
        later, after a promotion, does so at idle priority: on a busy machine one at idle priority before
        "ready" would starve and hold the start for start_timeout). One that fails to load is the standby
        check's business, not a failed start; one that takes longer than start_timeout is waited for no
        more, and goes on loading at idle priority."""
        started, deadline = time.monotonic(), time.monotonic() + self.config.supervisor.start_timeout
        while self._loading_spares() and time.monotonic() < deadline:
            self._wait_events(POLL)
            if self.stopping:
                raise ShutdownRequested()
        for cid, proc in self._loading_spares():
            self._set_priority(cid, proc, idle=True)
        if self.standbys:
            log(
                "spares_warm",
                count=sum(self.board.spare(self.slots[cid]) == health.SPARE_WARM for cid in self.standbys),
                seconds=f"{time.monotonic() - started:.2f}",
            )

    def _loading_spares(self) -> list[tuple[str, subprocess.Popen]]:
        """The spares alive and not warm yet."""
        return [
            (cid, proc)
            for cid, proc in self.standbys.items()
            if proc.poll() is None and self.board.spare(self.slots[cid]) != health.SPARE_WARM
        ]

    # ------------------------------------------------------------- standbys
    def _spawn_standby(self, spec: ChildSpec) -> None:
        """Start a warm spare for a worker (it loads, then waits on its semaphore to take over)."""
        if (
            spec.kind != "worker"
            or not self.config.workers.standby
            or self.stopping
            or not self.started
            or not self._backoff(spec.id).ready()
        ):
            return
        if spec.id in self.standbys and self.standbys[spec.id].poll() is None:
            return
        semaphore = self.standby_semaphores.get(spec.id)
        if semaphore is None:
            semaphore = self.standby_semaphores[spec.id] = posix_ipc.Semaphore(
                names.object_name(self.instance, f"standby.{spec.id}"), posix_ipc.O_CREX, 0o600, 0
            )
        while True:  # a promotion the previous spare never took must not promote the next one
            try:
                semaphore.acquire(0)
            except posix_ipc.BusyError:
                break
        self.board.set_spare(self.slots[spec.id], health.SPARE_LOADING)  # (from now: /health says so at once)
        self.standbys[spec.id] = subprocess.Popen(
            self._command(spec, semaphore.name),
            process_group=0,
            env=self._child_env(),
            stdin=subprocess.DEVNULL,
            pass_fds=self._pass_fds(spec),
        )
        if self.serving:  # idle from its first instruction (its threads inherit it): its imports alone are
            # a second of CPU that a worker resuming the streams of the one this spare replaced needs more
            self._set_priority(spec.id, self.standbys[spec.id], idle=True)
        log("standby", id=spec.id, pid=self.standbys[spec.id].pid)

    @staticmethod
    def _set_priority(cid: str, proc: subprocess.Popen, idle: bool) -> None:
        """A spare's threads at SCHED_IDLE while it loads beside a serving tree, back to the normal policy
        as it is promoted (the threads it makes meanwhile inherit its policy). Where that fails, logged: the
        spare then loads or serves at the priority it had."""
        try:
            placement.set_idle(idle, proc.pid)
        except OSError as exc:  # (ended meanwhile, or RLIMIT_NICE forbids the way back)
            log("spare_priority", id=cid, idle=idle, error=str(exc))

    def _check_standbys(self) -> None:
        """A spare never exits on its own: one that did crashed while loading or waiting. It counts
        toward the intensity (a spare that cannot load means a worker that cannot start) and is
        respawned after an exponentially growing pause, not at once and forever."""
        for cid, proc in list(self.standbys.items()):
            if proc.poll() is not None:
                del self.standbys[cid]
                self.board.set_spare(self.slots[cid], health.SPARE_NONE)
                delay = self._backoff(cid).failed()
                log(
                    "standby_exited",
                    id=cid,
                    pid=proc.pid,
                    reason=exit_reason(proc.returncode),
                    respawn_in=f"{delay:g}s",
                )
                if not self._count_restart(cid):
                    return
        for spec in self.specs:  # those whose pause is over (the others return at once)
            self._spawn_standby(spec)

    def _backoff(self, cid: str) -> Backoff:
        return self.standby_backoff.setdefault(cid, Backoff())

    def _stop_standbys(self) -> None:
        """SIGKILL: a spare has touched nothing shared (no slot, no inbox) and holds no state, and a
        SIGTERM that lands inside its Paddle import makes Paddle print a spurious error."""
        for proc in self.standbys.values():
            killpg(proc.pid, signal.SIGKILL)
        for proc in self.standbys.values():
            proc.wait()
            log("standby_stopped", pid=proc.pid)
        self.standbys.clear()
