"""The tree a client talks to: a supervisor it started (living as long as this process) or one found running,
and whether it is healthy."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

from fdcore.actors import health, topology
from fdcore.actors.health import HealthBoard, State
from fdcore.client.outputs import EngineError
from fdcore.config import Config, config_memfd, fd_path
from fdcore.core import placement
from fdcore.ipc import names


# --------------------------------------------------------------------- tree
class Tree:
    """The supervisor we started (if any) and the instance id we talk to."""

    def __init__(
        self,
        instance: str,
        proc: subprocess.Popen | None = None,
        lifeline: int | None = None,
        control_cpus: list[int] | None = None,
    ):
        self.instance = instance
        self.control_cpus = control_cpus  # where the tree's control plane runs (the supervisor's plan), if pinned
        self.proc = proc
        self.lifeline = lifeline  # write end of the pipe whose EOF tells the supervisor we are gone

    @classmethod
    def start(cls, config, timeout: float) -> Tree:
        """Start a supervisor that lives as long as this *process*. NOTE: PR_SET_PDEATHSIG follows
        the thread that forked, so a client built in a worker thread lost its tree when that thread
        ended; instead the supervisor reads a pipe whose only write end we hold (close-on-exec, so
        no program we start keeps it), and the kernel closes it when this process ends, however. A
        configuration given as a Config reaches it as an in-memory file descriptor: no file is
        written that a killed program could leave behind."""
        path, config_fd = _config_source(config)
        read_fd, write_fd = os.pipe()
        watch_fd, lifeline = os.pipe()
        cmd = [
            sys.executable,
            "-m",
            "fdcore.supervisor",
            "--config",
            path,
            "--ready-fd",
            str(write_fd),
            "--parent-fd",
            str(watch_fd),
        ]
        passed = (write_fd, watch_fd) + (() if config_fd is None else (config_fd,))
        try:
            proc = subprocess.Popen(cmd, pass_fds=passed, process_group=0, stdin=subprocess.DEVNULL)
        finally:
            os.close(write_fd)
            os.close(watch_fd)
            if config_fd is not None:
                os.close(config_fd)
        try:
            instance, *control = _read_ready(read_fd, proc, timeout).split()
        except BaseException:
            _terminate(proc, 5.0)
            os.close(lifeline)
            raise
        finally:
            os.close(read_fd)
        return cls(instance, proc, lifeline, placement.decode_cpus(control[0]) if control else None)

    @classmethod
    def find(cls, instance: str | None) -> Tree:
        running = sorted(
            {
                e.instance_id
                for e in names.list_entries()
                if topology.is_engine_inbox(e) and names.pid_alive(e.owner_pid)
            }
        )
        if instance is None:
            if len(running) != 1:
                raise EngineError(
                    f"connect(): {len(running)} running fdcore instances ({', '.join(running)}); "
                    "name one with instance=..."
                )
            instance = running[0]
        elif instance not in running:
            raise EngineError(f"connect(): no running fdcore instance {instance!r} (running: {running})")
        return cls(instance)

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return names.pid_alive(int(self.instance.rsplit(".", 1)[1]))

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is not None:
            _terminate(self.proc, timeout)
            self.proc = None
        if self.lifeline is not None:
            os.close(self.lifeline)
            self.lifeline = None


def _config_source(config) -> tuple[str, int | None]:
    """(what the supervisor's --config names, the descriptor to hand it or None): a path as given, a
    Config (None: the defaults) rendered into an in-memory file."""
    if isinstance(config, (str, os.PathLike)):
        return os.fspath(config), None
    if config is None:
        config = Config()
    if not isinstance(config, Config):
        raise TypeError(f"config must be a TOML file path or a fdcore.config.Config, got {type(config).__name__}")
    fd = config_memfd(config)
    return fd_path(fd), fd


def _read_ready(fd: int, proc: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    data = b""
    while not data.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise EngineError(f"the fdcore tree did not become ready within {timeout:g} s")
        if select.select([fd], [], [], remaining)[0]:
            chunk = os.read(fd, 256)
            if not chunk:
                code = proc.wait()
                raise EngineError(
                    f"the fdcore tree failed to start (supervisor exit code {code}); its log above says why"
                )
            data += chunk
    return data.decode().strip()


def _terminate(proc: subprocess.Popen, timeout: float) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def check_health(tree: Tree, stale_after: float = 10.0) -> tuple[bool, str]:
    """(True, "") once the tree is ready, while the supervisor lives and every actor is READY with a fresh
    heartbeat."""
    if not tree.alive():
        return False, f"the supervisor of {tree.instance} is gone"
    try:
        board = HealthBoard.attach(topology.health_name(tree.instance))
    except Exception as exc:
        return False, f"no health board ({exc})"
    try:
        if not board.tree_ready():  # (fdcore serve answers before: while the first warm spares load)
            return False, "starting: the tree is not ready yet"
        now = time.monotonic_ns()
        for slot in range(board.slots):
            state = board.read(slot, health.STATE)
            if state != State.READY:
                return False, f"actor in slot {slot} is {State(state).name}"
            age = health.silence_ns(board.read(slot, health.HEARTBEAT), board.read(slot, health.GRACE), now) / 1e9
            if age > stale_after:
                return False, f"actor in slot {slot} has not ticked for {age:.1f} s"
        return True, ""
    finally:
        board.close()


def tree_gone(tree: Tree) -> str:
    if tree.proc is not None and tree.proc.poll() is not None:
        return f"the fdcore tree stopped (supervisor exit code {tree.proc.returncode}; its log says why)"
    return f"the fdcore tree {tree.instance} stopped"
