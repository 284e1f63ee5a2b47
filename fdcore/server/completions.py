"""OpenAI's completions endpoint."""

from __future__ import annotations

import asyncio
import time
import uuid

from starlette.responses import Response

from fdcore.server import budget
from fdcore.server.responses import (
    JSON_ENCODE,
    Collected,
    joined_chunk,
    sse_response,
    text_offsets,
    usage_of,
    wants_usage,
)
from fdcore.server.schemas import (
    BadRequest,
    CompletionRequest,
    choice_params,
    completion_params,
    prompts_of,
    renamed,
)


class Completions:
    """POST /v1/completions (a mixin of fdcore.server.app's API, whose helpers these methods use): prompts, n and
    best-of choices, echo and logprobs, streamed or whole."""

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
            usage = wants_usage(body)
            echo_scored = body.logprobs if body.echo else None
            return sse_response(
                self._completion_chunks(started, rid, created, body.model, usage, body.n, echoed, echo_scored), self
            )
        results = await self.collect_all(started)

        def answer() -> bytes:  # (on a thread: a large answer takes its time, the event loop does not wait)
            choices = [
                self._completion_choice(i, result, echoed[i], results[i - i % body.n].prompt_logprobs, body)
                for i, result in enumerate(results)
            ]
            return JSON_ENCODE(
                {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": body.model,
                    "choices": choices,
                    "usage": usage_of(started, body.n, [len(r.tokens) for r in results]),
                }
            )

        return Response(await asyncio.to_thread(answer), media_type="application/json")

    async def completion_budget(self, body: CompletionRequest, params, prompts: list) -> None:
        """The response's size (fdcore.server.budget), text prompts' lengths bounded first and counted only
        when the bound is over budget."""
        echo_top = body.logprobs if body.echo else None
        fields = ", ".join(
            name
            for name, given in (
                ("n", body.n > 1),
                ("prompt", len(prompts) > 1),
                ("max_tokens", True),
                ("logprobs", body.logprobs is not None),
                ("echo", body.echo),
                ("prompt_logprobs", body.prompt_logprobs is not None),
            )
            if given
        )

        def asks(lengths) -> list[budget.Ask]:
            max_tokens = params.max_tokens if params.max_tokens is not None else self.settings.completion_max_tokens
            return [
                budget.Ask(max_tokens, body.logprobs, length, echo_top, body.prompt_logprobs)
                for length in lengths
                for _ in range(body.n)
            ]

        limit, context = self.settings.max_response_entries, self.settings.max_model_len
        scored = echo_top is not None or body.prompt_logprobs is not None
        bounds = [
            len(p) if not isinstance(p, str) else budget.text_tokens_bound(p, context) if scored else 0 for p in prompts
        ]
        try:
            budget.check(asks(bounds), limit, fields)
        except BadRequest:
            if all(not isinstance(p, str) for p in prompts):
                raise
            exact = await asyncio.to_thread(
                lambda: [len(self.tokenizer.encode(p)) if isinstance(p, str) else len(p) for p in prompts]
            )
            budget.check(asks(exact), limit, fields)

    def _completion_choice(self, index: int, result: Collected, echoed: str, scores, body) -> dict:
        """One whole choice; ``scores``: its prompt's prompt_logprobs (the prompt's first choice scored it)."""
        choice = {
            "index": index,
            "text": echoed + result.text,
            "finish_reason": result.last.outputs.finish_reason,
            "logprobs": None,
        }
        if body.logprobs is not None:
            choice["logprobs"] = self._completion_logprobs(result.tokens, result.logprobs, len(echoed))
            if body.echo:
                prompt = self.echo_logprobs(result.last.prompt_token_ids, scores, body.logprobs)
                choice["logprobs"] = joined_chunk(prompt, choice["logprobs"])
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
                yield {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": None}],
                }
        async for index, out in self.merged(started):
            if pending_echo[index]:
                pending_echo[index] = False
                logprobs = self.echo_logprobs(out.prompt_token_ids, out.prompt_logprobs, echo_scored)
                yield {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [{"index": index, "text": echoed[index], "logprobs": logprobs, "finish_reason": None}],
                }
            produced[index] += len(out.outputs.token_ids)
            logprobs = None
            if out.outputs.logprobs:
                logprobs = self._completion_logprobs(out.outputs.token_ids, out.outputs.logprobs, offsets[index])
            offsets[index] += len(out.outputs.text)
            if out.outputs.text or out.finished:
                yield {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [
                        {
                            "index": index,
                            "text": out.outputs.text,
                            "logprobs": logprobs,
                            "finish_reason": out.outputs.finish_reason,
                        }
                    ],
                }
            if out.finished:
                self.metrics.finished(out.outputs.finish_reason, out.metrics)
        if include_usage:
            yield {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [],
                "usage": usage_of(started, n, produced),
            }

    def _completion_logprobs(self, tokens, logprobs, offset):
        texts = [self.token_text(t) for t in tokens]
        return {
            "tokens": texts,
            "token_logprobs": [lp[0][1] for lp in logprobs],
            "top_logprobs": [{self.token_text(t): p for t, p in lp[1:]} for lp in logprobs],
            "text_offset": text_offsets(texts, offset),
        }
