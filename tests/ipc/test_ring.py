"""The single-producer ring: framing, wrap-around, limits, corruption, blocking."""

from __future__ import annotations

import collections
import os
import stat
import struct
import time
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fdcore.ipc import RecordTooLarge, Ring, RingClosed, RingCorrupted, RingEmpty, RingError, RingFull
from fdcore.ipc import ring as ring_mod

pytestmark = pytest.mark.tree


@pytest.fixture
def ring():
    r = Ring.create(4096)
    yield r
    r.close()
    r.unlink()


def test_records_come_back_in_order_through_a_second_handle(ring):
    reader = Ring.attach(ring.name)
    try:
        for i in range(100):
            ring.put_nowait(f"record {i}".encode())
        assert [reader.get_nowait() for _ in range(100)] == [f"record {i}".encode() for i in range(100)]
        with pytest.raises(RingEmpty):
            reader.get_nowait()
    finally:
        reader.close()


def test_empty_record_and_bytearray_and_memoryview_payloads(ring):
    ring.put_nowait(b"")
    ring.put_nowait(bytearray(b"abc"))
    ring.put_nowait(memoryview(b"xyz"))
    assert ring.get_many_nowait() == [b"", b"abc", b"xyz"]


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(st.one_of(st.integers(min_value=0, max_value=300), st.just("get"), st.just("drain")), max_size=200),
    capacity=st.sampled_from([64, 256, 512, 1024]),
)
def test_framing_and_wrap_around_match_a_fifo_model(ops, capacity):
    ring = Ring.create(capacity)
    try:
        model: collections.deque[bytes] = collections.deque()
        for i, op in enumerate(ops):
            if op == "get":
                if model:
                    assert ring.get_nowait() == model.popleft()
                else:
                    with pytest.raises(RingEmpty):
                        ring.get_nowait()
            elif op == "drain":
                assert ring.get_many_nowait() == list(model)
                model.clear()
            else:
                payload = bytes([i % 251]) * op
                if op > ring.max_record:
                    with pytest.raises(RecordTooLarge):
                        ring.put_nowait(payload)
                    continue
                used = sum(_record_size(p) for p in model)
                try:
                    ring.put_nowait(payload)
                    model.append(payload)
                except RingFull:
                    assert used + _record_size(payload) > capacity, "a record that fits was refused"
                else:
                    assert used + _record_size(payload) <= capacity, "a record that does not fit was taken"
        assert ring.get_many_nowait() == list(model)
        assert ring.statistics().used_bytes == 0
    finally:
        ring.close()
        ring.unlink()


def _record_size(payload: bytes) -> int:
    """Bytes a record takes in the data area: an 8-byte header, the payload padded to 8."""
    return (len(payload) + 15) & ~7


def test_capacity_rounds_up_to_a_power_of_two_and_record_limit():
    with Ring.create(1000) as r:
        assert r.statistics().capacity == 1024
        assert r.max_record == 1024 - 8
        r.put_nowait(b"x" * r.max_record)
        assert r.get_nowait() == b"x" * r.max_record
        with pytest.raises(RecordTooLarge, match="1017 bytes exceeds the limit of 1016"):
            r.put_nowait(b"x" * 1017)
        assert isinstance(RecordTooLarge("x"), ValueError)


def test_put_on_full_ring_times_out_and_get_on_empty_ring_times_out(ring):
    with pytest.raises(RingEmpty, match="within 0.05 s"):
        ring.get(timeout=0.05)
    while True:
        try:
            ring.put_nowait(b"y" * 100)
        except RingFull:
            break
    t0 = time.monotonic()
    with pytest.raises(RingFull, match="within 0.1 s"):
        ring.put(b"y" * 100, timeout=0.1)
    assert time.monotonic() - t0 >= 0.1
    ring.get_nowait()
    ring.put(b"y" * 100, timeout=0.1)  # room again once the consumer read one


def test_put_many_writes_all_or_reports_how_many(ring):
    assert ring.put_many([b"a" * 100] * 10) == 10
    with pytest.raises(RingFull) as info:
        ring.put_many([b"b" * 100] * 100, timeout=0.05)
    assert 0 < info.value.written < 100
    assert len(ring.get_many_nowait()) == 10 + info.value.written


def test_segments_are_private_and_named_with_the_prefix():
    with Ring.create(4096) as r:
        path = "/dev/shm" + r.name
        assert os.path.basename(path).startswith("fdcore-")
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat("/dev/shm/sem." + r.name[1:]).st_mode) == 0o600


def test_only_the_owner_unlinks_and_closed_handles_refuse_work(ring):
    other = Ring.attach(ring.name)
    with pytest.raises(RingError, match="only the creating handle"):
        other.unlink()
    other.close()
    other.close()  # idempotent
    with pytest.raises(RingClosed):
        other.put_nowait(b"x")
    with pytest.raises(RingClosed):
        other.get_nowait()
    with pytest.raises(RingClosed):  # a write to the closed handle's words too (it raised TypeError)
        other._words[0] = 1


# ------------------------------------------------------------------ corruption
def _mm(ring):
    return ring._mm


def test_attach_rejects_a_segment_that_is_not_a_ring(ring):
    _mm(ring)[0:8] = b"GARBAGE!"
    with pytest.raises(RingCorrupted, match="bad magic"):
        Ring.attach(ring.name)


def test_attach_rejects_an_impossible_capacity(ring):
    _mm(ring)[8:16] = (12345).to_bytes(8, "little")
    with pytest.raises(RingCorrupted, match="capacity 12345"):
        Ring.attach(ring.name)


def test_garbage_tail_is_detected(ring):
    reader = Ring.attach(ring.name)
    try:
        ring._words[ring_mod.TAIL] = 2**40 + 8
        with pytest.raises(RingCorrupted, match="tail"):
            reader.get_nowait()
    finally:
        reader.close()


def test_garbage_record_header_is_detected(ring):
    ring.put_nowait(b"hello")
    _mm(ring)[ring_mod.HEADER_SIZE : ring_mod.HEADER_SIZE + 8] = b"\xff\x00\x00\x00\x07\x00\x00\x00"
    with pytest.raises(RingCorrupted, match="bad record header"):
        ring.get_nowait()


@settings(max_examples=150, deadline=None)
@given(junk=st.binary(min_size=1, max_size=600), at=st.integers(min_value=0, max_value=4096 + 320))
def test_random_garbage_never_reads_out_of_bounds_or_hangs(junk, at):
    """Whatever the junk hits, reading ends (records, empty, or RingCorrupted), and what comes back
    is right: untouched records exactly, in order, up to the first one the junk hit; with the
    ring's own header hit, at least nothing that was never written."""
    records = [i.to_bytes(2, "little") * (i + 1) for i in range(40)]
    with Ring.create(4096) as r:
        for record in records:
            r.put_nowait(record)
        for _ in range(10):
            r.get_nowait()
        mm = _mm(r)
        end = min(len(mm), at + len(junk))
        mm[at:end] = junk[: end - at]
        try:
            reader = Ring.attach(r.name)
        except RingCorrupted:
            return
        got = []
        try:
            for _ in range(100):  # bounded: must end in a record, empty, or a clear error
                got.append(bytes(reader.get_nowait()))
        except (RingEmpty, RingCorrupted):
            pass
        finally:
            reader.close()
    if at < ring_mod.HEADER_SIZE:
        assert all(record in records for record in got)
        return
    offset = ring_mod.HEADER_SIZE + sum(_record_size(p) for p in records[:10])
    for expected, record in zip(records[10:], got, strict=False):
        size = _record_size(expected)
        if at < offset + size and end > offset:  # the junk hit this record: no promise from here on
            break
        assert record == expected
        offset += size


# --------------------------------------------------------------- cross-process
def _produce(name, count, size):
    ring = Ring.attach(name)
    for i in range(count):
        body = os.urandom(size - 8) if size > 8 else b""
        ring.put(i.to_bytes(4, "little") + zlib.crc32(body).to_bytes(4, "little") + body)
    ring.close()


@pytest.mark.parametrize("size", [8, 200, 3000])
def test_a_producer_process_fills_a_small_ring_and_blocks_for_room(spawn, size):
    count = 3000
    with Ring.create(8192) as ring:
        proc = spawn(_produce, ring.name, count, size)
        for i in range(count):
            record = ring.get(timeout=30)
            assert int.from_bytes(record[:4], "little") == i
            assert int.from_bytes(record[4:8], "little") == zlib.crc32(record[8:])
        proc.join(10)
        assert proc.exitcode == 0
        assert ring.statistics().used_bytes == 0


def _wait_then_put(name, ready_flag_offset):
    ring = Ring.attach(name)
    deadline = time.monotonic() + 10
    while not ring._mm[ready_flag_offset] and time.monotonic() < deadline:
        time.sleep(0.001)  # polling another process's flag: no event to wait on across processes
    time.sleep(0.05)  # let the consumer's first short nap pass: it is now in a long one
    ring.put(struct.pack("d", time.monotonic()))  # CLOCK_MONOTONIC is the same in every process
    ring.close()


def test_a_sleeping_consumer_is_woken_by_the_doorbell(spawn, monkeypatch):
    """The consumer naps up to 30 s here (instead of 1 s): only the doorbell can wake it in time,
    so a lost wake-up fails the test instead of hiding behind the next nap."""
    from fdcore.ipc import doorbell

    monkeypatch.setattr(doorbell, "MAX_NAP", 30.0)
    with Ring.create(4096) as ring:
        spawn(_wait_then_put, ring.name, ring_mod.CONSUMER_WAITING_OFF)
        record = ring.get(timeout=60)
        woken_after = time.monotonic() - struct.unpack("d", record)[0]
        assert woken_after < 0.5, f"the put woke the consumer only after {woken_after:.2f} s"
        assert ring.statistics().consumer_waits >= 1


# ---------------------------------------------------------- a peer that is not trusted (invariant 6)
def test_an_untrusting_attach_ignores_the_header_and_clears_words_that_do_not_fit(ring):
    """Magic, capacity and names overwritten, head and tail out of bounds: the attach opens the ring as
    it was made (the capacity the segment holds) and leaves it empty and consistent."""
    ring.put_nowait(b"x" * 100)
    _mm(ring)[0 : ring_mod.HEADER_SIZE] = os.urandom(ring_mod.HEADER_SIZE)
    ring._words[ring_mod.TAIL], ring._words[ring_mod.HEAD] = 2**50 + 3, 5
    with pytest.raises(RingCorrupted):
        Ring.attach(ring.name)
    reader = Ring.attach(ring.name, trust_header=False, bell_name=ring.name + ".bell")
    try:
        assert reader.max_record == 4096 - 8
        assert reader.get_many_nowait() == []
        ring.resync()
        ring.put_nowait(b"after")
        assert reader.get_nowait() == b"after"
    finally:
        reader.close()


def test_a_consumer_returns_the_records_before_a_bad_header_then_drops_the_rest(ring):
    reader = Ring.attach(ring.name)
    try:
        ring.put_nowait(b"first")
        ring.put_nowait(b"second")
        ring.put_nowait(b"third")
        at = ring_mod.HEADER_SIZE + 2 * _record_size(b"first")  # "third"'s header (same sizes)
        _mm(ring)[at + 4 : at + 8] = b"\xde\xad\xbe\xef"
        assert reader.get_many_nowait() == [b"first", b"second"]
        with pytest.raises(RingCorrupted, match="bad record header"):
            reader.get_many_nowait()
        assert reader.drop_published() == _record_size(b"third")
        assert reader.get_many_nowait() == []
        ring.resync()  # the producer goes on from where the consumer reset the ring
        ring.put_nowait(b"fourth")
        assert reader.get_many_nowait() == [b"fourth"]
    finally:
        reader.close()


def test_a_producer_whose_consumer_wrote_a_garbage_head_raises_then_drops_what_is_unread(ring):
    reader = Ring.attach(ring.name)
    try:
        ring.put_nowait(b"unread")
        reader._words[ring_mod.HEAD] = 2**40 + 1
        with pytest.raises(RingCorrupted, match="head"):
            ring.put_nowait(b"y" * 4080)  # (more than the room the producer knows of: it reads head)
        ring.drop_unread()
        _mm(ring)[0:8] = b"GARBAGE!"
        ring.rewrite_header()  # as made: a trusting attach works again
        again = Ring.attach(ring.name)
        again.close()
        reader.resync()
        ring.put_nowait(b"y" * 4080)
        assert reader.get_nowait() == b"y" * 4080
    finally:
        reader.close()
