"""Chat templates as Hugging Face transformers finds, compiles and renders them.

Where a checkpoint keeps them (transformers' rules):

- ``chat_template.jinja`` (written since transformers 4.43) is the default template, and
  ``additional_chat_templates/NAME.jinja`` (transformers 5) are named ones. Template *files*, when
  there are any, replace whatever ``tokenizer_config.json`` holds.
- ``chat_template.json`` (``{"chat_template": ...}``, the processors' legacy file) stands in for
  ``chat_template.jinja`` when that is missing.
- ``tokenizer_config.json``'s ``chat_template``: one template, or a list of ``{name, template}``.

Which one a request gets is transformers' ``get_chat_template`` rule: the one it names; else
``tool_use`` when the request gives tools (even an empty list) and the model has one; else
``default``.

Every template is compiled once, at start-up, in jinja2's immutable sandbox with what transformers
gives templates (trim_blocks, lstrip_blocks, loop controls, ``raise_exception``, ``strftime_now``,
its ``tojson``, ``{% generation %}``, a safer ``dict`` and ``namespace``). One that does not compile
is a :class:`CheckpointError` naming its file: the engine cannot start, and the supervisor says why
instead of restarting it forever. A template that fails on one request's messages is that
request's error (:class:`RequestError` naming ``messages``), whatever it raised.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any, NoReturn, cast

from fdcore.checkpoint import CheckpointError, read_json_object
from fdcore.core.validation import RequestError

if TYPE_CHECKING:
    from jinja2 import Template, nodes
    from jinja2.ext import Extension
    from jinja2.parser import Parser
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace

CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker for the end of the continued message
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    source: str  # the file it came from (named in errors)
    text: str
    compiled: Template  # a jinja2 Template


class ChatTemplates:
    """A checkpoint's chat templates by name, each compiled."""

    def __init__(self, path: str, templates: dict[str, ChatTemplate]):
        self.path = path
        self.templates = templates

    @classmethod
    def load(cls, path: str, tokenizer_config: dict[str, Any]) -> ChatTemplates:
        found = find_templates(path, tokenizer_config)
        return cls(
            path,
            {
                name: ChatTemplate(name, source, text, compile_template(text, source))
                for name, (text, source) in found.items()
            },
        )

    def select(self, name: str | None = None, tools: list[Any] | None = None) -> ChatTemplate:
        """transformers' choice: the named one; else tool_use when tools are given; else default."""
        if not self.templates:
            raise RequestError(
                "messages",
                f"the model at {self.path} has no chat template (chat_template.jinja, "
                "chat_template.json or tokenizer_config.json); send a prompt instead",
            )
        if name is not None:
            if name not in self.templates:
                raise RequestError(
                    "chat_template",
                    f"the model has no chat template named {name!r} (it has: {', '.join(sorted(self.templates))})",
                )
            return self.templates[name]
        if tools is not None and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" not in self.templates:
            raise RequestError(
                "chat_template",
                f"the model has several chat templates and no default: name one of {', '.join(sorted(self.templates))}",
            )
        return self.templates["default"]


# ----------------------------------------------------------------- discovery
def find_templates(path: str, tokenizer_config: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """{name: (template text, source file)} as transformers would load them from ``path`` (a GGUF
    file: its ``tokenizer.chat_template`` metadata, passed here as the setting)."""
    if os.path.isfile(path):
        return _from_setting(tokenizer_config.get("chat_template"), f"{path} (tokenizer.chat_template)")
    files = _template_files(path)
    if files:
        return files
    legacy = os.path.join(path, "tokenizer_config.json")
    return _from_setting(tokenizer_config.get("chat_template"), legacy)


def _template_files(path: str) -> dict[str, tuple[str, str]]:
    found = {}
    jinja_file = os.path.join(path, "chat_template.jinja")
    json_file = os.path.join(path, "chat_template.json")
    if os.path.isfile(jinja_file):
        found["default"] = (_read_text(jinja_file), jinja_file)
    elif os.path.isfile(json_file):
        found.update(_from_setting(read_json_object(json_file).get("chat_template"), json_file))
    for file in sorted(glob.glob(os.path.join(path, "additional_chat_templates", "*.jinja"))):
        found[os.path.basename(file).removesuffix(".jinja")] = (_read_text(file), file)
    return found


def _from_setting(value: Any, source: str) -> dict[str, tuple[str, str]]:
    """A ``chat_template`` entry: None, a string, or a list of {name, template}."""
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": (value, source)}
    if isinstance(value, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in value
    ):
        return {t["name"]: (t["template"], source) for t in value}
    raise CheckpointError(f"{source}: chat_template must be a string or a list of {{name, template}} objects")


def _read_text(file: str) -> str:
    try:
        with open(file, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file}: unreadable ({exc})") from None


# --------------------------------------------------------------- compilation
def compile_template(text: str, source: str) -> Template:
    try:
        return _environment().from_string(text)
    except Exception as exc:  # TemplateSyntaxError mostly; any failure means this model cannot chat
        raise CheckpointError(f"{source}: the chat template does not compile ({type(exc).__name__}: {exc})") from None


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    """One sandbox for every template, set up as transformers' ``_compile_jinja_template``."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_generation_tag(), loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(), namespace=_namespace_class()
    )
    return env


def _generation_tag() -> type[Extension]:
    """transformers' ``{% generation %}...{% endgeneration %}`` marks the assistant's text for training
    masks; serving has no use for the mark, so the tag renders its body unchanged."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser: Parser) -> nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    return GenerationTag


class TemplateRaised(Exception):
    """What ``raise_exception(message)`` raises inside a template."""


def _raise_exception(message: str) -> NoReturn:
    raise TemplateRaised(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' tojson: plain json.dumps (jinja's own escapes HTML and has fewer options)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict(...)`` and ``dict.fromkeys`` for templates, without the type object itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _namespace_class() -> type[Namespace]:
    """jinja's namespace, refusing underscore names (they would reach CPython internals)."""
    from jinja2.exceptions import SecurityError
    from jinja2.utils import Namespace

    def check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a chat template cannot store {name!r} on a namespace (no leading underscores)")

    class TemplateNamespace(Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            for name in dict(*args, **kwargs):
                check(name)
            Namespace.__init__(self, *args, **kwargs)

        def __setitem__(self, name: str, value: Any) -> None:
            check(name)
            Namespace.__setitem__(self, name, value)

    return TemplateNamespace


# ----------------------------------------------------------------- rendering
@dataclass(frozen=True)
class ChatOptions:
    """How to render one request's messages (apply_chat_template's arguments, vLLM's field names)."""

    tools: list[Any] | None = None
    documents: list[Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    variables: dict[str, Any] | None = None  # chat_template_kwargs: extra template variables
    template: str | None = None  # a template's name (see ChatTemplates.select)


def render(
    template: ChatTemplate, messages: list[dict[str, Any]], options: ChatOptions, special_tokens: dict[str, str]
) -> str:
    """The prompt text; any failure of the template is a RequestError naming ``messages``."""
    continuing = options.continue_final_message
    if continuing and options.add_generation_prompt:
        raise RequestError(
            "continue_final_message",
            "cannot be combined with add_generation_prompt: continue the final message, or start a new one, not both",
        )
    messages = [_alias_reasoning(m) for m in messages]
    final = _mark_final_message(messages, template) if continuing else None
    try:
        text = template.compiled.render(
            messages=messages,
            tools=options.tools,
            documents=options.documents,
            add_generation_prompt=options.add_generation_prompt,
            **{**special_tokens, **(options.variables or {})},
        )
    except TemplateRaised as exc:
        raise RequestError("messages", f"the chat template ({template.source}) refused them: {exc}") from None
    except Exception as exc:  # whatever a template does wrong, it is this request's error only
        raise RequestError(
            "messages", f"the chat template ({template.source}) failed on them ({type(exc).__name__}: {exc})"
        ) from None
    return _cut_after_final_message(text, cast(str, final)) if continuing else text


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """As transformers: a message's reasoning also goes by ``thinking`` (gpt-oss templates read that)."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _mark_final_message(messages: list[dict[str, Any]], template: ChatTemplate) -> str:
    """Append transformers' marker to the final message's content (so the text after it can be cut
    off); returns that content."""
    final = messages[-1].get("content")
    if not isinstance(final, str):
        raise RequestError("continue_final_message", "the final message has no content to continue")
    if "content" not in template.text:
        raise RequestError(
            "continue_final_message", f"the chat template ({template.source}) never shows a message's content"
        )
    messages[-1] = {**messages[-1], "content": final + CONTINUE_TAG}
    return final


def _cut_after_final_message(text: str, final: str) -> str:
    """The rendered text up to the end of the final message's content: the model continues it."""
    tag = CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise RequestError(
            "continue_final_message",
            "the chat template does not show the final message as given, so it cannot be continued",
        )
    at = text.rindex(tag)
    if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing space


def prepare_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Checked messages as templates expect them: keys whose value is null dropped (transformers: many
    templates print "None" otherwise), text parts joined into one string and tool-call arguments sent
    as JSON text parsed into objects (vLLM: templates write them with tojson)."""
    return [_prepare(i, message) for i, message in enumerate(messages)]


def _prepare(i: int, message: dict[str, Any]) -> dict[str, Any]:
    out = {key: value for key, value in message.items() if value is not None}
    if isinstance(out.get("content"), list):
        out["content"] = "\n".join(part["text"] for part in out["content"])
    if "tool_calls" in out:
        out["tool_calls"] = [
            _parse_arguments(f"messages[{i}].tool_calls[{j}]", call) for j, call in enumerate(out["tool_calls"])
        ]
    return out


def _parse_arguments(field: str, call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict):
        return call
    arguments = function.get("arguments")
    if not arguments:
        arguments = {}
    elif isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as exc:
            raise RequestError(f"{field}.function.arguments", f"not valid JSON ({exc})") from None
    return {**call, "function": {**function, "arguments": arguments}}
