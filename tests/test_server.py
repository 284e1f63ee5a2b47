"""The OpenAI-compatible HTTP server (fdcore:api) under the official openai client, curl, and a
table of malformed requests."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import time

import httpx
import openai
import pytest

from tests.supervised import Tree

MODEL = "tiny"
TREES: list = []  # the module's tree, for tests that kill its actors
KEY = "sk-test-fdcore"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from fdcore.models import tiny

    root = tmp_path_factory.mktemp("server")
    model = tiny.make_tiny_model(str(root / MODEL))
    port = free_port()
    config = root / "server.toml"
    config.write_text(f'[model]\npath = "{model}"\n[server]\nenabled = true\nport = {port}\n'
                      f'api_key = "{KEY}"\nmax_request_bytes = 65536\nheader_timeout = 1.0\n'
                      'timeout_keep_alive = 0.5\nlimit_concurrency = 200\n[engine]\nmax_pending_requests = 64\n')
    tree = Tree(str(config))
    TREES.append(tree)
    try:
        tree.wait("ready", timeout=120)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:  # the API is ready when the tree is; its socket may take a moment more
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
        yield base
    finally:
        tree.proc.send_signal(signal.SIGINT)  # a clean stop; whatever is left is killed
        try:
            tree.exit_code(30)
        finally:
            tree.destroy()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completions_with_the_openai_client(client):
    out = client.completions.create(model=MODEL, prompt="def main():", max_tokens=8, temperature=0)
    assert out.object == "text_completion" and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8 and out.usage.prompt_tokens > 0
    again = client.completions.create(model=MODEL, prompt="def main():", max_tokens=8, temperature=0)
    assert again.choices[0].text == out.choices[0].text  # greedy
    pieces = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="def main():", max_tokens=8, temperature=0, stream=True) if c.choices]
    assert "".join(pieces) == out.choices[0].text


def test_completion_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(value <= 0 for value in lp.token_logprobs)
    assert all(len(top) <= 3 for top in lp.top_logprobs)


def test_chat_with_the_openai_client_streaming_and_not(client):
    messages = [{"role": "user", "content": "Hello there"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                         logprobs=True, top_logprobs=2)
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.usage.completion_tokens == 10
    assert len(out.choices[0].logprobs.content) == 10
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on this machine")
def test_curl(server):
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3, "temperature": 0, "stream": True})
    result = subprocess.run(["curl", "-sN", f"{server}/v1/completions", "-H", f"Authorization: Bearer {KEY}",
                             "-H", "Content-Type: application/json", "-d", body],
                            capture_output=True, text=True, timeout=60, check=True)
    events = [line for line in result.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 2
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_health_and_metrics(server, client):
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    text = httpx.get(f"{server}/metrics").text
    for name in ("fdcore_requests_total", "fdcore_requests_running", "fdcore_requests_waiting",
                 "fdcore_kv_cache_usage_ratio", "fdcore_prefix_cache_hit_rate",
                 "fdcore_time_to_first_token_seconds_bucket", "fdcore_time_per_output_token_seconds_bucket",
                 "fdcore_e2e_request_latency_seconds_bucket", 'fdcore_actor_restarts{actor="worker0"}'):
        assert name in text, name
    assert 'fdcore_requests_total{outcome="length"}' in text


def _post(server, path, body, key=KEY, raw=None, headers=None):
    h = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    return httpx.post(f"{server}{path}", content=raw if raw is not None else json.dumps(body), headers=h, timeout=60)


OK = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
MALFORMED = [
    ("bad json", "/v1/completions", None, b"{not json", 400, None),
    ("empty body", "/v1/completions", None, b"", 400, None),
    ("body not an object", "/v1/completions", None, b"[1, 2]", 400, None),
    ("missing model", "/v1/completions", {"prompt": "hi"}, None, 400, "model"),
    ("missing prompt", "/v1/completions", {"model": MODEL}, None, 400, "prompt"),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, None, 400, "messages"),
    ("unknown model", "/v1/completions", {**OK, "model": "gpt-9"}, None, 404, "model"),
    ("unknown field", "/v1/completions", {**OK, "frobnicate": 1}, None, 400, "frobnicate"),
    ("max_tokens a string", "/v1/completions", {**OK, "max_tokens": "ten"}, None, 400, "max_tokens"),
    ("max_tokens zero", "/v1/completions", {**OK, "max_tokens": 0}, None, 400, "max_tokens"),
    ("max_tokens huge", "/v1/completions", {**OK, "max_tokens": 10**7}, None, 400, "max_tokens"),
    ("temperature negative", "/v1/completions", {**OK, "temperature": -1}, None, 400, "temperature"),
    ("temperature a string", "/v1/completions", {**OK, "temperature": "hot"}, None, 400, "temperature"),
    ("top_p zero", "/v1/completions", {**OK, "top_p": 0}, None, 400, "top_p"),
    ("n two", "/v1/completions", {**OK, "n": 2}, None, 400, "n"),
    ("logprobs too many", "/v1/completions", {**OK, "logprobs": 50}, None, 400, "logprobs"),
    ("presence penalty", "/v1/completions", {**OK, "presence_penalty": 5}, None, 400, "presence_penalty"),
    ("stop a number", "/v1/completions", {**OK, "stop": 3}, None, 400, "stop"),
    ("prompt token out of vocabulary", "/v1/completions", {**OK, "prompt": [999999]}, None, 400, "prompt_token_ids[0]"),
    ("empty prompt", "/v1/completions", {**OK, "prompt": ""}, None, 400, "prompt"),
    ("prompt too long", "/v1/completions", {**OK, "prompt": [5] * 3000}, None, 400, "prompt"),
    ("chat role unknown", "/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]},
     None, 400, "messages[0].role"),
    ("chat content missing", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user"}]}, None, 400,
     "messages[0].content"),
    ("top_logprobs without logprobs", "/v1/chat/completions", {**CHAT, "top_logprobs": 2}, None, 400,
     "top_logprobs"),
    ("oversized body", "/v1/completions", None, json.dumps({**OK, "prompt": "x" * 70000}).encode(), 413, None),
]


@pytest.mark.parametrize("name, path, body, raw, status, param", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_requests_get_openai_errors_and_the_server_keeps_serving(server, name, path, body, raw,
                                                                           status, param):
    response = _post(server, path, body, raw=raw)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    assert error["param"] == param, error
    assert _post(server, "/v1/completions", OK).status_code == 200


def test_api_key_and_unknown_routes(server):
    assert _post(server, "/v1/completions", OK, key=None).status_code == 401
    assert _post(server, "/v1/completions", OK, key="wrong").json()["error"]["code"] == "invalid_api_key"
    missing = httpx.get(f"{server}/v1/nothing-here")
    assert missing.status_code == 404 and "error" in missing.json()


def test_queue_full_is_429(server):
    import asyncio

    async def burst():
        async with httpx.AsyncClient(timeout=120) as http:
            body = {**OK, "max_tokens": 200, "ignore_eos": True}
            return await asyncio.gather(*(http.post(f"{server}/v1/completions", json=body,
                                                    headers={"Authorization": f"Bearer {KEY}"})
                                          for _ in range(100)))

    codes = [r.status_code for r in asyncio.run(burst())]
    assert 429 in codes and 200 in codes, codes
    assert all(r in (200, 429) for r in codes)


def test_binds_localhost_by_default():
    from fdcore.config import parse_config

    assert parse_config("[server]\nenabled = true\n", check_model=False).server.host == "127.0.0.1"


@pytest.mark.parametrize("text, serves", [("[server]\nport = 8123\n", True),
                                          ("[server]\nport = 8123\nenabled = false\n", False),
                                          ("[server]\nhost = \"0.0.0.0\"\n", False), ("", False)])
def test_a_server_section_that_names_a_port_serves(text, serves):
    from fdcore.config import parse_config

    assert parse_config(text, check_model=False).server.enabled is serves


def _actor(child_id: str):
    import psutil

    from fdcore.supervisor import actor_pid

    pid = actor_pid(TREES[-1].proc.pid, child_id)
    assert pid is not None, f"no {child_id}"
    return psutil.Process(pid)


def test_an_http_stream_survives_an_engine_kill(server):
    body = {"model": MODEL, "prompt": "def main():", "max_tokens": 120, "temperature": 0, "ignore_eos": True}
    clean = _post(server, "/v1/completions", body).json()["choices"][0]["text"]
    pieces, killed = [], False
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{server}/v1/completions", json={**body, "stream": True}, headers=headers,
                      timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            pieces.append(json.loads(line[6:])["choices"][0]["text"])
            if len(pieces) == 10 and not killed:
                _actor("engine").kill()
                killed = True
    assert killed and "".join(pieces) == clean


def test_the_api_actor_is_restarted_and_serves_again(server):
    old = _actor("api")
    old.kill()
    TREES[-1].wait("restarted", id="api", timeout=60)
    deadline = time.monotonic() + 30
    while True:
        try:
            if _post(server, "/v1/completions", OK).status_code == 200:
                break
        except httpx.HTTPError:
            assert time.monotonic() < deadline, "the restarted API does not answer"
    assert _actor("api").pid != old.pid


def _stand_in_app(default_max_tokens=None):
    """The HTTP app before a stand-in engine that records what it is asked (no tree needed)."""
    from fdcore.client import CompletionOutput, RequestOutput
    from fdcore.server.app import Settings, build_app

    seen = []

    class Engine:
        async def generate(self, prompt, params):
            seen.append((prompt, params))
            yield RequestOutput("r", prompt, [1, 2], CompletionOutput(0, "ok", [5], None, "stop"), True)

    settings = Settings(MODEL, 2048, default_max_tokens=default_max_tokens)
    return build_app(Engine(), settings, None, lambda: (True, ""), dict), seen


def test_chat_template_fields_reach_the_engine_and_unset_sampling_stays_unset():
    from starlette.testclient import TestClient

    app, seen = _stand_in_app()
    http = TestClient(app)
    tools = [{"type": "function", "function": {"name": "now", "parameters": {}}}]
    options = {"tools": tools, "tool_choice": "auto", "documents": [{"title": "t", "text": "x"}],
               "add_generation_prompt": False, "continue_final_message": True, "chat_template_kwargs": {"think": 1}}
    assert http.post("/v1/chat/completions", json={**CHAT, **options}).status_code == 200
    prompt, params = seen[-1]
    assert prompt == {"messages": CHAT["messages"], **{k: v for k, v in options.items() if k != "tool_choice"}}
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == (None,) * 5
    assert params.max_tokens == 2
    assert http.post("/v1/chat/completions", json={**CHAT, "max_tokens": None, "temperature": 0.5}).status_code == 200
    assert seen[-1] == ({"messages": CHAT["messages"]}, seen[-1][1])
    assert (seen[-1][1].max_tokens, seen[-1][1].temperature) == (2048, 0.5)  # no limit: the context
    assert http.post("/v1/completions", json={**OK, "max_tokens": None}).status_code == 200
    assert seen[-1][1].max_tokens is None  # the engine fills it: the model's default, else 16
    refused = http.post("/v1/chat/completions", json={**CHAT, "tool_choice": "required", "tools": tools})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tool_choice"
    app, seen = _stand_in_app(default_max_tokens=7)
    assert TestClient(app).post("/v1/chat/completions", json={**CHAT, "max_tokens": None}).status_code == 200
    assert seen[-1][1].max_tokens == 7  # the model's max_new_tokens


# ---------------------------------------------------------------- abuse
def _metric(server, name: str) -> float:
    text = httpx.get(f"{server}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + " ", name + "{")))


def _request_bytes(body: dict) -> bytes:
    raw = json.dumps(body).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n").encode() + raw


def test_64_clients_that_disconnect_mid_request_are_aborted_within_a_second(server):
    import asyncio

    host, port = server.removeprefix("http://").split(":")
    aborts = 'fdcore_requests_total{outcome="abort"}'
    before = _metric(server, aborts)

    async def scenario():
        conns = []
        for i in range(64):  # streamed or whole, left before or after the first token
            stream, early = i % 2 == 0, i % 4 < 2
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(_request_bytes({**OK, "max_tokens": 2000, "ignore_eos": True, "stream": stream}))
            await writer.drain()
            conns.append((stream, early, reader, writer))
        for stream, early, _, writer in conns:
            if early:
                writer.close()
        for stream, early, reader, _ in conns:
            if stream and not early:  # its first token has come
                while b"data: " not in await reader.readline():
                    pass
        for _, early, _, writer in conns:
            if not early:
                writer.close()
        return time.monotonic()

    closed = asyncio.run(scenario())
    while _metric(server, aborts) < before + 64:
        assert time.monotonic() - closed < 1.0, f"{_metric(server, aborts) - before} of 64 aborts after 1 s"
    while _metric(server, "fdcore_requests_running") > 0:
        assert time.monotonic() - closed < 1.0, "aborted requests still run after 1 s"
    assert _metric(server, aborts) == before + 64


def test_a_connection_that_sends_half_a_header_is_closed_after_the_header_timeout(server):
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
        started = time.monotonic()
        assert sock.recv(1024) == b"", "the server answered instead of closing"
        elapsed = time.monotonic() - started
    assert 0.9 < elapsed < 3.0, elapsed
    assert _post(server, "/v1/completions", OK).status_code == 200


def test_chat_max_tokens_comes_from_the_model_else_the_config():
    from fdcore.actors.api import chat_max_tokens
    from fdcore.config import parse_config

    server = parse_config("", check_model=False).server
    assert chat_max_tokens({"max_tokens": 64}, server) == 64
    assert chat_max_tokens({}, server) == 1024
    assert chat_max_tokens({}, parse_config("[server]\ndefault_max_tokens = 0\n", check_model=False).server) is None


def _response(sock) -> bytes:
    """One whole HTTP response (its head and Content-Length body) from a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return head


def test_an_idle_keep_alive_connection_is_closed_after_its_timeout(server):
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _response(sock).startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        assert sock.recv(1024) == b""
        assert 0.4 < time.monotonic() - started < 0.95  # timeout_keep_alive, before the head timeout


def test_connections_beyond_the_limit_get_503_until_they_go(server):
    host, port = server.removeprefix("http://").split(":")
    idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(200)]
    try:
        assert _post(server, "/v1/completions", OK).status_code == 503
        for sock in idle:  # the head timeout closes every idle connection
            assert sock.recv(1024) == b""
    finally:
        for sock in idle:
            sock.close()
    assert _post(server, "/v1/completions", OK).status_code == 200


def test_the_api_heartbeat_ticks_from_the_event_loop():
    """A loop wedged by a blocking call must stop the heartbeat, so the supervisor sees a hang."""
    import asyncio
    import itertools

    from fdcore.actors.api import ApiActor
    from fdcore.config import parse_config

    ticks = []

    class Board:
        def write(self, slot, field, value):
            ticks.append(time.monotonic())

    class WedgingServer:
        async def serve(self, sockets=None):
            await asyncio.sleep(0.2)
            time.sleep(0.6)  # noqa: ASYNC251 -- the blocking call on the loop this test is about
            await asyncio.sleep(0.2)

    config = parse_config("[supervisor]\nheartbeat_interval = 0.05\n", check_model=False)
    actor = ApiActor("api", "no-instance", config, Board(), 0)
    actor.server, actor.listener = WedgingServer(), None
    asyncio.run(actor._serve())
    gaps = [b - a for a, b in itertools.pairwise(ticks)]
    assert len(ticks) > 5 and max(gaps) > 0.55, "the heartbeat kept ticking while the loop was wedged"


def test_the_servers_connections_send_without_waiting_for_acks():
    """The API's listening socket makes asyncio set TCP_NODELAY on every connection it accepts: with
    Nagle's algorithm on, a streamed chunk after the response head waited for the client's delayed
    ACK (the first token ~40 ms late with aiohttp, vLLM's benchmark client)."""
    import asyncio

    from fdcore.actors.api import listening_socket

    async def accepted_nodelay() -> int:
        listener = listening_socket("127.0.0.1", 0)
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        async def on_connect(reader, writer):
            seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=listener)
        async with server:
            _, writer = await asyncio.open_connection(*listener.getsockname())
            value = await asyncio.wait_for(seen, 10)
            writer.close()
        return value

    assert asyncio.run(accepted_nodelay()) != 0
