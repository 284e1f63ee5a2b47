"""OpenAI request bodies as msgspec Structs, and their translation to fdcore's SamplingParams.

Decoding with msgspec gives a field-named error for every wrong type or missing
field; range checks are the engine's (the same table every client gets), so
the HTTP layer and the Python client can never disagree on what is valid.
"""

from __future__ import annotations

import msgspec

from fdcore.protocol import SamplingParams


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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
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


CHAT_TEMPLATE_FIELDS = ("tools", "documents", "add_generation_prompt", "continue_final_message",
                        "chat_template_kwargs")


class BadRequest(ValueError):
    """An OpenAI-shaped 4xx: message, the offending parameter, an HTTP status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.kind, self.code = param, status, kind, code


def decode(raw: bytes, schema):
    try:
        return msgspec.json.decode(raw, type=schema)
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


def sampling_params(body: _Body, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    if body.logit_bias:
        raise BadRequest("logit_bias is not supported", "logit_bias")
    if body.n != 1:
        raise BadRequest(f"n is {body.n}: only n = 1 is supported", "n")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return SamplingParams(
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
        repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, seed=body.seed, max_tokens=max_tokens,
        min_tokens=body.min_tokens, stop=stop, stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos, logprobs=logprobs)


def chat_prompt(body: ChatCompletionRequest) -> dict:
    """The engine's chat prompt: the messages and whichever template options the request gives.
    Tools reach the template; no output is parsed into tool calls, so only tool_choice "auto" (the
    model may call one) and "none" (vLLM's default: the template still sees the tools) are accepted."""
    if body.tool_choice not in (None, "auto", "none"):
        raise BadRequest(f"tool_choice {body.tool_choice!r} is not supported: fdcore does not constrain "
                         "the output to a tool call (use \"auto\" or \"none\")", "tool_choice")
    prompt = {"messages": body.messages}
    prompt.update({name: getattr(body, name) for name in CHAT_TEMPLATE_FIELDS if getattr(body, name) is not None})
    return prompt


def completion_params(body: CompletionRequest) -> SamplingParams:
    if body.echo:
        raise BadRequest("echo is not supported", "echo")
    if body.best_of not in (None, 1):
        raise BadRequest(f"best_of is {body.best_of}: only 1 is supported", "best_of")
    if body.suffix:
        raise BadRequest("suffix is not supported", "suffix")
    # No max_tokens: the model's default (generation_config.json), else 16, the engine decides.
    return sampling_params(body, body.max_tokens, body.logprobs)


def chat_params(body: ChatCompletionRequest, default_max_tokens: int) -> SamplingParams:
    """``default_max_tokens``: the model's max_new_tokens, else max_model_len (OpenAI's chat has no
    limit: the scheduler ends the answer with "length" when the context is full)."""
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    if body.top_logprobs is not None and not body.logprobs:
        raise BadRequest("top_logprobs requires logprobs to be true", "top_logprobs")
    return sampling_params(body, default_max_tokens if limit is None else limit, logprobs)


def prompts_of(body: CompletionRequest) -> list:
    """One prompt (a string or token ids) per choice; a batch of prompts is refused beyond one."""
    prompt = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise BadRequest("prompt is empty", "prompt")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [prompt]
    if all(isinstance(p, (str, list)) for p in prompt):
        raise BadRequest(f"prompt holds {len(prompt)} prompts: send one per request", "prompt")
    raise BadRequest("prompt must be a string, a list of token ids, or a list holding one of those", "prompt")
