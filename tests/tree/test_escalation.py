"""The supervisor's escalations, each driven by a child that misbehaves on purpose (the test-only
``FDCORE_TEST_FAULT`` fault point, fdcore/actors/faults.py):

- shutdown: Stop message, then SIGTERM, then SIGKILL, ``shutdown_timeout`` apart (README, DESIGN);
- hang detection: an actor whose heartbeat ticks but that makes no progress while busy is killed
  and restarted, and the requests it held resume token-identical (DESIGN: "busy without progress").
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from fdcore import AsyncLLM, SamplingParams
from fdcore.actors import faults
from tests.supervised import Tree, make_model_dir

pytestmark = pytest.mark.tree

SHUTDOWN_TIMEOUT = 1.0


@pytest.fixture
def start_tree(tmp_path):
    trees: list[Tree] = []
    model = make_model_dir(tmp_path)

    def start(extra: str, fault: str) -> Tree:
        path = tmp_path / f"tree-{len(trees)}.toml"
        path.write_text(f'[model]\npath = "{model}"\n[workers]\nstandby = false\n{extra}\n')
        trees.append(Tree(str(path), env={faults.FAULT_ENV: fault}))
        return trees[-1]

    yield start
    for tree in trees:
        tree.destroy()
        assert not tree.alive_children(), "a child outlived its test"


@pytest.mark.parametrize("fault, step", [("ignore_stop", "SIGTERM"), ("ignore_sigterm", "SIGKILL")])
def test_a_child_that_ignores_the_stop_is_ended_by_the_next_step(start_tree, fault, step):
    """A cache that ignores the Stop message is ended by SIGTERM one shutdown_timeout later; one
    that ignores SIGTERM as well, by SIGKILL one more later. The others stop by message, and the
    supervisor still exits 0 having removed everything (the leak guard checks)."""
    tree = start_tree(f"[supervisor]\nshutdown_timeout = {SHUTDOWN_TIMEOUT}\n", f"cache:{fault}")
    tree.wait("ready")
    cache = tree.pids["cache"]
    os.kill(tree.proc.pid, signal.SIGTERM)
    for cid in ("engine", "scheduler", "worker0"):
        assert tree.wait("child_stopped", id=cid)["by"] == "stop message", cid
    stopped = tree.wait("child_stopped", id="cache")
    assert stopped["by"] == step, "\n".join(tree.log)
    steps = 1 if step == "SIGTERM" else 2
    assert steps * SHUTDOWN_TIMEOUT <= float(stopped["seconds"]) < (steps + 1) * SHUTDOWN_TIMEOUT
    assert tree.exit_code() == 0
    assert not tree.alive_children() and not _alive(cache)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_busy_actor_without_progress_is_killed_and_its_requests_resume_identical(start_tree):
    """worker0 wedges on its 12th step in the tree's first generation: its loop keeps ticking the
    heartbeat (so only the busy-without-progress rule can see it), the supervisor calls it hung
    after hang_timeout, kills and restarts it, and every stream ends with the tokens the same
    requests get from the healthy tree afterwards."""
    tree = start_tree("[supervisor]\nhang_timeout = 2.0\nheartbeat_interval = 0.2\n", "worker0:wedge:12")
    tree.wait("ready")
    prompts = [[5 + (i * 131 + j * 17) % 4000 for j in range(20 + 3 * i)] for i in range(6)]
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=7 + i, max_tokens=30, ignore_eos=True) for i in range(6)
    ]

    async def stream_all(llm):
        async def one(i):
            tokens = []
            async for out in llm.generate(prompts[i], params[i], request_id=f"r{i}"):
                tokens += out.outputs.token_ids
            return tokens, out.outputs.finish_reason, out.error_msg

        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    async def scenario():
        llm = AsyncLLM.connect(tree.instance)
        try:
            started = time.monotonic()
            wedged = await asyncio.wait_for(stream_all(llm), 60)  # undetected, the wedge holds them forever
            took = time.monotonic() - started
            return wedged, await stream_all(llm), took
        finally:
            await llm.shutdown()

    wedged, healthy, took = asyncio.run(scenario())
    hung = tree.wait("hung", id="worker0")
    assert hung["reason"].startswith("busy without progress"), hung
    tree.wait("restarted", id="worker0")
    assert took >= 2.0, "the streams ended before the hang could have been detected"
    assert all(reason == "length" and not error for _, reason, error in healthy)
    assert wedged == healthy
    os.kill(tree.proc.pid, signal.SIGTERM)
    assert tree.exit_code() == 0


def test_a_forward_pass_longer_than_the_hang_timeout_is_not_a_hang(start_tree):
    """A worker inside one forward pass neither ticks nor makes progress. A model too large for the CPU
    (here every pass, the warm-up's too, 20 ms a token slower) given a 150-token prompt spends ~3 s in one
    pass, three hang timeouts: the grace the worker writes before each pass (what its measured passes
    predict, times four) keeps the supervisor from calling it hung, and the request completes with no
    restart. Without it the worker was killed and restarted into the same step, over and over."""
    tree = start_tree("[supervisor]\nhang_timeout = 1.0\nheartbeat_interval = 0.1\n", "worker0:slow_pass:20")
    tree.wait("ready")

    async def scenario():
        llm = AsyncLLM.connect(tree.instance)
        try:
            tokens, started = [], time.monotonic()
            async for out in llm.generate(
                list(range(5, 155)), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            ):
                tokens += out.outputs.token_ids
            return tokens, out.outputs.finish_reason, out.error_msg, time.monotonic() - started
        finally:
            await llm.shutdown()

    tokens, reason, error, took = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert took > 3 * 1.0, "the pass did not outlast the hang timeout: the test proves nothing"
    log = "\n".join(tree.log)
    assert "event=hung" not in log and "event=restarted" not in log, log
    assert (len(tokens), reason, error) == (4, "length", ""), (tokens, reason, error)
    os.kill(tree.proc.pid, signal.SIGTERM)
    assert tree.exit_code() == 0


@pytest.mark.parametrize("value", ["worker0", "worker0:sleep", "worker0:wedge:0", "worker0:wedge:x", "a:wedge:1:2"])
def test_a_malformed_fault_is_refused(monkeypatch, value):
    monkeypatch.setenv(faults.FAULT_ENV, value)
    with pytest.raises(ValueError, match=faults.FAULT_ENV):
        faults.behaviour_for("worker0")


def test_the_fault_is_only_the_named_childs(monkeypatch):
    monkeypatch.setenv(faults.FAULT_ENV, "worker0:wedge:3")
    assert faults.behaviour_for("worker0") == ("wedge", 3)
    assert faults.behaviour_for("worker1") is None
    monkeypatch.delenv(faults.FAULT_ENV)
    assert faults.behaviour_for("worker0") is None


def test_a_stop_signal_ends_an_idle_inbox_wait_at_once():
    """The actor's SIGTERM handler raises StopRequested. When the signal interrupts the semaphore
    wait itself (delivered to the waiting thread), posix_ipc runs the handler and keeps only a
    KeyboardInterrupt it raised: any other exception was lost, and the actor slept on until
    SIGKILL (seen as a flaky SIGTERM step above). Here the signal goes to this very thread."""
    import threading

    from fdcore.actors.runtime import StopRequested
    from fdcore.ipc import Inbox, names

    def raise_stop(signum, frame):
        raise StopRequested()

    box = Inbox.create(names.object_name(names.new_instance_id(), "idle"), ["supervisor"], capacity=4096)
    previous = signal.signal(signal.SIGUSR1, raise_stop)
    main = threading.get_ident()

    def signal_the_waiting_thread():
        time.sleep(0.3)  # no event can say "blocked in sem_timedwait": past the inbox's spin, it is
        signal.pthread_kill(main, signal.SIGUSR1)

    timer = threading.Thread(target=signal_the_waiting_thread)
    try:
        started = time.monotonic()
        timer.start()
        with pytest.raises(StopRequested):
            box.get_many(timeout=10.0)
        assert time.monotonic() - started < 0.3 + 0.5, "the wait outlived the signal"
    finally:
        timer.join()
        signal.signal(signal.SIGUSR1, previous)
        box.close()
        box.unlink()
