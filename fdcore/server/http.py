"""uvicorn's h11 protocol with a deadline for the request head.

uvicorn closes an idle keep-alive connection (``timeout_keep_alive``) but gives a
connection that trickles its request line and headers all the time it wants: each
such connection keeps a descriptor and a parser for ever, so a few thousand of them
exhaust the process. Here a connection must deliver a whole request head within
``header_timeout`` seconds of opening (or of its previous response's end), else it
is closed.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def with_header_timeout(header_timeout: float) -> type[H11Protocol]:
    """An H11Protocol class (uvicorn.Config's ``http=``) closing slow request heads."""

    class HeaderTimeoutProtocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._head_timer: asyncio.TimerHandle | None = None
            self._arm_head_timer()

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # a whole head arrived (or the connection ended)
                self._disarm_head_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_timer()  # the next request on this connection gets the same deadline

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_timer()
            super().connection_lost(exc)

        def _arm_head_timer(self) -> None:
            self._disarm_head_timer()
            self._head_timer = self.loop.call_later(header_timeout, self._head_too_slow)

        def _disarm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_too_slow(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol
