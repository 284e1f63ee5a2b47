"""Crash-proof serving: SIGKILL any actor mid-generation and every stream finishes with exactly
the tokens of a run without the crash (greedy and seeded sampling), with nothing left behind."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil
import pytest

from fdcore import AsyncLLM, SamplingParams
from fdcore.actors import topology
from fdcore.checkpoint import tiny
from fdcore.ipc import names
from fdcore.supervisor import actor_census
from fdcore.supervisor import actor_pid as find_actor
from tests.supervised import tree_config

pytestmark = pytest.mark.tree

CHILDREN = {"worker": "worker0", "scheduler": "scheduler", "cache": "cache", "engine": "engine"}  # kind: child


def config(model: str, **supervisor):
    return tree_config(
        model, scheduler={"max_num_batched_tokens": 64}, supervisor={"max_restarts": 100, "period": 60.0, **supervisor}
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.make_tiny_model(str(tmp_path_factory.mktemp("crash") / "tiny"))


def actor_pid(client: AsyncLLM, kind: str) -> int | None:
    return find_actor(client._tree.proc.pid, CHILDREN[kind])


def requests(count: int = 8, length: int = 24, max_tokens: int = 40):
    prompts = [[5 + (i * 131 + j * 17) % 4000 for j in range(length + 3 * i)] for i in range(count)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        if i % 2
        else SamplingParams(temperature=0.8, top_p=0.95, seed=40 + i, max_tokens=max_tokens, ignore_eos=True)
        for i in range(count)
    ]
    return prompts, params


async def stream_all(client: AsyncLLM, prompts, params, on_progress=None):
    """Every request streamed concurrently; returns (token ids, text, finish reason) per request."""
    received = [0]

    async def one(i):
        tokens, text = [], ""
        async for out in client.generate(prompts[i], params[i], request_id=f"r{i}"):
            tokens += out.outputs.token_ids
            text += out.outputs.text
            received[0] += len(out.outputs.token_ids)
            if on_progress is not None:
                await on_progress(received[0])
        return tokens, text, out.outputs.finish_reason, out.error_msg, out.error_code

    return await asyncio.gather(*(one(i) for i in range(len(prompts))))


def kill(client: AsyncLLM, kind: str) -> int:
    pid = actor_pid(client, kind)
    assert pid is not None, f"no {kind} to kill"
    os.kill(pid, signal.SIGKILL)
    return pid


async def wait_for_new(client: AsyncLLM, kind: str, old: int, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = actor_pid(client, kind)
        if pid is not None and pid != old:
            return pid
        await asyncio.sleep(0.01)
    raise AssertionError(f"{kind} was not restarted within {timeout} s")


def run(model_dir, scenario, prompts=None, params=None, strategy="one_for_one", **supervisor):
    """A fault-free run and a run with ``scenario(client, total_tokens)`` killing actors; afterwards
    every actor runs as exactly one process."""
    prompts, params = (prompts, params) if prompts else requests()
    tree_config = config(model_dir, strategy=strategy, **supervisor)

    async def main():
        async with AsyncLLM(tree_config) as client:
            clean = await stream_all(client, prompts, params)
            state = {"done": False, "busy": False}

            async def progress(total):  # called by every stream: run the scenario once at a time
                if not state["done"] and not state["busy"]:
                    state["busy"] = True
                    state["done"] = await scenario(client, total)
                    state["busy"] = False

            crashed = await stream_all(client, prompts, params, progress)
            health = await client.check_health()
            census = actor_census(client._tree.proc.pid, topology.child_ids(tree_config))
            return clean, crashed, state["done"], health, census

    clean, crashed, done, health, census = asyncio.run(main())
    assert done, "the scenario did not run"
    assert census == "", f"not one process per actor after the restarts: {census}"
    for i, (want, got) in enumerate(zip(clean, crashed, strict=True)):
        assert got[3] == "", f"request {i} failed: {got[3]}"
        assert got[0] == want[0], f"request {i}: tokens differ after the crash"
        assert got[1] == want[1], f"request {i}: text differs after the crash"
        assert got[2] == want[2] == "length"
    assert health == (True, "")
    return clean


def kill_at(kind: str, tokens: int):
    async def scenario(client, total):
        if total >= tokens:
            kill(client, kind)
            return True
        return False

    return scenario


@pytest.mark.parametrize("kind", ["worker", "scheduler", "cache", "engine"])
def test_sigkill_mid_generation_changes_no_token(model_dir, kind):
    run(model_dir, kill_at(kind, 100))


@pytest.mark.parametrize("strategy", ["rest_for_one", "one_for_all"])
@pytest.mark.parametrize("kind", ["scheduler", "cache", "worker"])
def test_strategies_that_restart_siblings_change_no_token(model_dir, strategy, kind):
    """The siblings (the engine among them) are stopped for a restart, not for a shutdown: no
    stream fails, the clients re-submit to the new engine, and no actor runs twice."""
    run(model_dir, kill_at(kind, 100), strategy=strategy)


@pytest.mark.parametrize("kind", ["worker", "cache"])
def test_a_stalled_actor_is_the_only_one_restarted(model_dir, kind):
    """SIGSTOP: the stalled actor is found hung and replaced, and the streams resume identical; the
    scheduler, which only waits for it (steps in flight, or a reply from the cache), is not."""
    pids = {}

    async def scenario(client, total):
        if total < 100:
            return False
        pids.update({k: actor_pid(client, k) for k in CHILDREN})
        os.kill(pids[kind], signal.SIGSTOP)
        await wait_for_new(client, kind, pids[kind])
        await asyncio.sleep(2.5)  # more than a hang timeout for anyone else to be found hung
        pids["after"] = {k: actor_pid(client, k) for k in CHILDREN}
        return True

    run(model_dir, scenario, heartbeat_interval=0.1, hang_timeout=1.5)
    assert {k for k in CHILDREN if pids["after"][k] != pids[k]} == {kind}


@pytest.mark.parametrize("kind", ["worker", "scheduler", "cache", "engine"])
def test_killed_twice_in_a_row(model_dir, kind):
    async def scenario(client, total):
        if total < 60:
            return False
        first = kill(client, kind)
        second = await wait_for_new(client, kind, first)
        os.kill(second, signal.SIGKILL)  # again, while it starts or while requests recompute
        return True

    run(model_dir, scenario)


@pytest.mark.parametrize("kind", ["worker", "scheduler", "cache", "engine"])
def test_killed_mid_prefill(model_dir, kind):
    prompts, params = requests(count=6, length=200, max_tokens=12)

    async def main():
        async with AsyncLLM(config(model_dir)) as client:
            clean = await stream_all(client, prompts, params)
            base = (await client.stats()).steps
            task = asyncio.ensure_future(stream_all(client, prompts, params))
            while (await client.stats()).steps < base + 4:  # a few of ~19 prefill chunks in, no token yet
                await asyncio.sleep(0.005)
            kill(client, kind)
            return clean, await task

    clean, crashed = asyncio.run(main())
    assert [c[:3] for c in crashed] == [c[:3] for c in clean]


def test_intensity_exceeded_ends_every_stream_with_an_error_and_leaves_nothing(model_dir):
    prompts, params = requests(count=4, max_tokens=400)

    async def main():
        client = AsyncLLM(config(model_dir, max_restarts=1, period=60.0))
        supervisor = client._tree.proc
        pids = [p.pid for p in psutil.Process(supervisor.pid).children()]
        outputs = asyncio.ensure_future(stream_all(client, prompts, params))
        while actor_pid(client, "worker") is None:
            await asyncio.sleep(0.01)
        first = kill(client, "worker")
        second = await wait_for_new(client, "worker", first)
        os.kill(second, signal.SIGKILL)
        results = await outputs
        await client.shutdown()
        return results, supervisor, pids + [first, second]

    results, supervisor, pids = asyncio.run(main())
    assert supervisor.returncode == 1
    for _tokens, _text, reason, error, _code in results:
        assert reason == "error" and error.startswith("fdcore stopped: worker0 "), error
    assert not [pid for pid in pids if names.pid_alive(pid)]
    assert not [e for e in names.list_entries() if e.owner_pid == supervisor.pid]


def test_sync_llm_resumes_after_an_engine_kill(model_dir):
    import threading

    from fdcore import LLM

    prompts, params = requests(count=6, max_tokens=60)
    with LLM(config(model_dir)) as llm:
        clean = [(o.outputs.token_ids, o.outputs.text) for o in llm.generate(prompts, params)]
        watcher = LLM.connect(llm.instance)  # a second client, in another slot, pulls the trigger
        killed = threading.Event()

        def killer():
            start = watcher.stats().steps
            while watcher.stats().steps < start + 10:
                pass
            os.kill(find_actor(llm._tree.proc.pid, "engine"), signal.SIGKILL)
            killed.set()

        thread = threading.Thread(target=killer)
        thread.start()
        crashed = [(o.outputs.token_ids, o.outputs.text) for o in llm.generate(prompts, params)]
        assert killed.is_set(), "the engine was meant to die while generate() ran"
        thread.join()
        watcher.shutdown()
        assert crashed == clean


@pytest.mark.parametrize("epoch", [None, 7])
def test_a_scheduler_drops_cache_answers_nobody_waits_for(model_dir, epoch):
    """The cache answers a call of a scheduler that was killed (or whose wait a Stop or Resync
    interrupted): the reply lands in the inbox of whoever reads it next, which must not crash."""
    from fdcore.actors.scheduler import SchedulerActor
    from fdcore.protocol import CacheReply, CacheStats, GrowReply

    actor = SchedulerActor("scheduler", "no-instance", config(model_dir), None, 0)  # no process
    actor.epoch = epoch
    actor.handle(CacheReply(1, True, [3], 0, CacheStats(), 6))
    actor.handle(GrowReply(0, [], CacheStats(), 6))


POISON = 2  # a token id no prompt of requests() holds (they start at 5)


@pytest.mark.parametrize("kind", ["engine", "scheduler", "worker", "cache"])
def test_a_poisoned_request_fails_alone_and_the_others_resume_identical(model_dir, monkeypatch, kind):
    """A request that makes an actor raise (the test fault point) is that request's 500, never a
    tree outage: the engine isolates its own per-request work, and a scheduler or worker it crashes
    twice in a row gets it quarantined. Every other stream completes as without it."""
    prompts, params = requests(count=32, max_tokens=40)  # 31 healthy streams beside the poisoned one
    assert not any(POISON in p for p in prompts)
    bad = 3
    poisoned = [*prompts[:bad], [POISON, *prompts[bad]], *prompts[bad + 1 :]]
    monkeypatch.setenv("FDCORE_TEST_POISON", f"{kind}:{POISON}")
    tree_config = config(model_dir, max_restarts=5)  # the shipped intensity: the tree must stay up

    async def main():
        async with AsyncLLM(tree_config) as client:
            clean = await stream_all(client, prompts, params)
            crashed = await stream_all(client, poisoned, params)
            return (
                clean,
                crashed,
                await client.check_health(),
                actor_census(client._tree.proc.pid, topology.child_ids(tree_config)),
            )

    clean, crashed, health, census = asyncio.run(main())
    _tokens, _text, reason, error, code = crashed[bad]
    assert (reason, code) == ("error", 500)
    wanted = (
        "request failed in fdcore:engine: PoisonedRequest"
        if kind == "engine"
        else f"request crashed fdcore:{kind} twice"
    )
    assert error.startswith(wanted), error
    for i in range(len(prompts)):
        if i != bad:
            assert crashed[i] == clean[i], f"request {i} changed"
    assert health == (True, "") and census == ""


@pytest.mark.parametrize("standby", [True, False])
def test_a_worker_crash_recomputes_only_each_streams_last_token(model_dir, standby):
    """The KV cache lives in shared memory the supervisor holds (``cache.shared_memory``): the worker's
    successor (its promoted spare, or a fresh restart) finds every block computed before the crash, the
    prefix cache still points at the full ones, and the cache manager keeps each stream's partly filled
    last block for it, so a resumed stream computes its last token only (the cache manager's counts: each
    prompt computed once before the crash, nothing else but one token a stream), and its tokens are those
    of a run without the crash."""
    prompts, params = requests(count=4, length=40, max_tokens=48)
    tree_config = config(model_dir)
    tree_config.workers.standby = standby

    async def main():
        async with AsyncLLM(tree_config) as client:
            state = {"done": False}

            async def progress(total):
                if not state["done"] and total >= 60:
                    state["done"] = True
                    kill(client, "worker")

            crashed = await stream_all(client, prompts, params, progress)
            stats = await client.stats()
            clean = await stream_all(client, prompts, params)  # (now every prompt is cached: no crash)
            return crashed, stats, clean

    crashed, stats, clean = asyncio.run(main())
    assert [c[0] for c in crashed] == [c[0] for c in clean] and all(c[3] == "" for c in crashed)
    # every prompt computed once; then, resumed, each stream computes its last token only (its full blocks
    # and the partly filled last one kept): where only full blocks were kept, 1 to 16 tokens a stream
    assert stats.cache.queried_tokens - stats.cache.hit_tokens == sum(map(len, prompts)) + len(prompts), stats.cache
