"""The API actor (fdcore:api): the OpenAI-compatible HTTP server, one more client of the engine.

Started by the supervisor when ``[server] enabled = true``, after the engine.
It serves ``fdcore.server.app`` with uvicorn in its main thread; a control
thread keeps its heartbeat on the health board and turns the supervisor's Stop
into a graceful uvicorn shutdown. Its engine connection is an ``AsyncLLM``
client slot, so an engine restart is survived the way any client survives it.
"""

from __future__ import annotations

import os
import threading
import time

from fdcore.actors import health, topology
from fdcore.actors.runtime import Actor
from fdcore.ipc import Receiver, RingEmpty
from fdcore.protocol import ControlMessage, Ping, Pong, Stop


class ApiActor(Actor):
    def on_start(self) -> None:
        from fdcore.client import AsyncLLM, _Tree, check_health
        from fdcore.core.tokenizer import ModelTokenizer
        from fdcore.server.app import Settings, build_app

        self.tree = _Tree(self.instance_id)
        self.llm = AsyncLLM(_tree=self.tree)
        welcome = self.llm._conn.welcome
        server = self.config.server
        settings = Settings(server.model_name or os.path.basename(welcome.model.rstrip("/")),
                            welcome.max_model_len, os.environ.get("FDCORE_API_KEY") or server.api_key,
                            server.max_request_bytes, welcome.sampling_defaults.get("max_tokens"))
        self.app = build_app(self.llm, settings, ModelTokenizer(welcome.model),
                             lambda: check_health(self.tree, self.config.supervisor.hang_timeout),
                             self._restarts)

    def _restarts(self) -> dict[str, int]:
        ids = topology.child_ids(self.config)
        return {cid: self.board.read(slot, health.RESTARTS) for slot, cid in enumerate(ids)}

    def serve(self, inbox) -> None:
        import uvicorn

        server = self.config.server
        self.server = uvicorn.Server(uvicorn.Config(self.app, host=server.host, port=server.port,
                                                    log_level="warning", lifespan="off", access_log=False))
        threading.Thread(target=self._control, args=(inbox,), name="fdcore-api-control", daemon=True).start()
        self.server.run()

    def _control(self, inbox) -> None:
        """Heartbeat and the supervisor's messages, beside uvicorn's event loop."""
        receiver = Receiver(inbox, ControlMessage)
        interval = self.config.supervisor.heartbeat_interval
        while not self.server.should_exit:
            self.board.write(self.slot, health.HEARTBEAT, time.monotonic_ns())
            try:
                messages = receiver.recv_many(timeout=interval)
            except RingEmpty:
                continue
            for message in messages:
                if isinstance(message, Stop):
                    self.server.should_exit = True
                elif isinstance(message, Ping):
                    self.send(topology.SUPERVISOR, Pong(message.nonce, self.child_id))
