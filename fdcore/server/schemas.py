"""OpenAI request bodies as msgspec Structs, and their translation to fdcore's SamplingParams.

Decoding with msgspec gives a field-named error for every wrong type or missing
field; range checks are the engine's (the same table every client gets), so
the HTTP layer and the Python client can never disagree on what is valid.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from fdcore.protocol import RequestBody, SamplingParams, StructuredOutputs


class _Body(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields fdcore may fill from the model's generation_config.json are None when not sent."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None  # (null: 0, as OpenAI's)
    frequency_penalty: float | None = None
    seed: int | None = None
    user: str | None = None
    logit_bias: dict | None = None
    # extensions (vLLM's names)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None  # each prompt token's logprob, rank and the top-N there (not streamed)
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's fields that fdcore honours only at the value that is what it does anyway (NEUTRAL)
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    include_stop_str_in_output: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    priority: Any = None
    return_tokens_as_token_ids: Any = None
    return_token_ids: Any = None
    return_token_offsets: Any = None
    bad_words: Any = None
    allowed_token_ids: Any = None
    truncate_prompt_tokens: Any = None
    stream_interval: Any = None
    thinking_token_budget: Any = None
    add_special_tokens: Any = None


# field -> the one value fdcore serves it with (null, the field's absence, is always accepted); a request
# that asks for another gets a 400 naming the field, never a silent difference
NEUTRAL = {
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "include_stop_str_in_output": False,
    "use_beam_search": False,
    "length_penalty": 1.0,
    "priority": 0,
    "return_tokens_as_token_ids": False,
    "return_token_ids": False,
    "return_token_offsets": False,
    "bad_words": [],
    "allowed_token_ids": None,
    "truncate_prompt_tokens": None,
    "stream_interval": 1,
    "thinking_token_budget": None,
}
COMPLETION_NEUTRAL = {**NEUTRAL, "add_special_tokens": True}
CHAT_NEUTRAL = {
    **NEUTRAL,
    "add_special_tokens": False,
    "parallel_tool_calls": True,
    "include_reasoning": True,
    "echo": False,
}


def check_neutral(body, table: dict) -> None:
    for name, neutral in table.items():
        value = getattr(body, name)
        if value is not None and value != neutral:
            raise BadRequest(
                f"{name} = {json.dumps(value)} is not supported: fdcore serves {json.dumps(neutral)} only", name
            )


class CompletionRequest(_Body, kw_only=True):
    prompt: str | list  # text, token ids, or a one-element list of either (checked in prompts_of)
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatCompletionRequest(_Body, kw_only=True):
    messages: list[dict]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    # vLLM's extensions: how the chat template is rendered
    documents: list[dict] | None = None
    add_generation_prompt: bool | None = None  # default: true, unless continue_final_message
    continue_final_message: bool | None = None
    chat_template_kwargs: dict | None = None
    parallel_tool_calls: Any = None
    include_reasoning: Any = None
    echo: Any = None


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's /tokenize: a prompt (its completion form) or messages (its chat form)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool | None = None  # vLLM's defaults only: true for a prompt, false for messages
    return_token_strs: bool = False
    tools: list[dict] | None = None
    documents: list[dict] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict | None = None


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    tokens: list[int]


CHAT_TEMPLATE_FIELDS = ("tools", "documents", "add_generation_prompt", "continue_final_message", "chat_template_kwargs")


class BadRequest(ValueError):
    """An OpenAI-shaped 4xx: message, the offending parameter, an HTTP status."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.param, self.status, self.kind, self.code = param, status, kind, code


MAX_DEPTH = 64  # JSON nesting a body may have (no request needs a tenth of it)
INT_RANGE = (-(1 << 63), (1 << 63) - 1)  # integers a field may hold (what travels on the engine's links)


def decode(raw: bytes, schema):
    """The body as ``schema``; every way it can be wrong is a BadRequest naming the field: types, missing
    or unknown fields, nesting deeper than MAX_DEPTH and integers outside INT_RANGE."""
    try:
        body = msgspec.json.decode(raw, type=schema)
    except RecursionError:  # nested past the interpreter's stack
        raise BadRequest(f"The request nests more than {MAX_DEPTH} levels deep", _too_deep_field(raw)) from None
    except msgspec.ValidationError as exc:
        text, _, where = str(exc).partition(" - at `$")
        param = where.rstrip("`").lstrip(".") or None
        if text.startswith("Object contains unknown field"):
            name = text.split("`")[1]
            raise BadRequest(f"Unrecognized request argument supplied: {name}", name) from None
        if text.startswith("Object missing required field"):
            name = text.split("`")[1]
            raise BadRequest(f"Missing required parameter: '{name}'", name) from None
        raise BadRequest(f"Invalid value for '{param}': {text}", param) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"The request body is not valid JSON ({exc})") from None
    check_values(body)
    return body


def check_values(body) -> None:
    """Nesting and integer ranges of a decoded body, walked without recursion (a body is at most
    ``server.max_request_bytes``, so the walk is bounded); a BadRequest names the first offending field."""
    stack = [(name, getattr(body, name), 1) for name in reversed(body.__struct_fields__)]
    while stack:
        path, value, depth = stack.pop()
        if isinstance(value, bool) or value is None or isinstance(value, (str, float)):
            continue
        if isinstance(value, int):
            if not INT_RANGE[0] <= value <= INT_RANGE[1]:
                raise BadRequest(f"Invalid value for '{path}': {value} is outside the 64-bit integer range", path)
        elif depth > MAX_DEPTH:
            path = path if len(path) <= 80 else path[:77] + "..."
            raise BadRequest(f"Invalid value for '{path}': nested more than {MAX_DEPTH} levels deep", path)
        elif isinstance(value, dict):
            stack += [(f"{path}.{key}", item, depth + 1) for key, item in value.items()]
        elif isinstance(value, list):
            if value and all(type(item) is int for item in value):  # token ids: the common large list
                if INT_RANGE[0] <= min(value) and max(value) <= INT_RANGE[1]:
                    continue
            stack += [(f"{path}[{i}]", item, depth + 1) for i, item in enumerate(value)]


_JSON_TOKENS = re.compile(rb'"((?:[^"\\]|\\.)*)"\s*:|"(?:[^"\\]|\\.)*"|[\[\]{}]')


def _too_deep_field(raw: bytes) -> str | None:
    """Which top-level field of a body too deep to decode is the deep one (None if none is found): the
    key in force when the brackets, strings aside, first go past MAX_DEPTH."""
    depth, field = 0, None
    for match in _JSON_TOKENS.finditer(raw):
        token = match.group(0)
        if match.group(1) is not None:
            if depth == 1:
                field = match.group(1).decode("utf-8", "replace")
        elif token in (b"[", b"{"):
            depth += 1
            if depth > MAX_DEPTH + 1:
                return field
        elif token in (b"]", b"}"):
            depth -= 1
    return None


def sampling_params(
    body: _Body, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return SamplingParams(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        seed=body.seed,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        stop=stop,
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        logit_bias=_logit_bias(body.logit_bias),
        structured_outputs=structured_outputs(body)[0],
        prompt_logprobs=prompt_logprobs,
    )


def _check_prompt_logprobs(body: _Body) -> None:
    """vLLM's rule: prompt_logprobs come whole with the answer, so a streamed request cannot have them."""
    if body.prompt_logprobs is not None and body.stream:
        raise BadRequest("prompt_logprobs are not available when stream is true", "prompt_logprobs")


GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs(body: _Body) -> tuple[StructuredOutputs | None, str | None]:
    """The request's output constraint and the field that gave it (one of response_format,
    structured_outputs, guided_*: more than one is refused, naming the second)."""
    response = None if body.response_format is None else _response_format(body.response_format)
    given = [
        name
        for name in ("response_format", "structured_outputs", *GUIDED_FIELDS)
        if getattr(body, name) is not None and (name != "response_format" or response is not None)
    ]
    if not given:  # ({"type": "text"} is no constraint)
        return None, None
    if len(given) > 1:
        raise BadRequest(f"give only one of {', '.join(given)}", given[1])
    source = given[0]
    if source == "response_format":
        return response, source
    if source == "structured_outputs":
        try:
            return msgspec.convert(body.structured_outputs, StructuredOutputs), source
        except msgspec.ValidationError as exc:
            text, _, where = str(exc).partition(" - at `$")
            raise BadRequest(f"Invalid structured_outputs: {text}", source + where.rstrip("`")) from None
    return StructuredOutputs(**{GUIDED_FIELDS[source]: getattr(body, source)}), source


def renamed(exc: BadRequest, body: _Body) -> BadRequest:
    """An engine refusal of the constraint, naming the field the request used (the engine knows it as
    structured_outputs.<form>)."""
    source = structured_outputs(body)[1]
    if not (exc.param or "").startswith("structured_outputs.") or source in (None, "structured_outputs"):
        return exc
    field = "response_format.json_schema.schema" if source == "response_format" else source
    message = str(exc).replace(exc.param, field, 1)
    return BadRequest(message, field, exc.status, exc.kind, exc.code)


def _response_format(spec: dict) -> StructuredOutputs | None:
    """OpenAI's response_format: text (no constraint), json_object, or json_schema {name, schema, strict}."""
    kind = spec.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        inner = spec.get("json_schema")
        if not isinstance(inner, dict) or not isinstance(inner.get("schema", {}), dict):
            raise BadRequest(
                "response_format.json_schema must be an object with a 'schema' object", "response_format.json_schema"
            )
        # no schema: any JSON object, as OpenAI's; strict or not, the output follows the schema
        return StructuredOutputs(json=inner.get("schema") or {"type": "object"})
    raise BadRequest(
        f"response_format type {kind!r} is not supported (text, json_object or json_schema)", "response_format.type"
    )


def _logit_bias(raw: dict | None) -> dict[int, float] | None:
    """OpenAI's {"token id": bias} (JSON keys are strings) as token ids; the engine checks the ranges."""
    if not raw:
        return None
    bias = {}
    for key, value in raw.items():
        try:
            token = int(key)
        except ValueError:
            raise BadRequest(f"logit_bias key {key[:40]!r} is not a token id", "logit_bias") from None
        if not 0 <= token <= INT_RANGE[1]:
            raise BadRequest(f"logit_bias key {key[:40]!r} is not a token id", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BadRequest(f"logit_bias[{key}] is {value!r}, not a number", f"logit_bias[{key}]")
        bias[token] = float(value)
    return bias


def chat_prompt(body: ChatCompletionRequest) -> dict:
    """The engine's chat prompt: the messages and whichever template options the request gives (the
    tools reach the template whatever tool_choice says, as vLLM's)."""
    prompt = {"messages": body.messages}
    prompt.update({name: getattr(body, name) for name in CHAT_TEMPLATE_FIELDS if getattr(body, name) is not None})
    return prompt


def tokenize_body(body: TokenizeRequest) -> RequestBody:
    """The engine's request body for what /tokenize counts: the same prompt forms and template options
    as a completion or chat request (so the same ids and the same field-named errors)."""
    chat = body.messages is not None
    if body.add_special_tokens is not None and body.add_special_tokens != (not chat):
        raise BadRequest(
            f"add_special_tokens is {str(body.add_special_tokens).lower()}: only what fdcore's "
            f"{'chat' if chat else 'completion'} requests do ({str(not chat).lower()}) is supported",
            "add_special_tokens",
        )
    options = {name: getattr(body, name) for name in CHAT_TEMPLATE_FIELDS if getattr(body, name) is not None}
    return RequestBody(prompt=body.prompt, messages=body.messages, **options)


def completion_params(body: CompletionRequest) -> SamplingParams:
    check_neutral(body, COMPLETION_NEUTRAL)
    _check_prompt_logprobs(body)
    if body.best_of not in (None, 1):
        raise BadRequest(f"best_of is {body.best_of}: only 1 is supported", "best_of")
    if body.suffix:
        raise BadRequest("suffix is not supported", "suffix")
    # No max_tokens: the model's default (generation_config.json), else 16, the engine decides.
    # echo with logprobs scores the echoed prompt too (OpenAI's legacy completions).
    scored = [n for n in (body.prompt_logprobs, body.logprobs if body.echo else None) if n is not None]
    return sampling_params(body, body.max_tokens, body.logprobs, max(scored, default=None))


def chat_params(
    body: ChatCompletionRequest, default_max_tokens: int, tool_constraint: StructuredOutputs | None = None
) -> SamplingParams:
    """``default_max_tokens``: the model's max_new_tokens, else max_model_len (OpenAI's chat has no
    limit: the scheduler ends the answer with "length" when the context is full). ``tool_constraint``:
    what tool_choice "required" or a named function holds the output to."""
    check_neutral(body, CHAT_NEUTRAL)
    _check_prompt_logprobs(body)
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    if body.top_logprobs and not body.logprobs:
        raise BadRequest("top_logprobs requires logprobs to be true", "top_logprobs")
    params = sampling_params(body, default_max_tokens if limit is None else limit, logprobs, body.prompt_logprobs)
    if tool_constraint is None:
        return params
    if params.structured_outputs is not None:
        raise BadRequest(
            f"tool_choice {body.tool_choice!r} constrains the output already: it cannot be combined "
            f"with {structured_outputs(body)[1]}",
            "tool_choice",
        )
    return msgspec.structs.replace(params, structured_outputs=tool_constraint)


MAX_CHOICES = 64  # choices one request may ask for (prompts x n): each is an engine request of its own


def prompts_of(body: CompletionRequest) -> list:
    """The request's prompts (strings or token-id lists): a string, token ids, or a list of those."""
    prompt = body.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise BadRequest("prompt is empty", "prompt")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [prompt]
    for i, one in enumerate(prompt):
        if not isinstance(one, (str, list)) or (
            isinstance(one, list) and not all(isinstance(t, int) and not isinstance(t, bool) for t in one)
        ):
            raise BadRequest(f"prompt[{i}] must be a string or a list of token ids", f"prompt[{i}]")
    return list(prompt)


def choice_params(
    params: SamplingParams, n: int, prompts: int = 1, share_prompt_scores: bool = True
) -> list[SamplingParams]:
    """Each of a prompt's n choices' parameters: choice i seeded ``seed + i`` when a seed is given
    (distinct and reproducible); checked against MAX_CHOICES. With ``share_prompt_scores`` only the
    first choice scores the prompt (prompt_logprobs): the others are given its scores."""
    if n < 1:
        raise BadRequest(f"n is {n}: at least 1", "n")
    if n * prompts > MAX_CHOICES:
        field = "n" if n > 1 else "prompt"
        raise BadRequest(
            f"{prompts} prompt(s) x n = {n} is {n * prompts} choices, more than the {MAX_CHOICES} "
            "one request may ask for",
            field,
        )
    others = params
    if share_prompt_scores and params.prompt_logprobs is not None:
        others = msgspec.structs.replace(params, prompt_logprobs=None)
    if params.seed is None:
        return [params] + [others] * (n - 1)
    return [msgspec.structs.replace(params if i == 0 else others, seed=params.seed + i) for i in range(n)]
