"""The clients under pressure: batches far beyond the engine's limit, engine kills during
submission from several threads, a dead reader thread, a stopped tree, a client built in a thread."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from fdcore import LLM, AsyncLLM, SamplingParams
from fdcore.checkpoint import tiny
from fdcore.client import EngineDeadError
from fdcore.config import parse_config
from fdcore.supervisor import actor_pid
from tests import ROOT
from tests.supervised import tree_config

pytestmark = pytest.mark.tree

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def config(model: str, **engine):
    return tree_config(model, supervisor={"max_restarts": 100}, engine=engine)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.make_tiny_model(str(tmp_path_factory.mktemp("client") / "tiny"))


@pytest.fixture(scope="module")
def small(model_dir):
    """A tree that holds at most 64 requests: anything more is refused with 429 by the engine."""
    llm = LLM(config(model_dir, max_pending_requests=64))
    yield llm
    llm.shutdown()


def prompts_of(count: int, length: int = 8) -> list[list[int]]:
    return [[3 + (i * 7919 + j * 31) % 4000 for j in range(length)] for i in range(count)]


# ------------------------------------------------------------ backpressure
def test_a_batch_far_above_the_engine_limit_is_served_whole_and_in_order(small):
    prompts = prompts_of(10_000)
    sent = []
    submit = small._conn.submit
    small._conn.submit = lambda request_id, *args, **kw: (sent.append(request_id), submit(request_id, *args, **kw))
    try:
        outs = small.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False
        )
    finally:
        del small._conn.submit
    assert len(outs) == len(prompts)
    assert [o.error_msg for o in outs if o.outputs.finish_reason != "length"] == []
    assert [o.prompt_token_ids for o in outs] == prompts, "outputs are in the order of the prompts"
    assert all(len(o.outputs.token_ids) == 4 for o in outs)
    assert len(sent) > len(prompts), "the engine's limit was meant to refuse (and the client to resend) some"
    again = small.generate(
        [{"prompt_token_ids": p} for p in prompts[:40]], SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False
    )
    assert [o.outputs.token_ids for o in again] == [o.outputs.token_ids for o in outs[:40]]


def test_async_wait_queues_instead_of_refusing(small):
    params = SamplingParams(max_tokens=6, **GREEDY)

    async def last(client, i, wait):
        tokens = []
        async for out in client.generate(prompts_of(128)[i], params, wait=wait):
            tokens += out.outputs.token_ids
        return out.error_code, len(tokens)

    async def scenario():
        async with AsyncLLM.connect(small.instance) as client:
            refused = await asyncio.gather(*(last(client, i, False) for i in range(128)))
            waited = await asyncio.gather(*(last(client, i, True) for i in range(128)))
            return refused, waited

    refused, waited = asyncio.run(scenario())
    assert (429, 0) in refused, "without wait the engine's limit refuses some"
    assert waited == [(0, 6)] * 128


# --------------------------------------------------------------- recovery
def test_an_engine_killed_while_three_threads_submit_loses_and_doubles_nothing(model_dir):
    params = SamplingParams(max_tokens=12, **GREEDY)
    prompts = prompts_of(64, length=12)
    client = AsyncLLM(config(model_dir))
    try:
        sent, sixteen = [], threading.Event()
        submit = client._conn.submit

        def counted(request_id, *args, **kw):
            submit(request_id, *args, **kw)
            sent.append(request_id)
            if len(sent) == 16:
                sixteen.set()

        client._conn.submit = counted
        results: dict[int, list] = {}

        async def one(i):
            finals, tokens = 0, []
            async for out in client.generate(prompts[i], params, request_id=f"r{i}"):
                tokens += out.outputs.token_ids
                finals += out.finished
            results[i] = [finals, tokens, out.outputs.finish_reason, out.error_msg]

        async def batch(indices):
            tasks = []
            for i in indices:  # paced, so that the kill falls in the middle of the submissions
                tasks.append(asyncio.ensure_future(one(i)))
                await asyncio.sleep(0.01)
            await asyncio.gather(*tasks)

        threads = [threading.Thread(target=asyncio.run, args=(batch(range(k, 64, 3)),)) for k in range(3)]
        for thread in threads:
            thread.start()
        assert sixteen.wait(30)
        os.kill(actor_pid(client._tree.proc.pid, "engine"), signal.SIGKILL)
        sent_at_kill = len(set(sent))
        for thread in threads:
            thread.join(120)
        with LLM.connect(client.instance) as reference:
            clean = reference.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        asyncio.run(client.shutdown())
    assert sent_at_kill < 64, "the engine was meant to die while requests were still being submitted"
    assert sorted(results) == list(range(64))
    for i, (finals, tokens, reason, error) in results.items():
        assert (finals, reason, error) == (1, "length", ""), (i, error)
        assert tokens == clean[i].outputs.token_ids, f"request {i} differs after the kill"


def test_a_dead_reader_thread_fails_every_stream_within_a_second(small):
    async def scenario():
        client = AsyncLLM.connect(small.instance)
        streams = [client.generate([5] * 20, SamplingParams(max_tokens=2000, **GREEDY)) for _ in range(4)]
        firsts = [await s.__anext__() for s in streams]
        client._router.fault = RuntimeError("injected by the test")
        started = time.monotonic()
        failures = []
        for stream in streams:
            with pytest.raises(EngineDeadError, match="reader thread died") as info:
                async for _ in stream:
                    pass
            failures.append(info.value)
        elapsed = time.monotonic() - started
        with pytest.raises(EngineDeadError):
            async for _ in client.generate("x"):
                pass
        await client.shutdown()
        return firsts, elapsed

    firsts, elapsed = asyncio.run(scenario())
    assert all(not f.finished for f in firsts)
    assert elapsed < 1.0


def test_calls_after_the_tree_stopped_raise_at_once(model_dir):
    llm = LLM(config(model_dir))
    try:
        supervisor = llm._tree.proc
        supervisor.send_signal(signal.SIGTERM)
        supervisor.wait(60)
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match="stopped"):
            llm.generate("x", use_tqdm=False)
        with pytest.raises(EngineDeadError):
            llm.stats()
        assert time.monotonic() - started < 0.5
    finally:
        llm.shutdown()


# ------------------------------------------------------------ parent watch
def test_a_client_built_in_a_thread_that_ended_keeps_its_tree(model_dir):
    made = []
    thread = threading.Thread(target=lambda: made.append(LLM(config(model_dir))))
    thread.start()
    thread.join()
    llm = made[0]
    try:  # PR_SET_PDEATHSIG fired at the thread's end: a tree tied to it would be stopping now
        out = llm.generate("hello", SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)[0]
        assert out.outputs.finish_reason == "length"
        assert llm.check_health() == (True, "")
        assert llm._tree.proc.poll() is None, "the tree stopped with the thread that built it"
    finally:
        llm.shutdown()


EMBEDDER = """
import sys, threading
from fdcore import LLM
from fdcore.config import parse_config
made = []
thread = threading.Thread(target=lambda: made.append(LLM(parse_config(sys.argv[1]))))
thread.start(); thread.join()
print(made[0]._tree.proc.pid, made[0].instance, flush=True)
sys.stdin.read()
"""


def test_the_tree_stops_when_the_process_that_started_it_dies(model_dir, tmp_path):
    """... and leaves nothing: no shared memory, and no file at all (the client hands the tree its
    configuration in memory, so a killed client has nothing to leave in /tmp)."""
    from fdcore.ipc import names

    private = tmp_path / "tmp"
    private.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", EMBEDDER, f'[model]\npath = "{model_dir}"\n'],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
        env={**os.environ, "TMPDIR": str(private)},
    )
    try:
        pid, instance = proc.stdout.readline().split()
        assert list(private.iterdir()) == []
        supervisor = psutil.Process(int(pid))
        proc.kill()
        proc.wait()
        supervisor.wait(60)
        assert not [e for e in names.list_entries() if e.instance_id == instance]
        assert list(private.iterdir()) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_full_engine_link_never_blocks_the_event_loop(model_dir):
    text = f'[model]\npath = "{model_dir}"\n[supervisor]\nring_capacity = 65536\n'
    client = AsyncLLM(parse_config(text))
    params = SamplingParams(max_tokens=2, **GREEDY)
    prompts = prompts_of(1000)  # ~130 kB of requests: twice what the engine's link holds

    async def one(i):
        async for out in client.generate(prompts[i], params, wait=True):  # noqa: B007 (the last one is read)
            pass
        return out.outputs.finish_reason

    async def scenario(engine):
        tasks = [asyncio.ensure_future(one(i)) for i in range(1000)]
        await asyncio.sleep(0)  # every request has tried to go: the link is full, the engine stopped
        gaps = []
        for _ in range(50):
            started = time.monotonic()
            await asyncio.sleep(0.005)
            gaps.append(time.monotonic() - started)
        unsent = client._conn.sender.ring.statistics().used_bytes
        engine.resume()
        return max(gaps), unsent, await asyncio.gather(*tasks)

    try:
        engine = psutil.Process(actor_pid(client._tree.proc.pid, "engine"))
        engine.suspend()
        stalled, used, reasons = asyncio.run(scenario(engine))
    finally:
        asyncio.run(client.shutdown())
    assert used > 60_000, f"the engine's link was meant to be full ({used} bytes used)"
    assert stalled < 0.2, f"the event loop stood still {stalled:.2f} s"
    assert reasons == ["length"] * 1000


def test_an_open_stream_raises_when_the_tree_is_killed(model_dir):
    from fdcore.ipc import names

    client = AsyncLLM(config(model_dir))
    supervisor = client._tree.proc

    async def scenario():
        stream = client.generate([5] * 20, SamplingParams(max_tokens=2000, **GREEDY))
        await stream.__anext__()
        supervisor.kill()  # no Stop, no 503 from the engine: the actors just die with it
        killed = time.monotonic()
        with pytest.raises(EngineDeadError, match="stopped"):
            async for _ in stream:
                pass
        return time.monotonic() - killed

    try:
        assert asyncio.run(scenario()) < 1.0
    finally:
        asyncio.run(client.shutdown())
        names.unlink_instance(client.instance)


def test_an_unanswered_hello_is_sent_again(monkeypatch):
    """A Hello written while the old engine died is lost with it: the client greets again."""
    from fdcore.client import connection as client_module
    from fdcore.ipc import RingEmpty
    from fdcore.protocol import Welcome

    monkeypatch.setattr(client_module, "HELLO_RESEND", 0.05)
    hellos = []

    class Engine:  # answers only the second Hello; sends and receives stand in for the rings
        def send(self, message, timeout=None):
            hellos.append(message)

        def recv(self, timeout=None):
            if len(hellos) < 2:
                time.sleep(timeout)
                raise RingEmpty("nothing yet")
            return Welcome(hellos[-1].session, 4096, 2048, "m", 1)

    conn = object.__new__(client_module.Connection)
    conn.slot, conn.tree, conn._send_lock = 0, None, threading.Lock()
    conn._resync = lambda: None
    conn.sender = conn.receiver = Engine()
    assert conn.handshake(5.0).session == hellos[-1].session
    assert len(hellos) == 2 and hellos[0].session == hellos[1].session

    class Gone(Engine):  # no engine at all: the client stops greeting once the tree is gone
        def recv(self, timeout=None):
            time.sleep(timeout)
            raise RingEmpty("never")

    hellos.clear()
    conn.receiver = Gone()
    conn.tree = type("Tree", (), {"instance": "x"})()
    started = time.monotonic()
    with pytest.raises(client_module.EngineError, match="did not answer"):
        conn.handshake(60.0, keep_waiting=lambda: len(hellos) < 3)
    assert len(hellos) == 3 and time.monotonic() - started < 5.0
