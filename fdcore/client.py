"""The thin client: embed fdcore in any Python program (``AsyncLLM``, and the sync ``LLM``).

::

    from fdcore import AsyncLLM, SamplingParams

    async with AsyncLLM("fdcore.toml") as llm:          # starts the actor tree ...
        async for out in llm.generate("Hello", SamplingParams(max_tokens=32)):
            print(out.outputs[0].text, end="")          # ... and streams deltas

``AsyncLLM(config)`` starts ``python -m fdcore.supervisor --config`` as a child
(it stops when the program ends, however it ends); ``AsyncLLM.connect()``
attaches to a tree that is already running. Any number of processes, up to
``engine.max_clients``, can use one tree at once: each claims a *client slot*
(an inbox the engine answers on) by locking it, so a slot is freed by the
kernel the moment its owner dies, and the engine then aborts what that owner
left running.

Streaming: each ``RequestOutput`` from ``generate`` carries the *new* tokens
and text since the previous one (FastDeploy's convention); ``LLM.generate``
returns whole outputs. A request the engine refuses ends with one output with
``finish_reason == "error"``, ``error_code`` (400, 429, ...) and ``error_msg``
naming the field and the limit; nothing is raised for it. ``LLM.generate``
never hands back a 429 (it keeps a window of requests in the engine and sends
refused ones again); ``AsyncLLM.generate(..., wait=True)`` waits for room too.

Only a client that can no longer be served raises: :class:`EngineDeadError`
from every open request and every later call, when the tree stopped, the client
was shut down or its reader thread died. An engine restart is not that: open
requests are re-submitted to the new engine and resume.
"""

from __future__ import annotations

import asyncio
import collections
import fcntl
import functools
import os
import queue
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

import msgspec

from fdcore.actors import health, topology
from fdcore.actors.health import HealthBoard, State
from fdcore.config import Config, ConfigError, config_memfd, fd_path, load_config
from fdcore.core import placement
from fdcore.ipc import Inbox, Receiver, Ring, RingCorrupted, RingEmpty, RingFull, Sender, names
from fdcore.protocol import (
    AbortRequest,
    AddRequest,
    ClientMessage,
    Hello,
    Metrics,
    PromptLogprob,
    SamplingParams,
    ServingStats,
    StatsQuery,
    Update,
    Welcome,
)

__all__ = ["LLM", "AsyncLLM", "CompletionOutput", "EngineDeadError", "EngineError", "PromptLogprob", "RequestOutput",
           "SamplingParams"]

_ENCODE = msgspec.msgpack.Encoder().encode
ENGINE_CHECK_INTERVAL = 0.2  # seconds between looks at whether the engine (and the tree) still live
RECOVERY_TIMEOUT = 300.0     # how long a restarted engine may take to answer
HELLO_RESEND = 1.0           # a Hello unanswered this long is sent again
RESYNC_PAUSE = 0.01          # a Hello our own link refused (its words contradict each other) is retried after this
SEND_TIMEOUT = 30.0          # how long a send waits for room in the engine's link before RingFull
INITIAL_WINDOW = 4096        # requests LLM.generate keeps in flight before the engine says how many fit


class EngineError(RuntimeError):
    """The tree could not be started or reached, or it went away."""

    def __init__(self, message: str, error_code: int = 500):
        super().__init__(message)
        self.error_code = error_code


class EngineDeadError(EngineError):
    """This client can no longer be served: the tree stopped, the client was shut down, or its
    reader thread died. Every open request raises it, and so does every later call, at once."""

    def __init__(self, message: str):
        super().__init__(message, 503)


@dataclass
class CompletionOutput:
    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[list[tuple[int, float]]] | None = None  # per token: (chosen id, lp), then top-N
    finish_reason: str | None = None  # stop | length | abort | error


@dataclass
class RequestOutput:
    """What the caller of ``AsyncLLM`` / ``LLM`` receives (the public shape, as vLLM's and FastDeploy's): one
    streamed delta, or the whole result, of a request. The only request shape user code sees; the
    protocol's ``Update`` is its wire form."""

    request_id: str
    prompt: str | list | None = None
    prompt_token_ids: list[int] | None = None
    outputs: CompletionOutput = field(default_factory=CompletionOutput)
    finished: bool = False
    metrics: Metrics | None = None
    error_code: int = 0
    error_msg: str = ""
    # prompt_logprobs: how the model scored each prompt token given those before it (the first: None)
    prompt_logprobs: list[PromptLogprob | None] | None = None


# --------------------------------------------------------------------- tree
class _Tree:
    """The supervisor we started (if any) and the instance id we talk to."""

    def __init__(self, instance: str, proc: subprocess.Popen | None = None, lifeline: int | None = None,
                 control_cpus: list[int] | None = None):
        self.instance = instance
        self.control_cpus = control_cpus  # where the tree's control plane runs (the supervisor's plan), if pinned
        self.proc = proc
        self.lifeline = lifeline  # write end of the pipe whose EOF tells the supervisor we are gone

    @classmethod
    def start(cls, config, timeout: float) -> _Tree:
        """Start a supervisor that lives as long as this *process*. NOTE: PR_SET_PDEATHSIG follows
        the thread that forked, so a client built in a worker thread lost its tree when that thread
        ended; instead the supervisor reads a pipe whose only write end we hold (close-on-exec, so
        no program we start keeps it), and the kernel closes it when this process ends, however. A
        configuration given as a Config reaches it as an in-memory file descriptor: no file is
        written that a killed program could leave behind."""
        path, config_fd = _config_source(config)
        read_fd, write_fd = os.pipe()
        watch_fd, lifeline = os.pipe()
        cmd = [sys.executable, "-m", "fdcore.supervisor", "--config", path, "--ready-fd", str(write_fd),
               "--parent-fd", str(watch_fd)]
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
    def find(cls, instance: str | None) -> _Tree:
        running = sorted({e.instance_id for e in names.list_entries()
                          if topology.is_engine_inbox(e) and names.pid_alive(e.owner_pid)})
        if instance is None:
            if len(running) != 1:
                raise EngineError(f"connect(): {len(running)} running fdcore instances ({', '.join(running)}); "
                                  "name one with instance=...")
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
                raise EngineError(f"the fdcore tree failed to start (supervisor exit code {code}); "
                                  "its log above says why")
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


# --------------------------------------------------------------- connection
class Connection:
    """One claimed client slot: sends requests to the engine, receives its answers."""

    def __init__(self, tree: _Tree, timeout: float = 30.0):
        self.tree = tree
        self.slot, self.lock_fd = self._claim(tree.instance)
        try:
            client = topology.client_id(self.slot)
            # as the supervisor made them: a previous owner of the slot may have written anything there
            self.inbox = Inbox.attach(topology.inbox_name(tree.instance, client), ["engine"], untrusted=["engine"])
            self.receiver = Receiver(self.inbox, ClientMessage)
            self.sender = Sender(Ring.attach(topology.link_name(tree.instance, "engine", client), trust_header=False,
                                             bell_name=topology.inbox_name(tree.instance, "engine")))
            self._send_lock = threading.Lock()
            self.welcome = self.handshake(timeout)
        except BaseException:
            os.close(self.lock_fd)
            raise

    @staticmethod
    def _claim(instance: str) -> tuple[int, int]:
        slot = 0
        while True:
            try:
                fd = os.open(topology.client_slot_path(instance, slot), os.O_RDWR)
            except FileNotFoundError:
                raise EngineError(f"all {slot} client slots of instance {instance} are taken "
                                  "(engine.max_clients)", 503) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return slot, fd
            except BlockingIOError:
                os.close(fd)
                slot += 1

    def engine_alive(self) -> bool:
        return names.pid_alive(self.welcome.engine_pid)

    def handshake(self, timeout: float, keep_waiting=lambda: True) -> Welcome:
        """Hello / Welcome with the engine (a restarted one too: our links outlive it). The
        engine aborts whatever this slot had running; what it had sent is dropped here. Hello is
        sent again every ``HELLO_RESEND`` s (one written while the old engine was dying may be
        lost with it) until ``timeout``, or until ``keep_waiting()`` says the tree is gone."""
        session = secrets.randbits(62)
        deadline = time.monotonic() + timeout
        while True:
            self._resync()
            try:
                self.send(Hello(self.slot, session))
                resend = HELLO_RESEND
            except RingCorrupted:  # words this process wrote over, read as the engine repaired them: again
                resend = RESYNC_PAUSE
            welcome = self._await_welcome(session, min(deadline, time.monotonic() + resend))
            if welcome is not None:
                self.welcome = welcome
                return welcome
            if time.monotonic() >= deadline or not keep_waiting():
                raise EngineError(f"the engine of {self.tree.instance} did not answer within {timeout:g} s")

    def _resync(self) -> None:
        """Our ends of both links where the engine may have reset them (it does when a slot's previous
        owner broke them); no change otherwise."""
        self.sender.ring.resync()
        self.inbox.link("engine").resync()

    def _await_welcome(self, session: int, until: float) -> Welcome | None:
        """Our Welcome, or None at ``until``; whatever else is in the ring is a previous session's."""
        while (remaining := until - time.monotonic()) > 0:
            try:
                message = self.receiver.recv(timeout=remaining)
            except RingEmpty:
                return None
            if isinstance(message, Welcome) and message.session == session:
                return message
        return None

    def send(self, message, timeout: float = SEND_TIMEOUT) -> None:
        with self._send_lock:
            self.sender.send(message, timeout=timeout)

    def submit(self, request_id: str, prompt, params: SamplingParams, resume_token_ids=(),
               resume_text_chars: int = 0, timeout: float = SEND_TIMEOUT, tenant: str = "") -> None:
        body: dict = {"sampling_params": params}
        if isinstance(prompt, str):
            body["prompt"] = prompt
        elif isinstance(prompt, dict):
            body.update(prompt)  # {"prompt_token_ids": [...]} or {"messages": [...]}
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            body["messages"] = prompt
        else:
            body["prompt_token_ids"] = prompt
        self.send(AddRequest(self.slot, request_id, msgspec.Raw(_ENCODE(body)), time.time(),
                             list(resume_token_ids), resume_text_chars, tenant), timeout)

    def resubmit(self, flights: dict) -> None:
        """Hand a restarted engine these requests again ({request id: _InFlight}), each with the
        tokens and text already received, so their streams resume where they were."""
        for request_id, flight in flights.items():
            self.submit(request_id, flight.prompt, flight.params, flight.token_ids, flight.text_chars,
                        tenant=flight.tenant)

    def send_soon(self, message) -> None:
        """Send without waiting: now if the link has room and no other thread is sending, else from
        a short-lived thread. For aborts and stats queries made on an event loop, which must never
        wait for the engine to drain its link."""
        if self._send_lock.acquire(blocking=False):
            try:
                self.sender.send_nowait(message)
                return
            except RingFull:
                pass
            finally:
                self._send_lock.release()
        threading.Thread(target=self.send, args=(message,), name="fdcore-client-send", daemon=True).start()

    def abort(self, request_id: str) -> None:
        self.send_soon(AbortRequest(self.slot, request_id))

    def close(self) -> None:
        self.sender.close()
        self.inbox.close()
        os.close(self.lock_fd)  # releases the slot


def chat_prompt(messages: list[dict], *, tools: list[dict] | None = None, documents: list[dict] | None = None,
                add_generation_prompt: bool | None = None, continue_final_message: bool | None = None,
                chat_template_kwargs: dict | None = None, chat_template: str | None = None) -> dict:
    """A chat prompt for ``generate``: the messages and the template options given (transformers'
    ``apply_chat_template`` names; None leaves an option to the engine: no tools or documents, a
    generation prompt unless the final message is continued, the model's default template)."""
    options = {"tools": tools, "documents": documents, "add_generation_prompt": add_generation_prompt,
               "continue_final_message": continue_final_message, "chat_template_kwargs": chat_template_kwargs,
               "chat_template": chat_template}
    return {"messages": messages, **{name: value for name, value in options.items() if value is not None}}


def _output(request_id: str, prompt, update: Update, prompt_token_ids) -> RequestOutput:
    return RequestOutput(request_id, prompt, prompt_token_ids,
                         CompletionOutput(0, update.text, list(update.token_ids), update.logprobs,
                                          update.finish_reason),
                         update.finish_reason is not None, update.metrics, update.error_code, update.error_msg,
                         update.prompt_logprobs)


def check_health(tree: _Tree, stale_after: float = 10.0) -> tuple[bool, str]:
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


class _Stream:
    """One open request as the router knows it: what to re-send, and where its answers go."""

    __slots__ = ("flight", "sink", "target")

    def __init__(self, flight: _InFlight, sink, target):
        self.flight, self.sink, self.target = flight, sink, target


class _LoopSink:
    """Delivers a reader batch to one event loop in one wake-up (equal per loop, so the reader
    groups a batch's answers by the loop that waits for them)."""

    __slots__ = ("loop",)

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop

    def __hash__(self) -> int:
        return id(self.loop)

    def __eq__(self, other) -> bool:
        return isinstance(other, _LoopSink) and other.loop is self.loop

    def __call__(self, items: list) -> None:
        try:
            self.loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # that loop is closed: nobody waits for these answers any more
            pass


def _put_all(items: list) -> None:
    for target, item in items:
        target.put_nowait(item)


class _Router:
    """The slot's only reader: one thread routes every answer to the request that waits for it,
    notices a dead engine (greets its successor, re-submits every open request) or a dead tree.

    One lock orders submissions against recovery: a request submitted while the client greets a
    restarted engine is only registered, and sent with the others once the Welcome is in, so
    nothing is sent twice or lost. If the thread itself dies (a protocol error, a ring stuck full),
    every open request and every later call fails with :class:`EngineDeadError`, never a hang.
    """

    def __init__(self, tree: _Tree, conn: Connection):
        self.tree, self.conn = tree, conn
        self.lock = threading.Lock()
        self.streams: dict[str, _Stream] = {}
        self.stats_waiters: dict[int, object] = {}
        self.recovering = False
        self.dead: str | None = None
        self.closing = threading.Event()
        self.fault: BaseException | None = None  # test hook: the reader raises it at its next turn
        self.thread = threading.Thread(target=self._run, name="fdcore-client-reader", daemon=True)
        self.thread.start()

    # ---------------------------------------------------------- callers
    def submit(self, request_id: str, prompt, params: SamplingParams, sink, target,
               timeout: float = SEND_TIMEOUT, tenant: str = "") -> None:
        """Open a request whose answers go to ``sink([(target, update), ...])``; RingFull (nothing
        registered) if the engine's link has no room within ``timeout``, or, with ``timeout == 0``,
        if another thread holds the lock while it waits for room (a caller on an event loop then
        waits in a worker thread instead)."""
        self.check()
        if not self.lock.acquire(blocking=timeout > 0):
            raise RingFull("another thread is waiting for room in the engine's link")
        try:
            self._check_alive()
            if request_id in self.streams:
                raise ValueError(f"request_id {request_id!r} is already open in this client")
            self.streams[request_id] = _Stream(_InFlight(prompt, params, tenant), sink, target)
            if not self.recovering:
                try:
                    self.conn.submit(request_id, prompt, params, timeout=timeout, tenant=tenant)
                except BaseException:
                    del self.streams[request_id]
                    raise
        finally:
            self.lock.release()

    def abort(self, request_id: str) -> None:
        """Ask the engine to stop the request; its last output ("abort") still comes."""
        self.check()
        self.conn.abort(request_id)

    def forget(self, request_id: str) -> None:
        """Nobody listens to the request any more: stop routing it and stop its computation. Never
        waits long (called on event loops): with the lock held by a thread waiting for room in the
        engine's link, it is done from a short-lived thread."""
        if not self.lock.acquire(blocking=False):
            threading.Thread(target=self._forget, args=(request_id,), name="fdcore-client-forget", daemon=True).start()
            return
        try:
            self._forget_locked(request_id)
        finally:
            self.lock.release()

    def _forget(self, request_id: str) -> None:
        with self.lock:
            self._forget_locked(request_id)

    def _forget_locked(self, request_id: str) -> None:
        stream = self.streams.pop(request_id, None)
        if stream is not None and self.dead is None and not self.recovering:
            self.conn.abort(request_id)

    def query_stats(self, waiter) -> int:
        """Send a StatsQuery; ``waiter(stats or exception)`` is called from the reader thread."""
        nonce = secrets.randbits(62)
        self.check()
        self.stats_waiters[nonce] = waiter  # no lock (callers on event loops): _die sets dead, then swaps
        if self.dead is not None:
            self.stats_waiters.pop(nonce, None)
            raise EngineDeadError(self.dead)
        self.conn.send_soon(StatsQuery(nonce, self.conn.slot))
        return nonce

    def check(self) -> None:
        """Raise :class:`EngineDeadError` at once if the tree or this client is gone."""
        if self.dead is None and not self.tree.alive():
            self._die(_tree_gone(self.tree))
        self._check_alive()

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)

    def close(self) -> None:
        self.closing.set()
        self.thread.join()
        self._die("this client was shut down")

    # ------------------------------------------------------------ reader
    def _run(self) -> None:
        try:
            if self.tree.control_cpus:  # the tree we started pinned its control plane: we are part of it
                try:
                    placement.pin_this_thread(self.tree.control_cpus)
                except OSError:
                    pass  # (CPUs this program may not use: it reads from wherever it runs)
            self._read()
        except BaseException as exc:  # noqa: BLE001 -- the watchdog: whatever killed us fails every request loudly
            self._die(f"the client's reader thread died: {exc!r}")

    def _read(self) -> None:
        next_check = time.monotonic() + ENGINE_CHECK_INTERVAL
        while not self.closing.is_set():
            if self.fault is not None:
                raise self.fault
            try:
                messages = self.conn.receiver.recv_many(timeout=ENGINE_CHECK_INTERVAL)
            except RingEmpty:
                messages = []
            if messages:
                self._route(messages)
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + ENGINE_CHECK_INTERVAL
                if not self.tree.alive():
                    self._die(_tree_gone(self.tree))
                    return
                if not self.conn.engine_alive():
                    self._recover()

    def _route(self, messages: list) -> None:
        batches: dict = {}
        with self.lock:
            for message in messages:
                if isinstance(message, Update):
                    stream = self.streams.get(message.request_id)
                    if stream is None:
                        continue
                    stream.flight.received(message)
                    if message.finish_reason is not None:
                        del self.streams[message.request_id]
                    batches.setdefault(stream.sink, []).append((stream.target, message))
                elif isinstance(message, ServingStats):
                    waiter = self.stats_waiters.pop(message.nonce, None)
                    if waiter is not None:
                        waiter(message)
        for sink, items in batches.items():
            sink(items)

    def _recover(self) -> None:
        """The engine died: greet its successor, then hand it every open request again, each with
        the tokens and text already received, so the streams resume where they were."""
        with self.lock:
            self.recovering = True
        try:
            self.conn.handshake(RECOVERY_TIMEOUT, keep_waiting=lambda: self.tree.alive() and not self.closing.is_set())
        except EngineError:
            self._die(_tree_gone(self.tree))
            return
        with self.lock:  # the in-flight set as of the Welcome: what was open, and what came meanwhile
            self.conn.resubmit({request_id: stream.flight for request_id, stream in self.streams.items()})
            self.recovering = False

    def _die(self, reason: str) -> None:
        """Fail every open request and stats query with EngineDeadError(reason); later calls raise."""
        with self.lock:
            if self.dead is not None:
                return
            self.dead = reason
            streams, self.streams = list(self.streams.values()), {}
            waiters, self.stats_waiters = list(self.stats_waiters.values()), {}
        batches: dict = {}
        for stream in streams:
            batches.setdefault(stream.sink, []).append((stream.target, EngineDeadError(reason)))
        for sink, items in batches.items():
            sink(items)
        for waiter in waiters:
            waiter(EngineDeadError(reason))


class _Client:
    """What both clients are: a tree (started here, or found running), a claimed slot in it and
    the router that reads the slot."""

    def __init__(self, config=None, *, start_timeout: float = 300.0, _tree: _Tree | None = None):
        self._tree = _tree or _Tree.start(config, start_timeout)
        try:
            self._conn = Connection(self._tree)
        except BaseException:
            if _tree is None:
                self._tree.stop()
            raise
        self._router = _Router(self._tree, self._conn)
        self._window = _pending_limit(config) if _tree is None else INITIAL_WINDOW

    @classmethod
    def connect(cls, instance: str | None = None):
        """Attach to a tree started with ``python -m fdcore.supervisor --config``."""
        return cls(_tree=_Tree.find(instance))

    @property
    def instance(self) -> str:
        return self._tree.instance

    def _close(self) -> None:
        self._router.close()
        self._conn.close()
        self._tree.stop()


def _pending_limit(config) -> int:
    """engine.max_pending_requests of a config we start a tree with (a file we cannot read: the
    default; the supervisor will say why)."""
    if isinstance(config, Config):
        return config.engine.max_pending_requests
    if config is None:
        return Config().engine.max_pending_requests
    try:
        return load_config(os.fspath(config), check_model=False).engine.max_pending_requests
    except ConfigError:
        return INITIAL_WINDOW


# -------------------------------------------------------------------- async
class AsyncLLM(_Client):
    """Asynchronous client: many concurrent streaming requests, from one event loop or several
    (each in its own thread)."""

    # ---------------------------------------------------------------- public
    async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, wait: bool = False, tenant: str = ""):
        """Stream ``RequestOutput`` deltas of one request until it finishes. ``wait=True``: while the
        engine is full (429), the request waits in this client and is sent again as room frees,
        instead of ending with the 429 error. ``tenant``: whom it is for, where this client serves
        several (the KV cache is shared fairly between tenants). Raises :class:`EngineDeadError` when
        the tree is gone."""
        request_id = request_id or uuid.uuid4().hex
        params = sampling_params or SamplingParams()
        answers: asyncio.Queue = asyncio.Queue()
        sink = _LoopSink(asyncio.get_running_loop())
        finished, prompt_ids, backoff = False, None, _Backoff()
        await self._submit(request_id, prompt, params, sink, answers, tenant)
        try:
            while not finished:
                update = await answers.get()
                if isinstance(update, BaseException):
                    finished = True
                    raise update
                if wait and _refused(update):
                    await asyncio.sleep(backoff.next())
                    await self._submit(request_id, prompt, params, sink, answers, tenant)
                    continue
                prompt_ids = update.prompt_token_ids or prompt_ids
                out = _output(request_id, prompt, update, prompt_ids)
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._router.forget(request_id)  # the caller stopped listening: stop computing

    async def _submit(self, request_id: str, prompt, params: SamplingParams, sink, answers, tenant: str) -> None:
        """Submit without blocking the event loop: only when the engine's link is full does the
        (blocking) wait for room move to a worker thread."""
        submit = functools.partial(self._router.submit, request_id, prompt, params, sink, answers, tenant=tenant)
        try:
            submit(timeout=0.0)
        except RingFull:
            await asyncio.get_running_loop().run_in_executor(None, submit)

    async def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None,
                   request_id: str | None = None, **options):
        """Stream the answer to one conversation; ``options`` as :func:`chat_prompt` (tools, ...)."""
        async for out in self.generate(chat_prompt(messages, **options), sampling_params, request_id):
            yield out

    async def abort(self, request_id: str) -> None:
        self._router.abort(request_id)

    async def check_health(self) -> tuple[bool, str]:
        return check_health(self._tree)

    async def stats(self, timeout: float = 10.0) -> ServingStats:
        """Running / waiting requests, steps, preemptions, KV-cache usage and prefix hit rate."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def answer(result) -> None:
            loop.call_soon_threadsafe(_settle, future, result)

        nonce = self._router.query_stats(answer)
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self._router.stats_waiters.pop(nonce, None)

    async def shutdown(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._close)

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()


def _settle(future: asyncio.Future, result) -> None:
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


def _refused(update: Update) -> bool:
    """The engine was full: the request never started and may simply be sent again."""
    return update.finish_reason == "error" and update.error_code == 429


class _Backoff:
    """Waits between re-sends of a refused request: doubling, so a full engine is not flooded."""

    def __init__(self, first: float = 0.005, longest: float = 0.25):
        self.delay, self.longest = first / 2, longest

    def next(self) -> float:
        self.delay = min(self.longest, self.delay * 2)
        return self.delay



@dataclass
class _InFlight:
    """A request as its client knows it (owned by the client's router): the prompt and parameters as
    submitted and the tokens and text already delivered: enough to submit it again to a restarted engine
    and resume the stream where it was. The engine's ``TrackedRequest`` dies with the engine; this does not."""

    prompt: object
    params: SamplingParams
    tenant: str = ""
    token_ids: list[int] = field(default_factory=list)
    text_chars: int = 0

    def received(self, update: Update) -> None:
        self.token_ids += update.token_ids
        self.text_chars += len(update.text)


def _tree_gone(tree: _Tree) -> str:
    if tree.proc is not None and tree.proc.poll() is not None:
        return f"the fdcore tree stopped (supervisor exit code {tree.proc.returncode}; its log says why)"
    return f"the fdcore tree {tree.instance} stopped"


# --------------------------------------------------------------------- sync
class LLM(_Client):
    """Synchronous helper: ``LLM(config).generate(prompts, params) -> list[RequestOutput]``; safe to
    call from several threads at once."""

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order of ``prompts``. However many there
        are, none is refused: a window of requests is kept in the engine and refilled as they
        finish, shrunk to what the engine accepts when it answers 429 (the refused ones are sent
        again). Raises :class:`EngineDeadError` if the tree goes away."""
        prompts = _as_prompt_list(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts")
        return _Batch(self._router, prompts, params, _Progress(len(prompts), enabled=use_tqdm), self._window).run()

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, **options) -> list[RequestOutput]:
        """Answer one conversation, or each of a list of them; ``options`` as :func:`chat_prompt`."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([chat_prompt(c, **options) for c in conversations], sampling_params, use_tqdm)

    def check_health(self) -> tuple[bool, str]:
        return check_health(self._tree)

    def stats(self, timeout: float = 10.0) -> ServingStats:
        answers: queue.SimpleQueue = queue.SimpleQueue()
        nonce = self._router.query_stats(answers.put)
        try:
            result = answers.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no statistics from the engine within {timeout:g} s") from None
        finally:
            self._router.stats_waiters.pop(nonce, None)
        if isinstance(result, BaseException):
            raise result
        return result

    def shutdown(self) -> None:
        self._close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _as_prompt_list(prompts) -> list:
    """One prompt (text, token ids, a {"prompt_token_ids"/"messages"} dict) or a sequence of them."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


class _Batch:
    """One ``LLM.generate`` call: keeps a window of its requests in the engine, refills it as they
    finish and sends refused (429) ones again, so any number of prompts goes through and the
    client holds state only for the window (plus each finished output).

    NOTE: the window is learnt as TCP learns its congestion window: it starts at the engine's
    limit (its configured one when this client started the tree, else the default); every 429 shrinks it to the requests still in flight (a burst's refusals arrive
    together, so it settles on what the engine accepted), every finished request grows it by
    1/window (one more request per window's worth of answers), probing for room other clients
    freed. With nothing in flight, a refused request waits a doubling back-off before it retries.
    """

    growth = 1.0  # requests the window grows by per window's worth of finished ones (0: a fixed window)

    def __init__(self, router: _Router, prompts: list, params: list, bar: _Progress, window: int = INITIAL_WINDOW):
        self.router, self.prompts, self.params, self.bar = router, prompts, params, bar
        self.results: list[RequestOutput | None] = [None] * len(prompts)
        self.tag = uuid.uuid4().hex[:8]
        self.answers: queue.SimpleQueue = queue.SimpleQueue()
        self.flying: set[int] = set()
        self.retry: collections.deque[int] = collections.deque()
        self.next = 0
        self.done = 0
        self.window = float(window)
        self.backoff, self.hold_until = _Backoff(), 0.0

    def run(self) -> list[RequestOutput]:
        try:
            while self.done < len(self.prompts):
                self._fill()
                self._receive()
        except BaseException:
            for i in self.flying:
                self.router.forget(self._id(i))
            raise
        finally:
            self.bar.close()
        return self.results

    def _id(self, i: int) -> str:
        return f"{self.tag}-{i}"

    def _fill(self) -> None:
        """Send requests (refused ones first) while the window has room."""
        if time.monotonic() < self.hold_until:
            return
        while len(self.flying) < self.window and (self.retry or self.next < len(self.prompts)):
            if self.retry:
                i = self.retry.popleft()
            else:
                i, self.next = self.next, self.next + 1
            self.router.submit(self._id(i), self.prompts[i], self.params[i] or SamplingParams(), self.answers.put, i)
            self.flying.add(i)

    def _receive(self) -> None:
        """Take every batch of answers the reader has routed to us (wait for the first)."""
        timeout = None if self.flying else max(0.0, self.hold_until - time.monotonic())
        try:
            items = self.answers.get(timeout=timeout)
        except queue.Empty:
            return
        while True:
            for i, update in items:
                if isinstance(update, BaseException):
                    raise update
                self._take(i, update)
            try:
                items = self.answers.get_nowait()
            except queue.Empty:
                return

    def _take(self, i: int, update: Update) -> None:
        if _refused(update):
            self.flying.discard(i)
            self.retry.append(i)
            self.window = max(1.0, float(len(self.flying)))
            if not self.flying:
                self.hold_until = time.monotonic() + self.backoff.next()
            return
        out = self.results[i]
        if out is None:
            out = self.results[i] = RequestOutput(self._id(i), self.prompts[i])
        _accumulate(out, update)
        if out.finished:
            self.flying.discard(i)
            self.done += 1
            self.window += self.growth / self.window
            self.backoff = _Backoff()
            self.bar.advance()


def _accumulate(out: RequestOutput, update: Update) -> None:
    c = out.outputs
    c.text += update.text
    c.token_ids += update.token_ids
    if update.logprobs:
        c.logprobs = (c.logprobs or []) + update.logprobs
    if update.prompt_token_ids is not None:
        out.prompt_token_ids = list(update.prompt_token_ids)
    if update.prompt_logprobs is not None:
        out.prompt_logprobs = update.prompt_logprobs
    if update.finish_reason is not None:
        c.finish_reason = update.finish_reason
        out.finished = True
        out.metrics = update.metrics
        out.error_code, out.error_msg = update.error_code, update.error_msg


class _Progress:
    """A one-line progress bar on stderr (only when it is a terminal, or forced)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done = total, 0
        self.enabled = enabled and sys.stderr.isatty()
        self.started = time.monotonic()

    def advance(self) -> None:
        self.done += 1
        if self.enabled:
            filled = 30 * self.done // self.total
            rate = self.done / max(1e-9, time.monotonic() - self.started)
            sys.stderr.write(f"\rgenerating [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} "
                             f"({rate:.1f} req/s)")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
