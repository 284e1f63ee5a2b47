"""How the engine keeps its clients' links: one slot each, greeted, fed in batches, cut off alone when slow or
corrupt."""

from __future__ import annotations

import fcntl
import os
import time
from dataclasses import dataclass, field

import msgspec

from fdcore import logs
from fdcore.actors import topology
from fdcore.config import model_path
from fdcore.ipc import RecordTooLarge, Ring, RingCorrupted, RingFull, Sender, names
from fdcore.protocol import (
    AbortRequest,
    AddRequest,
    AddSeq,
    FinishSeq,
    Hello,
    Resync,
    StatsQuery,
    Update,
    Welcome,
)

_log = logs.logger(__name__)


@dataclass(eq=False)
class ClientSlot:
    index: int
    sender: Sender
    lock_fd: int
    session: int = 0
    requests: dict[str, int] = field(default_factory=dict)  # request id -> seq
    outbox: list = field(default_factory=list)  # messages its full inbox did not take yet
    stalled_since: float | None = None  # when its inbox first had no room (monotonic)
    logged_at: float = float("-inf")  # when its last disconnection was logged (monotonic)


class ClientLinks:
    """The engine's side of its clients' links (a mixin of fdcore.actors.engine.EngineActor, whose state these
    methods read and set): slots claimed and greeted, updates batched per slot and flushed without blocking, a slow
    or corrupt link cut off alone."""

    def _on_client(self, client: int, message) -> None:
        match message:
            case AddRequest():
                self._on_request(client, message)
            case AbortRequest(request_id=request_id):
                self._on_abort(client, request_id)
            case Hello(session=session):
                self._on_hello(client, session)
            case StatsQuery():
                self.send("scheduler", msgspec.structs.replace(message, client=client))

    def _resync(self) -> None:
        """An actor behind us was restarted and lost its state: start a new epoch and hand the
        scheduler every unfinished request again, with the tokens already sent to its client
        (they count toward max_tokens and are recomputed, not re-sent)."""
        self.epoch += 1
        self.send("scheduler", Resync(self.epoch))
        eos = list(self.tokenizer.eos_token_ids)
        for tracked in sorted(self.table.values(), key=lambda t: t.seq):
            self.send(
                "scheduler",
                AddSeq(
                    tracked.seq,
                    tracked.prompt_token_ids,
                    tracked.params,
                    eos,
                    list(tracked.output_token_ids),
                    tracked.tenant,
                ),
            )

    def _on_hello(self, client: int, session: int) -> None:
        slot = self._slot(client)
        self._abandon(slot)
        slot.session = session
        slot.outbox.clear()
        self._deliver(
            client,
            [
                Welcome(
                    session,
                    self.limits.vocab_size,
                    self.limits.max_model_len,
                    model_path(self.config),
                    os.getpid(),
                    self.sampling_defaults,
                )
            ],
        )

    # ----------------------------------------------------------------- clients
    def _slot(self, client: int) -> ClientSlot:
        slot = self.clients.get(client)
        if slot is None:
            inbox = topology.inbox_name(self.instance_id, topology.client_id(client))
            # as the supervisor made it: the client may have written anything into its header
            sender = Sender(
                Ring.attach(
                    topology.link_name(self.instance_id, topology.client_id(client), self.child_id),
                    trust_header=False,
                    bell_name=inbox,
                )
            )
            lock_fd = os.open(os.path.join(names.SHM_DIR, inbox.lstrip("/")), os.O_RDWR)
            slot = self.clients[client] = ClientSlot(client, sender, lock_fd)
        return slot

    def _deliver(self, client: int, messages: list) -> None:
        slot = self.clients.get(client)
        if slot is None:
            return
        slot.outbox += messages
        self._flush(slot)

    def _flush(self, slot: ClientSlot) -> None:
        """Send a client's queued updates in records its ring can hold; a client that has left no
        room for longer than ``engine.client_stall_timeout`` while it has requests open is cut off
        (its backlog would grow without bound); nobody else ever waits for it."""
        while slot.outbox:
            try:
                count = self._send_some(slot)
            except RingCorrupted as exc:  # the client wrote into its ring's words: its link is reset
                slot.sender.ring.drop_unread()
                slot.sender.ring.rewrite_header()
                slot.outbox.clear()
                self._disconnect(slot.index, f"its inbox is corrupted ({exc})")
                return
            if count == 0:
                now = time.monotonic()
                slot.stalled_since = slot.stalled_since or now
                if slot.requests and now - slot.stalled_since > self.config.engine.client_stall_timeout:
                    self._disconnect(slot.index, f"it read nothing for {self.config.engine.client_stall_timeout:g} s")
                return
            del slot.outbox[:count]
            slot.stalled_since = None

    def _send_some(self, slot: ClientSlot) -> int:
        """Send the longest prefix of the outbox (halving from all of it) that fits one record and
        the room its ring has now; how many messages went (0: no room)."""
        count = len(slot.outbox)
        while True:
            try:
                slot.sender.send_many(slot.outbox[:count], timeout=0)
                return count
            except RingFull:
                if count == 1:
                    return 0
            except RecordTooLarge:
                if count == 1:  # one message larger than the ring: it can never be delivered
                    slot.outbox[0] = self._too_large(slot, slot.outbox[0])
                    continue
            count //= 2

    def _too_large(self, slot: ClientSlot, message) -> Update:
        """An update no record of the client's ring can hold (a request's text cannot be split
        here without breaking the stream's accounting): its request ends with a 500 instead."""
        request_id = getattr(message, "request_id", "")
        seq = slot.requests.get(request_id)
        if seq is not None:
            self.send("scheduler", FinishSeq(seq, "abort"))
            self._drop(self.table[seq])
        return Update(
            request_id,
            [],
            "",
            "error",
            error_code=500,
            error_msg="an update larger than the client's ring (supervisor.ring_capacity)",
        )

    def _disconnect(self, client: int, reason: str) -> None:
        """Cut a client off: its requests end with a 400 saying why (sent with the next flush), its
        slot forgets its session and backlog, whatever else it wrote is dropped. The engine and every
        other client go on. Logged at most once a second a slot (a client may keep breaking its link)."""
        slot = self._slot(client)
        self.disconnected += 1
        now = time.monotonic()
        if now - slot.logged_at >= 1.0:
            slot.logged_at = now
            _log.warning(f"fdcore: engine disconnected {topology.client_id(client)}: {reason}")
        self.receiver.source.drain(topology.client_id(client))  # first: what it sends after our answer counts
        slot.outbox.clear()
        slot.stalled_since = None
        slot.session = 0
        for seq in list(slot.requests.values()):
            tracked = self.table[seq]
            self.send("scheduler", FinishSeq(seq, "abort"))
            slot.outbox.append(
                Update(
                    tracked.request_id,
                    [],
                    "",
                    "error",
                    error_code=400,
                    error_msg=f"client disconnected by the engine: {reason}",
                )
            )
            self._drop(tracked)

    def _abandon(self, slot: ClientSlot) -> None:
        """Abort every request of a slot's previous owner (it is gone, or replaced)."""
        for seq in list(slot.requests.values()):
            self.send("scheduler", FinishSeq(seq, "abort"))
            self._drop(self.table[seq])

    def _owner_alive(self, slot: ClientSlot) -> bool:
        try:
            fcntl.flock(slot.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True  # the owner holds its lock
        fcntl.flock(slot.lock_fd, fcntl.LOCK_UN)
        return False
