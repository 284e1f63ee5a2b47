"""A supervisor tree under test: started as a real process, watched through its event log."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import psutil

from fdcore.checkpoint import tiny
from fdcore.config import parse_config
from fdcore.ipc import names

EVENT = re.compile(r"^fdcore\.supervisor: event=(\w+)(.*)$")
FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tree_config(model: str, **sections):
    """A parsed configuration for ``model``: each keyword a section, its dict that section's keys."""
    text = f'[model]\npath = "{model}"\n'
    for section, keys in sections.items():
        text += f"[{section}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items())
    return parse_config(text)


def make_model_dir(tmp_path) -> str:
    """The bundled tiny model, sharded so that loading reports progress in steps."""
    return tiny.make_tiny_model(str(tmp_path / "model"), shards=2)


class Tree:
    """``python -m fdcore.supervisor`` (or ``command``: another way to start one, e.g. ``fdcore serve``)
    in a session of its own, its events parsed from stderr."""

    def __init__(self, config_path: str | None, env: dict | None = None, command: list[str] | None = None):
        """``env``: variables over ours (None: unset)."""
        self.proc = subprocess.Popen(
            command or [sys.executable, "-m", "fdcore.supervisor", "--config", config_path],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
            start_new_session=True,
            env={k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None},
        )
        self.events: queue.Queue = queue.Queue()
        self.log: list[str] = []
        self.pids: dict[str, int] = {}
        self.seen_pids: set[int] = set()
        self.instance = None
        self.log_complete = threading.Event()  # stderr reached its end: the log holds every line
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line.rstrip())
            match = EVENT.match(line.strip())
            if match:
                fields = {k: v.strip('"') for k, v in FIELD.findall(match.group(2))}
                self.events.put((match.group(1), fields))
        self.log_complete.set()
        self.events.put(("eof", {}))

    def wait(self, event: str, timeout: float = 60, **match) -> dict:
        """The next event of that name (and fields); earlier other events are recorded."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no event {event} {match} within {timeout} s; log:\n" + "\n".join(self.log))
            try:
                name, fields = self.events.get(timeout=remaining)
            except queue.Empty:
                continue
            self._track(name, fields)
            if name == event and all(fields.get(k) == str(v) for k, v in match.items()):
                return fields
            if name == "eof":
                raise AssertionError(f"supervisor ended before {event} {match}; log:\n" + "\n".join(self.log))

    def _track(self, name: str, fields: dict) -> None:
        if name in ("started", "restarted"):
            self.pids[fields["id"]] = int(fields["pid"])
            self.seen_pids.add(int(fields["pid"]))
        if name == "ready":
            self.instance = fields["instance"]

    def kill_child(self, cid: str, sig=signal.SIGKILL) -> int:
        pid = self.pids[cid]
        os.kill(pid, sig)
        return pid

    def exit_code(self, timeout: float = 60) -> int:
        """Wait for the supervisor's exit, and for the last lines it and its children wrote."""
        code = self.proc.wait(timeout)
        self.log_complete.wait(5)
        return code

    def destroy(self) -> None:
        """Kill whatever is left, however the test ended. Shared memory is removed here only when
        the supervisor had to be killed (it could not clean up); a tree that stopped on its own
        must have removed everything itself, and the leak guard judges that."""
        procs = []
        try:
            procs = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pass
        killed_supervisor = self.proc.poll() is None
        for pid in [self.proc.pid, *self.seen_pids, *(p.pid for p in procs)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait(10)
        psutil.wait_procs([p for p in procs if p.is_running()], timeout=5)
        if killed_supervisor:  # (before "ready" the instance is known only by the supervisor's pid in its name)
            instances = (
                {self.instance}
                if self.instance
                else {e.instance_id for e in names.list_entries() if e.instance_id.endswith(f".{self.proc.pid}")}
            )
            for instance in instances:
                names.unlink_instance(instance)

    def alive_children(self) -> list[int]:
        return [
            pid
            for pid in self.seen_pids
            if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        ]
