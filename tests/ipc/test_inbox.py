"""Many producers into one inbox: nothing lost, duplicated or reordered; a killed producer harms no one."""

from __future__ import annotations

import os
import signal
import zlib

import pytest

from fdcore.ipc import Inbox, Receiver, Ring, RingEmpty, Sender, names
from fdcore.ipc.channel import ProtocolError
from fdcore.protocol import ClientMessage, Ping, Stop, Update

pytestmark = pytest.mark.tree


def _record(producer: int, seq: int) -> bytes:
    body = os.urandom(8 + (seq * 7 + producer) % 300)
    head = producer.to_bytes(2, "little") + seq.to_bytes(6, "little")
    return head + zlib.crc32(head + body).to_bytes(4, "little") + body


def _check(record: bytes) -> tuple[int, int]:
    head, crc, body = record[:8], record[8:12], record[12:]
    assert zlib.crc32(head + body).to_bytes(4, "little") == crc, "record corrupted in transit"
    return int.from_bytes(head[:2], "little"), int.from_bytes(head[2:], "little")


def _produce(ring_name: str, producer: int, count: int, batch: int):
    ring = Ring.attach(ring_name)
    seq = 0
    while count is None or seq < count:
        n = batch if count is None else min(batch, count - seq)
        ring.put_many([_record(producer, seq + i) for i in range(n)])
        seq += n
    ring.close()


@pytest.fixture
def inbox():
    box = Inbox.create(names.object_name(names.new_instance_id(), "engine"), capacity=16384)
    yield box
    box.close()
    box.unlink()


@pytest.mark.parametrize("batch", [1, 64])
def test_several_producer_processes_lose_duplicate_and_reorder_nothing(inbox, spawn, batch):
    producers, count = 4, 5000
    for p in range(producers):
        spawn(_produce, inbox.add_link(f"p{p}"), p, count, batch)
    next_seq = [0] * producers
    while sum(next_seq) < producers * count:
        for record in inbox.get_many(timeout=30):
            producer, seq = _check(record)
            assert seq == next_seq[producer], f"producer {producer}: got {seq}, expected {next_seq[producer]}"
            next_seq[producer] += 1
    assert next_seq == [count] * producers
    with pytest.raises(RingEmpty):
        inbox.get_nowait()


def test_a_producer_killed_mid_stream_leaves_the_others_whole(inbox, spawn):
    count = 20000
    victim = spawn(_produce, inbox.add_link("victim"), 0, None, 1)  # never stops on its own
    others = [spawn(_produce, inbox.add_link(f"p{p}"), p, count, 16) for p in (1, 2, 3)]
    next_seq = [0] * 4
    killed = False
    while sum(next_seq[1:]) < 3 * count:
        for record in inbox.get_many(timeout=30):
            producer, seq = _check(record)
            assert seq == next_seq[producer]
            next_seq[producer] += 1
        if not killed and next_seq[0] > 500:
            os.killpg(victim.pid, signal.SIGKILL)  # anywhere, mid-write included
            victim.join(10)
            killed = True
    assert killed and next_seq[1:] == [count] * 3
    for proc in others:
        proc.join(10)
        assert proc.exitcode == 0, "a surviving producer failed"
    for record in inbox.get_many_nowait():  # what the victim published before dying
        producer, seq = _check(record)
        assert producer == 0 and seq == next_seq[0]
        next_seq[0] += 1
    # A restarted producer attaches to the same link and carries on.
    spawn(_produce, inbox.link_name("victim"), 9, 10, 1).join(10)
    assert [_check(r) for r in inbox.get_many(timeout=10)] == [(9, i) for i in range(10)]


def test_round_robin_keeps_a_busy_link_from_starving_another(inbox):
    busy, quiet = (Ring.attach(inbox.add_link(n)) for n in ("busy", "quiet"))
    try:
        busy.put_many([b"busy"] * 50)
        quiet.put_nowait(b"quiet")
        assert b"quiet" in [inbox.get_nowait() for _ in range(2)]
    finally:
        busy.close()
        quiet.close()


def test_typed_channel_round_trips_structs_and_rejects_garbage(inbox):
    ring = Ring.attach(inbox.add_link("client"))
    sender, receiver = Sender(ring), Receiver(inbox, ClientMessage)
    try:
        message = Update("req-1", [1, 2, 3], "abc", finish_reason="stop")
        sender.send(message)
        sender.send_many([Update("req-2", [7], ""), Update("req-2", [8], "")])
        assert receiver.recv(timeout=5) == message
        assert [m.token_ids for m in receiver.recv_many(timeout=5)] == [[7], [8]]
        sender.send(Stop("not a client message"))
        with pytest.raises(ProtocolError, match="undecodable record"):
            receiver.recv(timeout=5)
        ring.put_nowait(b"\xc1 garbage")
        with pytest.raises(ProtocolError, match=inbox.name):
            receiver.recv_nowait()
        sender.send(Ping(nonce=5))
        with pytest.raises(ProtocolError):
            receiver.recv_nowait()
    finally:
        ring.close()


def test_consumer_attaches_by_name_and_producer_wakes_it(inbox, spawn):
    link = inbox.add_link("p")
    consumer = Inbox.attach(inbox.name, ["p"])
    try:
        spawn(_produce, link, 5, 3, 1)
        got = [_check(consumer.get(timeout=10)) for _ in range(3)]
        assert got == [(5, 0), (5, 1), (5, 2)]
        with pytest.raises(ValueError, match="only the creating handle"):
            consumer.unlink()
    finally:
        consumer.close()


def test_removing_a_link_unlinks_its_ring(inbox):
    name = inbox.add_link("gone")
    inbox.remove_link("gone")
    assert not os.path.exists("/dev/shm" + name)
    assert inbox.links == []
    with pytest.raises(ValueError, match="exists already"):
        inbox.add_link("x")
        inbox.add_link("x")


def test_a_batch_is_one_record_and_recv_hands_it_out_one_by_one(inbox):
    ring = Ring.attach(inbox.add_link("engine"))
    sender, receiver = Sender(ring), Receiver(inbox, ClientMessage)
    try:
        batch = [Update(f"req-{i}", [i], "") for i in range(100)]
        sender.send_many(batch)
        sender.send(Update("tail", [], ""))
        assert ring.statistics().records_put == 2
        assert [receiver.recv(timeout=5) for _ in range(3)] == batch[:3]
        rest = receiver.recv_many(timeout=5)
        assert rest == batch[3:] + [Update("tail", [], "")]
        sender.send_many([])
        sender.send(Update("after-empty", [], ""))
        assert receiver.recv(timeout=5).request_id == "after-empty"
    finally:
        ring.close()


def test_a_link_receiver_names_each_sender_and_returns_bad_records_instead_of_raising():
    """Each link decodes only its own union; garbage or a misplaced message on one link is that
    link's ProtocolError, handed back in place, and drain() empties one link only."""
    from fdcore.ipc import LinkReceiver

    with Inbox.create(
        names.object_name(names.new_instance_id(), "links"), ["actor", "client0"], capacity=4096
    ) as inbox:
        actor, client = (Sender(Ring.attach(inbox.link_name(p))) for p in ("actor", "client0"))
        receiver = LinkReceiver(inbox, {"actor": Stop | Ping, "client0": Ping})
        actor.send(Stop("bye"))
        client.send(Stop("forged"))  # valid msgpack, but not what a client may send
        client.ring.put(b"\xc1garbage")
        client.send_many([Ping(3), Ping(4)])
        items = receiver.recv_many(timeout=1.0)
        assert items[0] == ("actor", Stop("bye"))
        assert [link for link, _ in items[1:3]] == ["client0", "client0"]
        assert all(isinstance(m, ProtocolError) for _, m in items[1:3])
        assert items[3:] == [("client0", Ping(3)), ("client0", Ping(4))]
        client.send(Ping(5))
        actor.send(Ping(6))
        assert inbox.drain("client0") == 1
        assert receiver.recv_many(timeout=1.0) == [("actor", Ping(6))]
        actor.close()
        client.close()


def test_a_corrupted_link_is_reported_emptied_and_repaired_and_the_others_go_on():
    """A link whose ring was written over gives its records before the damage, then one RingCorrupted
    item (not an exception): the link is emptied, its header rewritten, and its producer, synced again,
    is heard; the other link never notices. The consumer's attach did not trust that link's header."""
    from fdcore.ipc import LinkReceiver, RingCorrupted
    from fdcore.ipc import ring as ring_mod

    name = names.object_name(names.new_instance_id(), "links")
    with Inbox.create(name, ["actor", "client0"], capacity=4096) as owner:
        client_ring = Ring.attach(owner.link_name("client0"))
        client_ring._mm[0:64] = os.urandom(64)  # magic and capacity: a trusting attach would refuse the link
        inbox = Inbox.attach(name, ["actor", "client0"], untrusted=["client0"])
        actor, client = Sender(Ring.attach(owner.link_name("actor"))), Sender(client_ring)
        try:
            receiver = LinkReceiver(inbox, {"actor": Ping, "client0": Ping})
            client.send(Ping(1))
            client_ring._words[ring_mod.TAIL] = client_ring._tail + 3  # a tail that cannot be
            actor.send(Ping(2))
            items = receiver.recv_many(timeout=1.0)
            assert ("actor", Ping(2)) in items
            bad = [m for link, m in items if link == "client0"]
            assert len(bad) == 1 and isinstance(bad[0], ProtocolError) and "corrupted ring" in str(bad[0])
            assert not inbox.readable()
            Ring.attach(owner.link_name("client0")).close()  # the header is as made again
            client_ring.resync()
            client.send(Ping(3))
            assert receiver.recv_many(timeout=1.0) == [("client0", Ping(3))]
            assert not isinstance(bad[0], RingCorrupted)
        finally:
            actor.close()
            client.close()
            inbox.close()
