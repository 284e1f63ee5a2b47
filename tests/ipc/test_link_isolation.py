"""The engine distrusts its client links: the link names the sender, each link decodes only what a
client may send, and one client's garbage, misplaced messages, forged ``client`` fields or forged
``Hello`` cost that client only. Also: backlogs go out in records the ring can hold."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest

from fdcore import AsyncLLM, SamplingParams
from fdcore.checkpoint import tiny
from fdcore.client.connection import Connection
from fdcore.ipc import RingEmpty
from fdcore.protocol import (
    AbortRequest,
    AddRequest,
    Hello,
    Ping,
    Restarted,
    SeqTokens,
    ServingStats,
    Stop,
    Suspects,
    Update,
    Welcome,
)
from fdcore.supervisor import actor_pid
from tests.tree.test_crash_resume import config, requests, stream_all

pytestmark = pytest.mark.tree

HOSTILE = ["bytes", "wrong_type", "wrong_type_batch", "forged_abort", "forged_add", "forged_hello"]
DISCONNECTING = {"bytes", "wrong_type", "wrong_type_batch"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.make_tiny_model(str(tmp_path_factory.mktemp("links") / "tiny"))


def wrong_type(rng: random.Random):
    """A valid record of a type only an actor (or the engine itself) may send."""
    return rng.choice(
        [
            Stop("forged"),
            Ping(1),
            Restarted("worker0", 9),
            SeqTokens(0, [1], [7], [None]),
            Suspects("worker0", 0, list(range(1, 9))),
            ServingStats(1, client=0),
            Update("r0", [1], "x"),
            Welcome(1, 10, 10, "m"),
        ]
    )


def final_update(conn: Connection, request_id: str, timeout: float = 20.0) -> Update:
    """The attacker's last update of one request (its error, or its end)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            message = conn.receiver.recv(timeout=max(0.0, deadline - time.monotonic()))
        except RingEmpty:
            raise AssertionError(f"no final update for {request_id}") from None
        if isinstance(message, Update) and message.request_id == request_id and message.finish_reason:
            return message


def await_welcome(conn: Connection, session: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        message = conn.receiver.recv(timeout=max(0.0, deadline - time.monotonic()))
        if isinstance(message, Welcome) and message.session == session:
            return


def attack(conn: Connection, victim: int, case: int, kind: str, rng: random.Random) -> None:
    """One hostile record after a request of the attacker's own; checks what the attacker hears."""
    own = f"a{case}"
    conn.submit(own, [5, 6, 7, 8], SamplingParams(max_tokens=200, ignore_eos=True))
    match kind:
        case "bytes":
            conn.sender.ring.put(os.urandom(rng.randrange(1, 64)))
        case "wrong_type":
            conn.send(wrong_type(rng))
        case "wrong_type_batch":
            conn.sender.send_many([wrong_type(rng), AbortRequest(conn.slot, own)])
        case "forged_abort":  # aborting the victim's stream: the link says it is ours, so a no-op
            conn.send(AbortRequest(victim, f"r{rng.randrange(8)}"))
        case "forged_add":  # a request in the victim's name, with one of its ids: ours, not its
            forged = f"r{rng.randrange(8)}"
            conn.send(AddRequest(victim, forged, conn_body(), time.time()))
            conn.send(AbortRequest(victim, forged))
            assert final_update(conn, forged).finish_reason in ("abort", "length")
        case "forged_hello":  # takes over the victim's slot? only resets ours
            session = rng.randrange(1 << 40)
            conn.send(Hello(victim, session))
            await_welcome(conn, session)
            return  # our own request was dropped with our old session
    if kind in DISCONNECTING:
        update = final_update(conn, own)
        assert (update.finish_reason, update.error_code) == ("error", 400), update
        assert update.error_msg.startswith("client disconnected by the engine: "), update.error_msg
    else:
        conn.send(AbortRequest(conn.slot, own))
        assert final_update(conn, own).finish_reason in ("abort", "length")


def conn_body():
    import msgspec

    return msgspec.Raw(
        msgspec.msgpack.encode(
            {"prompt_token_ids": [9, 10, 11], "sampling_params": {"max_tokens": 200, "ignore_eos": True}}
        )
    )


FUZZ_CASES = 1000


def test_a_hostile_client_costs_only_itself(model_dir):
    """Hostile records on every client link but the honest client's (7 attackers, in turn)."""
    rng = random.Random(12)
    prompts, params = requests(count=8, max_tokens=200)
    cases = [rng.choice(HOSTILE) for _ in range(FUZZ_CASES)]

    async def main():
        async with AsyncLLM(config(model_dir)) as client:
            clean = await stream_all(client, prompts, params)
            engine = actor_pid(client._tree.proc.pid, "engine")
            attackers = [Connection(client._tree) for _ in range(7)]  # engine.max_clients = 8
            assert len({a.slot for a in attackers} | {client._conn.slot}) == 8
            try:
                streams = asyncio.ensure_future(stream_all(client, prompts, params))
                for case, kind in enumerate(cases):
                    attacker = attackers[case % len(attackers)]
                    await asyncio.to_thread(attack, attacker, client._conn.slot, case, kind, rng)
                crashed = await streams
                for attacker in attackers:
                    attacker.handshake(10.0)  # the engine still answers every attacker too
            finally:
                for attacker in attackers:
                    attacker.close()
            stats = await client.stats()
            return clean, crashed, engine, actor_pid(client._tree.proc.pid, "engine"), stats

    clean, crashed, engine_before, engine_after, stats = asyncio.run(main())
    assert engine_after == engine_before, "the engine was restarted: a client's records crashed it"
    assert crashed == clean
    assert stats.disconnected_clients == sum(kind in DISCONNECTING for kind in cases)


def stall_config(model_dir: str, stall_timeout: float):
    from fdcore.config import parse_config

    return parse_config(
        f'[model]\npath = "{model_dir}"\n[engine]\nclient_stall_timeout = {stall_timeout}\n'
        "[supervisor]\nring_capacity = 16384\n"
    )


def read_all(conn: Connection, request_ids: set[str], timeout: float = 30.0) -> dict[str, list[Update]]:
    """Every update of these requests until each has ended."""
    updates: dict[str, list[Update]] = {rid: [] for rid in request_ids}
    open_ids, deadline = set(request_ids), time.monotonic() + timeout
    while open_ids:
        message = conn.receiver.recv(timeout=max(0.0, deadline - time.monotonic()))
        if isinstance(message, Update) and message.request_id in updates:
            updates[message.request_id].append(message)
            if message.finish_reason:
                open_ids.discard(message.request_id)
    return updates


@pytest.mark.parametrize("pause, stall_timeout, cut_off, max_tokens", [(2.0, 30.0, False, 200), (3.0, 1.0, True, 2000)])
def test_a_client_that_stops_reading(model_dir, pause, stall_timeout, cut_off, max_tokens):
    """Its backlog (far more than one record of its 16 KiB ring) goes out in records the ring holds
    once it reads again; past the stall timeout it is cut off with an error. Others never notice.
    (A stall counts only while the client's requests are open: those that are cut off run long
    enough that no machine finishes them within the stall timeout.)"""
    prompts, params = requests(count=8, max_tokens=120)
    slow_ids = {f"s{i}" for i in range(20)}

    async def main():
        async with AsyncLLM(stall_config(model_dir, stall_timeout)) as client:
            clean = await stream_all(client, prompts, params)
            engine = actor_pid(client._tree.proc.pid, "engine")
            slow = Connection(client._tree)
            try:
                for rid in sorted(slow_ids):
                    slow.submit(
                        rid, [5, 6, 7, int(rid[1:]) + 20], SamplingParams(max_tokens=max_tokens, ignore_eos=True)
                    )
                streams = asyncio.ensure_future(stream_all(client, prompts, params))
                await asyncio.sleep(pause)  # the slow client reads nothing meanwhile
                updates = await asyncio.to_thread(read_all, slow, slow_ids)
                crashed = await streams
            finally:
                slow.close()
            stats = await client.stats()
            return clean, crashed, engine, actor_pid(client._tree.proc.pid, "engine"), stats, updates

    clean, crashed, engine_before, engine_after, stats, updates = asyncio.run(main())
    assert engine_after == engine_before and crashed == clean
    assert stats.disconnected_clients == int(cut_off)
    for rid, received in updates.items():
        last = received[-1]
        if cut_off:
            assert (last.finish_reason, last.error_code) == ("error", 400), last
            assert last.error_msg == f"client disconnected by the engine: it read nothing for {stall_timeout:g} s"
        else:
            assert last.finish_reason == "length", last
            assert sum(len(u.token_ids) for u in received) == max_tokens, rid


# ------------------------------------------------------------ a client that writes into its rings' words
def _publish_raw(ring, header: tuple[int, int], payload: bytes = b"") -> None:
    """A record with a header of our choosing (length, check word), published as a producer would."""
    import struct

    from fdcore.ipc.ring_layout import HEADER_SIZE, TAIL

    tail = ring._tail
    struct.pack_into("II", ring._mm, HEADER_SIZE + (tail & ring._mask), *header)
    ring._mm[HEADER_SIZE + (tail & ring._mask) + 8 : HEADER_SIZE + (tail & ring._mask) + 8 + len(payload)] = payload
    ring._tail = tail + ((len(payload) + 15) & ~7)
    ring._words[TAIL] = ring._tail
    ring._bell.semaphore.release()


def corrupt(conn: Connection, kind: str, rng: random.Random) -> None:
    """What a client with its own rings mapped can do to the words the engine reads."""
    from fdcore.ipc.ring_layout import HEADER_SIZE, TAIL

    ring = conn.sender.ring
    match kind:
        case "check_word":
            _publish_raw(ring, (4, 0xDEADBEEF), b"\x90\x90\x90\x90")
        case "length":
            _publish_raw(ring, (0xFFFFFFF0, (ring._tail >> 3) & 0xFFFFFFFF))
        case "tail":
            ring._words[TAIL] = rng.choice([ring._tail + 3, ring._tail + (1 << 40), 8])
            ring._bell.semaphore.release()
        case "deep":
            ring.put(b"\x91" * 100_000 + b"\xc0")
        case "header_bytes":  # anything over the header, both lines and the first record
            start = rng.randrange(0, HEADER_SIZE + 64)
            garbage = os.urandom(rng.randrange(1, HEADER_SIZE + 64 - start + 1))
            ring._mm[start : start + len(garbage)] = garbage
            ring._bell.semaphore.release()


RING_ATTACKS = ["check_word", "length", "tail", "deep", "header_bytes"]
BREAKING = {"check_word", "length", "tail", "deep"}  # (random header bytes may miss every word the engine reads)


def first_update(conn: Connection, request_id: str, timeout: float = 20.0) -> Update:
    deadline = time.monotonic() + timeout
    while True:
        message = conn.receiver.recv(timeout=max(0.0, deadline - time.monotonic()))
        if isinstance(message, Update) and message.request_id == request_id:
            return message


def handshake_across_a_head_republished(conn: Connection) -> None:
    """A client whose own scribbling left its link's head word garbage: its resync adopts that garbage as
    its tail, and the engine republishes its real head while resync reads the words, so that the Hello
    finds a head and a tail that contradict each other. The handshake must resync again, not fail."""
    from fdcore.ipc.ring_layout import TAIL

    ring, real_resync = conn.sender.ring, conn._resync

    def resync_then_republish() -> None:
        conn._resync = real_resync
        head = int(ring._words[ring._head_word])
        ring._words[ring._head_word] = 1 << 60
        real_resync()
        assert ring._tail == 1 << 60 and int(ring._words[TAIL]) == 1 << 60
        ring._words[ring._head_word] = ring._head_seen = head  # the engine's head, published as resync read it

    conn._resync = resync_then_republish
    conn.handshake(10.0)


def test_a_client_that_corrupts_its_own_ring_is_disconnected_not_the_engine(model_dir):
    """Record headers with a wrong check word or an impossible length, a tail out of bounds, a record
    nested 100,000 deep, random bytes over the ring's header and lines: each disconnects the attacker
    (its request ends with a 400) and resets its link, which then serves it again; the engine is never
    restarted and an honest client's streams come out as in a quiet run. Then the attacker's ring
    headers are left garbage and the engine is killed: it restarts into them and serves everyone."""
    rng = random.Random(43)
    prompts, params = requests(count=8, max_tokens=200)
    cases = RING_ATTACKS * 4 + [rng.choice(RING_ATTACKS) for _ in range(20)]

    def one(conn: Connection, case: int, kind: str) -> None:
        own = f"a{case}"
        conn.submit(own, [5, 6, 7, 8], SamplingParams(max_tokens=2000, ignore_eos=True))
        first_update(conn, own)  # admitted: what follows is what the engine finds on the running link
        corrupt(conn, kind, rng)
        if kind in BREAKING:
            update = final_update(conn, own)
            assert (update.finish_reason, update.error_code) == ("error", 400), (kind, update)
        conn.handshake(10.0)  # the link works again (a new session: the old request is gone either way)

    async def main():
        async with AsyncLLM(config(model_dir)) as client:
            clean = await stream_all(client, prompts, params)
            engine = actor_pid(client._tree.proc.pid, "engine")
            attacker = Connection(client._tree)
            try:
                await asyncio.to_thread(handshake_across_a_head_republished, attacker)
                streams = asyncio.ensure_future(stream_all(client, prompts, params))
                for case, kind in enumerate(cases):
                    await asyncio.to_thread(one, attacker, case, kind)
                during = await streams
                after_attacks = actor_pid(client._tree.proc.pid, "engine")
                stats = await client.stats()
                from fdcore.ipc.ring_layout import HEADER_SIZE

                for ring in (attacker.sender.ring, attacker.inbox._links["engine"]):  # garbage headers, for good
                    ring._mm[0:HEADER_SIZE] = os.urandom(HEADER_SIZE)
                streams = asyncio.ensure_future(stream_all(client, prompts, params))
                await asyncio.sleep(0.5)
                os.kill(after_attacks, signal.SIGKILL)
                restarted = await streams
            finally:
                attacker.close()
            return clean, during, restarted, engine, after_attacks, stats

    clean, during, restarted, engine_before, engine_after, stats = asyncio.run(main())
    assert engine_after == engine_before, "a client's ring crashed the engine"
    assert during == clean and restarted == clean
    assert stats.disconnected_clients >= sum(kind in BREAKING for kind in cases)
