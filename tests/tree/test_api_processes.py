"""What an HTTP server process's death costs (README): its own connections, and nothing else.

The connections of a SIGKILLed fdcore:api die with it (a stream ends without ``[DONE]``: its client must
take that as an error); the engine aborts their requests; the supervisor restarts the process. With
``server.processes = 2`` the two share the port, so the survivor's streams finish untouched and a new
request is served at once, before the restart.
"""

from __future__ import annotations

import json
import select
import signal
import socket
import threading
import time

import httpx
import pytest

from fdcore.checkpoint import tiny
from fdcore.supervisor import actor_pid
from tests.supervised import Tree

pytestmark = pytest.mark.tree


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_apis(tmp_path_factory):
    root = tmp_path_factory.mktemp("apis")
    model = tiny.make_tiny_model(str(root / "tiny"))
    port = _free_port()
    config = root / "tree.toml"
    config.write_text(
        f'[model]\npath = "{model}"\n[server]\nenabled = true\nport = {port}\nprocesses = 2\n'
        "[supervisor]\nmax_restarts = 20\n"
    )
    tree = Tree(str(config))
    try:
        tree.wait("ready", timeout=120)
        yield tree, f"http://127.0.0.1:{port}"
    finally:
        tree.proc.send_signal(signal.SIGINT)
        try:
            tree.exit_code(30)
        finally:
            tree.destroy()


BODY = {"model": "tiny", "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stream": True}


def _stream(base: str, i: int, out: dict, started: threading.Barrier | None = None) -> None:
    """One streamed completion on a connection of its own: (text, whether [DONE] came, the error if any)."""
    text, done, error = "", False, None
    try:
        with (
            httpx.Client(timeout=60) as http,
            http.stream("POST", f"{base}/v1/completions", json={**BODY, "prompt": [5 + i, 6, 7, 8]}) as response,
        ):
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    text += json.loads(line[6:])["choices"][0]["text"]
                    if started is not None and len(text) > 0:
                        started.wait()
                        started = None
    except (httpx.HTTPError, threading.BrokenBarrierError) as exc:
        error = exc
    out[i] = (text, done, error)


def _all_streams(base: str, count: int, kill=None) -> dict:
    out: dict = {}
    barrier = threading.Barrier(count + 1, timeout=60) if kill else None
    threads = [threading.Thread(target=_stream, args=(base, i, out, barrier)) for i in range(count)]
    for thread in threads:
        thread.start()
    if kill:
        barrier.wait()  # every stream has its first text
        kill()
    for thread in threads:
        thread.join(120)
    return out


def test_a_killed_api_process_loses_only_its_own_connections(two_apis):
    tree, base = two_apis
    quiet = _all_streams(base, 32)
    assert all(done for _, done, _ in quiet.values())
    victim = actor_pid(tree.proc.pid, "api0")
    served_at: list[float] = []

    def kill():
        import os

        pidfd = os.pidfd_open(victim)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        # (readable once it has exited, its sockets closed: a connection the kernel queued on the dying
        # listener in between is reset, whatever the server does, unless net.ipv4.tcp_migrate_req = 1)
        select.select([pidfd], [], [], 10)
        os.close(pidfd)
        reply = httpx.post(
            f"{base}/v1/completions", json={**BODY, "stream": False, "prompt": "hi", "max_tokens": 2}, timeout=30
        )
        assert reply.status_code == 200
        served_at.append(time.monotonic() - killed)

    crashed = _all_streams(base, 32, kill)
    finished = [i for i, (_, done, _) in crashed.items() if done]
    cut = [i for i, (_, done, error) in crashed.items() if not done]
    assert finished and cut, "the kernel gave every connection to one process: no process's loss was seen"
    assert all(crashed[i][0] == quiet[i][0] for i in finished), "a survivor's stream changed"
    assert served_at[0] < 1.0, f"a new request waited {served_at[0]:.2f} s for the restart"
    tree.wait("restarted", id="api0", timeout=60)
    assert all(done for _, done, _ in _all_streams(base, 8).values())
