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

from fdcore import logs
from fdcore.actors import faults, health, topology
from fdcore.actors.health import HealthBoard, State
from fdcore.checkpoint import CheckpointError
from fdcore.config import Config, load_config, worker_ranks, worker_threads
from fdcore.core import placement
from fdcore.ipc import BroadcastRing, Inbox, Receiver, Ring, RingEmpty, Sender
from fdcore.protocol import ControlMessage, Ping, Pong, Stop, Suspects

_log = logs.logger(__name__)

PR_SET_PDEATHSIG = 1


class Interrupted(Exception):
    """A wait for a reply ended by a message that changes everything (see Actor.call)."""


class StopRequested(KeyboardInterrupt):
    """Raised by the SIGTERM handler so a blocking wait ends at once.

    NOTE: it derives from KeyboardInterrupt because that is the one exception posix_ipc lets a
    signal handler raise out of a semaphore wait: when the signal interrupts the wait itself
    (EINTR), posix_ipc runs the handler and replaces any other exception it raised with
    SignalError, which the doorbell treats as a spurious wake-up. A plain BaseException was lost
    that way whenever the kernel delivered SIGTERM to the waiting main thread, and the actor was
    SIGKILLed a shutdown_timeout later without its on_stop."""


class Actor:
    """Base class: subclasses set ``inbox_type`` and override the hooks."""

    inbox_type = ControlMessage
    suspects_to: str | None = None  # where a crash report naming requests goes (on to the engine)

    def __init__(self, child_id: str, instance_id: str, config: Config, board: HealthBoard, slot: int):
        self.child_id = child_id
        self.instance_id = instance_id
        self.config = config
        self.board = board
        self.slot = slot
        self._senders: dict[str, Sender] = {}
        self.stopping = False
        self.standby = False  # a warm spare that has not taken over yet: it must not touch the slot
        self.placement: placement.Placement | None = None  # the tree's CPU plan, where the supervisor set one
        self.weights_fd: int | None = None  # a worker's: its rank's shared weight file (fdcore.models.shared_weights)
        self.kv_fd: int | None = None  # a worker's: its rank's KV cache file (cache.shared_memory)
        self.stop_reason = "stopped"
        self.restarting = False  # stopped only to be started again: open work goes to the successor
        self.receiver: Receiver | None = None  # set by run()
        self.deferred: list = []  # messages that arrived while waiting for a reply (see call())
        self.handling: list[int] = []  # requests the work in hand concerns: named if it raises

    # ------------------------------------------------------------------ hooks
    def on_start(self) -> None:
        """Slow set-up before the actor counts as ready."""

    def handle(self, message) -> None:
        """One message; the default understands the control messages."""
        match message:
            case Ping(nonce=nonce):
                self.send(topology.SUPERVISOR, Pong(nonce, self.child_id))
            case Stop(reason=reason, restart=restart):
                self.stopping = True
                self.stop_reason = reason
                self.restarting = restart
            case _:
                raise ValueError(f"{self.child_id}: unexpected message {type(message).__name__}")

    def make_receiver(self, inbox: Inbox):
        """How the loop reads the inbox (an actor that must know each message's link overrides
        this and :meth:`dispatch`)."""
        return Receiver(inbox, self.inbox_type)

    def dispatch(self, item) -> None:
        """One item of what the receiver returned: for most actors, a message."""
        self.handle(item)

    def on_stop(self) -> None:
        """Clean-up after the loop ends (not called after a crash)."""

    def has_work(self) -> bool:
        """True while work is queued that should make progress (hang detection)."""
        return False

    def after_messages(self) -> None:
        """Called after each batch of messages (or an idle wait): act on what was learnt."""

    def wait_timeout(self, interval: float) -> float:
        """How long the loop may wait for a message (shorter while there is work to retry)."""
        return interval

    def heartbeat(self) -> None:
        """Tell the supervisor this actor is alive (its health slot's heartbeat, now)."""
        self.board.write(self.slot, health.HEARTBEAT, time.monotonic_ns())

    def report_suspects(self) -> None:
        """Crash handler: name the requests we were handling, so that one that keeps crashing us is
        quarantined instead of re-submitted into the next crash (best effort: we are dying)."""
        if self.suspects_to is None or not self.handling:
            return
        try:
            self.send(self.suspects_to, Suspects(self.child_id, getattr(self, "epoch", None) or 0, list(self.handling)))
        except Exception as exc:
            _log.warning(f"fdcore: {self.child_id} could not report its suspects: {exc!r}")

    # --------------------------------------------------------------- plumbing
    def _sender(self, to: str) -> Sender:
        sender = self._senders.get(to)
        if sender is None:
            if to == topology.WORKERS:
                ring = BroadcastRing.attach(topology.step_ring_name(self.instance_id))
            else:
                ring = Ring.attach(topology.link_name(self.instance_id, to, self.child_id))
            sender = self._senders[to] = Sender(ring)
        return sender

    def send(self, to: str, message) -> None:
        """Send to another actor's inbox (or the supervisor's) over this actor's link; to
        ``topology.WORKERS``, every rank of the worker group at once (the scheduler's steps)."""
        self._sender(to).send(message)

    def send_many(self, to: str, messages: list) -> None:
        """Several messages as one record: one copy, one publish, one wake-up."""
        if len(messages) == 1:
            self._sender(to).send(messages[0])
        elif messages:
            self._sender(to).send_many(messages)

    def call(self, to: str, message, reply_type, timeout: float, prelude: list = (), *, accept=None, interrupt=None):
        """Send ``message`` (after ``prelude``, in the same record) and wait for the first
        message of ``reply_type`` (that ``accept`` approves, if given); everything else that
        arrives meanwhile is kept, in order, for the loop (``deferred``). A message of type (or
        tuple of types) ``interrupt`` ends the wait at once with :class:`Interrupted` (it stays deferred)."""
        self.send_many(to, [*prelude, message])
        deadline = time.monotonic() + timeout
        interval = self.config.supervisor.heartbeat_interval
        busy = self.board.read(self.slot, health.BUSY)
        self.board.write(self.slot, health.BUSY, 0)  # waiting on a peer: its own health says if it is stalled
        try:
            return self._await_reply(to, reply_type, deadline, timeout, interval, accept, interrupt)
        finally:
            self.board.write(self.slot, health.BUSY, busy)

    def _await_reply(self, to: str, reply_type, deadline: float, timeout: float, interval: float, accept, interrupt):
        """call()'s wait, ticking the heartbeat (we are alive, only waiting)."""
        while True:
            self.heartbeat()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self.child_id}: no {reply_type.__name__} from {to} within {timeout:g} s")
            try:
                batch = self.receiver.recv_many(timeout=min(remaining, interval))
            except RingEmpty:
                continue
            for i, reply in enumerate(batch):
                if isinstance(reply, reply_type) and (accept is None or accept(reply)):
                    self.deferred += batch[i + 1 :]
                    return reply
                if isinstance(reply, reply_type):
                    continue  # a stale answer (another epoch): dropped
                self.deferred.append(reply)
                if interrupt is not None and isinstance(reply, interrupt):
                    self.deferred += batch[i + 1 :]
                    raise Interrupted(reply)

    def close(self) -> None:
        for sender in self._senders.values():
            sender.close()


def run(actor: Actor, inbox: Inbox) -> None:
    """The loop: receive, handle, let the actor act on what it learnt, tick; returns when asked to stop."""
    board, slot = actor.board, actor.slot
    actor.receiver = actor.make_receiver(inbox)
    interval = actor.config.supervisor.heartbeat_interval
    progress = 0
    while not actor.stopping:
        actor.heartbeat()
        messages, actor.deferred = actor.deferred, []
        if not messages:
            try:
                messages = actor.receiver.recv_many(timeout=actor.wait_timeout(interval))
            except RingEmpty:
                messages = []
        if messages:
            board.write(slot, health.BUSY, 1)
        for message in messages:
            actor.handling = []
            actor.dispatch(message)
            progress += 1
            board.write(slot, health.PROGRESS, progress)
            if actor.stopping:
                break
        if not actor.stopping:
            actor.handling = []
            actor.after_messages()
        board.write(slot, health.BUSY, int(actor.has_work()))


def main(actor_cls, argv=None) -> int:
    # (long: an actor's whole life in order, each health-board state written beside what causes it)
    args = _parse_args(argv)
    _die_with_parent(args.parent)
    standby = args.standby is not None
    _set_title(topology.standby_title(args.id) if standby else topology.title_of(args.id))
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the supervisor's to handle
    config = load_config(args.config, check_model=False)
    board = HealthBoard.attach(topology.health_name(args.instance))
    if not standby:
        board.write(args.slot, health.PID, os.getpid())
        board.write(args.slot, health.STATE, State.STARTING)
    actor = actor_cls(args.id, args.instance, config, board, args.slot)
    actor.standby = standby
    actor.placement = _take_place(args.id, config)
    actor.weights_fd = args.weights_fd
    actor.kv_fd = args.kv_fd
    faults.install(actor)
    inbox = None
    try:
        if standby:
            board.set_spare(args.slot, health.SPARE_LOADING)
        actor.on_start()
        if standby:  # loaded and warm: wait to replace the actor when it dies
            board.set_spare(args.slot, health.SPARE_WARM)
            _wake_supervisor(args.parent)
            _wait_for_promotion(args.standby)
            board.set_spare(args.slot, health.SPARE_NONE)  # (the supervisor starts the next one loading)
            _set_title(topology.title_of(args.id))
            board.write(args.slot, health.PID, os.getpid())
            actor.standby = False
        producers = topology.producers_of(args.id, config)
        inbox = Inbox.attach(
            topology.inbox_name(args.instance, args.id),
            producers,
            untrusted=[p for p in producers if topology.client_index(p) is not None],
        )
        for producer, ring_name, reader in topology.broadcast_links(args.id, args.instance):
            inbox.attach_reader(producer, ring_name, reader)
        board.write(args.slot, health.STATE, State.READY)
        _wake_supervisor(args.parent)
        if hasattr(actor, "serve"):  # an actor with its own event loop (the HTTP server)
            actor.serve(inbox)
        else:
            run(actor, inbox)
        board.write(args.slot, health.STATE, State.STOPPING)
        actor.on_stop()
    except StopRequested:
        if not actor.standby:
            board.write(args.slot, health.STATE, State.STOPPING)
            actor.on_stop()
    except CheckpointError as exc:  # the user's files: one line naming file and field, no traceback
        _log.error(f"fdcore: {args.id} cannot start: {exc}")
        return 1
    except Exception:
        if _stop_signals and actor.standby:
            return 0  # a spare told to stop while it loaded (the signal surfaced in some import)
        _crash_report(args.id)
        actor.report_suspects()
        return 1
    finally:
        actor.close()
        if inbox is not None:
            inbox.close()
    if not actor.standby:
        board.write(args.slot, health.STATE, State.STOPPED)
    board.close()
    return 0


def _wake_supervisor(parent: int) -> None:
    """Tell the supervisor to look at the health board now (we are ready, or a warm spare), not at its next
    poll: a promoted spare's restart is that much shorter. SIGCHLD: a signal it wakes for anyway, and
    whose default action (had it none installed) is to ignore it."""
    try:
        os.kill(parent, signal.SIGCHLD)
    except ProcessLookupError:
        pass  # (it died: PR_SET_PDEATHSIG ends us next)


def _wait_for_promotion(semaphore_name: str) -> None:
    """Block until the supervisor releases our semaphore (SIGTERM still ends the wait)."""
    import posix_ipc

    semaphore = posix_ipc.Semaphore(semaphore_name)
    try:
        while True:
            try:
                semaphore.acquire(1.0)
                return
            except posix_ipc.BusyError:
                continue
    finally:
        semaphore.close()


def _parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m fdcore.actors")
    parser.add_argument("kind")
    parser.add_argument("--id", required=True)
    parser.add_argument("--instance", required=True)
    parser.add_argument("--slot", type=int, required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--parent", type=int, required=True, help="the supervisor's pid")
    parser.add_argument(
        "--standby", default=None, help="load, then wait on this semaphore before taking over the actor's place"
    )
    parser.add_argument(
        "--weights-fd", type=int, default=None, help="an inherited descriptor: the rank's shared weight file"
    )
    parser.add_argument(
        "--kv-fd", type=int, default=None, help="an inherited descriptor: the rank's shared KV cache file"
    )
    return parser.parse_args(argv)


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL us the moment the supervisor dies, however it dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # it died before prctl took effect
        os._exit(1)


def _take_place(child_id: str, config: Config) -> placement.Placement | None:
    """Bind this process to its CPUs in the supervisor's plan (fdcore.core.placement): a worker rank to
    its share (it places its main thread itself, once its threads exist), any other actor to the
    control CPUs. The plan, or None where there is none."""
    if not config.workers.pin_cpus:
        return None
    plan = placement.inherited_plan(worker_ranks(config.workers), worker_threads(config.workers))
    if plan is None:
        return None
    mine = (
        placement.rank_cpus(plan, topology.worker_rank(child_id))
        if topology.kind_of(child_id) == "worker"
        else plan.control
    )
    try:
        placement.pin_process_threads(None, mine)
    except OSError as exc:  # (CPUs taken away since the supervisor started, e.g. by a cgroup): run unpinned
        _log.warning(f"{child_id}: CPU placement given up: {exc}")
        return None
    return plan


def _set_title(title: str) -> None:
    import setproctitle

    setproctitle.setproctitle(title)


_stop_signals: list[int] = []


def _raise_stop(signum, frame):
    _stop_signals.append(signum)
    raise StopRequested()


def _crash_report(child_id: str) -> None:
    _log.error(f"fdcore: CRASH actor={child_id} pid={os.getpid()}\n{traceback.format_exc().rstrip()}")
    sys.stderr.flush()
