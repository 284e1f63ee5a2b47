"""The broadcast ring: one copy of each record, every reader gets it, the slowest reader bounds the
producer, each reader is woken by its own doorbell, and a reader killed anywhere is replaced."""

from __future__ import annotations

import collections
import os
import signal
import struct
import time
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fdcore.ipc import BroadcastRing, Doorbell, Inbox, Ring, RingCorrupted, RingFull, names
from fdcore.ipc import broadcast as broadcast_mod

pytestmark = pytest.mark.tree


class Group:
    """N readers' doorbells (as their inboxes would own them) and a ring over them."""

    def __init__(self, readers: int, capacity: int):
        instance = names.new_instance_id()
        self.bells = [
            Doorbell.standalone(names.object_name(instance, f"worker{i}"), create=True) for i in range(readers)
        ]
        self.ring = BroadcastRing.create(
            [bell.name for bell in self.bells], capacity, name=names.object_name(instance, "steps")
        )

    def reader(self, i: int) -> BroadcastRing:
        return BroadcastRing.attach(self.ring.name, reader=i)

    def close(self) -> None:
        self.ring.close()
        self.ring.unlink()
        for bell in self.bells:
            bell.close()
            bell.unlink()


@pytest.fixture
def group3():
    group = Group(3, 4096)
    yield group
    group.close()


def _record(seq: int, size: int = 24) -> bytes:
    body = seq.to_bytes(4, "little") + os.urandom(max(0, size - 8))
    return zlib.crc32(body).to_bytes(4, "little") + body


def _seq(record: bytes) -> int:
    assert zlib.crc32(record[4:]).to_bytes(4, "little") == record[:4], "record corrupted in transit"
    return int.from_bytes(record[4:8], "little")


def test_every_reader_gets_every_record_once_and_in_order(group3):
    readers = [group3.reader(i) for i in range(3)]
    try:
        for i in range(100):
            group3.ring.put_nowait(_record(i))
        for reader in readers:
            assert [_seq(reader.get_nowait()) for _ in range(100)] == list(range(100))
            assert reader.get_many_nowait() == []
        stats = group3.ring.statistics()
        assert stats.records_put == 100 and stats.used_bytes == 0
    finally:
        for reader in readers:
            reader.close()


def test_the_slowest_reader_bounds_the_producers_room(group3):
    fast, slow = group3.reader(0), group3.reader(2)
    try:
        sent = 0
        while True:
            try:
                group3.ring.put_nowait(_record(sent, 200))
            except RingFull:
                break
            sent += 1
            fast.get_many_nowait()  # reader 0 keeps up; readers 1 and 2 take nothing
        assert 10 < sent < 4096 // 200 + 1
        assert group3.ring.heads()[0] > group3.ring.heads()[2] == 0
        assert [_seq(r) for r in slow.get_many_nowait()] == list(range(sent))
        with pytest.raises(RingFull):  # reader 1 still holds every record
            group3.ring.put_nowait(_record(sent, 200))
        reader1 = group3.reader(1)
        reader1.get_many_nowait()
        reader1.close()
        group3.ring.put_nowait(_record(sent, 200))  # now every reader has freed the room
        assert _seq(fast.get_nowait()) == _seq(slow.get_nowait()) == sent
    finally:
        fast.close()
        slow.close()


@settings(max_examples=100, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.integers(min_value=0, max_value=300),
            st.tuples(st.sampled_from([0, 1]), st.sampled_from(["get", "drain"])),
        ),
        max_size=150,
    )
)
def test_framing_and_wrap_around_match_a_fifo_model_per_reader(ops):
    group = Group(2, 512)
    readers = [group.reader(0), group.reader(1)]
    models = [collections.deque(), collections.deque()]
    try:
        for i, op in enumerate(ops):
            if isinstance(op, int):
                payload = bytes([i % 256]) * op
                try:
                    group.ring.put_nowait(payload)
                except RingFull:
                    in_use = max(sum((len(r) + 15) & ~7 for r in model) for model in models)
                    assert in_use + ((op + 15) & ~7) > 512
                    continue
                for model in models:
                    model.append(payload)
            else:
                who, how = op
                if how == "get":
                    if models[who]:
                        assert readers[who].get_nowait() == models[who].popleft()
                else:
                    assert readers[who].get_many_nowait() == list(models[who])
                    models[who].clear()
    finally:
        for reader in readers:
            reader.close()
        group.close()


def test_attach_refuses_a_wrong_reader_index_a_plain_ring_and_garbage(group3):
    with pytest.raises(ValueError, match=r"reader 3 out of range: the ring has 3 readers \(0..2\)"):
        BroadcastRing.attach(group3.ring.name, reader=3)
    with Ring.create(4096) as plain:
        with pytest.raises(RingCorrupted, match="bad magic"):
            BroadcastRing.attach(plain.name, reader=0)
    mm = group3.ring._mm
    tail_word = broadcast_mod.TAIL_OFF
    struct.pack_into("Q", mm, tail_word, 1 << 40)
    with pytest.raises(RingCorrupted, match="reader 0's head 0 and tail"):
        BroadcastRing.attach(group3.ring.name, reader=0)
    struct.pack_into("Q", mm, tail_word, 0)


def test_unlinking_removes_the_ring_but_not_the_readers_doorbells():
    group = Group(2, 4096)
    ring_name = group.ring.name
    group.ring.close()
    group.ring.unlink()
    assert not os.path.exists("/dev/shm" + ring_name)
    assert all(os.path.exists("/dev/shm" + bell.name) for bell in group.bells)
    assert ring_name.startswith("/fdcore-")
    for bell in group.bells:
        bell.close()
        bell.unlink()


# --------------------------------------------------------------- cross-process
def _read(ring_name: str, reader: int, count: int, report_name: str, die_after: int | None):
    """Reader ``reader``: take ``count`` records, checking order; report each sequence number."""
    ring = BroadcastRing.attach(ring_name, reader=reader)
    report = Ring.attach(report_name)
    expected = None
    for _ in range(count):
        seq = _seq(ring.get(timeout=30))
        assert expected is None or seq == expected, f"reader {reader}: got {seq}, expected {expected}"
        expected = seq + 1
        report.put(struct.pack("II", reader, seq))
        if die_after is not None and seq == die_after:
            os.kill(os.getpid(), signal.SIGKILL)
    ring.close()
    report.close()


def _reports(readers: int) -> Inbox:
    """Where reader processes report what they got: one link each (a ring has one producer)."""
    return Inbox.create(
        names.object_name(names.new_instance_id(), "reports"), [f"r{i}" for i in range(readers)], capacity=1 << 20
    )


def _produce(ring_name: str, count: int, size: int):
    ring = BroadcastRing.attach(ring_name)
    for i in range(count):
        ring.put(_record(i, size))
    ring.close()


@pytest.mark.parametrize("size", [24, 900])
def test_reader_processes_each_get_everything_from_one_producer_process(spawn, size):
    count, group = 3000, Group(3, 8192)
    with _reports(3) as report:
        try:
            for i in range(3):
                spawn(_read, group.ring.name, i, count, report.link_name(f"r{i}"), None)
            producer = spawn(_produce, group.ring.name, count, size)
            got = [[] for _ in range(3)]
            while sum(map(len, got)) < 3 * count:
                reader, seq = struct.unpack("II", report.get(timeout=30))
                got[reader].append(seq)
            assert got == [list(range(count))] * 3
            producer.join(10)
            assert producer.exitcode == 0
            published = struct.unpack_from("Q", group.ring._mm, broadcast_mod.TAIL_OFF)[0]
            assert published == count * ((size + 15) & ~7)  # one copy of each record, not three
        finally:
            group.close()


def test_a_reader_killed_mid_stream_is_replaced_and_the_others_never_notice(spawn):
    count, group = 4000, Group(2, 4096)
    with _reports(2) as report:
        try:
            spawn(_read, group.ring.name, 0, count, report.link_name("r0"), None)
            victim = spawn(_read, group.ring.name, 1, count, report.link_name("r1"), 700)
            spawn(_produce, group.ring.name, count, 64)
            got = [[], []]
            while not (got[1] and got[1][-1] == 700):
                reader, seq = struct.unpack("II", report.get(timeout=30))
                got[reader].append(seq)
            victim.join(10)
            assert victim.exitcode == -signal.SIGKILL
            # The successor carries on from the victim's published head: record 701.
            spawn(_read, group.ring.name, 1, count - 701, report.link_name("r1"), None)
            while len(got[0]) < count or len(got[1]) < count:
                reader, seq = struct.unpack("II", report.get(timeout=30))
                got[reader].append(seq)
            assert got == [list(range(count))] * 2
        finally:
            group.close()


def _wait_then_put(ring_name: str, bell_names: list[str]):
    ring = BroadcastRing.attach(ring_name)
    bells = [Doorbell.standalone(name, create=False) for name in bell_names]
    deadline = time.monotonic() + 10
    while not all(bell.mm[0] for bell in bells) and time.monotonic() < deadline:
        time.sleep(0.001)  # polling other processes' flags: no event to wait on across processes
    time.sleep(0.05)  # let the readers' first short naps pass: they are now in long ones
    ring.put(struct.pack("d", time.monotonic()))  # one publish for both
    for bell in bells:
        bell.close()
    ring.close()


def _sleep_in_an_inbox(inbox_name: str, ring_name: str, reader: int, report_name: str):
    inbox = Inbox.attach(inbox_name, ["supervisor"])
    inbox.attach_reader("scheduler", ring_name, reader)
    report = Ring.attach(report_name)
    record = inbox.get(timeout=60)
    report.put(struct.pack("Id", reader, time.monotonic() - struct.unpack("d", record)[0]))
    inbox.close()
    report.close()


def test_one_publish_wakes_every_sleeping_reader_through_its_inbox_doorbell(spawn, monkeypatch):
    """The readers nap up to 30 s here (instead of 1 s): only the doorbells can wake them in time."""
    from fdcore.ipc import doorbell

    monkeypatch.setattr(doorbell, "MAX_NAP", 30.0)
    instance = names.new_instance_id()
    inboxes = [Inbox.create(names.object_name(instance, f"worker{i}"), ["supervisor"]) for i in range(2)]
    ring = BroadcastRing.create([inbox.name for inbox in inboxes], 4096, name=names.object_name(instance, "steps"))
    try:
        with _reports(2) as report:
            for i, inbox in enumerate(inboxes):
                spawn(_sleep_in_an_inbox, inbox.name, ring.name, i, report.link_name(f"r{i}"))
            spawn(_wait_then_put, ring.name, [inbox.name for inbox in inboxes])
            woken = dict(struct.unpack("Id", report.get(timeout=60)) for _ in range(2))
            assert sorted(woken) == [0, 1]
            assert max(woken.values()) < 0.5, f"woken only after {woken}"
    finally:
        ring.close()
        ring.unlink()
        for inbox in inboxes:
            inbox.close()
            inbox.unlink()


def test_an_inbox_takes_a_reader_beside_its_own_links(group3):
    instance = names.new_instance_id()
    inbox = Inbox.create(names.object_name(instance, "worker1"), ["supervisor"])
    try:
        inbox.attach_reader("scheduler", group3.ring.name, 1)
        assert inbox.links == ["supervisor", "scheduler"]
        supervisor = Ring.attach(inbox.link_name("supervisor"))
        supervisor.put_nowait(b"from the supervisor")
        supervisor.close()
        group3.ring.put_nowait(b"a step")
        assert sorted(inbox.get_many_by_link_nowait()) == [
            ("scheduler", b"a step"),
            ("supervisor", b"from the supervisor"),
        ]
        inbox.remove_link("scheduler")  # the ring is not the inbox's: it stays
        assert os.path.exists("/dev/shm" + group3.ring.name)
    finally:
        inbox.close()
        inbox.unlink()
