"""What the API answers with: OpenAI's error shape, server-sent events, usage and logprob offsets."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, NamedTuple

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from fdcore.server.tools import ToolPlan

if TYPE_CHECKING:
    from fdcore.server.app import _Api


class Collected(NamedTuple):
    """One choice's whole answer."""

    text: str
    tokens: list[int]
    logprobs: list
    last: object  # its last RequestOutput
    prompt_logprobs: list | None  # prompt_logprobs asked of it: a PromptLogprob per prompt token (the first: None)


CLIENT_CLOSED = 499  # nginx's status for "the client closed the connection": logged, never sent


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


def error_response(
    message: str, status: int, param: str | None = None, code: str | None = None, headers: dict | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, status, param, code), status_code=status, headers=headers)


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "api_error"), "param": param, "code": code}}


def text_offsets(texts: list[str], start: int) -> list[int]:
    """Where each of these consecutive texts starts, the first at ``start``."""
    offsets, at = [], start
    for text in texts:
        offsets.append(at)
        at += len(text)
    return offsets


def joined_chunk(first: dict, then: dict) -> dict:
    """Two OpenAI completion logprobs objects as one (the echoed prompt's, then the answer's)."""
    return {key: first[key] + then[key] for key in first}


JSON_ENCODE = msgspec.json.Encoder().encode  # (compact, UTF-8, and a logprob of -inf becomes null, not invalid JSON)


async def disconnected(request: Request) -> None:
    """Returns once the client has gone (its body was read already: only a disconnect is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def tool_finish(reason: str, plan: ToolPlan, called: bool) -> str:
    """OpenAI's finish_reason: tool_calls when the model chose to call (auto, required); a named
    function's call ends with stop."""
    return "tool_calls" if called and reason == "stop" and plan.mode in ("auto", "required") else reason


def wants_usage(body) -> bool:
    return bool((body.stream_options or {}).get("include_usage"))


def usage_of(started: list, n: int, produced: list[int]) -> dict:
    """OpenAI's usage: each prompt's tokens once (not once per choice), every choice's output."""
    prompt_tokens = sum(len(first.prompt_token_ids or []) for _, first in started[::n])
    completion_tokens = sum(produced)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse_response(chunks, api: _Api) -> StreamingResponse:
    async def events():
        try:
            async for chunk in chunks:
                yield b"data: " + JSON_ENCODE(chunk) + b"\n\n"
            if api.drain_over:  # cut short by the server's stop: say so before the end
                yield (
                    b"data: "
                    + JSON_ENCODE(
                        error_body("The server shut down before this stream ended", 503, code="shutting_down")
                    )
                    + b"\n\n"
                )
            yield b"data: [DONE]\n\n"
        except asyncio.CancelledError:  # the client went away: the request is aborted upstream
            raise

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
