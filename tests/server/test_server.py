"""The OpenAI-compatible HTTP server (fdcore:api) under the official openai client, curl, and a
table of malformed requests."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time

import httpx
import msgspec
import openai
import pytest

from tests import DATA
from tests.supervised import Tree

pytestmark = pytest.mark.tree

MODEL = "tiny"
TREES: list = []  # the module's tree, for tests that kill its actors
KEY = "sk-test-fdcore"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from fdcore.checkpoint import tiny

    root = tmp_path_factory.mktemp("server")
    model = tiny.make_tiny_model(str(root / MODEL))
    port = free_port()
    config = root / "server.toml"
    config.write_text(
        f'[model]\npath = "{model}"\n[server]\nenabled = true\nport = {port}\n'
        f'api_key = "{KEY}"\nmax_request_bytes = 65536\nheader_timeout = 1.0\nbody_timeout = 1.0\n'
        "timeout_keep_alive = 0.5\nlimit_concurrency = 200\nmax_connections = 300\n"
        "max_connections_per_peer = 300\n[engine]\nmax_pending_requests = 64\n"
    )
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
    pieces = [
        c.choices[0].text
        for c in client.completions.create(model=MODEL, prompt="def main():", max_tokens=8, temperature=0, stream=True)
        if c.choices
    ]
    assert "".join(pieces) == out.choices[0].text


def test_completion_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(value <= 0 for value in lp.token_logprobs)
    assert all(len(top) <= 3 for top in lp.top_logprobs)


def test_chat_with_the_openai_client_streaming_and_not(client):
    messages = [{"role": "user", "content": "Hello there"}]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2
    )
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.usage.completion_tokens == 10
    assert len(out.choices[0].logprobs.content) == 10
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on this machine")
def test_curl(server):
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3, "temperature": 0, "stream": True})
    result = subprocess.run(
        [
            "curl",
            "-sN",
            f"{server}/v1/completions",
            "-H",
            f"Authorization: Bearer {KEY}",
            "-H",
            "Content-Type: application/json",
            "-d",
            body,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    events = [line for line in result.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 2
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_health_and_metrics(server, client):
    health = httpx.get(f"{server}/health").json()
    assert health["status"] == "ok" and health["spares"]["worker0"] in ("loading", "warm")
    client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    text = httpx.get(f"{server}/metrics").text
    for name in (
        "fdcore_requests_total",
        "fdcore_requests_running",
        "fdcore_requests_waiting",
        "fdcore_kv_cache_usage_ratio",
        "fdcore_prefix_cache_hit_rate",
        "fdcore_time_to_first_token_seconds_bucket",
        "fdcore_time_per_output_token_seconds_bucket",
        "fdcore_e2e_request_latency_seconds_bucket",
        'fdcore_actor_restarts{actor="worker0"}',
    ):
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
    ("n zero", "/v1/completions", {**OK, "n": 0}, None, 400, "n"),
    ("n too many", "/v1/completions", {**OK, "n": 65}, None, 400, "n"),
    ("prompts x n too many", "/v1/completions", {**OK, "prompt": ["a"] * 33, "n": 2}, None, 400, "n"),
    ("a prompt of the list not a prompt", "/v1/completions", {**OK, "prompt": ["a", 5]}, None, 400, "prompt[1]"),
    (
        "prompt_logprobs streamed",
        "/v1/completions",
        {**OK, "prompt_logprobs": 1, "stream": True},
        None,
        400,
        "prompt_logprobs",
    ),
    ("prompt_logprobs too many", "/v1/completions", {**OK, "prompt_logprobs": 21}, None, 400, "prompt_logprobs"),
    (
        "chat prompt_logprobs negative",
        "/v1/chat/completions",
        {**CHAT, "prompt_logprobs": -1},
        None,
        400,
        "prompt_logprobs",
    ),
    ("logit_bias key not a token id", "/v1/completions", {**OK, "logit_bias": {"abc": 1}}, None, 400, "logit_bias"),
    ("logit_bias above 100", "/v1/completions", {**OK, "logit_bias": {"5": 101}}, None, 400, "logit_bias[5]"),
    ("logit_bias not a number", "/v1/completions", {**OK, "logit_bias": {"5": "x"}}, None, 400, "logit_bias[5]"),
    ("seed + n past the limit", "/v1/completions", {**OK, "n": 2, "seed": 2**63 - 1}, None, 400, "seed"),
    ("logprobs too many", "/v1/completions", {**OK, "logprobs": 50}, None, 400, "logprobs"),
    ("presence penalty", "/v1/completions", {**OK, "presence_penalty": 5}, None, 400, "presence_penalty"),
    ("stop a number", "/v1/completions", {**OK, "stop": 3}, None, 400, "stop"),
    ("prompt token out of vocabulary", "/v1/completions", {**OK, "prompt": [999999]}, None, 400, "prompt_token_ids[0]"),
    ("empty prompt", "/v1/completions", {**OK, "prompt": ""}, None, 400, "prompt"),
    ("prompt too long", "/v1/completions", {**OK, "prompt": [5] * 3000}, None, 400, "prompt"),
    (
        "chat role unknown",
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "wizard", "content": "x"}]},
        None,
        400,
        "messages[0].role",
    ),
    (
        "chat content missing",
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user"}]},
        None,
        400,
        "messages[0].content",
    ),
    ("top_logprobs without logprobs", "/v1/chat/completions", {**CHAT, "top_logprobs": 2}, None, 400, "top_logprobs"),
    ("oversized body", "/v1/completions", None, json.dumps({**OK, "prompt": "x" * 70000}).encode(), 413, None),
    ("tokenize both forms", "/tokenize", {"prompt": "hi", "messages": CHAT["messages"]}, None, 400, "messages"),
    ("tokenize neither form", "/tokenize", {"model": MODEL}, None, 400, "prompt"),
    (
        "tokenize chat option on a prompt",
        "/tokenize",
        {"prompt": "hi", "add_generation_prompt": True},
        None,
        400,
        "add_generation_prompt",
    ),
    (
        "tokenize special tokens off",
        "/tokenize",
        {"prompt": "hi", "add_special_tokens": False},
        None,
        400,
        "add_special_tokens",
    ),
    ("tokenize unknown model", "/tokenize", {"model": "gpt-9", "prompt": "hi"}, None, 404, "model"),
    ("tokenize unknown field", "/tokenize", {"prompt": "hi", "truncate": 3}, None, 400, "truncate"),
    ("detokenize out of vocabulary", "/detokenize", {"tokens": [5, 999999]}, None, 400, "tokens[1]"),
    ("detokenize not ids", "/detokenize", {"tokens": ["a"]}, None, 400, "tokens[0]"),
    ("seed past 64 bits", "/v1/completions", {**OK, "seed": 2**64}, None, 400, "seed"),
    ("max_tokens past 64 bits", "/v1/completions", {**OK, "max_tokens": 10**20}, None, 400, "max_tokens"),
    ("prompt id past 64 bits", "/v1/completions", {**OK, "prompt": [5, 2**64]}, None, 400, "prompt[1]"),
    ("logit_bias key past 64 bits", "/v1/completions", {**OK, "logit_bias": {str(2**64): 1}}, None, 400, "logit_bias"),
    ("chat seed past 64 bits", "/v1/chat/completions", {**CHAT, "seed": -(2**63) - 1}, None, 400, "seed"),
    (
        "tool_choice function a string",
        "/v1/chat/completions",
        {
            **CHAT,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": "f"},
        },
        None,
        400,
        "tool_choice",
    ),
    (
        "tool_choice of another type",
        "/v1/chat/completions",
        {
            **CHAT,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "x", "function": {"name": "f"}},
        },
        None,
        400,
        "tool_choice",
    ),
]


@pytest.mark.parametrize("name, path, body, raw, status, param", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_requests_get_openai_errors_and_the_server_keeps_serving(
    server, name, path, body, raw, status, param
):
    response = _post(server, path, body, raw=raw)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    assert error["param"] == param, error
    assert _post(server, "/v1/completions", OK).status_code == 200


@pytest.mark.parametrize(
    "path, body, field, depth",
    [
        ("/v1/completions", OK, "prompt", 980),
        ("/v1/completions", OK, "prompt", 20000),
        ("/v1/completions", OK, "response_format", 980),
        ("/v1/chat/completions", CHAT, "messages", 980),
        ("/v1/chat/completions", CHAT, "chat_template_kwargs", 980),
        ("/tokenize", {"prompt": "x"}, "prompt", 980),
    ],
)
def test_deep_nesting_is_a_400_naming_the_field_and_never_a_traceback(server, path, body, field, depth):
    """JSON nested below what any request needs (and far below, past the decoder's own limit) in a field
    whose type takes lists or objects: a 400 naming that field, in OpenAI's shape, and nothing on the log."""
    inner = {"a": None}
    text = json.dumps({k: v for k, v in body.items() if k != field} | {field: inner})
    deep = "[" * depth + "]" * depth if field in ("prompt", "messages") else '{"a":' * depth + "1" + "}" * depth
    raw = text.replace(json.dumps(inner), deep).encode()
    before = len(TREES[0].log)
    response = _post(server, path, None, raw=raw)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith(field), response.json()
    assert _post(server, "/v1/completions", OK).status_code == 200
    assert not [line for line in TREES[0].log[before:] if "Traceback" in line]


def test_tokenize_counts_what_a_request_runs_and_detokenize_reverses_it(server, client):
    """vLLM's /tokenize and /detokenize: the ids of a prompt and of chat messages are the ones the engine
    ran (its usage's prompt_tokens), and /detokenize gives the text back."""
    done = client.completions.create(model=MODEL, prompt="def main():", max_tokens=1)
    ids = _post(server, "/tokenize", {"model": MODEL, "prompt": "def main():"}).json()
    assert ids["count"] == len(ids["tokens"]) == done.usage.prompt_tokens and ids["token_strs"] is None
    assert ids["max_model_len"] == 2048 and all(isinstance(t, int) for t in ids["tokens"])
    strings = _post(server, "/tokenize", {"prompt": "def main():", "return_token_strs": True}).json()
    assert strings["tokens"] == ids["tokens"] and len(strings["token_strs"]) == ids["count"]
    assert (
        _post(server, "/detokenize", {"model": MODEL, "tokens": ids["tokens"]}).json()["prompt"].endswith("def main():")
    )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    counted = _post(server, "/tokenize", {"messages": messages}).json()
    assert counted["count"] == chat.usage.prompt_tokens > ids["count"]
    bare = _post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert bare["count"] < counted["count"] and counted["tokens"][: bare["count"]] == bare["tokens"]


def test_n_choices_are_seeded_per_index_streamed_or_not(client):
    """n = 4: four choices, index 0-3, choice i what a single request seeded seed + i gives (distinct,
    reproducible); usage counts the prompt once and every choice's tokens; streamed, the chunks of each
    index assemble to the same texts."""
    ask = {"model": MODEL, "prompt": "def main():", "max_tokens": 8, "temperature": 1.0, "seed": 7}
    out = client.completions.create(**ask, n=4)
    assert [c.index for c in out.choices] == [0, 1, 2, 3] and len({c.text for c in out.choices}) == 4
    single = client.completions.create(**ask)
    assert out.usage.prompt_tokens == single.usage.prompt_tokens and out.usage.completion_tokens == 32
    for i in (0, 3):
        assert client.completions.create(**{**ask, "seed": 7 + i}).choices[0].text == out.choices[i].text
    texts = ["", "", "", ""]
    for chunk in client.completions.create(**ask, n=4, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in out.choices]
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 3,
    }
    answers = client.chat.completions.create(**chat, n=3)
    assert len({c.message.content for c in answers.choices}) == 3 and answers.usage.completion_tokens == 18
    streamed = ["", "", ""]
    for chunk in client.chat.completions.create(**chat, n=3, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == [c.message.content for c in answers.choices]


def test_logit_bias_forces_a_token(server, client):
    """{"42": 100} through the openai client: every token is 42 (what /detokenize makes of five 42s)."""
    forced = client.completions.create(
        model=MODEL, prompt="def main():", max_tokens=5, temperature=1.0, logit_bias={"42": 100}
    )
    assert forced.choices[0].text == _post(server, "/detokenize", {"tokens": [42] * 5}).json()["prompt"]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0, logit_bias={"42": 100}
    )
    assert chat.choices[0].message.content == forced.choices[0].text


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_response_format_json_schema_streamed_or_not(client):
    import jsonschema

    ask = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "who?"}],
        "max_tokens": 200,
        "temperature": 1.0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    }
    for seed in range(4):
        whole = client.chat.completions.create(**ask, seed=seed).choices[0]
        assert whole.finish_reason == "stop"
        jsonschema.validate(json.loads(whole.message.content), PERSON)
        streamed = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(**ask, seed=seed, stream=True)
            if c.choices
        )
        assert streamed == whole.message.content
    anything = client.chat.completions.create(**{**ask, "response_format": {"type": "json_object"}}, seed=1)
    assert isinstance(json.loads(anything.choices[0].message.content), dict)


def test_vllms_guided_fields_and_structured_outputs(client):
    ask = {"model": MODEL, "prompt": "pick:", "max_tokens": 20, "temperature": 1.0, "seed": 5}
    choice = client.completions.create(**ask, extra_body={"guided_choice": ["left", "right"]}).choices[0].text
    assert choice in ("left", "right")
    regex = client.completions.create(**ask, extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"}).choices[0].text
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", regex)
    same = client.completions.create(**ask, extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})
    assert same.choices[0].text == regex


@pytest.mark.parametrize(
    "extra, param, says",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/nope"}}}},
            "response_format.json_schema.schema",
            "cannot be compiled",
        ),
        ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
        ({"structured_outputs": {"regex": "a", "jsn": {}}}, "structured_outputs", "jsn"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty list"),
        ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice", "only one of"),
        ({"response_format": {"type": "structural_tag"}}, "response_format.type", "not supported"),
    ],
)
def test_a_bad_constraint_is_a_400_naming_the_field_the_request_used(server, extra, param, says):
    refused = httpx.post(
        f"{server}/v1/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": MODEL, "prompt": "x", "max_tokens": 4, **extra},
    )
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == param and says in error["message"], error


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK_TOOL = {
    "type": "function",
    "function": {"name": "now", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
}


def _streamed_calls(chunks) -> tuple[list[dict], str | None]:
    """The calls an openai client's stream assembles (by index: id and name first, arguments appended)."""
    calls, reason = {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)], reason


def test_tool_choice_required_and_named_return_parsed_calls_streamed_or_not(client):
    import jsonschema

    ask = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "weather in Paris?"}],
        "max_tokens": 300,
        "temperature": 1.0,
        "tools": [WEATHER_TOOL, CLOCK_TOOL],
    }
    schemas = {"get_weather": WEATHER_TOOL["function"]["parameters"], "now": CLOCK_TOOL["function"]["parameters"]}
    for seed in range(3):
        whole = client.chat.completions.create(**ask, tool_choice="required", seed=seed).choices[0]
        assert whole.finish_reason == "tool_calls" and whole.message.tool_calls
        for call in whole.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        streamed, reason = _streamed_calls(
            client.chat.completions.create(**ask, tool_choice="required", seed=seed, stream=True)
        )
        assert reason == "tool_calls"
        assert streamed == [
            {"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls
        ]
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = client.chat.completions.create(**ask, tool_choice=named, seed=9).choices[0]
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather" and whole.finish_reason == "stop"
    jsonschema.validate(json.loads(call.function.arguments), schemas["get_weather"])
    streamed, _ = _streamed_calls(client.chat.completions.create(**ask, tool_choice=named, seed=9, stream=True))
    assert streamed == [{"name": "get_weather", "arguments": call.function.arguments}]


def test_tool_choice_auto_parses_what_the_model_writes(client):
    """A Hermes-style call (the model held to one by a regex, as a trained model would write it)."""
    ask = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "time?"}],
        "max_tokens": 60,
        "temperature": 0,
        "tools": [WEATHER_TOOL, CLOCK_TOOL],
        "extra_body": {"guided_regex": r'Checking\.\n<tool_call>\n\{"name": "now", "arguments": \{\}\}\n</tool_call>'},
    }
    whole = client.chat.completions.create(**ask).choices[0]
    assert whole.message.content == "Checking." and whole.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == [("now", "{}")]
    chunks = list(client.chat.completions.create(**ask, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip() == "Checking."
    assert _streamed_calls(chunks) == ([{"name": "now", "arguments": "{}"}], "tool_calls")


def _vllm_fields():
    with open(os.path.join(DATA, "vllm_request_fields.json")) as f:
        table = json.load(f)
    return [
        (path, name, default)
        for path in ("/v1/completions", "/v1/chat/completions")
        for name, default in table[path].items()
        if name not in ("model", "prompt", "messages")
    ]


def test_every_field_vllm_accepts_is_served_or_refused_by_name(server):
    """vLLM 0.32's request fields (tools/vllm_request_fields.py), each sent with vLLM's default: 200, or
    a 400 whose param is that field. Never a 500, never an error about something else."""
    base = {
        "/v1/completions": {"model": MODEL, "prompt": "x", "max_tokens": 2},
        "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
    }
    served, refused = [], []
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        for path, name, default in _vllm_fields():
            reply = http.post(path, json={**base[path], name: default})
            if reply.status_code == 200:
                served.append(name)
                continue
            assert reply.status_code == 400, (path, name, reply.status_code, reply.text)
            assert reply.json()["error"]["param"] == name, (path, name, reply.json())
            refused.append(name)
    for name in (
        "n",
        "logit_bias",
        "echo",
        "response_format",
        "structured_outputs",
        "tools",
        "tool_choice",
        "seed",
        "top_k",
        "min_p",
        "stop_token_ids",
        "chat_template_kwargs",
        "stream_options",
    ):
        assert name in served, name
    print(f"vLLM's fields: {len(set(served))} served, refused by name: {sorted(set(refused))}")


def test_echo_puts_the_prompt_first(server, client):
    ask = {"model": MODEL, "prompt": "def main():", "max_tokens": 4, "temperature": 0}
    plain = client.completions.create(**ask).choices[0].text
    assert client.completions.create(**ask, echo=True).choices[0].text == "def main():" + plain
    streamed = "".join(c.choices[0].text for c in client.completions.create(**ask, echo=True, stream=True) if c.choices)
    assert streamed == "def main():" + plain
    ids = _post(server, "/tokenize", {"prompt": "def main():"}).json()["tokens"]
    echoed = client.completions.create(**{**ask, "prompt": ids}, echo=True).choices[0].text
    assert echoed == _post(server, "/detokenize", {"tokens": ids}).json()["prompt"] + plain


def test_prompt_logprobs_score_every_prompt_token_in_vllms_shape(server, client):
    """prompt_logprobs = 2 with n = 2: each choice has vLLM's list (null, then per prompt token its
    own entry with logprob, rank and decoded text, and the top 2), the same for both choices; the
    chat form scores its rendered prompt, once."""
    prompt = "def main(): return 42"
    ids = _post(server, "/tokenize", {"prompt": prompt}).json()["tokens"]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "n": 2, "prompt_logprobs": 2}
    choices = _post(server, "/v1/completions", body).json()["choices"]
    scores = choices[0]["prompt_logprobs"]
    assert choices[1]["prompt_logprobs"] == scores
    assert len(scores) == len(ids) and scores[0] is None
    for token, entry in zip(ids[1:], scores[1:], strict=True):
        own = entry[str(token)]
        assert own["decoded_token"] == _post(server, "/detokenize", {"tokens": [token]}).json()["prompt"]
        assert own["logprob"] <= 0 and own["rank"] >= 1
        best = sorted(entry.values(), key=lambda e: e["rank"])
        assert [e["rank"] for e in best][:2] == [1, 2] and best[0]["logprob"] >= own["logprob"]
        assert len(entry) in (2, 3)  # the top 2, and the prompt's own token unless it is one of them
    assert (
        "prompt_logprobs"
        not in _post(server, "/v1/completions", {**body, "prompt_logprobs": None}).json()["choices"][0]
    )
    chat = _post(server, "/v1/chat/completions", {**CHAT, "prompt_logprobs": 1}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None


def test_echo_with_logprobs_scores_the_prompt_too(server, client):
    """OpenAI's legacy echo + logprobs: the prompt's tokens first (the first without a logprob), then
    the answer's, with text offsets across both; streamed, the echo chunk brings the same scores."""
    ask = {"model": MODEL, "prompt": "def main(): return 42", "max_tokens": 3, "temperature": 0, "logprobs": 2}
    ids = _post(server, "/tokenize", {"prompt": ask["prompt"]}).json()["tokens"]
    plain = client.completions.create(**ask).choices[0]
    echoed = client.completions.create(**ask, echo=True).choices[0]
    lp = echoed.logprobs
    assert echoed.text == ask["prompt"] + plain.text
    assert len(lp.tokens) == len(ids) + len(plain.logprobs.tokens)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(p <= 0 for p in lp.token_logprobs[1:])
    assert lp.token_logprobs[len(ids) :] == plain.logprobs.token_logprobs
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert lp.text_offset[len(ids)] == len(ask["prompt"])
    scored = _post(server, "/v1/completions", {**ask, "prompt_logprobs": 2}).json()["choices"][0]["prompt_logprobs"]
    assert lp.token_logprobs[1 : len(ids)] == [
        entry[str(t)]["logprob"] for t, entry in zip(ids[1:], scored[1:], strict=False)
    ]
    chunks = [c.choices[0] for c in client.completions.create(**ask, echo=True, stream=True) if c.choices]
    assert chunks[0].text == ask["prompt"]
    assert chunks[0].logprobs.token_logprobs == lp.token_logprobs[: len(ids)]
    assert "".join(c.text for c in chunks) == echoed.text


def test_several_prompts_in_one_completions_request(client):
    """A list of prompts (text or token ids) with n = 2: choice 2 p + i is prompt p's choice i."""
    ids = client.completions.create(model=MODEL, prompt="hello", max_tokens=1).usage.prompt_tokens
    ask = {"model": MODEL, "max_tokens": 5, "temperature": 1.0, "seed": 11}
    out = client.completions.create(**ask, prompt=["def main():", "hello", [5, 6, 7]], n=2)
    assert [c.index for c in out.choices] == list(range(6))
    assert out.choices[2].text == client.completions.create(**ask, prompt="hello").choices[0].text
    assert out.choices[5].text == client.completions.create(**{**ask, "seed": 12}, prompt=[5, 6, 7]).choices[0].text
    single = client.completions.create(**ask, prompt="def main():")
    assert out.usage.prompt_tokens == single.usage.prompt_tokens + ids + 3
    assert out.usage.completion_tokens == 30


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
            return await asyncio.gather(
                *(
                    http.post(f"{server}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
                    for _ in range(100)
                )
            )

    codes = [r.status_code for r in asyncio.run(burst())]
    assert 429 in codes and 200 in codes, codes
    assert all(r in (200, 429) for r in codes)


def test_binds_localhost_by_default():
    from fdcore.config import parse_config

    assert parse_config("[server]\nenabled = true\n", check_model=False).server.host == "127.0.0.1"


@pytest.mark.parametrize(
    "text, serves",
    [
        ("[server]\nport = 8123\n", True),
        ("[server]\nport = 8123\nenabled = false\n", False),
        ('[server]\nhost = "0.0.0.0"\n', False),
        ("", False),
    ],
)
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
    with httpx.stream(
        "POST", f"{server}/v1/completions", json={**body, "stream": True}, headers=headers, timeout=120
    ) as response:
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


TENANTS_SEEN: list[str] = []


def test_each_request_is_its_peers_tenant():
    """The HTTP server is one client of the engine; the tenant it gives each request (the scheduler's
    unit of fair sharing) is the request's peer address."""
    from starlette.testclient import TestClient

    app, _ = _stand_in_app()
    TENANTS_SEEN.clear()
    for peer in ("10.1.2.3", "10.9.9.9"):
        assert TestClient(app, client=(peer, 5000)).post("/v1/completions", json={**OK, "n": 2}).status_code == 200
    assert TENANTS_SEEN == ["10.1.2.3"] * 2 + ["10.9.9.9"] * 2


def _stand_in_app(default_max_tokens=None, reasoning_parser="", pieces=("ok",)):
    """The HTTP app before a stand-in engine that records what it is asked and answers ``pieces``, one
    output each (no tree needed)."""
    from fdcore.client import CompletionOutput, RequestOutput
    from fdcore.server.app import Settings, build_app

    seen = []

    class Engine:
        async def generate(self, prompt, params, request_id=None, tenant=""):
            seen.append((prompt, params))
            TENANTS_SEEN.append(tenant)
            for i, piece in enumerate(pieces):
                last = i == len(pieces) - 1
                yield RequestOutput(
                    "r", prompt, [1, 2], CompletionOutput(0, piece, [5], None, "stop" if last else None), last
                )

    settings = Settings(MODEL, 2048, default_max_tokens=default_max_tokens, reasoning_parser=reasoning_parser)
    return build_app(Engine(), settings, None, lambda: (True, ""), dict), seen


@pytest.mark.parametrize(
    "path, field, value, status",
    [
        ("/v1/completions", "use_beam_search", True, 400),
        ("/v1/completions", "use_beam_search", False, 200),
        ("/v1/completions", "skip_special_tokens", False, 400),
        ("/v1/completions", "add_special_tokens", False, 400),
        ("/v1/chat/completions", "add_special_tokens", False, 200),
        ("/v1/chat/completions", "parallel_tool_calls", True, 200),
        ("/v1/chat/completions", "parallel_tool_calls", False, 400),
        ("/v1/chat/completions", "echo", True, 400),
        ("/v1/chat/completions", "presence_penalty", None, 200),
        ("/v1/chat/completions", "top_logprobs", 0, 200),
    ],
)
def test_vllm_fields_are_served_at_the_value_fdcore_honours_and_refused_at_any_other(path, field, value, status):
    from starlette.testclient import TestClient

    app, _ = _stand_in_app()
    body = {**(CHAT if "chat" in path else OK), field: value}
    reply = TestClient(app).post(path, json=body)
    assert reply.status_code == status, reply.text
    if status == 400:
        assert reply.json()["error"]["param"] == field and "not supported" in reply.json()["error"]["message"]


@pytest.mark.parametrize(
    "parser, pieces, reasoning, content",
    [
        ("qwen3", ["<thi", "nk>\nWhich", " city?</th", "ink>\n\nParis."], "\nWhich city?", "Paris."),
        ("qwen3", ["Paris", "."], None, "Paris."),
        ("deepseek_r1", ["Which city?", "</think>", "Paris."], "Which city?", "Paris."),
        ("deepseek_r1", ["still thinking"], "still thinking", None),
    ],
)
def test_reasoning_content_apart_from_the_answer_streamed_or_not(parser, pieces, reasoning, content):
    from starlette.testclient import TestClient

    app, _ = _stand_in_app(reasoning_parser=parser, pieces=pieces)
    http = TestClient(app)
    message = http.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (reasoning, content)
    with http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as events:
        deltas = [
            json.loads(line[6:])["choices"][0]["delta"] for line in events.iter_lines() if line.startswith("data: {")
        ]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == (reasoning or "")
    assert "".join(d.get("content", "") for d in deltas) == (content or "")


def test_chat_template_fields_reach_the_engine_and_unset_sampling_stays_unset():
    from starlette.testclient import TestClient

    app, seen = _stand_in_app()
    http = TestClient(app)
    tools = [{"type": "function", "function": {"name": "now", "parameters": {}}}]
    options = {
        "tools": tools,
        "tool_choice": "auto",
        "documents": [{"title": "t", "text": "x"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
        "chat_template_kwargs": {"think": 1},
    }
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
    assert (
        http.post("/v1/chat/completions", json={**CHAT, "tool_choice": "required", "tools": tools}).status_code == 200
    )
    assert '"now"' in json.dumps(msgspec.to_builtins(seen[-1][1].structured_outputs))  # held to a call of "now"
    refused = http.post(
        "/v1/chat/completions", json={**CHAT, "tool_choice": "required", "tools": tools, "guided_regex": "x"}
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tool_choice"
    app, seen = _stand_in_app(default_max_tokens=7)
    assert TestClient(app).post("/v1/chat/completions", json={**CHAT, "max_tokens": None}).status_code == 200
    assert seen[-1][1].max_tokens == 7  # the model's max_new_tokens


# ---------------------------------------------------------------- abuse
def _metric(server, name: str) -> float:
    text = httpx.get(f"{server}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith((name + " ", name + "{")))


def _request_bytes(body: dict) -> bytes:
    raw = json.dumps(body).encode()
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n"
    ).encode() + raw


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
        for _stream, early, _, writer in conns:
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

    _expect_aborts(server, before, 64, asyncio.run(scenario()), within=1.0)


def test_clients_of_several_choices_that_disconnect_abort_every_choice(server):
    """8 clients with n = 4 (streamed or whole) leave mid-request: all 32 choices are aborted and counted."""
    import asyncio

    host, port = server.removeprefix("http://").split(":")
    aborts = 'fdcore_requests_total{outcome="abort"}'
    before = _metric(server, aborts)

    async def scenario():
        conns = []
        for i in range(8):
            reader, writer = await asyncio.open_connection(host, int(port))
            body = {**OK, "max_tokens": 2000, "ignore_eos": True, "stream": i % 2 == 0, "n": 4}
            writer.write(_request_bytes(body))
            await writer.drain()
            conns.append((i % 2 == 0, reader, writer))
        for stream, reader, _ in conns:
            if stream:  # a first token has come
                while b"data: " not in await reader.readline():
                    pass
        for _, _, writer in conns:
            writer.close()
        return time.monotonic()

    _expect_aborts(server, before, 32, asyncio.run(scenario()), within=2.0)


def _expect_aborts(server, before: float, count: int, closed: float, within: float) -> None:
    """``count`` more aborts counted, and nothing running, within ``within`` s of ``closed``."""
    aborts = 'fdcore_requests_total{outcome="abort"}'
    while _metric(server, aborts) < before + count:
        assert time.monotonic() - closed < within, (
            f"{_metric(server, aborts) - before} of {count} aborts after {within} s"
        )
    while _metric(server, "fdcore_requests_running") > 0:
        assert time.monotonic() - closed < within, f"aborted requests still run after {within} s"
    assert _metric(server, aborts) == before + count


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
    from fdcore.config import parse_config
    from fdcore.server.actor import chat_max_tokens

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
    length = int(
        next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    )
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


HALF_REQUESTS = {
    "head": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-",
    "body": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: 100000\r\n\r\n{",
}


def _closed_by_server(sock) -> bool:
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("half", HALF_REQUESTS)
def test_sockets_that_never_finish_a_request_deny_service_to_no_one(server, half):
    """1,100 connections that send half a request head (or a whole head and one byte of a 100 KB body)
    and hold on, more than the server keeps (max_connections = 300): a real request meanwhile is served
    at once. They are not requests (admission counts requests), the oldest give way to new connections,
    and the rest are closed by the head (or body) deadline."""
    host, port = server.removeprefix("http://").split(":")
    socks = []
    try:
        for _ in range(1100):
            sock = socket.create_connection((host, int(port)), timeout=10)
            sock.sendall(HALF_REQUESTS[half])
            socks.append(sock)
        started = time.monotonic()
        assert _post(server, "/v1/completions", OK).status_code == 200
        assert time.monotonic() - started < 2.0
        assert all(_closed_by_server(sock) for sock in socks)
    finally:
        for sock in socks:
            sock.close()


def test_a_response_too_large_to_build_is_refused_before_any_work(server):
    """Issue 43's heavy requests: 64 choices of a 2,040-token prompt echoed and scored with 20 logprobs,
    and 64 chat choices of 2,000 tokens with 20 top logprobs: a 400 naming the size, the engine never asked."""
    prompt = [5 + (i * 37) % 4000 for i in range(2040)]
    heavy = [
        ("/v1/completions", {**OK, "prompt": prompt, "n": 64, "echo": True, "logprobs": 20, "prompt_logprobs": 20}),
        ("/v1/completions", {**OK, "prompt": "word " * 1500, "n": 64, "prompt_logprobs": 20}),
        ("/v1/chat/completions", {**CHAT, "n": 64, "logprobs": True, "top_logprobs": 20, "max_tokens": 2000}),
        (
            "/v1/chat/completions",
            {**CHAT, "n": 10, "logprobs": True, "top_logprobs": 20, "max_tokens": 1000, "prompt_logprobs": 20},
        ),
    ]
    before = _metric(server, 'fdcore_requests_total{outcome="error"}')
    for path, body in heavy:
        started = time.monotonic()
        refused = _post(server, path, body)
        assert refused.status_code == 400, refused.text[:300]
        assert "server.max_response_entries" in refused.json()["error"]["message"]
        assert refused.json()["error"]["param"] == "n"
        assert time.monotonic() - started < 2.0
    assert _metric(server, 'fdcore_requests_total{outcome="error"}') == before  # no engine request was made
    # 1,501 tokens: their bound (the context) is over budget, their count is not
    fits = {**OK, "prompt": "word " * 1500, "n": 5, "prompt_logprobs": 20, "max_tokens": 1}
    assert _post(server, "/v1/completions", fits).status_code == 200


def test_a_large_answer_is_built_off_the_event_loop(server):
    """16 choices x 1,500 tokens x 6 logprobs (144,000 entries, within the budget): while the answer is
    made, the server keeps answering /health at once."""
    import threading

    body = {**OK, "prompt": [5, 6, 7], "n": 16, "logprobs": 5, "max_tokens": 1500, "ignore_eos": True}
    done = []
    thread = threading.Thread(target=lambda: done.append(_post(server, "/v1/completions", body)))
    thread.start()
    worst = 0.0
    while thread.is_alive():
        started = time.monotonic()
        assert httpx.get(f"{server}/health", timeout=30).status_code == 200
        worst = max(worst, time.monotonic() - started)
        time.sleep(0.02)
    thread.join()
    assert done[0].status_code == 200 and len(done[0].json()["choices"]) == 16
    assert worst < 0.5, f"/health waited {worst:.2f} s while the answer was built"


def test_metrics_are_a_snapshot_at_most_a_second_old():
    """A flood of scrapes asks the engine at most once a second (concurrent ones share one question)."""
    import asyncio

    from fdcore.server.app import StatsSnapshot

    asked = []

    async def fetch():
        asked.append(time.monotonic())
        await asyncio.sleep(0.01)
        return len(asked)

    async def main():
        snapshot = StatsSnapshot(fetch, max_age=0.3)
        first = await asyncio.gather(*(snapshot.get() for _ in range(50)))
        again = [await snapshot.get() for _ in range(20)]
        await asyncio.sleep(0.35)
        return first, again, await snapshot.get()

    first, again, later = asyncio.run(main())
    assert first == [1] * 50 and again == [1] * 20 and later == 2 and len(asked) == 2


def test_requests_beyond_the_limit_get_503_with_retry_after():
    """limit_concurrency counts requests being served (not sockets): one past it is refused at once."""
    import asyncio

    from fdcore.server.http import RequestAdmission

    release = asyncio.Event()
    served = []

    async def app(scope, receive, send):
        served.append(scope["path"])
        await release.wait()

    async def main():
        admission = RequestAdmission(app, 2, 1000)
        sent = []

        async def send(message):
            sent.append(message)

        async def whole():
            return {"type": "http.request", "body": b"{}", "more_body": False}

        never = asyncio.Event()

        async def slow_body():  # a client that never sends its body: not a request yet
            await never.wait()

        scope = {"type": "http", "path": "/x"}
        waiting = [asyncio.ensure_future(admission(scope, slow_body, send)) for _ in range(5)]
        busy = [asyncio.ensure_future(admission(scope, whole, send)) for _ in range(2)]
        await asyncio.sleep(0.01)
        await admission(scope, whole, send)
        release.set()
        await asyncio.gather(*busy)
        await admission(scope, whole, send)
        for task in waiting:
            task.cancel()
        return sent

    sent = asyncio.run(main())
    assert len(served) == 3 and sent[0]["status"] == 503 and (b"retry-after", b"1") in sent[0]["headers"]
    assert b"limit_concurrency" in sent[1]["body"]


def test_the_api_heartbeat_ticks_from_the_event_loop():
    """A loop wedged by a blocking call must stop the heartbeat, so the supervisor sees a hang."""
    import asyncio
    import itertools

    from fdcore.config import parse_config
    from fdcore.server.actor import ApiActor

    ticks = []

    class Board:
        def write(self, slot, field, value):
            ticks.append(time.monotonic())

    class WedgingServer:
        async def serve(self, sockets=None):
            await asyncio.sleep(0.2)
            time.sleep(0.6)
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

    from fdcore.server.actor import listening_socket

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


def test_choices_started_before_their_client_left_are_aborted_and_counted():
    """n = 3: one choice has its first output, two wait for theirs, and the client leaves. The started
    choice's stream is closed (aborting it in the engine), and all three are counted as aborts."""
    import asyncio
    import types

    from fdcore.server.app import _Api
    from fdcore.server.metrics import ServerMetrics

    closed: list[int] = []

    class OneAnswersLLM:
        def __init__(self):
            self.answered = asyncio.Event()

        def generate(self, prompt, index, request_id=None, tenant=""):
            return self.stream(index)

        async def stream(self, index):
            try:
                if index != 0:
                    await asyncio.Event().wait()  # no first output before the client leaves
                self.answered.set()  # start() returns in this same step: nothing is awaited in between
                yield types.SimpleNamespace(finished=False, outputs=types.SimpleNamespace(finish_reason=None))
                await asyncio.Event().wait()
            finally:
                closed.append(index)

    metrics = ServerMetrics()

    async def scenario():
        llm = OneAnswersLLM()
        api = _Api(llm, settings=None, tokenizer=None, metrics=metrics)
        work = asyncio.ensure_future(api.start_all([("p", 0), ("p", 1), ("p", 2)]))
        await llm.answered.wait()
        work.cancel()
        with pytest.raises(asyncio.CancelledError):
            await work

    asyncio.run(scenario())
    assert sorted(closed) == [0, 1, 2]
    assert metrics.requests.labels("abort")._value.get() == 3
