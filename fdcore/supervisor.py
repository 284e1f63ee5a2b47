"""The supervisor: ``python -m fdcore.supervisor --config FILE.toml [--check]``.

It owns everything: every shared-memory object of the instance (created at
start, unlinked at exit), and every actor process, each started in a process
group of its own so that a kill reaches whatever the actor started too.

- Start: sweep the leftovers of dead instances, create the inboxes and the
  health board, start the children in order, each within ``start_timeout`` of
  reporting READY; a child that fails to start stops the whole tree with its
  error (never a wait forever, never a restart loop).
- Run: a child that exits, or hangs (health board), is handled by its restart
  type and the strategy (:mod:`fdcore.supervision`); too many restarts within
  the period stop the tree with a non-zero exit and the reason.
- Stop (SIGINT / SIGTERM): children in reverse order, each by a Stop message,
  then SIGTERM, then SIGKILL, ``shutdown_timeout`` apart. A second Ctrl-C kills
  at once. If the supervisor itself is SIGKILLed, the kernel SIGKILLs every
  actor (``PR_SET_PDEATHSIG``) and the next start sweeps the segments.

Events go to stderr as ``fdcore.supervisor: event=NAME key=value ...`` lines.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

import posix_ipc

from fdcore import envs, janitor
from fdcore.actors import health, topology
from fdcore.actors.health import HealthBoard, State
from fdcore.config import (Config, ConfigError, config_memfd, fd_path, kv_outlives_workers, load_config,
                           model_path, render_config, worker_ranks, worker_threads)
from fdcore.core import placement
from fdcore.ipc import BroadcastRing, Inbox, Ring, Sender, names
from fdcore.ipc.shm import SHM_DIR, NoSharedMemory, free_bytes
from fdcore.protocol import Restarted, Stop
from fdcore.supervision import Backoff, ChildSpec, RestartIntensity, plan_restart, should_restart

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


class Supervisor:
    def __init__(self, config: Config, ready_fd: int | None = None):
        self.ready_fd = ready_fd
        self.config = config
        self.config_fd = config_memfd(config)  # what every child reads (restarts too): the effective configuration
        self.instance = names.new_instance_id()
        self.weight_fds = self._weight_files()
        sup = config.supervisor
        self.specs = topology.child_specs(config)
        self.kv_fds = self._kv_files()
        self.slots = {spec.id: i for i, spec in enumerate(self.specs)}
        self.intensity = RestartIntensity(sup.max_restarts, sup.period)
        self.children: dict[str, Child] = {}
        self.generation = 0
        self.exit_code = 0
        self.stopping = False
        self.stop_reason = "the supervisor was asked to stop"
        self._signals: list[tuple[int, bool]] = []  # (signal, whether the tree was already stopping), as received
        self._signals_logged = 0
        self._wake_r = self._wake_w = -1
        self.board: HealthBoard | None = None
        self.inboxes: list[Inbox] = []
        self.started = False
        self.serving = False  # (from "ready" on: a spare loads at idle priority)
        self.restart_counts: dict[str, int] = {}
        self.standbys: dict[str, subprocess.Popen] = {}  # warm spare workers, by the child they replace
        self.standby_semaphores: dict = {}
        self.standby_backoff: dict[str, Backoff] = {}  # by child: pauses between respawns of crashing spares
        self.senders: dict[str, Sender] = {}
        self.step_ring: BroadcastRing | None = None  # the scheduler's steps, read by every worker rank
        self.group_comm = None  # the worker group's communicator segment (tensor_parallel_size > 1)
        self.group_master = ""  # a paddle.distributed group's rendezvous host:port
        # (taken before the supervisor binds itself to the control CPUs: the children's plan starts from all)
        self.cpus = sorted(os.sched_getaffinity(0))
        self.worker_threads = worker_threads(config.workers)
        self.placement = (placement.plan(self.cpus, worker_ranks(config.workers), self.worker_threads)
                          if config.workers.pin_cpus else None)

    # ------------------------------------------------------------------ main
    def run(self) -> int:
        started = time.monotonic()
        self._install_signals()
        if self.placement is not None:
            try:
                placement.pin_process_threads(None, self.placement.control)
            except OSError as exc:  # (CPUs this process may not take): the tree runs unpinned
                log("placement_given_up", error=repr(exc))
                self.placement = None
        self.janitor, janitor_pipe = janitor.start(self.instance)  # first: it removes what a killed supervisor left
        try:
            self._build_kernels()
            self._create_ipc()
            self._start_all()
            self.board.set_tree_ready()
            log("ready", instance=self.instance, children=len(self.children), math_threads=self.worker_threads,
                seconds=f"{time.monotonic() - started:.2f}")
            self._notify_ready()
            self._loop()
        except StartFailure as exc:
            log("start_failed", reason=str(exc))
            self.exit_code = 1
        except ShutdownRequested:
            pass
        finally:
            stop_started = time.monotonic()
            self._log_signals()
            self._stop_all()
            self._destroy_ipc()
            os.close(janitor_pipe)  # nothing is left for it: it exits
            self.janitor.wait()
            self._log_signals()  # (one received while stopping, with no wait after it)
            log("stopped", exit_code=self.exit_code, seconds=f"{time.monotonic() - stop_started:.2f}")
        return self.exit_code

    def _build_kernels(self) -> None:
        """The workers' C++ operators, built (once per CPU and source version) before any actor starts, so
        that the build counts against no start timeout; in a process of its own (the supervisor never
        imports Paddle), its progress on our stderr. A failure stops the start with the compiler's
        complaint; ``model.kernels = "python"`` (or the null backend) needs none."""
        if self.config.model.kernels == "python" or self.config.model.backend != "paddle":
            return
        started = time.monotonic()
        env = {**self._child_env(), envs.BUILD_FOR_PID: str(os.getpid())}  # (it dies with us)
        proc = subprocess.Popen([sys.executable, "-m", "fdcore.cli", "build-kernels"], env=env, process_group=0,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        lines: list[str] = []

        def read() -> None:
            for line in proc.stderr:
                lines.append(line.rstrip())
                if line.startswith("fdcore: compiling"):
                    log("kernels", progress=line.rsplit(":", 1)[1].strip())

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        while proc.poll() is None:
            self._wait_events(POLL)
            if self.stopping:  # (a signal: the build is not finished for nothing)
                _killpg(proc.pid, signal.SIGKILL)  # (the builder leads a group: its compilers too)
                proc.wait()
                raise ShutdownRequested()
        reader.join()
        if proc.returncode != 0:
            failed = [line for line in lines if line.startswith("fdcore: cannot")]
            raise StartFailure((failed or lines or ["the build of fdcore's operators failed"])[-1])
        if any(line.startswith("fdcore: compiling") for line in lines):
            log("kernels_built", seconds=f"{time.monotonic() - started:.0f}")

    def _notify_ready(self) -> None:
        """Tell whoever started us (an embedding client) the instance id, then close the pipe."""
        if self.ready_fd is None:
            return
        try:
            control = "" if self.placement is None else " " + placement.encode_cpus(self.placement.control)
            os.write(self.ready_fd, f"{self.instance}{control}\n".encode())
        except OSError as exc:
            log("notify_failed", error=repr(exc))
        finally:
            os.close(self.ready_fd)
            self.ready_fd = None

    def _loop(self) -> None:
        while not self.stopping:
            self._wait_events(POLL)
            self._check_standbys()
            for child in list(self.children.values()):
                if self.children.get(child.spec.id) is not child:
                    continue  # stopped and replaced by a restart this turn: that handled its exit
                if child.proc.poll() is not None:
                    self._on_exit(child, _exit_reason(child.proc.returncode),
                                  abnormal=child.proc.returncode != 0)
                elif (reason := self._stall_reason(child)) is not None:
                    log("hung", id=child.spec.id, pid=child.proc.pid, reason=reason)
                    self._kill(child)
                    self._on_exit(child, f"hung ({reason})", abnormal=True)
                if self.stopping:
                    break

    # --------------------------------------------------------------- failures
    def _on_exit(self, child: Child, reason: str, abnormal: bool) -> None:
        """A child is gone: restart it, with the siblings its strategy takes along (which are
        stopped as for a restart, so that no open request is failed), then tell the engine when
        request state was lost. Called once per child object: the loop skips replaced children."""
        log("exited", id=child.spec.id, pid=child.proc.pid, reason=reason)
        del self.children[child.spec.id]
        if not should_restart(child.spec.restart, abnormal) or not self._count_restart(child.spec.id):
            return
        order = [s.id for s in self.specs if s.id in self.children or s.id == child.spec.id]
        plan = plan_restart(self.config.supervisor.strategy, order, child.spec.id, self.children,
                            [topology.worker_ids(self.config)])
        if self.group_comm is not None and topology.kind_of(child.spec.id) == "worker":
            self.group_comm.abort()  # the other ranks wait for the dead one in a collective: they give up and exit
        for cid in plan.stop:
            self._stop_for_restart(self.children.pop(cid), child.spec.id)
        if self.stopping:
            return  # a sibling found dead on its own was one crash too many
        if any(topology.kind_of(cid) == "worker" for cid in plan.start):
            self._renew_group()
        self.generation += 1
        for cid in plan.start:
            self.restart_counts[cid] = self.restart_counts.get(cid, 0) + 1
            self._restart(cid)
        if not self.stopping and "engine" in self.children and any(
                self.children[c].spec.stateful for c in plan.start if c in self.children):
            # Their request state died with them: the engine re-submits every unfinished request
            # in a new epoch (crash-resume). An engine or API restart needs no such thing (a new
            # engine starts a new epoch anyway, and its clients re-submit).
            self._send("engine", Restarted(",".join(plan.start), self.generation))

    def _count_restart(self, cid: str) -> bool:
        """One restart in the intensity window; False (and the tree stops) when one too many."""
        if self.intensity.record():
            return True
        log("intensity_exceeded", id=cid, reason=self.intensity.describe())
        self.stop_reason = f"{cid} failed too often: {self.intensity.describe()}"
        self.exit_code = 1
        self.stopping = True
        return False

    def _stop_for_restart(self, sibling: Child, failed: str) -> None:
        """Stop a sibling that ``failed``'s restart takes along; one that died on its own
        meanwhile is a crash of its own (logged and counted once, here: it is restarted anyway)."""
        if sibling.proc.poll() is not None:
            log("exited", id=sibling.spec.id, pid=sibling.proc.pid,
                reason=_exit_reason(sibling.proc.returncode))
            if sibling.proc.returncode != 0:
                self._count_restart(sibling.spec.id)
            return
        if topology.kind_of(sibling.spec.id) == topology.kind_of(failed) == "worker":
            self._terminate(sibling)  # a rank of the failed one's group: it waits in a collective, reading nothing
            return
        self._stop_child(sibling, Stop(f"restarting with {failed}", restart=True))

    def _terminate(self, child: Child) -> None:
        """SIGTERM, then SIGKILL after ``shutdown_timeout``: for a child that cannot read a Stop."""
        t0 = time.monotonic()
        _killpg(child.proc.pid, signal.SIGTERM)
        how = "SIGTERM"
        if not self._wait_exit(child, child.spec.shutdown_timeout):
            how = "SIGKILL"
            self._kill(child)
        log("child_stopped", id=child.spec.id, pid=child.proc.pid, by=how, seconds=f"{time.monotonic() - t0:.2f}")

    def _restart(self, cid: str) -> None:
        spec = next(s for s in self.specs if s.id == cid)
        try:
            self._start_child(spec)
            log("restarted", id=cid, pid=self.children[cid].proc.pid, generation=self.generation)
        except StartFailure as exc:
            log("restart_failed", id=cid, reason=str(exc))
            if self._count_restart(cid):
                self._restart(cid)
            else:
                self.stop_reason = f"{cid} could not be restarted: {exc}"

    def _stall_reason(self, child: Child) -> str | None:
        board, slot = self.board, child.slot
        if board.read(slot, health.STATE) != State.READY:
            return None
        return child.stall.look(board.read(slot, health.HEARTBEAT), board.read(slot, health.PROGRESS),
                                bool(board.read(slot, health.BUSY)), time.monotonic_ns(),
                                int(self.config.supervisor.hang_timeout * 1e9), board.read(slot, health.GRACE))

    # ------------------------------------------------------------- starting
    def _start_all(self) -> None:
        for spec in self.specs:
            self._start_child(spec)
            log("started", id=spec.id, pid=self.children[spec.id].proc.pid)
        self.started = True  # spares load only now, not competing with the tree's own start
        for spec in self.specs:
            self._spawn_standby(spec)
        self._wait_for_spares()
        self.serving = True

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
            log("spares_warm", count=sum(self.board.spare(self.slots[cid]) == health.SPARE_WARM
                                         for cid in self.standbys), seconds=f"{time.monotonic() - started:.2f}")

    def _loading_spares(self) -> list[tuple[str, subprocess.Popen]]:
        """The spares alive and not warm yet."""
        return [(cid, proc) for cid, proc in self.standbys.items()
                if proc.poll() is None and self.board.spare(self.slots[cid]) != health.SPARE_WARM]

    def _start_child(self, spec: ChildSpec) -> None:
        slot = self.slots[spec.id]
        self.board.reset(slot, self.generation)
        self.board.write(slot, health.RESTARTS, self.restart_counts.get(spec.id, 0))
        standby = self.standbys.pop(spec.id, None)
        if standby is not None and standby.poll() is None:
            proc = standby  # a warm spare: loaded already, it takes the place at once
            self._set_priority(spec.id, proc, idle=False)  # (one still loading: every request now waits for it)
            self.standby_semaphores[spec.id].release()
            self._backoff(spec.id).succeeded()
            log("promoted", id=spec.id, pid=proc.pid)
        else:
            if standby is not None:
                standby.wait()
            proc = subprocess.Popen(self._command(spec), process_group=0, env=self._child_env(),
                                    stdin=subprocess.DEVNULL, pass_fds=self._pass_fds(spec))
        child = self.children[spec.id] = Child(spec, slot, proc)
        try:
            self._wait_ready(child)
        except StartFailure:
            self._kill(child)
            del self.children[spec.id]
            raise
        self._spawn_standby(spec)

    def _command(self, spec: ChildSpec, standby: str | None = None) -> list[str]:
        cmd = [sys.executable, "-m", "fdcore.actors", spec.kind, "--id", spec.id,
               "--instance", self.instance, "--slot", str(self.slots[spec.id]), "--config", fd_path(self.config_fd),
               "--parent", str(os.getpid())]
        weights, kv = self._weights_fd(spec), self.kv_fds.get(spec.id)
        cmd += ["--weights-fd", str(weights)] if weights is not None else []
        cmd += ["--kv-fd", str(kv)] if kv is not None else []
        if standby:
            cmd += ["--standby", standby]
        return cmd

    def _pass_fds(self, spec: ChildSpec) -> tuple[int, ...]:
        return tuple(fd for fd in (self.config_fd, self._weights_fd(spec), self.kv_fds.get(spec.id)) if fd is not None)

    def _weights_fd(self, spec: ChildSpec) -> int | None:
        return self.weight_fds.get(topology.worker_rank(spec.id)) if spec.kind == "worker" else None

    def _weight_files(self) -> dict[int, int]:
        """One empty shared file per tensor-parallel rank for its packed weights, which the rank's first
        worker fills and its spare, its restarts and the other groups' same rank map (fdcore.models.shared_weights)."""
        workers = self.config.workers
        if self.config.model.backend == "null" or workers.shared_weights == "off":
            return {}
        return {rank: nameless_file(envs.fdcore_home(), f"fdcore-{self.instance}-weights.r{rank}")
                for rank in range(workers.tensor_parallel_size)}

    def _kv_files(self) -> dict[str, int]:
        """One empty shared-memory file per worker process place for its KV cache (``cache.shared_memory``),
        which the worker sizes and writes and its successor (the promoted spare, a restart) maps as it is:
        every block computed before a crash is still there, and the cache manager keeps pointing at them."""
        if not kv_outlives_workers(self.config):
            return {}
        return {spec.id: os.memfd_create(f"fdcore-{self.instance}-kv.{spec.id}", os.MFD_CLOEXEC)
                for spec in self.specs if spec.kind == "worker"}

    # ------------------------------------------------------------- standbys
    def _spawn_standby(self, spec: ChildSpec) -> None:
        """Start a warm spare for a worker (it loads, then waits on its semaphore to take over)."""
        if (spec.kind != "worker" or not self.config.workers.standby or self.stopping or not self.started
                or not self._backoff(spec.id).ready()):
            return
        if spec.id in self.standbys and self.standbys[spec.id].poll() is None:
            return
        semaphore = self.standby_semaphores.get(spec.id)
        if semaphore is None:
            semaphore = self.standby_semaphores[spec.id] = posix_ipc.Semaphore(
                names.object_name(self.instance, f"standby.{spec.id}"), posix_ipc.O_CREX, 0o600, 0)
        while True:  # a promotion the previous spare never took must not promote the next one
            try:
                semaphore.acquire(0)
            except posix_ipc.BusyError:
                break
        self.board.set_spare(self.slots[spec.id], health.SPARE_LOADING)  # (from now: /health says so at once)
        self.standbys[spec.id] = subprocess.Popen(self._command(spec, semaphore.name), process_group=0,
                                                  env=self._child_env(), stdin=subprocess.DEVNULL,
                                                  pass_fds=self._pass_fds(spec))
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
                log("standby_exited", id=cid, pid=proc.pid, reason=_exit_reason(proc.returncode),
                    respawn_in=f"{delay:g}s")
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
            _killpg(proc.pid, signal.SIGKILL)
        for proc in self.standbys.values():
            proc.wait()
            log("standby_stopped", pid=proc.pid)
        self.standbys.clear()

    def _wait_ready(self, child: Child) -> None:
        deadline = time.monotonic() + self.config.supervisor.start_timeout
        loading = 0
        while self.board.read(child.slot, health.STATE) != State.READY:
            loading = self._log_loading(child, loading)
            if child.proc.poll() is not None:
                raise StartFailure(f"{child.spec.id} exited during start-up "
                                   f"({_exit_reason(child.proc.returncode)}); its error is above")
            if time.monotonic() > deadline:
                raise StartFailure(f"{child.spec.id} did not report ready within "
                                   f"{self.config.supervisor.start_timeout:g} s")
            self._wait_events(POLL)
            if self.stopping:
                raise ShutdownRequested()
        self._log_loading(child, loading)

    def _log_loading(self, child: Child, last: int) -> int:
        """Log a child's start-up progress when it moved since ``last`` (permille)."""
        now = self.board.read(child.slot, health.LOADING)
        if now != last:
            log("loading", id=child.spec.id, progress=f"{now / 10:.0f}%")
        return now

    def _child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["OMP_NUM_THREADS"] = str(self.worker_threads)
        if self.placement is not None:
            env[envs.CPUS] = placement.encode_cpus(self.cpus)
        else:
            env.pop(envs.CPUS, None)  # (a tree started from within another's actor)
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        if self.config.model.kernels == "python":
            env[envs.NO_KERNELS] = "1"
        if self.group_master:
            env[envs.GROUP_MASTER] = self.group_master
        return env

    # -------------------------------------------------------------- stopping
    def _stop_all(self) -> None:
        self._stop_standbys()
        for spec in reversed(self.specs):
            child = self.children.pop(spec.id, None)
            if child is not None:
                self._stop_child(child)

    def _stop_child(self, child: Child, message: Stop | None = None) -> None:
        """Stop message (default: the tree's stop), then SIGTERM, then SIGKILL, ``shutdown_timeout``
        apart. A child that is gone already is not sent the message: its successor would read it."""
        t0 = time.monotonic()
        timeout = child.spec.shutdown_timeout
        if child.spec.kind == "api" and not (message and message.restart):  # it drains its requests first
            timeout += self.config.server.drain_timeout
        how = "stop message" if child.proc.poll() is None else "exited before"
        if not self._kill_now and child.proc.poll() is None:
            self._send(child.spec.id, message or Stop(self.stop_reason))
            if not self._wait_exit(child, timeout):
                how = "SIGTERM"
                _killpg(child.proc.pid, signal.SIGTERM)
                if not self._wait_exit(child, timeout):
                    how = "SIGKILL"
        if child.proc.poll() is None:
            how = "SIGKILL"
            self._kill(child)
        log("child_stopped", id=child.spec.id, pid=child.proc.pid, by=how,
            seconds=f"{time.monotonic() - t0:.2f}")

    def _wait_exit(self, child: Child, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while child.proc.poll() is None:
            if self._kill_now or time.monotonic() > deadline:
                return False
            self._wait_events(min(POLL, max(0.0, deadline - time.monotonic())))
        return True

    def _kill(self, child: Child) -> None:
        _killpg(child.proc.pid, signal.SIGKILL)
        child.proc.wait()

    def _send(self, cid: str, message) -> None:
        try:
            self.senders[cid].send(message, timeout=0.5)
        except Exception as exc:  # a full or broken inbox must not stop the shutdown
            log("send_failed", id=cid, error=repr(exc))

    # -------------------------------------------------------------- signals
    @property
    def _kill_now(self) -> bool:
        return len(self._signals) >= 2

    def _install_signals(self) -> None:
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        signal.set_wakeup_fd(self._wake_w)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake select()

    def _on_signal(self, signum, frame) -> None:
        """SIGINT / SIGTERM: stop (a second: kill the children now). Only records it: Python runs the handler
        between any two steps of the main thread, log()'s write to stderr included, where writing again raises
        "reentrant call inside BufferedWriter" (a SIGTERM during a restart's log ended the supervisor with
        exit code 1). The waits report it (_log_signals)."""
        self._signals.append((signum, self.stopping))
        self.stopping = True

    def _log_signals(self) -> None:
        """Log the signals received since the last call, as they were received."""
        while self._signals_logged < len(self._signals):
            signum, was_stopping = self._signals[self._signals_logged]
            self._signals_logged += 1
            name = signal.Signals(signum).name
            if not was_stopping:
                log("signal", name=name, action="stopping")
            if self._signals_logged >= 2:
                log("signal", name=name, action="killing now")

    def _wait_events(self, timeout: float) -> None:
        try:
            select.select([self._wake_r], [], [], timeout)
        except InterruptedError:
            pass
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        self._log_signals()

    # ------------------------------------------------------------------ ipc
    def _create_ipc(self) -> None:
        removed = names.sweep()
        if removed:
            log("swept", objects=len(removed))
        self._check_shared_memory()
        names.claim_instance(self.instance)
        try:
            self._create_segments()
        except NoSharedMemory as exc:  # (filled by someone else since the check)
            raise StartFailure(f"{exc.strerror}; this tree needs "
                               f"{shared_memory_line(self.config, self._group_bytes())}") from None

    def _check_shared_memory(self) -> None:
        """Refuse to start, with one line, where /dev/shm cannot hold the tree's segments: they are
        committed at creation, so a start that passes this never meets SIGBUS for lack of room."""
        group = self._group_bytes()
        need, _ = topology.shared_memory_need(self.config, group)
        free = free_bytes()
        if need > free:
            raise StartFailure(f"{SHM_DIR} has {free:,} bytes free; this tree needs "
                               f"{shared_memory_line(self.config, group)}"
                               " (make /dev/shm larger, or lower supervisor.ring_capacity or engine.max_clients)")

    def _group_bytes(self) -> int:
        """The worker group's communicator segment (0 without one)."""
        from fdcore.ipc.allreduce import ShmCommunicator

        shape = self._group_shape()
        return 0 if shape is None else ShmCommunicator.segment_size(*shape)

    def _group_shape(self) -> tuple[int, int] | None:
        """(ranks, bytes a rank's slot) of the worker group's shared-memory communicator, sized from the
        checkpoint's shapes (its headers only: no weights are read here); None without one."""
        if self.config.workers.tensor_parallel_size == 1 or self.config.workers.communicator == "paddle":
            return None
        from fdcore.checkpoint import inspect_checkpoint
        from fdcore.models.tensor_parallel import communicator_capacity

        world = self.config.workers.tensor_parallel_size
        return world, communicator_capacity(inspect_checkpoint(model_path(self.config)), self.config.scheduler, world)

    def _create_segments(self) -> None:
        self.board = HealthBoard.create(topology.health_name(self.instance), len(self.specs))
        capacity = self.config.supervisor.ring_capacity
        own = Inbox.create(topology.inbox_name(self.instance, topology.SUPERVISOR),
                           [s.id for s in self.specs], capacity=capacity)
        self.inboxes.append(own)
        for spec in self.specs:
            inbox = Inbox.create(topology.inbox_name(self.instance, spec.id),
                                 list(spec.producers), capacity=capacity)
            self.inboxes.append(inbox)
            self.senders[spec.id] = Sender(Ring.attach(inbox.link_name(topology.SUPERVISOR)))
        for client in topology.client_ids(self.config):
            self.inboxes.append(Inbox.create(topology.inbox_name(self.instance, client), ["engine"],
                                             capacity=capacity))
        self.step_ring = BroadcastRing.create(
            [topology.inbox_name(self.instance, worker) for worker in topology.worker_ids(self.config)],
            capacity, name=topology.step_ring_name(self.instance))
        if self.config.workers.tensor_parallel_size > 1:
            self._renew_group()

    def _renew_group(self) -> None:
        """Before a worker group starts (no rank runs): a fresh communicator. The shared-memory one's
        generations are zeroed (the new group counts its collectives from 0); a paddle.distributed
        group gets a new rendezvous port (FDCORE_GROUP_MASTER in the ranks' environment)."""
        if self.config.workers.tensor_parallel_size == 1:
            return
        if self.config.workers.communicator == "paddle":
            from fdcore.models.tensor_parallel import free_port_block

            self.group_master = f"127.0.0.1:{free_port_block(self.config.workers.tensor_parallel_size + 1)}"
        elif self.group_comm is None:
            self._create_group_comm()
        else:
            self.group_comm.reset()

    def _create_group_comm(self) -> None:
        from fdcore.ipc.allreduce import ShmCommunicator

        self.group_comm = ShmCommunicator.create(topology.group_name(self.instance), *self._group_shape())

    def _destroy_ipc(self) -> None:
        for semaphore in self.standby_semaphores.values():
            semaphore.close()
        for sender in self.senders.values():
            sender.close()
        for inbox in self.inboxes:
            inbox.close()
        if self.step_ring is not None:
            self.step_ring.close()
        if self.board is not None:
            self.board.close()
        if self.group_comm is not None:
            self.group_comm.close()
        names.unlink_instance(self.instance)


def shared_memory_line(config: Config, group_bytes: int = 0) -> str:
    """The tree's /dev/shm need as one phrase (logs, --check)."""
    need, objects = topology.shared_memory_need(config, group_bytes)
    return (f"{need:,} bytes in {objects} objects (supervisor.ring_capacity = {config.supervisor.ring_capacity:,} "
            f"a link, engine.max_clients = {config.engine.max_clients})")


def actor_pid(supervisor_pid: int, child_id: str) -> int | None:
    """The live process of one actor of a running tree, found by its title (tools, tests, chaos)."""
    pids = actor_processes(supervisor_pid).get(topology.title_of(child_id), [])
    return pids[0] if pids else None


def actor_processes(supervisor_pid: int) -> dict[str, list[int]]:
    """The supervisor's live children by process title (fdcore:engine: [pid], ...): a healthy tree
    has exactly one per actor, whatever restarts it went through."""
    import psutil

    found: dict[str, list[int]] = {}
    for child in psutil.Process(supervisor_pid).children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                found.setdefault(child.cmdline()[0], []).append(child.pid)
        except (psutil.NoSuchProcess, IndexError):
            continue
    return found


def actor_census(supervisor_pid: int, child_ids: list[str]) -> str:
    """'' when every actor runs as exactly one process, else what is wrong ('2 fdcore:engine
    (pids ...)', '0 fdcore:cache'): what chaos runs and tests check after each restart."""
    found = actor_processes(supervisor_pid)
    wrong = [(title, found.get(title, [])) for title in map(topology.title_of, child_ids)]
    return ", ".join(f"{len(pids)} {title} (pids {pids})" for title, pids in wrong if len(pids) != 1)


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _exit_reason(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


def log(event: str, **fields) -> None:
    text = " ".join(f"{k}={_quote(v)}" for k, v in fields.items())
    sys.stderr.write(f"fdcore.supervisor: event={event} {text}\n")
    sys.stderr.flush()


def _quote(value) -> str:
    text = str(value)
    return json.dumps(text) if (" " in text or not text) else text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fdcore.supervisor", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="TOML configuration file")
    parser.add_argument("--check", action="store_true", help="validate, print the effective configuration, exit")
    parser.add_argument("--ready-fd", type=int, default=None,
                        help="write the instance id to this file descriptor once ready (used by AsyncLLM)")
    parser.add_argument("--stop-with-parent", action="store_true",
                        help="shut down when the process that started us dies (embedded use)")
    parser.add_argument("--parent-fd", type=int, default=None,
                        help="shut down when this pipe reaches end-of-file: every holder of its write end "
                             "(the embedding process) is gone; unlike --stop-with-parent it follows the "
                             "process, not the thread that started us (used by AsyncLLM / LLM)")
    args = parser.parse_args(argv)
    return _supervise(args)


def _supervise(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"fdcore: configuration error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        print(render_config(config))
        print(_describe_spares(config))
        print(_describe_shared_weights(config))
        return max(_check_shared_memory(config), _check_model(config))
    import setproctitle

    setproctitle.setproctitle("fdcore:supervisor")
    if args.stop_with_parent:
        _stop_with_parent()
    if args.parent_fd is not None:
        _stop_when_closed(args.parent_fd)
    return Supervisor(config, args.ready_fd).run()


def _check_model(config: Config) -> int:
    """--check's look at the checkpoint: print its chat templates and the sampling defaults the
    engine will give requests that leave them unset; a model the engine could not start with is an
    error (exit code 2)."""
    from fdcore.checkpoint import CheckpointError

    try:
        print(describe_model(config))
    except CheckpointError as exc:
        print(f"fdcore: checkpoint error: {exc}", file=sys.stderr)
        return 2
    return 0


def _describe_spares(config: Config) -> str:
    """--check's line on the warm spares."""
    if not config.workers.standby:
        return "# warm spare workers: off (workers.standby = false): a crashed worker is started afresh"
    return ("# warm spare workers: on (workers.standby): the tree says ready once each spare is loaded and warm "
            "(a spare that loads later, after a promotion, loads at idle priority); /health says whether it is warm")


def nameless_file(directory: str, name: str) -> int:
    """An empty file with no name (``O_TMPFILE``) on ``directory``'s filesystem, else a memfd called ``name``.
    Neither can outlive its last holder, whatever signal ends the tree. A disk filesystem's page cache
    gives a mapped file large folios (Linux 6.x: ext4, xfs), mapped with huge-page TLB entries, where
    shared memory gets 4 KiB pages unless the kernel's shmem THP setting allows more; on a Zen 4 EPYC
    a float32 weight stream over such a file ran as fast as over private huge pages, over a memfd 39 %
    slower. The file's pages are written back to the disk once, like any file's."""
    try:
        os.makedirs(directory, exist_ok=True)
        return os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError:  # (no O_TMPFILE on that filesystem, or no directory to be had)
        return os.memfd_create(name, os.MFD_CLOEXEC)


def _describe_shared_weights(config: Config) -> str:
    """--check's line on where the packed weights live."""
    mode = config.workers.shared_weights
    if mode == "off" or config.model.backend == "null":
        return "# shared weights: off: every worker process packs a private copy of its weights"
    return (f"# shared weights: {mode}: each rank's packed weights once in a nameless shared file (in "
            f"{envs.fdcore_home()}, or a memfd where that filesystem cannot hold one), mapped read-only by its spare "
            "and its restarts" + (" unless its pages measure over 20% slower than private huge pages at load"
                                  if mode == "auto" else ""))


def _check_shared_memory(config: Config) -> int:
    """--check's look at /dev/shm: what the tree will commit there and what is free (exit code 2 when it
    does not fit; a tensor-parallel group's communicator is not counted here)."""
    need, _ = topology.shared_memory_need(config)
    free = free_bytes()
    print(f"# shared memory: {shared_memory_line(config)}; {SHM_DIR} has {free:,} bytes free")
    if need > free:
        print(f"fdcore: {SHM_DIR} has {free:,} bytes free; this tree needs {need:,}", file=sys.stderr)
        return 2
    return 0


def describe_model(config: Config) -> str:
    """The model as the engine will serve it, as TOML comments (templates compiled, defaults checked)."""
    from fdcore.core.generation_config import generation_config_file, sampling_defaults
    from fdcore.core.tokenizer import ModelTokenizer
    from fdcore.checkpoint import inspect_checkpoint

    path, mode = model_path(config), config.model.generation_config
    args = inspect_checkpoint(path)
    tokenizer = ModelTokenizer(path)
    limits = tokenizer.limits(config.scheduler.max_model_len, config.cache.num_blocks * config.cache.block_size)
    defaults = sampling_defaults(path, mode, limits)
    templates = ", ".join(f"{t.name} ({t.source})" for t in tokenizer.chat_templates.templates.values())
    source = f'model.generation_config = "{mode}"' + (f", {generation_config_file(path)}" if mode == "auto" else "")
    shape = (f"# {args.architecture}: {args.num_layers} layers, hidden {args.hidden_size}, {args.num_heads} heads "
             f"({args.num_kv_heads} kv), vocab {args.vocab_size}; config and tensor headers checked")
    lines = [f"# model {path}", shape, f"# chat templates: {templates or 'none'}",
             f"# sampling defaults for requests that leave them unset ({source}):" + ("" if defaults else " none")]
    return "\n".join(lines + [f"#   {name} = {json.dumps(value)}" for name, value in defaults.items()])


def _stop_with_parent() -> None:
    """SIGTERM (a clean stop) when our parent dies: an embedded tree ends with its program."""
    import ctypes

    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGTERM, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def _stop_when_closed(fd: int) -> None:
    """SIGTERM (a clean stop) once ``fd``, a pipe's read end, reads EOF: the kernel closes the write
    end when the embedding process ends, whichever of its threads started us."""
    import threading

    os.set_inheritable(fd, False)  # our own children must not hold it open

    def watch() -> None:
        while os.read(fd, 64):
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="fdcore-parent-watch", daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
