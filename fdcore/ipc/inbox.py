"""An actor's inbox: many producers, one consumer, no shared lock.

Design (the choice the ring layer was built for): one single-producer
:class:`~fdcore.ipc.ring.Ring` per producer link, all sharing one
:class:`~fdcore.ipc.doorbell.Doorbell` that the consumer sleeps on.

Why not one multi-producer ring? Producers would have to agree on who writes
where, through a lock or an atomic reservation. A producer SIGKILLed while
holding the lock wedges everyone; one killed between reserving space and
filling it leaves a hole the consumer cannot tell from a slow writer. With one
ring per link, a producer owns its ring's tail outright: killed at any
instruction, it leaves at most an unpublished partial record in *its own*
ring, invisible to the consumer, and every other link carries on untouched. A
restarted producer re-attaches and continues from the published tail.

The consumer takes records round-robin across links (no link can starve the
others) and drains in batches with :meth:`Inbox.get_many`.

Names: the doorbell is ``<inbox name>`` (segment and semaphore), each link's
ring ``<inbox name>.<producer>``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fdcore.ipc.broadcast import BroadcastRing
from fdcore.ipc.doorbell import Doorbell
from fdcore.ipc.ring import Ring
from fdcore.ipc.ring_layout import DEFAULT_CAPACITY, DEFAULT_SPIN, RingCorrupted, RingEmpty, RingStatistics

if TYPE_CHECKING:
    from collections.abc import Callable, Container, Iterable

BELL_WAITING_OFF = 0


@dataclass(frozen=True)
class InboxStatistics:
    name: str
    links: dict[str, RingStatistics]
    sleeps: int


class Inbox:
    """The consumer's view of all its links (or the owner's, who creates and unlinks them)."""

    def __init__(self, name: str, bell: Doorbell, owner: bool, capacity: int, spin: float):
        self.name = name
        self.owner = owner
        self.capacity = capacity
        self.spin = spin
        self._bell = bell
        self._links: dict[str, Ring] = {}
        self._order: list[Ring] = []
        self._next = 0
        self._sleeps = 0

    @classmethod
    def create(
        cls, name: str, producers: Iterable[str] = (), *, capacity: int = DEFAULT_CAPACITY, spin: float = DEFAULT_SPIN
    ) -> Inbox:
        """Create the doorbell and one ring per producer; this handle owns them all."""
        inbox = cls(name, Doorbell.standalone(name, create=True), True, capacity, spin)
        try:
            for producer in producers:
                inbox.add_link(producer)
        except BaseException:
            inbox.close()
            inbox.unlink()
            raise
        return inbox

    @classmethod
    def attach(
        cls, name: str, producers: Iterable[str] = (), *, spin: float = DEFAULT_SPIN, untrusted: Container[str] = ()
    ) -> Inbox:
        """Open an existing inbox as its consumer, with the named links. The links of ``untrusted``
        producers (clients) are opened as the creator made them: nothing such a producer writes into
        its ring can stop the attach (the ring's invariant 6)."""
        inbox = cls(name, Doorbell.standalone(name, create=False), False, 0, spin)
        try:
            for producer in producers:
                inbox.attach_link(producer, trusted=producer not in untrusted)
        except BaseException:
            inbox.close()
            raise
        return inbox

    def link_name(self, producer: str) -> str:
        """The ring a producer attaches to (``Ring.attach(inbox.link_name(p))``)."""
        return f"{self.name}.{producer}"

    def add_link(self, producer: str, capacity: int | None = None) -> str:
        """Create a new link (owner side); returns its ring name."""
        self._check_new(producer)
        ring = Ring.create(
            capacity or self.capacity, name=self.link_name(producer), doorbell=self._bell, spin=self.spin
        )
        self._add(producer, ring)
        return ring.name

    def attach_link(self, producer: str, trusted: bool = True) -> None:
        """Start consuming an existing link (consumer side); one whose producer is not ``trusted`` is
        opened as it was made, its header unread."""
        self._check_new(producer)
        self._add(
            producer, Ring.attach(self.link_name(producer), doorbell=self._bell, spin=self.spin, trust_header=trusted)
        )

    def link(self, producer: str) -> Ring:
        """The ring of one link (its consumer's end)."""
        return self._links[producer]

    def attach_reader(self, producer: str, ring_name: str, reader: int) -> None:
        """Start consuming, as reader ``reader``, a :class:`~fdcore.ipc.broadcast.BroadcastRing`
        that ``producer`` writes for several inboxes (the ring is not the inbox's: it neither
        creates nor unlinks it)."""
        self._check_new(producer)
        self._add(producer, BroadcastRing.attach(ring_name, reader=reader, doorbell=self._bell, spin=self.spin))

    def _check_new(self, producer: str) -> None:
        if producer in self._links:
            raise ValueError(f"{self.name}: link {producer!r} exists already")

    def _add(self, producer: str, ring: Ring) -> None:
        self._links[producer] = ring
        self._order.append(ring)

    def remove_link(self, producer: str) -> None:
        """Stop consuming a link; the owner also unlinks its ring."""
        ring = self._links.pop(producer)
        self._order.remove(ring)
        ring.close()
        if self.owner and ring.owner:
            ring.unlink()

    @property
    def links(self) -> list[str]:
        return list(self._links)

    # --------------------------------------------------------------- consuming
    def get_nowait(self) -> bytes:
        """One record from the next non-empty link, or :class:`RingEmpty`."""
        order = self._order
        count = len(order)
        for i in range(count):
            ring = order[(self._next + i) % count]
            data = ring._try_get()
            if data is not None:
                self._next = (self._next + i + 1) % count
                return data
        raise RingEmpty(self.name)

    def get(self, timeout: float | None = None) -> bytes:
        """One record, waiting up to ``timeout`` seconds (None: forever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return self.get_nowait()
            except RingEmpty:
                if not self._wait(deadline):
                    raise RingEmpty(f"{self.name}: no record within {timeout} s") from None

    def get_many_nowait(self, max_records: int | None = None) -> list[bytes]:
        """Everything available now (at most ``max_records`` from each link)."""
        out: list[bytes] = []
        for ring in self._order:
            out += ring.get_many_nowait(max_records)
        return out

    def get_many(self, max_records: int | None = None, timeout: float | None = None) -> list[bytes]:
        """Wait up to ``timeout`` for at least one record, then drain every link
        (at most ``max_records`` from each)."""
        return self._wait_for(self.get_many_nowait, max_records, timeout)

    def get_many_by_link_nowait(self, max_records: int | None = None) -> list[tuple[str, bytes | RingCorrupted]]:
        """Like :meth:`get_many_nowait`, each record with the link it came by: the sender of a
        record is its link, which a consumer can trust (the body is whatever the producer wrote). A
        link found corrupted is emptied and repaired (the ring's invariant 6) and gives its :class:`RingCorrupted`
        as an item, after the records read before it: one producer's broken ring is that producer's
        problem, never the consumer's crash."""
        out: list[tuple[str, bytes | RingCorrupted]] = []
        for producer, ring in self._links.items():
            try:
                out += [(producer, raw) for raw in ring.get_many_nowait(max_records)]
            except RingCorrupted as exc:
                ring.drop_published()
                ring.rewrite_header()
                out.append((producer, exc))
        return out

    def get_many_by_link(
        self, max_records: int | None = None, timeout: float | None = None
    ) -> list[tuple[str, bytes | RingCorrupted]]:
        """Like :meth:`get_many`, each record with its link."""
        return self._wait_for(self.get_many_by_link_nowait, max_records, timeout)

    def _wait_for(
        self, take: Callable[[int | None], list[Any]], max_records: int | None, timeout: float | None
    ) -> list[Any]:
        """``take(max_records)`` until it returns something, sleeping on the doorbell between tries."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            out = take(max_records)
            if out:
                return out
            if not self._wait(deadline):
                raise RingEmpty(f"{self.name}: no record within {timeout} s")

    def drain(self, producer: str) -> int:
        """Drop everything waiting on one link (a producer that was disconnected); the records dropped
        (a corrupted link is emptied whole and counts 0)."""
        ring = self._links[producer]
        try:
            return len(ring.get_many_nowait())
        except RingCorrupted:
            ring.drop_published()
            ring.rewrite_header()
            return 0

    def readable(self) -> bool:
        """True when some link has a record, or is corrupted (so that a reader goes on to find out)."""
        for ring in self._order:
            try:
                if ring.readable():
                    return True
            except RingCorrupted:
                return True
        return False

    def _wait(self, deadline: float | None) -> bool:
        for ring in self._order:
            ring._publish_head()
        spin_end = time.monotonic() + self.spin
        while time.monotonic() < spin_end:
            if self.readable():
                return True
        self._sleeps += 1
        return self._bell.wait(self.readable, deadline)

    # --------------------------------------------------------------- lifecycle
    def statistics(self) -> InboxStatistics:
        return InboxStatistics(self.name, {p: r.statistics() for p, r in self._links.items()}, self._sleeps)

    def close(self) -> None:
        for ring in self._order:
            ring.close()
        self._bell.close()

    def unlink(self) -> None:
        """Remove every name of the inbox (owner only)."""
        if not self.owner:
            raise ValueError(f"{self.name}: only the creating handle may unlink the inbox")
        for ring in self._order:
            if ring.owner:
                ring.unlink()
        self._bell.unlink()

    def __enter__(self) -> Inbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self.owner:
            self.unlink()
