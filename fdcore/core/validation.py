"""Request validation: every bad input gets an error naming the field and the limit.

Pure: given the request's fields and the model's limits, return the
normalised request or raise :class:`RequestError`. It runs in the engine
before anything is queued, so a bad request costs nothing else: no crash,
no restart, no other user's request lost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast

from fdcore.protocol import RequestBody, SamplingParams

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 300  # tokens one request may bias (OpenAI's limit)
MAX_REQUEST_ID = 256
ROLES = ("system", "user", "assistant", "tool")
MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content")
CHAT_OPTIONS = (
    "tools",
    "documents",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "chat_template",
)
# template variables a request sets through its own fields (chat_template_kwargs may not)
# transformers' SPECIAL_TOKENS_ATTRIBUTES: the named special tokens every template may use (the checkpoint's)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
RESERVED_VARIABLES = ("messages", *CHAT_OPTIONS, *SPECIAL_TOKENS)


class RequestError(ValueError):
    """A request that cannot be served as given (HTTP-style ``code``, offending ``field``)."""

    def __init__(self, field: str, message: str, code: int = 400):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.code = code


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int


def validate_request_id(request_id: Any) -> None:
    if not isinstance(request_id, str) or not request_id:
        raise RequestError("request_id", "must be a non-empty string")
    if len(request_id) > MAX_REQUEST_ID:
        raise RequestError("request_id", f"is {len(request_id)} characters long, at most {MAX_REQUEST_ID} allowed")


def check_one_prompt(prompt: Any, prompt_token_ids: Any, messages: Any) -> None:
    """Exactly one of the three prompt forms, and not empty."""
    given = [
        name
        for name, value in (("prompt", prompt), ("prompt_token_ids", prompt_token_ids), ("messages", messages))
        if value is not None
    ]
    if not given:
        raise RequestError("prompt", "one of prompt, prompt_token_ids or messages is required")
    if len(given) > 1:
        raise RequestError(given[1], f"give only one of prompt, prompt_token_ids, messages (got {', '.join(given)})")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise RequestError("prompt", "must be a non-empty string")
    if prompt_token_ids is not None and not prompt_token_ids:
        raise RequestError("prompt_token_ids", "must not be empty")
    if messages is not None:
        check_messages(messages)


def check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "must be a non-empty list of {role, content} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(f"messages[{i}]", "must be an object with 'role' and 'content'")
        unknown = sorted(set(message) - set(MESSAGE_KEYS), key=str)
        if unknown:
            raise RequestError(f"messages[{i}].{unknown[0]}", f"unknown key (a message has {', '.join(MESSAGE_KEYS)})")
        if message.get("role") not in ROLES:
            raise RequestError(f"messages[{i}].role", f"{message.get('role')!r} is not one of {', '.join(ROLES)}")
        _check_content(f"messages[{i}]", message)
        for key in ("name", "tool_call_id", "reasoning_content"):
            if message.get(key) is not None and not isinstance(message[key], str):
                raise RequestError(f"messages[{i}].{key}", "must be a string")
        if message.get("tool_calls") is not None:
            _check_tool_calls(f"messages[{i}].tool_calls", message["tool_calls"])


def _check_content(field: str, message: dict[str, Any]) -> None:
    """A string, or OpenAI's list of text parts; none at all only beside an assistant's tool calls."""
    content = message.get("content")
    if content is None and message.get("role") == "assistant" and message.get("tool_calls"):
        return
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return
    if not isinstance(content, str):
        raise RequestError(f"{field}.content", "must be a string or a list of {type: text, text} parts")


def _check_tool_calls(field: str, calls: Any) -> None:
    if not isinstance(calls, list):
        raise RequestError(field, "must be a list of {id, type, function: {name, arguments}} objects")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(f"{field}[{j}]", "must be an object with function: {name, arguments}")
        if not isinstance(function.get("arguments"), (str, dict, type(None))):
            raise RequestError(f"{field}[{j}].function.arguments", "must be a JSON string or an object")


def check_chat_options(body: RequestBody) -> None:
    """The template options belong to chat requests; their own variables are not chat_template_kwargs'."""
    given = [name for name in CHAT_OPTIONS if getattr(body, name) is not None]
    if given and body.messages is None:
        raise RequestError(given[0], "applies only to a chat request (messages)")
    for key in body.chat_template_kwargs or {}:
        if key in SPECIAL_TOKENS:
            raise RequestError(f"chat_template_kwargs.{key}", "is the model's special token: a request cannot set it")
        if key in RESERVED_VARIABLES:
            raise RequestError(f"chat_template_kwargs.{key}", "is set by the request's own field, not here")


def check_token_ids(token_ids: list[int], limits: ModelLimits, field: str = "prompt_token_ids") -> None:
    for i, token in enumerate(token_ids):
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < limits.vocab_size:
            raise RequestError(
                f"{field}[{i}]", f"token id {token!r} is outside the vocabulary [0, {limits.vocab_size})"
            )


def check_length(num_prompt_tokens: int, params: SamplingParams, limits: ModelLimits) -> None:
    if num_prompt_tokens >= limits.max_model_len:
        raise RequestError(
            "prompt", f"{num_prompt_tokens} tokens leave no room to generate: max_model_len is {limits.max_model_len}"
        )
    if num_prompt_tokens + params.min_tokens > limits.max_model_len:
        raise RequestError(
            "min_tokens",
            f"prompt ({num_prompt_tokens} tokens) + min_tokens ({params.min_tokens}) "
            f"exceeds max_model_len ({limits.max_model_len})",
        )


def check_sampling(params: SamplingParams, limits: ModelLimits) -> SamplingParams:
    """Range checks of every sampling parameter (unset ones as they will be filled); returns it
    unchanged when valid."""
    checked, params = params, params.with_defaults()
    _number("temperature", params.temperature, low=0.0)
    _number("top_p", params.top_p, low=0.0, high=1.0, low_open=True)
    _number("min_p", params.min_p, low=0.0, high=1.0)
    _number("repetition_penalty", params.repetition_penalty, low=0.0, low_open=True)
    _number("presence_penalty", params.presence_penalty, low=-2.0, high=2.0)
    _number("frequency_penalty", params.frequency_penalty, low=-2.0, high=2.0)
    _integer("n", params.n, 1, 1, "only n = 1 is supported")
    _integer("top_k", params.top_k, -1, limits.vocab_size)
    _integer("max_tokens", params.max_tokens, 1, limits.max_model_len)
    _integer(
        "min_tokens", params.min_tokens, 0, cast(int, params.max_tokens), f"at most max_tokens ({params.max_tokens})"
    )
    if params.seed is not None:
        _integer("seed", params.seed, 0, 2**63 - 1)
    if params.logprobs is not None:
        _integer("logprobs", params.logprobs, 0, MAX_LOGPROBS)
    if params.prompt_logprobs is not None:
        _integer("prompt_logprobs", params.prompt_logprobs, 0, MAX_LOGPROBS)
    if len(params.stop) > MAX_STOP_STRINGS:
        raise RequestError("stop", f"{len(params.stop)} stop strings, at most {MAX_STOP_STRINGS} allowed")
    for i, stop in enumerate(params.stop):
        if not stop:
            raise RequestError(f"stop[{i}]", "must be a non-empty string")
    check_token_ids(params.stop_token_ids, limits, "stop_token_ids")
    _check_logit_bias(params.logit_bias or {}, limits)
    return checked


def _check_logit_bias(bias: dict[Any, Any], limits: ModelLimits) -> None:
    if len(bias) > MAX_LOGIT_BIAS:
        raise RequestError("logit_bias", f"{len(bias)} tokens, at most {MAX_LOGIT_BIAS} allowed")
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < limits.vocab_size:
            raise RequestError(
                f"logit_bias[{token!r}]", f"token id {token!r} is outside the vocabulary [0, {limits.vocab_size})"
            )
        _number(f"logit_bias[{token}]", value, low=-100.0, high=100.0)


def _number(
    field: str, value: Any, low: float | None = None, high: float | None = None, low_open: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(field, f"must be a finite number, got {value!r}")
    if low is not None and (value < low or (low_open and value == low)):
        bound = f"> {low}" if low_open else f">= {low}"
        raise RequestError(field, f"is {value}, must be {bound}" + (f" and <= {high}" if high is not None else ""))
    if high is not None and value > high:
        raise RequestError(field, f"is {value}, must be <= {high}")


def _integer(field: str, value: Any, low: int, high: int, why: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(field, f"must be an integer, got {value!r}")
    if not low <= value <= high:
        raise RequestError(field, f"is {value}, must be in [{low}, {high}]" + (f": {why}" if why else ""))
