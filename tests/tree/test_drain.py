"""A stop that drains (issue 44): on SIGTERM the server refuses new requests at once (503, Retry-After,
/health 503) while the open ones run out, for up to ``server.drain_timeout``; whatever is left then ends
with finish_reason "abort", an error event and [DONE], before any actor is stopped."""

from __future__ import annotations

import json
import signal
import socket
import threading

import httpx
import pytest

from fdcore.checkpoint import tiny
from tests.supervised import Tree

pytestmark = pytest.mark.tree


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.make_tiny_model(str(tmp_path_factory.mktemp("drain") / "tiny"))


def _server(tmp_path, model_dir, drain_timeout: float) -> tuple[Tree, str]:
    port = _free_port()
    config = tmp_path / "tree.toml"
    config.write_text(
        f'[model]\npath = "{model_dir}"\n[server]\nenabled = true\nport = {port}\n'
        f"drain_timeout = {drain_timeout}\n[workers]\nstandby = false\n"
    )
    tree = Tree(str(config))
    tree.wait("ready", timeout=120)
    return tree, f"http://127.0.0.1:{port}"


def _stream(base: str, i: int, tokens: int, out: dict, started: threading.Barrier | None) -> None:
    """One streamed completion: (text, finish reasons, error events, whether [DONE] came)."""
    text, reasons, errors, done = "", [], [], False
    body = {
        "model": "tiny",
        "prompt": [5 + i, 6, 7, 8],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=120) as http, http.stream("POST", f"{base}/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    errors.append(event["error"])
                    continue
                choice = event["choices"][0]
                text += choice["text"]
                reasons += [choice["finish_reason"]] if choice["finish_reason"] else []
                if started is not None and text:
                    started.wait()
                    started = None
    out[i] = (text, reasons, errors, done)


def _streams(base: str, tokens: int, stop=None) -> dict:
    out: dict = {}
    barrier = threading.Barrier(33, timeout=120) if stop else None
    threads = [threading.Thread(target=_stream, args=(base, i, tokens, out, barrier)) for i in range(32)]
    for thread in threads:
        thread.start()
    if stop:
        barrier.wait()  # every stream has its first text
        stop()
    for thread in threads:
        thread.join(180)
    return out


def test_sigterm_lets_32_streams_finish_and_refuses_new_requests_at_once(tmp_path, model_dir):
    tree, base = _server(tmp_path, model_dir, drain_timeout=60.0)
    refused = []
    try:
        quiet = _streams(base, 300)

        def stop():
            tree.proc.send_signal(signal.SIGTERM)
            tree.wait("signal", timeout=10)
            late = httpx.post(
                f"{base}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=10
            )
            refused.append(
                (late.status_code, late.headers.get("retry-after"), httpx.get(f"{base}/health", timeout=10).status_code)
            )

        drained = _streams(base, 300, stop)
        assert tree.exit_code(120) == 0
    finally:
        tree.destroy()
    assert refused == [(503, "1", 503)]
    assert {i: (t, r, d) for i, (t, r, e, d) in drained.items()} == {i: (t, r, d) for i, (t, r, e, d) in quiet.items()}
    assert all(done and reasons == ["length"] and not errors for _, reasons, errors, done in drained.values())


def test_what_the_drain_timeout_leaves_ends_with_abort_an_error_event_and_done(tmp_path, model_dir):
    tree, base = _server(tmp_path, model_dir, drain_timeout=1.0)
    try:
        cut = _streams(base, 2000, lambda: tree.proc.send_signal(signal.SIGTERM))
        assert tree.exit_code(120) == 0
    finally:
        tree.destroy()
    assert all(done for _, _, _, done in cut.values()), "a stream ended without [DONE]"
    aborted = [(reasons, errors) for _, reasons, errors, _ in cut.values() if reasons != ["length"]]
    assert aborted, "every stream finished within the drain's second: nothing was cut"
    for reasons, errors in aborted:
        assert reasons == ["abort"] and len(errors) == 1 and errors[0]["code"] == "shutting_down"
