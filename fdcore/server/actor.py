"""The API actor (fdcore:api): the OpenAI-compatible HTTP server, one more client of the engine.

Started by the supervisor when ``[server] enabled = true``, after the engine.
It serves ``fdcore.server.app`` with uvicorn in its main thread, whose event
loop also ticks its heartbeat (a loop wedged by a blocking call stops ticking,
so the supervisor sees the API hung and restarts it); a control thread answers
the supervisor and turns its Stop into a graceful uvicorn shutdown. Slow request
heads and bodies, idle keep-alive connections and connections past the table's size are cut off, and
requests past ``limit_concurrency`` get 503 (:mod:`fdcore.server.http`). Its engine connection is an ``AsyncLLM``
client slot, so an engine restart is survived the way any client survives it.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading

from fdcore import envs, logs
from fdcore.actors import health, topology
from fdcore.actors.runtime import Actor
from fdcore.ipc import Receiver, RingEmpty
from fdcore.protocol import ControlMessage, Ping, Pong, Stop

_log = logs.logger(__name__)


class ApiActor(Actor):
    def on_start(self) -> None:
        from fdcore.client import AsyncLLM, Tree
        from fdcore.core.tokenizer import ModelTokenizer
        from fdcore.server.app import Settings, build_app

        self.llm = AsyncLLM(tree=Tree(self.instance_id))
        welcome = self.llm.welcome
        server = self.config.server
        settings = Settings(
            server.model_name or os.path.basename(welcome.model.rstrip("/")),
            welcome.max_model_len,
            envs.get(envs.API_KEY) or server.api_key,
            server.max_request_bytes,
            chat_max_tokens(welcome.sampling_defaults, server),
            server.reasoning_parser,
            server.max_response_entries,
            welcome.sampling_defaults.get("max_tokens") or 16,
        )
        self.app = build_app(
            self.llm,
            settings,
            ModelTokenizer(welcome.model),
            lambda: self.llm.health(self.config.supervisor.hang_timeout),
            self._restarts,
            self._spares,
        )
        # bound before we count as ready; several processes share the port (the kernel spreads connections)
        self.listener = listening_socket(server.host, server.port, reuse_port=server.processes > 1)

    def _spares(self) -> dict[str, str]:
        """How each worker's warm spare stands: none, loading or warm (none at all without workers.standby)."""
        if not self.config.workers.standby:
            return {}
        ids = topology.child_ids(self.config)
        return {
            cid: health.SPARE_NAMES.get(self.board.spare(slot), "none")
            for slot, cid in enumerate(ids)
            if topology.kind_of(cid) == "worker"
        }

    def _restarts(self) -> dict[str, int]:
        ids = topology.child_ids(self.config)
        return {cid: self.board.read(slot, health.RESTARTS) for slot, cid in enumerate(ids)}

    def serve(self, inbox) -> None:
        import uvicorn

        from fdcore.server.http import ConnectionLimits, RequestAdmission, hardened_protocol

        server = self.config.server
        limits = ConnectionLimits(
            server.header_timeout,
            server.body_timeout,
            min(server.max_connections, _descriptors() - 64),
            server.max_connections_per_peer,
        )
        self.server = uvicorn.Server(
            uvicorn.Config(
                RequestAdmission(self.app, server.limit_concurrency, server.max_request_bytes),
                host=server.host,
                port=server.port,
                log_level="warning",
                lifespan="off",
                access_log=False,
                http=hardened_protocol(limits),
                timeout_keep_alive=server.timeout_keep_alive,
            )
        )
        threading.Thread(target=self._control, args=(inbox,), name="fdcore-api-control", daemon=True).start()
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        beat = asyncio.ensure_future(self._heartbeat())
        try:
            await self.server.serve(sockets=[self.listener])
        finally:
            beat.cancel()

    async def _heartbeat(self) -> None:
        """Ticks from the event loop itself, so that a wedged loop is seen as a hung actor."""
        interval = self.config.supervisor.heartbeat_interval
        while True:
            self.heartbeat()
            await asyncio.sleep(interval)

    def _control(self, inbox) -> None:
        """The supervisor's messages, beside uvicorn's event loop."""
        receiver = Receiver(inbox, ControlMessage)
        interval = self.config.supervisor.heartbeat_interval
        while not self.server.should_exit:
            try:
                messages = receiver.recv_many(timeout=interval)
            except RingEmpty:
                continue
            for message in messages:
                if isinstance(message, Stop):
                    self._stop(message)
                    return
                elif isinstance(message, Ping):
                    self.send(topology.SUPERVISOR, Pong(message.nonce, self.child_id))

    def _stop(self, stop: Stop) -> None:
        """The supervisor's Stop. Stopping the tree: drain first (new requests 503, /health 503, the open
        ones run out for up to ``server.drain_timeout``, what is left ends with abort, an error event and
        [DONE]), then close. Stopped to be restarted with a sibling: at once."""
        timeout = 0.0 if stop.restart else self.config.server.drain_timeout
        if timeout > 0:
            drained = asyncio.run_coroutine_threadsafe(self.app.state.api.drain(timeout), self.loop)
            try:
                drained.result(timeout + 10.0)
            except Exception as exc:  # (the loop is stopping or wedged: close anyway)
                _log.warning(f"fdcore: {self.child_id} could not drain: {exc!r}")
        self.server.should_exit = True


def _descriptors() -> int:
    """The open files this process may have, raised to the hard limit (each connection is one)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def chat_max_tokens(sampling_defaults: dict, server) -> int | None:
    """Chat's max_tokens when a request names none: the model's max_new_tokens, else
    ``server.default_max_tokens`` (0 or None: up to the context), so that an abandoned or endless
    chat does not hold a batch slot for the whole context."""
    return sampling_defaults.get("max_tokens") or server.default_max_tokens or None


def listening_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """The server's socket, bound and listening while the actor starts: "ready" then means a client
    can connect (its connection waits in the backlog until uvicorn accepts it), and a port in use
    fails the start with the reason instead of a running tree without its server."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # NOTE: proto named, not 0 (socket.create_server's): asyncio sets TCP_NODELAY only on connections
    # whose socket says IPPROTO_TCP, and without it every streamed chunk after the response head
    # waited for the client's delayed ACK (~40 ms to the first token, measured with aiohttp).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock
