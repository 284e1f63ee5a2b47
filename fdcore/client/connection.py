"""A client's link to the engine: a claimed client slot (an inbox the engine answers on, locked so the kernel
frees it when its owner dies) and the Hello / Welcome handshake, sent again after an engine restart."""

from __future__ import annotations

import fcntl
import os
import secrets
import threading
import time

import msgspec

from fdcore.actors import topology
from fdcore.client.outputs import EngineError
from fdcore.client.tree import Tree
from fdcore.ipc import Inbox, Receiver, Ring, RingCorrupted, RingEmpty, RingFull, Sender, names
from fdcore.protocol import (
    AbortRequest,
    AddRequest,
    ClientMessage,
    Hello,
    SamplingParams,
    Welcome,
)

ENCODE = msgspec.msgpack.Encoder().encode


HELLO_RESEND = 1.0  # a Hello unanswered this long is sent again


RESYNC_PAUSE = 0.01  # a Hello our own link refused (its words contradict each other) is retried after this


SEND_TIMEOUT = 30.0  # how long a send waits for room in the engine's link before RingFull


# --------------------------------------------------------------- connection
class Connection:
    """One claimed client slot: sends requests to the engine, receives its answers."""

    def __init__(self, tree: Tree, timeout: float = 30.0):
        self.tree = tree
        self.slot, self.lock_fd = self._claim(tree.instance)
        try:
            client = topology.client_id(self.slot)
            # as the supervisor made them: a previous owner of the slot may have written anything there
            self.inbox = Inbox.attach(topology.inbox_name(tree.instance, client), ["engine"], untrusted=["engine"])
            self.receiver = Receiver(self.inbox, ClientMessage)
            self.sender = Sender(
                Ring.attach(
                    topology.link_name(tree.instance, "engine", client),
                    trust_header=False,
                    bell_name=topology.inbox_name(tree.instance, "engine"),
                )
            )
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
                raise EngineError(
                    f"all {slot} client slots of instance {instance} are taken (engine.max_clients)", 503
                ) from None
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

    def submit(
        self,
        request_id: str,
        prompt,
        params: SamplingParams,
        resume_token_ids=(),
        resume_text_chars: int = 0,
        timeout: float = SEND_TIMEOUT,
        tenant: str = "",
    ) -> None:
        body: dict = {"sampling_params": params}
        if isinstance(prompt, str):
            body["prompt"] = prompt
        elif isinstance(prompt, dict):
            body.update(prompt)  # {"prompt_token_ids": [...]} or {"messages": [...]}
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            body["messages"] = prompt
        else:
            body["prompt_token_ids"] = prompt
        self.send(
            AddRequest(
                self.slot,
                request_id,
                msgspec.Raw(ENCODE(body)),
                time.time(),
                list(resume_token_ids),
                resume_text_chars,
                tenant,
            ),
            timeout,
        )

    def resubmit(self, flights: dict) -> None:
        """Hand a restarted engine these requests again ({request id: InFlight}), each with the
        tokens and text already received, so their streams resume where they were."""
        for request_id, flight in flights.items():
            self.submit(
                request_id, flight.prompt, flight.params, flight.token_ids, flight.text_chars, tenant=flight.tenant
            )

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
