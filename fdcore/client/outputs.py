"""What a client hands back: streamed and whole outputs, and the two errors a client raises."""

from __future__ import annotations

from dataclasses import dataclass, field

from fdcore.protocol import (
    Metrics,
    PromptLogprob,
    Update,
)


class EngineError(RuntimeError):
    """The tree could not be started or reached, or it went away."""

    def __init__(self, message: str, error_code: int = 500):
        super().__init__(message)
        self.error_code = error_code


class EngineDeadError(EngineError):
    """This client can no longer be served: the tree stopped, the client was shut down, or its
    reader thread died. Every open request raises it, and so does every later call, at once."""

    def __init__(self, message: str):
        super().__init__(message, 503)


@dataclass
class CompletionOutput:
    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[list[tuple[int, float]]] | None = None  # per token: (chosen id, lp), then top-N
    finish_reason: str | None = None  # stop | length | abort | error


@dataclass
class RequestOutput:
    """What the caller of ``AsyncLLM`` / ``LLM`` receives (the public shape, as vLLM's and FastDeploy's): one
    streamed delta, or the whole result, of a request. The only request shape user code sees; the
    protocol's ``Update`` is its wire form."""

    request_id: str
    prompt: str | list | None = None
    prompt_token_ids: list[int] | None = None
    outputs: CompletionOutput = field(default_factory=CompletionOutput)
    finished: bool = False
    metrics: Metrics | None = None
    error_code: int = 0
    error_msg: str = ""
    # prompt_logprobs: how the model scored each prompt token given those before it (the first: None)
    prompt_logprobs: list[PromptLogprob | None] | None = None


def chat_prompt(
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    add_generation_prompt: bool | None = None,
    continue_final_message: bool | None = None,
    chat_template_kwargs: dict | None = None,
    chat_template: str | None = None,
) -> dict:
    """A chat prompt for ``generate``: the messages and the template options given (transformers'
    ``apply_chat_template`` names; None leaves an option to the engine: no tools or documents, a
    generation prompt unless the final message is continued, the model's default template)."""
    options = {
        "tools": tools,
        "documents": documents,
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
        "chat_template_kwargs": chat_template_kwargs,
        "chat_template": chat_template,
    }
    return {"messages": messages, **{name: value for name, value in options.items() if value is not None}}


def output_of(request_id: str, prompt, update: Update, prompt_token_ids) -> RequestOutput:
    return RequestOutput(
        request_id,
        prompt,
        prompt_token_ids,
        CompletionOutput(0, update.text, list(update.token_ids), update.logprobs, update.finish_reason),
        update.finish_reason is not None,
        update.metrics,
        update.error_code,
        update.error_msg,
        update.prompt_logprobs,
    )


def refused(update: Update) -> bool:
    """The engine was full: the request never started and may simply be sent again."""
    return update.finish_reason == "error" and update.error_code == 429


def as_prompt_list(prompts) -> list:
    """One prompt (text, token ids, a {"prompt_token_ids"/"messages"} dict) or a sequence of them."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def accumulate(out: RequestOutput, update: Update) -> None:
    c = out.outputs
    c.text += update.text
    c.token_ids += update.token_ids
    if update.logprobs:
        c.logprobs = (c.logprobs or []) + update.logprobs
    if update.prompt_token_ids is not None:
        out.prompt_token_ids = list(update.prompt_token_ids)
    if update.prompt_logprobs is not None:
        out.prompt_logprobs = update.prompt_logprobs
    if update.finish_reason is not None:
        c.finish_reason = update.finish_reason
        out.finished = True
        out.metrics = update.metrics
        out.error_code, out.error_msg = update.error_code, update.error_msg
