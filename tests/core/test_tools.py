"""Tool calls: what each tool_choice holds the output to, and the calls parsed out of it, whole or
streamed in pieces (the same calls and content either way)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fdcore.server.schemas import BadRequest
from fdcore.server.tools import ToolStream, plan_of

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "now", "description": "the time"}}
TOOLS = [WEATHER, TIME]


def calls_of(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            None,
            [("get_weather", {"city": "Paris"})],
        ),
        (
            'Let me look.\n<tool_call>{"name": "now", "arguments": {}}</tool_call>\n<tool_call>{"name": "get_weather", '
            '"arguments": {"city": "Oslo"}}</tool_call>',
            "Let me look.",
            [("now", {}), ("get_weather", {"city": "Oslo"})],
        ),
        ('<tool_call>{"name": "now", "arguments": "{}"}', None, [("now", {})]),  # EOS before the closing tag
        ('{"name": "get_weather", "parameters": {"city": "Rome"}}', None, [("get_weather", {"city": "Rome"})]),
        (
            '<|python_tag|>{"name": "now", "parameters": {}}; {"name": "now", "parameters": {}}',
            None,
            [("now", {}), ("now", {})],
        ),
        ('{"name": "launch_rockets", "parameters": {}}', '{"name": "launch_rockets", "parameters": {}}', []),
        (
            '<tool_call>{"name": "now", "arguments": {</tool_call>',
            '<tool_call>{"name": "now", "arguments": {</tool_call>',
            [],
        ),
        ("It is sunny {mostly}.", "It is sunny {mostly}.", []),
    ],
)
def test_auto_parses_hermes_and_llama3_calls_streamed_or_not(text, content, calls):
    plan = plan_of(TOOLS, "auto")
    got_content, got_calls = plan.split(text)
    assert (got_content, calls_of(got_calls)) == (content, calls)
    rng = np.random.default_rng(len(text))
    for _ in range(20):  # the same text in random pieces, as the engine streams it
        cuts = sorted(rng.choice(range(1, len(text)), size=min(6, len(text) - 1), replace=False))
        stream, deltas = ToolStream(plan), []
        for piece in np.split(np.array(list(text)), cuts):
            deltas += stream.feed("".join(piece))
        due, called = stream.finish()
        deltas += due
        streamed = "".join(d.get("content", "") for d in deltas)
        streamed_calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
        assert called == bool(calls)
        assert calls_of(streamed_calls) == calls
        assert [d["tool_calls"][0]["index"] for d in deltas if "tool_calls" in d] == list(range(len(calls)))
        assert streamed.strip() == (content or "")


def test_required_holds_the_output_to_an_array_of_known_calls():
    plan = plan_of(TOOLS, "required")
    schema = plan.constraint().json
    assert schema["minItems"] == 1
    assert [option["properties"]["name"]["const"] for option in schema["items"]["anyOf"]] == ["get_weather", "now"]
    assert plan.constraint().json["items"]["anyOf"][0]["properties"]["parameters"] == WEATHER["function"]["parameters"]
    content, calls = plan.split(
        '[{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Lima"}}]'
    )
    assert content is None and calls_of(calls) == [("now", {}), ("get_weather", {"city": "Lima"})]
    assert plan.split('[{"name": "now", "param') == ('[{"name": "now", "param', [])  # cut short: content


def test_a_named_function_streams_its_arguments():
    plan = plan_of(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert plan.constraint().json == WEATHER["function"]["parameters"]
    stream = ToolStream(plan)
    deltas = stream.feed('{"city": ') + stream.feed('"Kyiv"}') + stream.finish()[0]
    header = deltas[0]["tool_calls"][0]
    assert header["function"] == {"name": "get_weather", "arguments": ""} and header["id"].startswith("call_")
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == '{"city": "Kyiv"}'
    assert plan_of(TOOLS, "none").split("plain") == ("plain", [])


@pytest.mark.parametrize(
    "tools, choice, param",
    [
        (None, "required", "tool_choice"),
        ([{"type": "function"}], "auto", "tools[0]"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "auto", "tools[0].function.parameters"),
        (TOOLS, {"type": "function", "function": {"name": "missing"}}, "tool_choice.function.name"),
        (TOOLS, "sometimes", "tool_choice"),
    ],
)
def test_bad_tools_or_choices_name_the_field(tools, choice, param):
    with pytest.raises(BadRequest) as caught:
        plan_of(tools, choice)
    assert caught.value.param == param
