"""README claims that had no test: a second Ctrl-C, the standby worker, client slots.

Each runs a real tree (tests/supervised.py) and checks the claim as the README
states it.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from fdcore import LLM
from fdcore.client import EngineError
from tests import ROOT
from tests.supervised import Tree, make_model_dir

pytestmark = pytest.mark.tree


@pytest.fixture
def start_tree(tmp_path):
    trees: list[Tree] = []
    model = make_model_dir(tmp_path)

    def start(extra: str = "", env: dict | None = None) -> Tree:
        path = tmp_path / f"tree-{len(trees)}.toml"
        path.write_text(f'[model]\npath = "{model}"\n{extra}\n')
        trees.append(Tree(str(path), env=env))
        return trees[-1]

    yield start
    for tree in trees:
        tree.destroy()
        assert not tree.alive_children(), "a child outlived its test"


def test_a_second_ctrl_c_kills_at_once(start_tree):
    """README: SIGINT stops the children in order, `shutdown_timeout` apart per step; a second
    Ctrl-C kills at once. The cache (stopped last) is frozen, so the orderly stop would wait
    2 x 5 s for it; the second SIGINT must end everything well before."""
    tree = start_tree("[supervisor]\nshutdown_timeout = 5.0\n[workers]\nstandby = false\n")
    tree.wait("ready")
    os.kill(tree.pids["cache"], signal.SIGSTOP)
    os.kill(tree.proc.pid, signal.SIGINT)
    tree.wait("child_stopped", id="worker0")  # the orderly stop has reached the frozen cache
    second = time.monotonic()
    os.kill(tree.proc.pid, signal.SIGINT)
    tree.exit_code(timeout=30)  # whatever the code: what matters is how fast it came
    assert time.monotonic() - second < 2.5, "the second Ctrl-C waited for the orderly stop"
    assert not tree.alive_children()


def test_the_standby_worker_takes_a_crashed_workers_place(start_tree):
    """README: `workers.standby` keeps a loaded spare that replaces a crashed worker at once."""
    tree = start_tree("[workers]\nstandby = true\n")
    spare = int(tree.wait("standby", id="worker0")["pid"])
    tree.wait("ready")
    tree.kill_child("worker0")
    promoted = tree.wait("promoted", id="worker0")
    assert int(promoted["pid"]) == spare  # the loaded spare, not a fresh process
    tree.wait("standby", id="worker0")  # and a new spare is loaded behind it
    os.kill(tree.proc.pid, signal.SIGTERM)
    assert tree.exit_code() == 0


def test_without_a_standby_a_crashed_worker_is_started_afresh(start_tree):
    tree = start_tree("[workers]\nstandby = false\n")
    tree.wait("ready")
    killed = tree.kill_child("worker0")
    restarted = tree.wait("restarted", id="worker0")
    assert int(restarted["pid"]) != killed
    os.kill(tree.proc.pid, signal.SIGTERM)
    assert tree.exit_code() == 0
    assert not any("event=standby" in line or "event=promoted" in line for line in tree.log)


def test_max_clients_slots_are_claimed_refused_and_freed(start_tree):
    """README: up to `engine.max_clients` processes use one tree at once (each claims a slot)."""
    tree = start_tree("[engine]\nmax_clients = 2\n[workers]\nstandby = false\n")
    tree.wait("ready")
    with LLM.connect(tree.instance):
        with LLM.connect(tree.instance):
            with pytest.raises(EngineError, match=r"engine\.max_clients"):
                LLM.connect(tree.instance)
        with LLM.connect(tree.instance) as third:  # the freed slot is claimed again
            assert third.check_health() == (True, "")
    os.kill(tree.proc.pid, signal.SIGTERM)
    assert tree.exit_code() == 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_server_takes_its_key_from_the_environment_its_name_from_the_config_and_health_says_503(
    start_tree, monkeypatch
):
    """README: FDCORE_API_KEY (over server.api_key), server.model_name, /health 503 with the reason
    while an actor is not serving, 200 again once it is back."""
    import httpx

    port = _free_port()
    monkeypatch.setenv("FDCORE_API_KEY", "from-env")
    tree = start_tree(
        f'[server]\nenabled = true\nport = {port}\nmodel_name = "my-model"\napi_key = "from-file"\n'
        "[workers]\nstandby = false\n"
    )
    tree.wait("ready")
    base = f"http://127.0.0.1:{port}"
    with httpx.Client(base_url=base, timeout=10) as http:
        assert http.get("/v1/models", headers={"Authorization": "Bearer from-file"}).status_code == 401
        models = http.get("/v1/models", headers={"Authorization": "Bearer from-env"}).json()
        assert [m["id"] for m in models["data"]] == ["my-model"]
        assert http.get("/health").status_code == 200
        tree.kill_child("worker0")
        deadline = time.monotonic() + 30
        while (answer := http.get("/health")).status_code == 200:
            assert time.monotonic() < deadline, "/health never said the worker was down"
        assert answer.status_code == 503 and answer.json()["status"] == "unhealthy" and answer.json()["reason"]
        tree.wait("restarted", id="worker0")
        deadline = time.monotonic() + 30
        while http.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "/health did not recover after the restart"
    os.kill(tree.proc.pid, signal.SIGTERM)
    assert tree.exit_code() == 0


def test_health_says_starting_until_the_first_spares_are_warm(start_tree):
    """The API answers before the tree is ready (it starts before the warm spares load): /health is 503,
    "starting", until the supervisor says ready, so that a load balancer (or a benchmark) waits for a tree
    whose first requests do not share the CPUs with a loading spare."""
    import httpx

    port = _free_port()
    tree = start_tree(f"[server]\nenabled = true\nport = {port}\n[workers]\nstandby = true\n")
    spare = int(tree.wait("standby", id="worker0")["pid"])  # (spawned once every actor, the API too, started)
    os.kill(spare, signal.SIGSTOP)  # it cannot become warm until we say so
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            answer = http.get("/health")
            assert answer.status_code == 503 and answer.json()["reason"].startswith("starting"), answer.text
            assert answer.json()["spares"] == {"worker0": "loading"}
            os.kill(spare, signal.SIGCONT)
            tree.wait("ready")
            answer = http.get("/health")
            assert answer.status_code == 200 and answer.json()["spares"] == {"worker0": "warm"}, answer.text
    finally:
        os.kill(spare, signal.SIGCONT)
    os.kill(tree.proc.pid, signal.SIGTERM)
    assert tree.exit_code() == 0


def test_breaking_out_of_async_for_aborts_the_request(start_tree):
    """README: breaking out of the `async for` aborts the request (its blocks are freed)."""
    import asyncio

    from fdcore import AsyncLLM, SamplingParams

    tree = start_tree("[workers]\nstandby = false\n")
    tree.wait("ready")

    async def scenario():
        llm = AsyncLLM.connect(tree.instance)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)
            outputs = 0
            async for _ in llm.generate([5] * 30, params, request_id="walked-away"):
                outputs += 1
                if outputs == 3:
                    break
            deadline = time.monotonic() + 1.0
            while (stats := await llm.stats()).running or stats.cache.num_free < stats.cache.num_blocks:
                assert time.monotonic() < deadline, f"the abandoned request still runs after 1 s: {stats}"
                await asyncio.sleep(0.01)  # polling the engine's counters: no event to wait on
        finally:
            await llm.shutdown()

    asyncio.run(scenario())
    os.kill(tree.proc.pid, signal.SIGTERM)
    assert tree.exit_code() == 0


def _metric(text: str, sample: str) -> float:
    """One sample's value (name with its labels, as written) from Prometheus text; 0 when absent."""
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return float(values.get(sample, 0.0))


def test_metrics_count_what_happened(start_tree):
    """README: /metrics counts requests by outcome and fills the TTFT / TPOT / end-to-end
    histograms (checked by the numbers, not by the names appearing)."""
    import httpx

    port = _free_port()
    tree = start_tree(f"[server]\nenabled = true\nport = {port}\n[workers]\nstandby = false\n")
    tree.wait("ready")
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        before = http.get("/metrics").text
        for _ in range(3):
            body = {"model": model, "prompt": "def main():", "max_tokens": 5, "ignore_eos": True, "temperature": 0}
            assert http.post("/v1/completions", json=body).status_code == 200
        bad = {"model": model, "prompt": "x", "temperature": -1}
        assert http.post("/v1/completions", json=bad).status_code == 400
        after = http.get("/metrics").text
    for histogram in (
        "fdcore_time_to_first_token_seconds",
        "fdcore_time_per_output_token_seconds",
        "fdcore_e2e_request_latency_seconds",
    ):
        assert _metric(after, histogram + "_count") - _metric(before, histogram + "_count") == 3, histogram
        assert _metric(after, histogram + "_sum") > _metric(before, histogram + "_sum"), histogram
    grown = {
        outcome: _metric(after, f'fdcore_requests_total{{outcome="{outcome}"}}')
        - _metric(before, f'fdcore_requests_total{{outcome="{outcome}"}}')
        for outcome in ("length", "error")
    }
    assert grown == {"length": 3, "error": 1}, grown
    os.kill(tree.proc.pid, signal.SIGTERM)
    assert tree.exit_code() == 0


def test_actors_talk_only_through_shared_memory(start_tree):
    """README: actors talk only through msgspec messages over shared-memory rings: no actor process
    holds a socket of any kind (inet or unix), and no fdcore module imports pickle,
    multiprocessing or a socket library (the API actor's HTTP socket faces users, not actors; a
    paddle.distributed worker group, chosen with workers.communicator = "paddle" for groups across
    machines, rendezvouses over TCP and is the only other user)."""
    import pathlib
    import re

    import psutil

    tree = start_tree("[workers]\nstandby = false\n")
    tree.wait("ready")
    with LLM.connect(tree.instance) as llm:  # traffic on every link first
        from fdcore import SamplingParams

        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        sockets = {cid: psutil.Process(pid).net_connections(kind="all") for cid, pid in tree.pids.items()}
    assert sockets == {cid: [] for cid in tree.pids}, sockets
    package = pathlib.Path(ROOT) / "fdcore"
    forbidden = re.compile(r"^\s*(?:import|from)\s+(pickle|multiprocessing|socket|zmq)\b", re.M)
    offenders = {
        str(path.relative_to(package)): forbidden.findall(path.read_text())
        for path in package.rglob("*.py")
        if forbidden.search(path.read_text())
    }
    assert offenders == {"server/actor.py": ["socket"], "models/tensor_parallel.py": ["socket"]}, offenders
    os.kill(tree.proc.pid, signal.SIGTERM)
    assert tree.exit_code() == 0


def _policies(pid: int) -> set[int]:
    return {os.sched_getscheduler(int(task)) for task in os.listdir(f"/proc/{pid}/task")}


def _wait_for_policy(pid: int, policy: int, what: str) -> None:
    deadline = time.monotonic() + 60
    while _policies(pid) != {policy}:  # (no event says when a process has set its threads' policy)
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_the_first_spare_loads_before_ready_and_later_ones_at_idle_priority(start_tree):
    """The tree says ready only once the first spare is warm (the health board says so too), and that
    spare loads at the normal priority: nothing is served yet, and one at SCHED_IDLE would starve on a busy
    machine and hold the start for start_timeout. Once promoted, it serves at the normal policy; the spare
    that loads behind it, beside a serving tree, takes only CPU time nothing else wants (SCHED_IDLE, every
    thread, from its start); promoted in turn, every thread of it (OpenMP's, made while it loaded) runs normally
    again."""
    from fdcore.actors import health, topology
    from fdcore.actors.health import HealthBoard

    tree = start_tree("[workers]\nstandby = true\n")
    spare = int(tree.wait("standby", id="worker0")["pid"])
    tree.wait("spares_warm", count=1)  # before "ready": the first requests share no CPU with a loading spare
    tree.wait("ready")
    board = HealthBoard.attach(topology.health_name(tree.instance))
    try:
        assert board.spare(1) == health.SPARE_WARM  # (slot 1: worker0, after the cache manager)
        assert _policies(spare) == {os.SCHED_OTHER}
        tree.kill_child("worker0")
        assert int(tree.wait("promoted", id="worker0")["pid"]) == spare
        second = int(tree.wait("standby", id="worker0")["pid"])
        # idle from before its imports (the supervisor sets it before it says "standby"): a second of
        # CPU at the normal priority would slow the promoted worker as it resumes the streams
        assert _policies(second) == {os.SCHED_IDLE}, "a spare loading beside the serving tree is not at idle priority"
        deadline = time.monotonic() + 60
        while board.spare(1) != health.SPARE_WARM:  # (the board is where a later spare says it is warm)
            assert time.monotonic() < deadline, "the second spare never warmed"
            time.sleep(0.01)
        os.kill(spare, signal.SIGKILL)
        assert int(tree.wait("promoted", id="worker0")["pid"]) == second
        _wait_for_policy(second, os.SCHED_OTHER, "the promoted worker kept idle-priority threads")
    finally:
        board.close()
    os.kill(tree.proc.pid, signal.SIGTERM)
    assert tree.exit_code() == 0


def test_a_first_spare_slower_than_start_timeout_goes_on_at_idle_priority(start_tree):
    """A first spare that is not warm within start_timeout is waited for no more: the tree says ready, and
    the spare goes on loading at SCHED_IDLE, every thread, so that it slows no request; promoted before it
    is warm (its worker died), it loads on at the normal priority."""
    tree = start_tree(
        "[supervisor]\nstart_timeout = 15.0\n[workers]\nstandby = true\n",
        env={"FDCORE_TEST_FAULT": "worker0:stall_spare"},
    )
    spare = int(tree.wait("standby", id="worker0")["pid"])
    assert tree.wait("spares_warm")["count"] == "0"
    tree.wait("ready")
    assert _policies(spare) == {os.SCHED_IDLE}
    # promoted while still loading, every request now waits for it: it loads at the normal priority
    tree.kill_child("worker0")
    assert int(tree.wait("promoted", id="worker0")["pid"]) == spare
    assert _policies(spare) == {os.SCHED_OTHER}
    os.kill(tree.proc.pid, signal.SIGTERM)
    assert tree.exit_code() == 0


def _weight_file_inodes(pid: int) -> set[str]:
    """The inodes of the shared weight files (fdcore.models.shared_weights) that process maps: nameless files
    in $FDCORE_HOME, or memfds."""
    from fdcore.envs import fdcore_home

    nameless = os.path.join(fdcore_home(), "#")
    with open(f"/proc/{pid}/maps") as maps:
        return {line.split()[4] for line in maps if "-weights.r0" in line or nameless in line}


def test_a_spare_maps_the_weights_its_worker_packed(start_tree):
    """Weights that exist once: the worker packs them into the rank's shared file and its warm spare maps
    the same pages (one file in both processes' maps); the spare reads no checkpoint and packs nothing."""
    tree = start_tree("[workers]\nstandby = true\n")
    spare = int(tree.wait("standby", id="worker0")["pid"])
    tree.wait("ready")
    worker = tree.pids["worker0"]
    assert _weight_file_inodes(worker) and _weight_file_inodes(worker) == _weight_file_inodes(spare)
    log = "\n".join(tree.log)
    assert log.count("weights packed into the rank's shared memory") == 1, log
    assert log.count("weights mapped from the rank's shared memory") == 1, log
    assert log.count("loading weights 2/2") == 1, log  # (the tiny model's two shards, read once)
    os.kill(tree.proc.pid, signal.SIGTERM)
    assert tree.exit_code() == 0


def test_a_restarted_worker_maps_the_weights_instead_of_loading_them(start_tree):
    """With no spare, a SIGKILLed worker's successor maps what its predecessor packed: no load, no packing
    (and the file outlives the worker that packed it: the supervisor holds it)."""
    tree = start_tree("[workers]\nstandby = false\n")
    tree.wait("ready")
    first = tree.pids["worker0"]
    inodes = _weight_file_inodes(first)
    tree.kill_child("worker0")
    successor = int(tree.wait("restarted", id="worker0")["pid"])
    assert successor != first and _weight_file_inodes(successor) == inodes
    log = "\n".join(tree.log)
    assert log.count("weights packed into the rank's shared memory") == 1, log
    assert log.count("weights mapped from the rank's shared memory") == 1, log
    assert log.count("loading weights 2/2") == 1, log
    os.kill(tree.proc.pid, signal.SIGTERM)
    assert tree.exit_code() == 0
