"""The actor runtime: an OS process with a title, an inbox, a handler per message, a heartbeat.

Lifecycle (pykka's hooks, OTP's readiness):

1. the process titles itself (``fdcore:<id>``), asks the kernel to SIGKILL it
   if the supervisor dies (``PR_SET_PDEATHSIG``), attaches its inbox and its
   health slot;
2. ``on_start()`` does the slow set-up (a worker loads weights); only then is
   the slot marked READY, which is what the supervisor waits for;
3. the loop takes batches of messages, hands each to ``handle()`` and bumps the
   progress counter; it ticks the heartbeat at least every
   ``heartbeat_interval`` even when idle;
4. a ``Stop`` message or SIGTERM ends the loop: ``on_stop()`` runs and the
   process exits 0. Any exception is a crash: a report (actor, pid, traceback)
   goes to stderr, which is the supervisor's log, and the process exits 1.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import time
import traceback

from fdcore.actors import health, topology
from fdcore.actors.health import HealthBoard, State
from fdcore.config import Config, load_config
from fdcore.ipc import Inbox, Receiver, Ring, RingEmpty, Sender
from fdcore.protocol import ControlMessage, Ping, Pong, Stop

PR_SET_PDEATHSIG = 1


class StopRequested(BaseException):
    """Raised by the SIGTERM handler so a blocking wait ends at once."""


class Actor:
    """Base class: subclasses set ``inbox_type`` and override the hooks."""

    inbox_type = ControlMessage

    def __init__(self, child_id: str, instance_id: str, config: Config, board: HealthBoard,
                 slot: int):
        self.child_id = child_id
        self.instance_id = instance_id
        self.config = config
        self.board = board
        self.slot = slot
        self._senders: dict[str, Sender] = {}
        self.stopping = False

    # ------------------------------------------------------------------ hooks
    def on_start(self) -> None:
        """Slow set-up before the actor counts as ready."""

    def handle(self, message) -> None:
        """One message; the default understands the control messages."""
        match message:
            case Ping(nonce=nonce):
                self.send(topology.SUPERVISOR, Pong(nonce, self.child_id))
            case Stop():
                self.stopping = True
            case _:
                raise ValueError(f"{self.child_id}: unexpected message {type(message).__name__}")

    def on_stop(self) -> None:
        """Clean-up after the loop ends (not called after a crash)."""

    def has_work(self) -> bool:
        """True while work is queued that should make progress (hang detection)."""
        return False

    # --------------------------------------------------------------- plumbing
    def send(self, to: str, message) -> None:
        """Send to another actor's inbox (or the supervisor's) over this actor's link."""
        sender = self._senders.get(to)
        if sender is None:
            inbox = topology.inbox_name(self.instance_id, to)
            sender = self._senders[to] = Sender(Ring.attach(f"{inbox}.{self.child_id}"))
        sender.send(message)

    def close(self) -> None:
        for sender in self._senders.values():
            sender.close()


def run(actor: Actor, inbox: Inbox) -> None:
    """The loop: receive, handle, tick; returns when asked to stop."""
    board, slot = actor.board, actor.slot
    receiver = Receiver(inbox, actor.inbox_type)
    interval = actor.config.supervisor.heartbeat_interval
    progress = 0
    while not actor.stopping:
        board.write(slot, health.HEARTBEAT, time.monotonic_ns())
        try:
            messages = receiver.recv_many(timeout=interval)
        except RingEmpty:
            continue
        board.write(slot, health.BUSY, 1)
        for message in messages:
            actor.handle(message)
            progress += 1
            board.write(slot, health.PROGRESS, progress)
            if actor.stopping:
                break
        board.write(slot, health.BUSY, int(actor.has_work()))


def main(actor_cls, argv=None) -> int:
    args = _parse_args(argv)
    _die_with_parent(args.parent)
    _set_title(topology.title_of(args.id))
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the supervisor's to handle
    config = load_config(args.config, check_model=False)
    board = HealthBoard.attach(topology.health_name(args.instance))
    board.write(args.slot, health.PID, os.getpid())
    board.write(args.slot, health.STATE, State.STARTING)
    inbox = Inbox.attach(topology.inbox_name(args.instance, args.id),
                         topology.producers_of(args.id, config))
    actor = actor_cls(args.id, args.instance, config, board, args.slot)
    try:
        actor.on_start()
        board.write(args.slot, health.STATE, State.READY)
        run(actor, inbox)
        board.write(args.slot, health.STATE, State.STOPPING)
        actor.on_stop()
    except StopRequested:
        board.write(args.slot, health.STATE, State.STOPPING)
        actor.on_stop()
    except Exception:
        _crash_report(args.id)
        return 1
    finally:
        actor.close()
        inbox.close()
    board.write(args.slot, health.STATE, State.STOPPED)
    board.close()
    return 0


def _parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m fdcore.actors")
    parser.add_argument("kind")
    parser.add_argument("--id", required=True)
    parser.add_argument("--instance", required=True)
    parser.add_argument("--slot", type=int, required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--parent", type=int, required=True, help="the supervisor's pid")
    return parser.parse_args(argv)


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL us the moment the supervisor dies, however it dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # it died before prctl took effect
        os._exit(1)


def _set_title(title: str) -> None:
    import setproctitle

    setproctitle.setproctitle(title)


def _raise_stop(signum, frame):
    raise StopRequested()


def _crash_report(child_id: str) -> None:
    sys.stderr.write(f"fdcore: CRASH actor={child_id} pid={os.getpid()}\n{traceback.format_exc()}")
    sys.stderr.flush()
