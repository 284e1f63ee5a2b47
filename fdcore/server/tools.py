"""Tool calling for chat requests: OpenAI's ``tools`` and ``tool_choice``.

- ``none``: the template sees the tools, the output is content.
- ``auto`` (the default when tools are given): the model decides; calls are parsed out of its text,
  in the two styles chat templates teach: Hermes / Qwen (``<tool_call>{"name", "arguments"}
  </tool_call>``, as many as it writes) and Llama 3 (the whole answer one JSON object ``{"name",
  "parameters"}``, after an optional ``<|python_tag|>``). Text that does not parse stays content.
- ``required``: the output is constrained (a JSON schema) to a non-empty array of calls of the given
  tools with their parameters' schemas, so it always parses.
- a named function: the output is constrained to that function's parameters; it is the call's
  arguments.

Streaming (:class:`ToolStream`): content is sent as it comes, except what may be the start of a
call (held back until it is clearly not); a call is sent whole once the output ends (its arguments in
one delta, which the openai client assembles like any other). A named function's arguments stream
as they are drawn.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from fdcore.protocol import StructuredOutputs
from fdcore.server.reasoning import tag_prefix
from fdcore.server.schemas import BadRequest

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES = re.compile(re.escape(HERMES_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(HERMES_CLOSE) + r"|$)", re.S)


@dataclass
class ToolPlan:
    """How one chat request's tools are used: ``mode`` none / auto / required / named."""

    mode: str = "none"
    tools: dict[str, dict] = field(default_factory=dict)  # name -> the function's JSON schema of parameters
    named: str | None = None

    def constraint(self) -> StructuredOutputs | None:
        """What the output is held to (required and named only)."""
        if self.mode == "named":
            return StructuredOutputs(json=self.tools[self.named])
        if self.mode == "required":
            calls = [
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "parameters": parameters},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for name, parameters in self.tools.items()
            ]
            return StructuredOutputs(json={"type": "array", "minItems": 1, "items": {"anyOf": calls}})
        return None

    def split(self, text: str) -> tuple[str | None, list[dict]]:
        """A whole output as (content, tool calls)."""
        if self.mode == "named":
            return None, [tool_call(self.named, text)]
        if self.mode == "required":
            try:
                return None, [
                    tool_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in json.loads(text)
                ]
            except (ValueError, TypeError, KeyError):  # cut short by max_tokens: what it wrote is content
                return text, []
        if self.mode == "auto":
            return self._parse(text)
        return text, []

    def _parse(self, text: str) -> tuple[str | None, list[dict]]:
        if HERMES_OPEN in text:
            calls = [self._call(json_text) for json_text in _HERMES.findall(text)]
            if calls and all(calls):
                content = _HERMES.sub("", text).strip()
                return content or None, calls
            return text, []
        stripped = text.strip()
        if stripped.startswith(PYTHON_TAG):
            stripped = stripped[len(PYTHON_TAG) :].strip()
        if stripped.startswith("{"):
            calls = [self._call(part) for part in stripped.split(";")]
            if all(calls):
                return None, calls
        return text, []

    def _call(self, json_text: str) -> dict | None:
        """A call the model wrote, if it is one: a known tool's name and an object of arguments."""
        try:
            call = json.loads(json_text)
        except ValueError:
            return None
        if not isinstance(call, dict) or call.get("name") not in self.tools:
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):
            return tool_call(call["name"], arguments)
        return tool_call(call["name"], json.dumps(arguments, ensure_ascii=False))


def tool_call(name: str, arguments: str) -> dict:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def plan_of(tools: list[dict] | None, tool_choice) -> ToolPlan:
    """The request's ToolPlan; a malformed tool or choice is a BadRequest naming it."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise BadRequest("tool_choice is only allowed when tools are given", "tool_choice")
        return ToolPlan()
    schemas = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise BadRequest(f"tools[{i}] must be {{type: function, function: {{name, parameters}}}}", f"tools[{i}]")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise BadRequest(
                f"tools[{i}].function.parameters must be a JSON schema object", f"tools[{i}].function.parameters"
            )
        schemas[function["name"]] = parameters
    if tool_choice in (None, "auto"):
        return ToolPlan("auto", schemas)
    if tool_choice in ("none", "required"):
        return ToolPlan(tool_choice, schemas)
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) and tool_choice.get("type") == "function" else None
    if not isinstance(name, str):
        raise BadRequest(
            f"tool_choice {tool_choice!r} is not none, auto, required or {{type: function, function: {{name}}}}",
            "tool_choice",
        )
    if name not in schemas:
        raise BadRequest(f"tool_choice names {name!r}, which is not one of the tools", "tool_choice.function.name")
    return ToolPlan("named", schemas, name)


class ToolStream:
    """One streamed choice's deltas: ``feed(text)`` as output arrives, ``finish()`` at its end."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.held = ""  # text not sent yet (a possible call, or all of a required answer)
        self.in_call = False  # auto: a call has begun; everything from there waits for the end
        self.sent = False  # auto: content went out (a Llama 3 call can only be the whole answer)
        self.opened = False  # named: the call's header went out

    def feed(self, text: str) -> list[dict]:
        if self.plan.mode == "named":
            return self._arguments(text)
        if self.plan.mode == "none":
            return [{"content": text}] if text else []
        self.held += text
        if self.plan.mode == "required" or self.in_call:
            return []
        return self._auto_content()

    def _arguments(self, text: str) -> list[dict]:
        deltas = [] if self.opened else [{"tool_calls": [{"index": 0, **tool_call(self.plan.named, "")}]}]
        self.opened = True
        return deltas + ([{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}] if text else [])

    def _auto_content(self) -> list[dict]:
        """Content that cannot be part of a call is sent; a call's start (or what may become one) is held."""
        at = self.held.find(HERMES_OPEN)
        if at < 0 and not self.sent and _may_open(self.held.lstrip()):
            at = len(self.held) - len(self.held.lstrip())  # a Llama 3 call (or its tag) leads the answer
        if at < 0:
            at = len(self.held) - tag_prefix(self.held, HERMES_OPEN)
        else:
            self.in_call = True
        sent, self.held = self.held[:at], self.held[at:]
        self.sent = self.sent or bool(sent.strip())
        return [{"content": sent}] if sent else []

    def finish(self) -> tuple[list[dict], bool]:
        """The deltas still due, and whether the choice made calls (its finish_reason is then tool_calls)."""
        if self.plan.mode == "named":
            return self._arguments(""), False
        if not self.held:
            return [], False
        content, calls = self.plan.split(self.held)
        deltas = [{"content": content}] if content else []
        for i, call in enumerate(calls):
            deltas.append({"tool_calls": [{"index": i, **call}]})
        self.held = ""
        return deltas, bool(calls)


def _may_open(text: str) -> bool:
    """Could an answer that starts so be a Llama 3 call (``{"name"...`` or ``<|python_tag|>``)?"""
    return bool(text) and (text.startswith("{") or text.startswith(PYTHON_TAG[: len(text)]))
