"""Connection hygiene for the HTTP server: deadlines for a request's head and body, a bounded table of
connections in which slow sockets give way to new ones, and admission that counts requests.

uvicorn's own defences count the wrong things: ``limit_concurrency`` counts *connections*, so a
thousand sockets that trickle half a request head make every real request a 503, and nothing bounds
how long a connection may take to send its head or its body. Here:

- A connection must deliver a whole request head within ``header_timeout`` seconds of opening (or of
  its previous response's end), and the body that head declares within ``body_timeout`` seconds of
  the head; else it is closed.
- :class:`ConnectionTable` (pure) keeps at most ``max_connections`` connections, at most
  ``max_connections_per_peer`` of them from one peer address. A connection that would pass either
  limit makes room by closing the oldest *waiting* connection (still sending its head or body, or idle
  between keep-alive requests) of that peer, else of the peer with the most connections; only when
  every connection in the way is serving a request is the new one refused. So sockets that never send a
  request cannot keep a real one out: it displaces them, and its own head arrives long before it could
  become the oldest waiting one.
- :class:`RequestAdmission` (an ASGI wrapper) answers 503 past ``limit_concurrency`` requests being
  served at once: requests (their bodies whole), not sockets.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_connections: int = 2048
    max_connections_per_peer: int = 512


@dataclass(eq=False)
class Entry:
    """One connection as the table sees it: whose it is, and since when it has been waiting (None while
    it serves a request: a request in hand is never displaced)."""

    peer: str
    waiting_since: float | None
    handle: object = field(default=None, repr=False)  # the protocol (what the caller closes)


class ConnectionTable:
    """Which connections the server keeps (pure: the protocol reports what happens, with the time)."""

    def __init__(self, max_connections: int, max_per_peer: int):
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer
        self.by_peer: dict[str, list[Entry]] = {}
        self.count = 0

    def admit(self, entry: Entry) -> list[Entry] | None:
        """Room for a new connection: the connections to close for it ([] when there is room), or None
        when it must be refused (everything in the way is serving a request). Admitted, it is counted."""
        mine = self.by_peer.get(entry.peer, [])
        victims: list[Entry] = []
        if len(mine) >= self.max_per_peer:
            victim = _oldest_waiting(mine)
            if victim is None:
                return None
            victims.append(victim)
        if self.count - len(victims) >= self.max_connections:
            victim = self._oldest_waiting_of_the_largest_peer(exclude=victims)
            if victim is None:
                return None
            victims.append(victim)
        for victim in victims:
            self.remove(victim)
        self.by_peer.setdefault(entry.peer, []).append(entry)
        self.count += 1
        return victims

    def remove(self, entry: Entry) -> None:
        """A connection that is gone (idempotent)."""
        mine = self.by_peer.get(entry.peer)
        if mine is None or entry not in mine:
            return
        mine.remove(entry)
        self.count -= 1
        if not mine:
            del self.by_peer[entry.peer]

    def _oldest_waiting_of_the_largest_peer(self, exclude: list[Entry]) -> Entry | None:
        for _, entries in sorted(self.by_peer.items(), key=lambda item: -len(item[1])):
            victim = _oldest_waiting([e for e in entries if e not in exclude])
            if victim is not None:
                return victim
        return None


def _oldest_waiting(entries: list[Entry]) -> Entry | None:
    waiting = [e for e in entries if e.waiting_since is not None]
    return min(waiting, key=lambda e: e.waiting_since) if waiting else None


def hardened_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    """An H11Protocol class (uvicorn.Config's ``http=``) with the deadlines and the connection table."""
    # (long: the protocol class is defined in this closure over ``limits``, as uvicorn takes a class)
    table = ConnectionTable(limits.max_connections, limits.max_connections_per_peer)

    class HardenedProtocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._timer: asyncio.TimerHandle | None = None
            peer = transport.get_extra_info("peername")
            self._entry = Entry(str(peer[0]) if peer else "?", time.monotonic(), self)
            victims = table.admit(self._entry)
            if victims is None:  # everything in the way serves a request: this one waits for nothing
                self._entry = None
                transport.close()
                return
            for victim in victims:
                victim.handle._close_waiting()
            self._arm(limits.header_timeout)

        def handle_events(self) -> None:
            super().handle_events()
            self._track()

        def on_response_complete(self) -> None:
            super().on_response_complete()  # (handles a pipelined request at once, if there is one)
            self._track()

        def _track(self) -> None:
            """Follow h11's view of the client: waiting for a head (IDLE), reading a body (SEND_BODY), or
            with a whole request in hand (anything else), each phase with its deadline."""
            if self._entry is None or self.transport.is_closing():
                return
            state = self.conn.their_state
            phase = "head" if state is h11.IDLE else "body" if state is h11.SEND_BODY else "serving"
            if phase == self._phase:
                return
            self._phase = phase
            if phase == "serving":
                self._entry.waiting_since = None
                self._disarm()
                return
            if self._entry.waiting_since is None:
                self._entry.waiting_since = time.monotonic()
            self._arm(limits.header_timeout if phase == "head" else limits.body_timeout)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._entry is not None:
                table.remove(self._entry)
            super().connection_lost(exc)

        _phase = "head"

        def _arm(self, seconds: float) -> None:
            self._disarm()
            self._timer = self.loop.call_later(seconds, self._too_slow)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _too_slow(self) -> None:
            self._timer = None
            if self._entry is not None and self._entry.waiting_since is not None:
                self._close_waiting()

        def _close_waiting(self) -> None:
            """Close a connection that sends no request (or sends it too slowly); its table entry goes now."""
            if self._entry is not None:
                table.remove(self._entry)
            if not self.transport.is_closing():
                self.transport.close()

    HardenedProtocol.table = table  # (for tests and statistics)
    return HardenedProtocol


class RequestAdmission:
    """ASGI wrapper: at most ``limit`` HTTP requests served at once (0: no limit); more get a 503 with
    ``Retry-After``. A request counts once its whole body is here (read first, up to ``max_body`` bytes,
    then handed to the app as it came): one still sending its body is a socket, not a request."""

    def __init__(self, app, limit: int, max_body: int):
        self.app = app
        self.limit = limit
        self.max_body = max_body
        self.active = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.limit:
            await self.app(scope, receive, send)
            return
        received = await self._body(receive)
        if received[-1]["type"] == "http.disconnect":
            return  # gone before its request was whole: nothing to serve
        if self.active >= self.limit:
            await _refuse(send, f"more than {self.limit} requests at once (server.limit_concurrency)")
            return
        self.active += 1
        try:
            await self.app(scope, _replaying(received, receive), send)
        finally:
            self.active -= 1

    async def _body(self, receive) -> list[dict]:
        """The request's messages up to its body's end (or a disconnect, or more than max_body bytes)."""
        received, size = [], 0
        while True:
            message = await receive()
            received.append(message)
            if message["type"] != "http.request":
                return received
            size += len(message.get("body", b""))
            if not message.get("more_body", False) or size > self.max_body:
                return received


def _replaying(received: list[dict], receive):
    """A receive() that gives ``received`` first, then what ``receive`` gives."""
    pending = list(received)

    async def replay() -> dict:
        return pending.pop(0) if pending else await receive()

    return replay


async def _refuse(send, message: str) -> None:
    import json

    body = json.dumps(
        {"error": {"message": message, "type": "service_unavailable", "param": None, "code": None}}
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 503,
            "headers": [
                (b"content-type", b"application/json"),
                (b"retry-after", b"1"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
