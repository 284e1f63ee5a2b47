"""The OpenAI-compatible ASGI app (Starlette): completions, chat completions, models, vLLM's tokenize and
detokenize, health, metrics.

Requests are decoded with msgspec (a wrong type or a missing field is a 400
naming the parameter), checked by the engine like every other client's (the
same field-named errors), and answered in OpenAI's shapes: JSON, or
server-sent events when ``stream`` is true. Errors are always
``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hmac
import time
import uuid
from dataclasses import dataclass
from typing import NamedTuple

import msgspec

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fdcore.core.validation import ModelLimits, RequestError, check_token_ids
from fdcore.protocol import RequestBody
from fdcore.server import budget
from fdcore.server.metrics import ServerMetrics
from fdcore.server.schemas import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    chat_params,
    chat_prompt,
    choice_params,
    completion_params,
    decode,
    prompts_of,
    renamed,
    tokenize_body,
)
from fdcore.server.reasoning import REASONING, ReasoningStream, split_reasoning
from fdcore.server.tools import ToolPlan, ToolStream, plan_of

class Collected(NamedTuple):
    """One choice's whole answer."""

    text: str
    tokens: list[int]
    logprobs: list
    last: object  # its last RequestOutput
    prompt_logprobs: list | None  # prompt_logprobs asked of it: a PromptLogprob per prompt token (the first: None)


CLIENT_CLOSED = 499  # nginx's status for "the client closed the connection": logged, never sent
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               503: "service_unavailable"}


@dataclass
class Settings:
    model_name: str
    max_model_len: int
    api_key: str = ""
    max_request_bytes: int = 1 << 20
    default_max_tokens: int | None = None  # the model's max_new_tokens (generation_config.json), if any
    reasoning_parser: str = ""  # chat: how <think>...</think> becomes reasoning_content ("" = it does not)
    max_response_entries: int = 200_000  # tokens and logprobs a response may list (fdcore.server.budget)
    completion_max_tokens: int = 16  # completions' max_tokens when a request gives none (the engine's default)


def error_response(message: str, status: int, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param, code), status_code=status, headers=headers)


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "api_error"), "param": param,
                      "code": code}}


def build_app(llm, settings: Settings, tokenizer, health, restarts, spares=dict) -> Starlette:
    """``llm``: an AsyncLLM; ``health()`` -> (ok, reason); ``restarts()`` -> {actor: count}; ``spares()`` ->
    {worker: none | loading | warm}."""
    metrics = ServerMetrics()
    api = _Api(llm, settings, tokenizer, metrics)

    async def completions(request: Request) -> Response:
        return await api.handle(request, api.completions)

    async def chat(request: Request) -> Response:
        return await api.handle(request, api.chat)

    async def tokenize(request: Request) -> Response:
        return await api.handle(request, api.tokenize)

    async def detokenize(request: Request) -> Response:
        return await api.handle(request, api.detokenize)

    async def models(request: Request) -> Response:
        if (denied := api.check_key(request)) is not None:
            return denied
        return JSONResponse({"object": "list", "data": [
            {"id": settings.model_name, "object": "model", "created": api.started, "owned_by": "fdcore",
             "max_model_len": settings.max_model_len}]})

    async def health_check(request: Request) -> Response:
        if api.draining:  # (a load balancer moves away)
            return JSONResponse({"status": "unhealthy", "reason": "shutting down"}, status_code=503)
        ok, reason = health()
        answer = {"status": "ok"} if ok else {"status": "unhealthy", "reason": reason}
        warm = spares()
        return JSONResponse({**answer, "spares": warm} if warm else answer, status_code=200 if ok else 503)

    snapshot = StatsSnapshot(lambda: llm.stats(timeout=2.0))
    observed = [None]

    async def metrics_endpoint(request: Request) -> Response:
        stats = await snapshot.get()
        if stats is not None and stats is not observed[0]:
            observed[0] = stats
            metrics.observe_stats(stats, restarts())
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def http_error(request: Request, exc: HTTPException) -> Response:
        return error_response(f"{request.method} {request.url.path}: {exc.detail}", exc.status_code)

    app = Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/health", health_check, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
    ], exception_handlers={HTTPException: http_error})
    app.state.api = api  # (the actor drains it when it stops)
    return app


class StatsSnapshot:
    """The engine's serving stats for /metrics, asked for at most once every ``max_age`` seconds: a
    scrape is otherwise a round trip through engine and scheduler, and a flood of scrapes would slow
    every stream. Scrapes that arrive while it is asked for share that answer; when the engine cannot
    answer (a restart), the last one is served."""

    def __init__(self, fetch, max_age: float = 1.0):
        self.fetch, self.max_age = fetch, max_age
        self.value, self.at = None, float("-inf")
        self.pending: asyncio.Future | None = None

    async def get(self):
        if time.monotonic() - self.at < self.max_age:
            return self.value
        if self.pending is None:
            self.pending = asyncio.ensure_future(self._refresh())
        return await asyncio.shield(self.pending)

    async def _refresh(self):
        try:
            self.value = await self.fetch()
        except Exception:  # the engine is restarting: the last answer stands
            pass
        finally:
            self.at, self.pending = time.monotonic(), None
        return self.value


# whom the request in hand is for: its peer's address. The engine's scheduler shares the KV cache fairly between
# tenants, so one address's huge or unread requests cannot keep another's first token waiting.
TENANT: contextvars.ContextVar[str] = contextvars.ContextVar("fdcore_tenant", default="")
OFF_LOOP_BYTES = 64 << 10  # bodies larger than this are decoded on a thread, not on the event loop


class _Api:
    def __init__(self, llm, settings: Settings, tokenizer, metrics: ServerMetrics):
        self.llm, self.settings, self.tokenizer, self.metrics = llm, settings, tokenizer, metrics
        self.started = int(time.time())
        self.open: set[str] = set()  # the engine requests of this server that have not ended
        self.draining = False        # stopping: new requests get 503, the open ones run out (drain())
        self.drain_over = False      # the drain's time ran out: what is left was aborted
        # every token's text, made once: a response with logprobs names tens of thousands of tokens
        self.texts = [] if tokenizer is None else tokenizer.tokenizer.decode_batch(
            [[t] for t in range(tokenizer.tokenizer.get_vocab_size())])

    # ------------------------------------------------------------- plumbing
    def check_key(self, request: Request) -> Response | None:
        key = self.settings.api_key
        if not key:
            return None
        given = request.headers.get("authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return None
        return error_response("Incorrect or missing API key (Authorization: Bearer ...)", 401,
                              code="invalid_api_key")

    async def body(self, request: Request) -> bytes:
        limit = self.settings.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BadRequest(f"The request body is {declared} bytes, more than the {limit} allowed", status=413)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BadRequest(f"The request body is more than the {limit} bytes allowed", status=413)
            chunks.append(chunk)
        return b"".join(chunks)

    async def handle(self, request: Request, endpoint) -> Response:
        if (denied := self.check_key(request)) is not None:
            return denied
        if self.draining:
            return error_response("The server is shutting down; retry on another", 503,
                                  code="shutting_down", headers={"Retry-After": "1"})
        try:
            TENANT.set(request.client.host if request.client else "")  # (the tasks made from here on see it)
            return await self.unless_disconnected(request, endpoint(await self.body(request)))
        except BadRequest as exc:
            return error_response(str(exc), exc.status, exc.param, exc.code)
        except ClientDisconnect:  # gone before its body was read: nothing was started
            self.metrics.finished("abort", None)
            return Response(status_code=CLIENT_CLOSED)

    async def unless_disconnected(self, request: Request, work) -> Response:
        """The endpoint's work, cancelled the moment its client goes away. Starlette watches for a
        disconnect only while a streamed body is being sent; a non-streamed answer, or a stream
        still waiting for its first output, would otherwise compute on for nobody. Cancelling the
        work closes its AsyncLLM stream, which aborts the request in the engine."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task  # start() or outputs() counted the abort
            return Response(status_code=CLIENT_CLOSED)  # nobody reads it
        return task.result()

    def check_model(self, model: str) -> None:
        if model != self.settings.model_name:
            raise BadRequest(f"The model '{model}' does not exist; this server serves "
                             f"'{self.settings.model_name}'", "model", 404, code="model_not_found")

    async def drain(self, timeout: float) -> int:
        """Stop taking requests and let the open ones run out, for up to ``timeout`` seconds; then abort
        what is left (each stream still ends: its last chunk says abort, then an error event and
        [DONE]). Returns how many were aborted."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.open and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = list(self.open)
        if left:
            self.drain_over = True
            for request_id in left:
                await self.llm.abort(request_id)
            while self.open and time.monotonic() < deadline + 5.0:  # their last outputs reach their streams
                await asyncio.sleep(0.02)
        return len(left)

    async def start(self, prompt, params):
        """The request's output stream and its first output; an engine refusal becomes a BadRequest."""
        request_id = uuid.uuid4().hex
        self.open.add(request_id)
        try:
            return await self._start(request_id, prompt, params)
        except BaseException:
            self.open.discard(request_id)
            raise

    async def _start(self, request_id: str, prompt, params):
        stream = self._tracked(request_id, self.llm.generate(prompt, params, request_id=request_id,
                                                             tenant=TENANT.get()))
        try:
            first = await stream.__anext__()
        except asyncio.CancelledError:  # the client left before the first output
            self.metrics.finished("abort", None)
            raise
        if first.outputs.finish_reason == "error":
            await stream.aclose()
            self.metrics.finished("error", None)
            field = first.error_msg.split(":", 1)[0] if ":" in first.error_msg else None
            raise BadRequest(first.error_msg, field, first.error_code or 500,
                             code="rate_limit_exceeded" if first.error_code == 429 else None)
        return stream, first

    async def _tracked(self, request_id: str, stream):
        """``stream``, counted open (drain()) until it ends or is closed."""
        try:
            async for out in stream:
                yield out
        finally:
            self.open.discard(request_id)
            await stream.aclose()

    async def start_all(self, requests: list) -> list:
        """start() for each (prompt, params) at once (each choice's first token is not waited for before
        the next is sent); if any is refused, or the caller is cancelled, the others are closed (aborted)."""
        if len(requests) == 1:
            return [await self.start(*requests[0])]
        tasks = [asyncio.ensure_future(self.start(prompt, params)) for prompt, params in requests]
        try:
            started = await asyncio.gather(*tasks, return_exceptions=True)
        except asyncio.CancelledError:  # the client left: choices already started must be aborted too
            await self.abandon([result for result in await asyncio.gather(*tasks, return_exceptions=True)
                                if not isinstance(result, BaseException)])
            raise
        failed = [result for result in started if isinstance(result, BaseException)]
        if failed:
            await self.abandon([result for result in started if not isinstance(result, BaseException)])
            raise failed[0]
        return started

    async def abandon(self, started: list) -> None:
        """Close (abort in the engine) and count choices whose streams nobody will read."""
        for stream, _ in started:
            await stream.aclose()
            self.metrics.finished("abort", None)

    async def merged(self, started: list):
        """(choice index, output) of every started choice, in the order they come."""
        if len(started) == 1:
            async for out in self.outputs(*started[0]):
                yield 0, out
            return
        # bounded: while the reader is stuck (a client that does not read) the pumps wait, instead of
        # turning every output of every choice into a chunk nobody sends yet
        queue: asyncio.Queue = asyncio.Queue(maxsize=4 * len(started))

        async def pump(index, stream, first):
            try:
                async for out in self.outputs(stream, first):
                    await queue.put((index, out))
                await queue.put((index, None))
            except Exception as exc:  # handed to the reader
                await queue.put((index, exc))

        began = []

        async def pump_all():
            began.append(True)
            await self.each_choice(started, pump)

        pumps = asyncio.ensure_future(pump_all())
        try:
            left = len(started)
            while left:
                index, out = await queue.get()
                if isinstance(out, Exception):
                    raise out
                if out is None:
                    left -= 1
                else:
                    yield index, out
        finally:
            pumps.cancel()
            await asyncio.gather(pumps, return_exceptions=True)
            if not began:  # cancelled before it ran: no choice was read
                await self.abandon(started)

    async def outputs(self, stream, first):
        """Every output of the request; one whose reader goes away mid-stream counts as aborted
        (its AsyncLLM stream, cancelled or closed, has aborted it in the engine)."""
        out = first
        try:
            yield first
            if not first.finished:
                async for out in stream:
                    yield out
        except (asyncio.CancelledError, GeneratorExit):
            if not out.finished:
                self.metrics.finished("abort", None)
            raise

    async def collect(self, stream, first) -> Collected:
        """A whole (not streamed) answer."""
        text, tokens, logprobs, out, scores = "", [], [], first, None
        async for out in self.outputs(stream, first):
            text += out.outputs.text
            tokens += out.outputs.token_ids
            logprobs += out.outputs.logprobs or []
            scores = out.prompt_logprobs or scores
        self.metrics.finished(out.outputs.finish_reason, out.metrics)
        if out.outputs.finish_reason == "error":
            raise BadRequest(out.error_msg, status=out.error_code or 500)
        return Collected(text, tokens, logprobs, out, scores)

    async def collect_all(self, started: list) -> list:
        """collect() of every choice; one that fails cancels (aborts) the others."""
        if len(started) == 1:
            return [await self.collect(*started[0])]
        return await self.each_choice(started, lambda index, stream, first: self.collect(stream, first))

    async def each_choice(self, started: list, work) -> list:
        """``work(index, stream, first)`` of every choice as tasks; when one fails or the caller is
        cancelled, the rest are cancelled, and a choice whose task was cancelled before it ran (so its
        stream was never read: nothing aborted it or counted it) is closed and counted here."""
        entered = [False] * len(started)

        async def run(index, stream, first):
            entered[index] = True
            return await work(index, stream, first)

        tasks = [asyncio.ensure_future(run(i, stream, first)) for i, (stream, first) in enumerate(started)]
        try:
            return await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.abandon([choice for choice, ran in zip(started, entered, strict=True) if not ran])

    def prompt_text(self, prompt) -> str:
        """What echo returns of a prompt: its text as sent, or its token ids decoded."""
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    def token_text(self, token_id: int) -> str:
        texts = self.texts
        return texts[token_id] if 0 <= token_id < len(texts) else self.tokenizer.decode([token_id])

    async def decoded(self, raw: bytes, schema):
        """The body decoded and checked (schemas.decode), on a thread when it is large."""
        if len(raw) > OFF_LOOP_BYTES:
            return await asyncio.to_thread(decode, raw, schema)
        return decode(raw, schema)

    def vllm_prompt_logprobs(self, scores: list) -> list:
        """vLLM's prompt_logprobs: per prompt token (the first: null) {token id: {logprob, rank,
        decoded_token}}, the prompt's own token first, then the top-N there."""
        def entry(token, logprob, rank):
            return {"logprob": logprob, "rank": rank, "decoded_token": self.token_text(token)}

        shown = []
        for score in scores:
            if score is None:
                shown.append(None)
                continue
            tokens = {str(score.token_id): entry(score.token_id, score.logprob, score.rank)}
            for rank, (token, logprob) in enumerate(score.top, 1):
                tokens.setdefault(str(token), entry(token, logprob, rank))
            shown.append(tokens)
        return shown

    def echo_logprobs(self, prompt_ids: list[int], scores: list, top_n: int) -> dict:
        """OpenAI's completion logprobs of an echoed prompt: its first token has none (null)."""
        texts = [self.token_text(t) for t in prompt_ids]
        return {"tokens": texts, "token_logprobs": [s and s.logprob for s in scores],
                "top_logprobs": [s and {self.token_text(t): p for t, p in s.top[:top_n]} for s in scores],
                "text_offset": _offsets(texts, 0)}

    # ------------------------------------------------- tokenize / detokenize
    def limits(self) -> ModelLimits:
        return ModelLimits(self.tokenizer.vocab_size, self.settings.max_model_len)

    async def tokenize(self, raw: bytes) -> Response:
        """vLLM's /tokenize: the ids a completion (prompt) or chat (messages) request would run, from the
        same code the engine runs them with (the API holds the same tokenizer and templates)."""
        body = await self.decoded(raw, TokenizeRequest)
        if body.model is not None:
            self.check_model(body.model)
        try:
            ids = self.tokenizer.prompt_ids(tokenize_body(body), self.limits())
        except RequestError as exc:
            raise BadRequest(str(exc), exc.field, exc.code) from None
        strings = [self.tokenizer.tokenizer.id_to_token(t) for t in ids] if body.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": self.settings.max_model_len, "tokens": ids,
                             "token_strs": strings})

    async def detokenize(self, raw: bytes) -> Response:
        body = await self.decoded(raw, DetokenizeRequest)
        if body.model is not None:
            self.check_model(body.model)
        try:
            check_token_ids(body.tokens, self.limits(), "tokens")
        except RequestError as exc:
            raise BadRequest(str(exc), exc.field) from None
        return JSONResponse({"prompt": self.tokenizer.decode(body.tokens)})

    # ---------------------------------------------------------- completions
    async def completions(self, raw: bytes) -> Response:
        """One choice per prompt and per n (index = prompt * n + i), each an engine request of its own:
        the prompt's KV blocks are shared through the prefix cache, choice i is seeded seed + i."""
        body = await self.decoded(raw, CompletionRequest)
        self.check_model(body.model)
        params = completion_params(body)
        prompts = prompts_of(body)
        per_prompt = choice_params(params, body.n, len(prompts), share_prompt_scores=not body.stream)
        await self.completion_budget(body, params, prompts)
        try:
            started = await self.start_all([(prompt, p) for prompt in prompts for p in per_prompt])
        except BadRequest as exc:
            raise renamed(exc, body) from None
        echoed = [self.prompt_text(prompt) if body.echo else "" for prompt in prompts for _ in per_prompt]
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            usage = _include_usage(body)
            echo_scored = body.logprobs if body.echo else None
            return _sse(self._completion_chunks(started, rid, created, body.model, usage, body.n, echoed, echo_scored),
                        self)
        results = await self.collect_all(started)

        def answer() -> bytes:  # (on a thread: a large answer takes its time, the event loop does not wait)
            choices = [self._completion_choice(i, result, echoed[i], results[i - i % body.n].prompt_logprobs, body)
                       for i, result in enumerate(results)]
            return _JSON({"id": rid, "object": "text_completion", "created": created, "model": body.model,
                          "choices": choices, "usage": _usage(started, body.n, [len(r.tokens) for r in results])})

        return Response(await asyncio.to_thread(answer), media_type="application/json")

    async def completion_budget(self, body: CompletionRequest, params, prompts: list) -> None:
        """The response's size (fdcore.server.budget), text prompts' lengths bounded first and counted only
        when the bound is over budget."""
        echo_top = body.logprobs if body.echo else None
        fields = ", ".join(name for name, given in (("n", body.n > 1), ("prompt", len(prompts) > 1),
                           ("max_tokens", True), ("logprobs", body.logprobs is not None), ("echo", body.echo),
                           ("prompt_logprobs", body.prompt_logprobs is not None)) if given)

        def asks(lengths) -> list[budget.Ask]:
            max_tokens = params.max_tokens if params.max_tokens is not None else self.settings.completion_max_tokens
            return [budget.Ask(max_tokens, body.logprobs, length, echo_top, body.prompt_logprobs)
                    for length in lengths for _ in range(body.n)]

        limit, context = self.settings.max_response_entries, self.settings.max_model_len
        scored = echo_top is not None or body.prompt_logprobs is not None
        bounds = [len(p) if not isinstance(p, str) else budget.text_tokens_bound(p, context) if scored else 0
                  for p in prompts]
        try:
            budget.check(asks(bounds), limit, fields)
        except BadRequest:
            if all(not isinstance(p, str) for p in prompts):
                raise
            exact = await asyncio.to_thread(lambda: [len(self.tokenizer.encode(p)) if isinstance(p, str) else len(p)
                                                     for p in prompts])
            budget.check(asks(exact), limit, fields)

    def _completion_choice(self, index: int, result: Collected, echoed: str, scores, body) -> dict:
        """One whole choice; ``scores``: its prompt's prompt_logprobs (the prompt's first choice scored it)."""
        choice = {"index": index, "text": echoed + result.text, "finish_reason": result.last.outputs.finish_reason,
                  "logprobs": None}
        if body.logprobs is not None:
            choice["logprobs"] = self._completion_logprobs(result.tokens, result.logprobs, len(echoed))
            if body.echo:
                prompt = self.echo_logprobs(result.last.prompt_token_ids, scores, body.logprobs)
                choice["logprobs"] = _joined(prompt, choice["logprobs"])
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.vllm_prompt_logprobs(scores)
        return choice

    async def _completion_chunks(self, started, rid, created, model, include_usage, n, echoed, echo_scored):
        """``echo_scored``: echo with logprobs (top-N): each echoed prompt comes with its scores, in
        front of its choice's first output (which brings them); else the echoed prompts come first."""
        produced, offsets = [0] * len(started), [len(text) for text in echoed]
        pending_echo = [bool(text) for text in echoed]
        for index, text in enumerate(echoed):
            if text and echo_scored is None:  # echo: the prompt first
                pending_echo[index] = False
                yield {"id": rid, "object": "text_completion", "created": created, "model": model,
                       "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": None}]}
        async for index, out in self.merged(started):
            if pending_echo[index]:
                pending_echo[index] = False
                logprobs = self.echo_logprobs(out.prompt_token_ids, out.prompt_logprobs, echo_scored)
                yield {"id": rid, "object": "text_completion", "created": created, "model": model,
                       "choices": [{"index": index, "text": echoed[index], "logprobs": logprobs,
                                    "finish_reason": None}]}
            produced[index] += len(out.outputs.token_ids)
            logprobs = None
            if out.outputs.logprobs:
                logprobs = self._completion_logprobs(out.outputs.token_ids, out.outputs.logprobs, offsets[index])
            offsets[index] += len(out.outputs.text)
            if out.outputs.text or out.finished:
                yield {"id": rid, "object": "text_completion", "created": created, "model": model,
                       "choices": [{"index": index, "text": out.outputs.text, "logprobs": logprobs,
                                    "finish_reason": out.outputs.finish_reason}]}
            if out.finished:
                self.metrics.finished(out.outputs.finish_reason, out.metrics)
        if include_usage:
            yield {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
                   "usage": _usage(started, n, produced)}

    def _completion_logprobs(self, tokens, logprobs, offset):
        texts = [self.token_text(t) for t in tokens]
        return {"tokens": texts, "token_logprobs": [lp[0][1] for lp in logprobs],
                "top_logprobs": [{self.token_text(t): p for t, p in lp[1:]} for lp in logprobs],
                "text_offset": _offsets(texts, offset)}

    # ----------------------------------------------------------------- chat
    async def chat(self, raw: bytes) -> Response:
        body = await self.decoded(raw, ChatCompletionRequest)
        self.check_model(body.model)
        plan = plan_of(body.tools, body.tool_choice)
        params = chat_params(body, self.settings.default_max_tokens or self.settings.max_model_len, plan.constraint())
        prompt = chat_prompt(body)
        await self.chat_budget(body, params, prompt)
        try:
            started = await self.start_all([(prompt, p) for p in choice_params(params, body.n)])
        except BadRequest as exc:
            raise renamed(exc, body) from None
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            usage = _include_usage(body)
            return _sse(self._chat_chunks(started, rid, created, body.model, usage, body.logprobs, body.n, plan), self)
        results = await self.collect_all(started)
        return Response(await asyncio.to_thread(self._chat_answer, body, plan, results, started, rid, created),
                        media_type="application/json")

    def _chat_answer(self, body: ChatCompletionRequest, plan: ToolPlan, results: list, started: list, rid: str,
                     created: int) -> bytes:
        """A whole chat completion as JSON (on a thread: see completions)."""
        choices = []
        for i, (text, tokens, logprobs, out, _) in enumerate(results):
            reasoning, answer = split_reasoning(self.settings.reasoning_parser, text)
            content, calls = plan.split(answer) if answer or reasoning is None else (None, [])  # all thought
            message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {}),
                       **({"reasoning_content": reasoning} if self.settings.reasoning_parser else {})}
            choices.append({"index": i, "message": message,
                            "finish_reason": _tool_finish(out.outputs.finish_reason, plan, bool(calls)),
                            "logprobs": {"content": self._chat_logprobs(tokens, logprobs)} if body.logprobs else None})
        answer = {"id": rid, "object": "chat.completion", "created": created, "model": body.model,
                  "choices": choices, "usage": _usage(started, body.n, [len(r.tokens) for r in results])}
        if body.prompt_logprobs is not None:  # vLLM's: the rendered prompt's, once for every choice
            answer["prompt_logprobs"] = self.vllm_prompt_logprobs(results[0].prompt_logprobs)
        return _JSON(answer)

    async def chat_budget(self, body: ChatCompletionRequest, params, prompt: dict) -> None:
        """The response's size (fdcore.server.budget); the rendered prompt is counted only where its
        scores (prompt_logprobs) could put it over budget."""
        top = (body.top_logprobs or 0) if body.logprobs else None
        fields = ", ".join(name for name, given in (("n", body.n > 1), ("max_tokens", True), ("top_logprobs", top),
                           ("prompt_logprobs", body.prompt_logprobs is not None)) if given)
        outputs = [budget.Ask(params.max_tokens, top)] * body.n
        if body.prompt_logprobs is None:
            budget.check(outputs, self.settings.max_response_entries, fields)
            return
        scored = budget.Ask(0, None, self.settings.max_model_len, None, body.prompt_logprobs)
        try:
            budget.check(outputs + [scored], self.settings.max_response_entries, fields)
        except BadRequest:
            request = RequestBody(**prompt)
            try:
                length = len(await asyncio.to_thread(self.tokenizer.prompt_ids, request, self.limits()))
            except RequestError:  # the engine names what is wrong with the prompt
                return
            budget.check(outputs + [budget.Ask(0, None, length, None, body.prompt_logprobs)],
                         self.settings.max_response_entries, fields)

    async def _chat_chunks(self, started, rid, created, model, include_usage, want_logprobs, n, plan):
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        for index in range(len(started)):
            yield {**base, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]}
        produced = [0] * len(started)
        streams = [ToolStream(plan) for _ in started]
        thoughts = [ReasoningStream(self.settings.reasoning_parser) for _ in started]
        async for index, out in self.merged(started):
            produced[index] += len(out.outputs.token_ids)
            logprobs = None
            if want_logprobs and out.outputs.logprobs:
                logprobs = {"content": self._chat_logprobs(out.outputs.token_ids, out.outputs.logprobs)}
            pieces = thoughts[index].feed(out.outputs.text) + (thoughts[index].finish() if out.finished else [])
            deltas, reason = [], None
            for field, piece in pieces:  # the answer's pieces go on through the tool-call parser
                deltas += [{field: piece}] if field == REASONING else streams[index].feed(piece)
            if out.finished:
                due, called = streams[index].finish()
                deltas, reason = deltas + due, _tool_finish(out.outputs.finish_reason, plan, called)
            if out.finished and not deltas:
                deltas = [{}]
            for i, delta in enumerate(deltas):
                yield {**base, "choices": [{"index": index, "delta": delta, "logprobs": logprobs if i == 0 else None,
                                            "finish_reason": reason if i == len(deltas) - 1 else None}]}
            if out.finished:
                self.metrics.finished(out.outputs.finish_reason, out.metrics)
        if include_usage:
            yield {**base, "choices": [], "usage": _usage(started, n, produced)}

    def _chat_logprobs(self, tokens, logprobs):
        entries = []
        for lp in logprobs:
            text = self.token_text(lp[0][0])
            entries.append({"token": text, "logprob": lp[0][1], "bytes": list(text.encode()),
                            "top_logprobs": [{"token": self.token_text(t), "logprob": p,
                                              "bytes": list(self.token_text(t).encode())} for t, p in lp[1:]]})
        return entries


def _offsets(texts: list[str], start: int) -> list[int]:
    """Where each of these consecutive texts starts, the first at ``start``."""
    offsets, at = [], start
    for text in texts:
        offsets.append(at)
        at += len(text)
    return offsets


def _joined(first: dict, then: dict) -> dict:
    """Two OpenAI completion logprobs objects as one (the echoed prompt's, then the answer's)."""
    return {key: first[key] + then[key] for key in first}


_JSON = msgspec.json.Encoder().encode  # (compact, UTF-8, and a logprob of -inf becomes null, not invalid JSON)


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (its body was read already: only a disconnect is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _tool_finish(reason: str, plan: ToolPlan, called: bool) -> str:
    """OpenAI's finish_reason: tool_calls when the model chose to call (auto, required); a named
    function's call ends with stop."""
    return "tool_calls" if called and reason == "stop" and plan.mode in ("auto", "required") else reason


def _include_usage(body) -> bool:
    return bool((body.stream_options or {}).get("include_usage"))


def _usage(started: list, n: int, produced: list[int]) -> dict:
    """OpenAI's usage: each prompt's tokens once (not once per choice), every choice's output."""
    prompt_tokens = sum(len(first.prompt_token_ids or []) for _, first in started[::n])
    completion_tokens = sum(produced)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(chunks, api: _Api) -> StreamingResponse:
    async def events():
        try:
            async for chunk in chunks:
                yield b"data: " + _JSON(chunk) + b"\n\n"
            if api.drain_over:  # cut short by the server's stop: say so before the end
                yield b"data: " + _JSON(error_body("The server shut down before this stream ended", 503,
                                                   code="shutting_down")) + b"\n\n"
            yield b"data: [DONE]\n\n"
        except asyncio.CancelledError:  # the client went away: the request is aborted upstream
            raise
    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
