"""The reader thread: routes the engine's updates to the requests waiting on them, re-submits what is in
flight after an engine restart, and fails every waiter once the tree is gone."""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from dataclasses import dataclass, field

from fdcore.client.connection import SEND_TIMEOUT, Connection
from fdcore.client.outputs import EngineDeadError, EngineError
from fdcore.client.tree import Tree, tree_gone
from fdcore.core import placement
from fdcore.ipc import RingEmpty, RingFull
from fdcore.protocol import (
    SamplingParams,
    ServingStats,
    StatsQuery,
    Update,
)

ENGINE_CHECK_INTERVAL = 0.2  # seconds between looks at whether the engine (and the tree) still live


RECOVERY_TIMEOUT = 300.0  # how long a restarted engine may take to answer


class Stream:
    """One open request as the router knows it: what to re-send, and where its answers go."""

    __slots__ = ("flight", "sink", "target")

    def __init__(self, flight: InFlight, sink, target):
        self.flight, self.sink, self.target = flight, sink, target


class LoopSink:
    """Delivers a reader batch to one event loop in one wake-up (equal per loop, so the reader
    groups a batch's answers by the loop that waits for them)."""

    __slots__ = ("loop",)

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop

    def __hash__(self) -> int:
        return id(self.loop)

    def __eq__(self, other) -> bool:
        return isinstance(other, LoopSink) and other.loop is self.loop

    def __call__(self, items: list) -> None:
        try:
            self.loop.call_soon_threadsafe(put_all, items)
        except RuntimeError:  # that loop is closed: nobody waits for these answers any more
            pass


def put_all(items: list) -> None:
    for target, item in items:
        target.put_nowait(item)


class Router:
    """The slot's only reader: one thread routes every answer to the request that waits for it,
    notices a dead engine (greets its successor, re-submits every open request) or a dead tree.

    One lock orders submissions against recovery: a request submitted while the client greets a
    restarted engine is only registered, and sent with the others once the Welcome is in, so
    nothing is sent twice or lost. If the thread itself dies (a protocol error, a ring stuck full),
    every open request and every later call fails with :class:`EngineDeadError`, never a hang.
    """

    def __init__(self, tree: Tree, conn: Connection):
        self.tree, self.conn = tree, conn
        self.lock = threading.Lock()
        self.streams: dict[str, Stream] = {}
        self.stats_waiters: dict[int, object] = {}
        self.recovering = False
        self.dead: str | None = None
        self.closing = threading.Event()
        self.fault: BaseException | None = None  # test hook: the reader raises it at its next turn
        self.thread = threading.Thread(target=self._run, name="fdcore-client-reader", daemon=True)
        self.thread.start()

    # ---------------------------------------------------------- callers
    def submit(
        self,
        request_id: str,
        prompt,
        params: SamplingParams,
        sink,
        target,
        timeout: float = SEND_TIMEOUT,
        tenant: str = "",
    ) -> None:
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
            self.streams[request_id] = Stream(InFlight(prompt, params, tenant), sink, target)
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
            self._die(tree_gone(self.tree))
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
        except BaseException as exc:
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
                    self._die(tree_gone(self.tree))
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
            self._die(tree_gone(self.tree))
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


class Backoff:
    """Waits between re-sends of a refused request: doubling, so a full engine is not flooded."""

    def __init__(self, first: float = 0.005, longest: float = 0.25):
        self.delay, self.longest = first / 2, longest

    def next(self) -> float:
        self.delay = min(self.longest, self.delay * 2)
        return self.delay


@dataclass
class InFlight:
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
