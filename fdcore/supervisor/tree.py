"""The supervisor's loop over one tree (see the package's docstring for what it guarantees)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time

from fdcore import envs, janitor
from fdcore.actors import health, topology
from fdcore.actors.health import HealthBoard, State
from fdcore.config import Config, config_memfd, fd_path, worker_ranks, worker_threads
from fdcore.core import placement
from fdcore.ipc import BroadcastRing, Inbox, Sender, names
from fdcore.protocol import Restarted, Stop
from fdcore.supervision import Backoff, ChildSpec, RestartIntensity, plan_restart, should_restart
from fdcore.supervisor.children import POLL, Child, ShutdownRequested, StartFailure, exit_reason, killpg
from fdcore.supervisor.events import log
from fdcore.supervisor.segments import SharedMemory
from fdcore.supervisor.spares import Spares


class Supervisor(SharedMemory, Spares):
    """The OTP loop of one tree: start the children in order, restart what exits or hangs by its strategy within
    the restart intensity, stop in reverse order on a signal (fdcore.supervision holds the policy as data)."""

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
        self.placement = (
            placement.plan(self.cpus, worker_ranks(config.workers), self.worker_threads)
            if config.workers.pin_cpus
            else None
        )

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
            log(
                "ready",
                instance=self.instance,
                children=len(self.children),
                math_threads=self.worker_threads,
                seconds=f"{time.monotonic() - started:.2f}",
            )
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
        proc = subprocess.Popen(
            [sys.executable, "-m", "fdcore.cli", "build-kernels"],
            env=env,
            process_group=0,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
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
                killpg(proc.pid, signal.SIGKILL)  # (the builder leads a group: its compilers too)
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
                    self._on_exit(child, exit_reason(child.proc.returncode), abnormal=child.proc.returncode != 0)
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
        plan = plan_restart(
            self.config.supervisor.strategy, order, child.spec.id, self.children, [topology.worker_ids(self.config)]
        )
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
        if (
            not self.stopping
            and "engine" in self.children
            and any(self.children[c].spec.stateful for c in plan.start if c in self.children)
        ):
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
            log("exited", id=sibling.spec.id, pid=sibling.proc.pid, reason=exit_reason(sibling.proc.returncode))
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
        killpg(child.proc.pid, signal.SIGTERM)
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
        return child.stall.look(
            board.read(slot, health.HEARTBEAT),
            board.read(slot, health.PROGRESS),
            bool(board.read(slot, health.BUSY)),
            time.monotonic_ns(),
            int(self.config.supervisor.hang_timeout * 1e9),
            board.read(slot, health.GRACE),
        )

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
            proc = subprocess.Popen(
                self._command(spec),
                process_group=0,
                env=self._child_env(),
                stdin=subprocess.DEVNULL,
                pass_fds=self._pass_fds(spec),
            )
        child = self.children[spec.id] = Child(spec, slot, proc)
        try:
            self._wait_ready(child)
        except StartFailure:
            self._kill(child)
            del self.children[spec.id]
            raise
        self._spawn_standby(spec)

    def _command(self, spec: ChildSpec, standby: str | None = None) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "fdcore.actors",
            spec.kind,
            "--id",
            spec.id,
            "--instance",
            self.instance,
            "--slot",
            str(self.slots[spec.id]),
            "--config",
            fd_path(self.config_fd),
            "--parent",
            str(os.getpid()),
        ]
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

    def _wait_ready(self, child: Child) -> None:
        deadline = time.monotonic() + self.config.supervisor.start_timeout
        loading = 0
        while self.board.read(child.slot, health.STATE) != State.READY:
            loading = self._log_loading(child, loading)
            if child.proc.poll() is not None:
                raise StartFailure(
                    f"{child.spec.id} exited during start-up ({exit_reason(child.proc.returncode)}); its error is above"
                )
            if time.monotonic() > deadline:
                raise StartFailure(
                    f"{child.spec.id} did not report ready within {self.config.supervisor.start_timeout:g} s"
                )
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
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
                killpg(child.proc.pid, signal.SIGTERM)
                if not self._wait_exit(child, timeout):
                    how = "SIGKILL"
        if child.proc.poll() is None:
            how = "SIGKILL"
            self._kill(child)
        log("child_stopped", id=child.spec.id, pid=child.proc.pid, by=how, seconds=f"{time.monotonic() - t0:.2f}")

    def _wait_exit(self, child: Child, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while child.proc.poll() is None:
            if self._kill_now or time.monotonic() > deadline:
                return False
            self._wait_events(min(POLL, max(0.0, deadline - time.monotonic())))
        return True

    def _kill(self, child: Child) -> None:
        killpg(child.proc.pid, signal.SIGKILL)
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
