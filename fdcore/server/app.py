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

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fdcore.core.validation import ModelLimits, RequestError, check_token_ids
from fdcore.server.chat import Chat
from fdcore.server.completions import Completions
from fdcore.server.metrics import ServerMetrics
from fdcore.server.responses import (
    CLIENT_CLOSED,
    Collected,
    disconnected,
    error_response,
    text_offsets,
)
from fdcore.server.schemas import (
    BadRequest,
    DetokenizeRequest,
    TokenizeRequest,
    decode,
    tokenize_body,
)


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


def build_app(llm, settings: Settings, tokenizer, health, restarts, spares=dict) -> Starlette:
    """``llm``: an AsyncLLM; ``health()`` -> (ok, reason); ``restarts()`` -> {actor: count}; ``spares()`` ->
    {worker: none | loading | warm}."""
    # (long: the route table and the handlers' shared state; each handler is a line or two)
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
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": settings.model_name,
                        "object": "model",
                        "created": api.started,
                        "owned_by": "fdcore",
                        "max_model_len": settings.max_model_len,
                    }
                ],
            }
        )

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

    app = Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/health", health_check, methods=["GET"]),
            Route("/metrics", metrics_endpoint, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error},
    )
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


class _Api(Chat, Completions):
    def __init__(self, llm, settings: Settings, tokenizer, metrics: ServerMetrics):
        self.llm, self.settings, self.tokenizer, self.metrics = llm, settings, tokenizer, metrics
        self.started = int(time.time())
        self.open: set[str] = set()  # the engine requests of this server that have not ended
        self.draining = False  # stopping: new requests get 503, the open ones run out (drain())
        self.drain_over = False  # the drain's time ran out: what is left was aborted
        # every token's text, made once: a response with logprobs names tens of thousands of tokens
        self.texts = (
            []
            if tokenizer is None
            else tokenizer.tokenizer.decode_batch([[t] for t in range(tokenizer.tokenizer.get_vocab_size())])
        )

    # ------------------------------------------------------------- plumbing
    def check_key(self, request: Request) -> Response | None:
        key = self.settings.api_key
        if not key:
            return None
        given = request.headers.get("authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return None
        return error_response("Incorrect or missing API key (Authorization: Bearer ...)", 401, code="invalid_api_key")

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
            return error_response(
                "The server is shutting down; retry on another", 503, code="shutting_down", headers={"Retry-After": "1"}
            )
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
        gone = asyncio.ensure_future(disconnected(request))
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
            raise BadRequest(
                f"The model '{model}' does not exist; this server serves '{self.settings.model_name}'",
                "model",
                404,
                code="model_not_found",
            )

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
        stream = self._tracked(
            request_id, self.llm.generate(prompt, params, request_id=request_id, tenant=TENANT.get())
        )
        try:
            first = await stream.__anext__()
        except asyncio.CancelledError:  # the client left before the first output
            self.metrics.finished("abort", None)
            raise
        if first.outputs.finish_reason == "error":
            await stream.aclose()
            self.metrics.finished("error", None)
            field = first.error_msg.split(":", 1)[0] if ":" in first.error_msg else None
            raise BadRequest(
                first.error_msg,
                field,
                first.error_code or 500,
                code="rate_limit_exceeded" if first.error_code == 429 else None,
            )
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
            await self.abandon(
                [
                    result
                    for result in await asyncio.gather(*tasks, return_exceptions=True)
                    if not isinstance(result, BaseException)
                ]
            )
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
        return {
            "tokens": texts,
            "token_logprobs": [s and s.logprob for s in scores],
            "top_logprobs": [s and {self.token_text(t): p for t, p in s.top[:top_n]} for s in scores],
            "text_offset": text_offsets(texts, 0),
        }

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
        return JSONResponse(
            {"count": len(ids), "max_model_len": self.settings.max_model_len, "tokens": ids, "token_strs": strings}
        )

    async def detokenize(self, raw: bytes) -> Response:
        body = await self.decoded(raw, DetokenizeRequest)
        if body.model is not None:
            self.check_model(body.model)
        try:
            check_token_ids(body.tokens, self.limits(), "tokens")
        except RequestError as exc:
            raise BadRequest(str(exc), exc.field) from None
        return JSONResponse({"prompt": self.tokenizer.decode(body.tokens)})
