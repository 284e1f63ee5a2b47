"""OpenAI's chat completions endpoint."""

from __future__ import annotations

import asyncio
import time
import uuid

from starlette.responses import Response

from fdcore.core.validation import RequestError
from fdcore.protocol import RequestBody
from fdcore.server import budget
from fdcore.server.reasoning import REASONING, ReasoningStream, split_reasoning
from fdcore.server.responses import (
    JSON_ENCODE,
    sse_response,
    tool_finish,
    usage_of,
    wants_usage,
)
from fdcore.server.schemas import (
    BadRequest,
    ChatCompletionRequest,
    chat_params,
    chat_prompt,
    choice_params,
    renamed,
)
from fdcore.server.tools import ToolPlan, ToolStream, plan_of


class Chat:
    """POST /v1/chat/completions (a mixin of fdcore.server.app's API): messages through the chat template, tool
    calls and reasoning split out, streamed or whole."""

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
            usage = wants_usage(body)
            return sse_response(
                self._chat_chunks(started, rid, created, body.model, usage, body.logprobs, body.n, plan), self
            )
        results = await self.collect_all(started)
        return Response(
            await asyncio.to_thread(self._chat_answer, body, plan, results, started, rid, created),
            media_type="application/json",
        )

    def _chat_answer(
        self, body: ChatCompletionRequest, plan: ToolPlan, results: list, started: list, rid: str, created: int
    ) -> bytes:
        """A whole chat completion as JSON (on a thread: see completions)."""
        choices = []
        for i, (text, tokens, logprobs, out, _) in enumerate(results):
            reasoning, answer = split_reasoning(self.settings.reasoning_parser, text)
            content, calls = plan.split(answer) if answer or reasoning is None else (None, [])  # all thought
            message = {
                "role": "assistant",
                "content": content,
                **({"tool_calls": calls} if calls else {}),
                **({"reasoning_content": reasoning} if self.settings.reasoning_parser else {}),
            }
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "finish_reason": tool_finish(out.outputs.finish_reason, plan, bool(calls)),
                    "logprobs": {"content": self._chat_logprobs(tokens, logprobs)} if body.logprobs else None,
                }
            )
        answer = {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": body.model,
            "choices": choices,
            "usage": usage_of(started, body.n, [len(r.tokens) for r in results]),
        }
        if body.prompt_logprobs is not None:  # vLLM's: the rendered prompt's, once for every choice
            answer["prompt_logprobs"] = self.vllm_prompt_logprobs(results[0].prompt_logprobs)
        return JSON_ENCODE(answer)

    async def chat_budget(self, body: ChatCompletionRequest, params, prompt: dict) -> None:
        """The response's size (fdcore.server.budget); the rendered prompt is counted only where its
        scores (prompt_logprobs) could put it over budget."""
        top = (body.top_logprobs or 0) if body.logprobs else None
        fields = ", ".join(
            name
            for name, given in (
                ("n", body.n > 1),
                ("max_tokens", True),
                ("top_logprobs", top),
                ("prompt_logprobs", body.prompt_logprobs is not None),
            )
            if given
        )
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
            budget.check(
                outputs + [budget.Ask(0, None, length, None, body.prompt_logprobs)],
                self.settings.max_response_entries,
                fields,
            )

    async def _chat_chunks(self, started, rid, created, model, include_usage, want_logprobs, n, plan):
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        for index in range(len(started)):
            yield {
                **base,
                "choices": [
                    {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
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
                deltas, reason = deltas + due, tool_finish(out.outputs.finish_reason, plan, called)
            if out.finished and not deltas:
                deltas = [{}]
            for i, delta in enumerate(deltas):
                yield {
                    **base,
                    "choices": [
                        {
                            "index": index,
                            "delta": delta,
                            "logprobs": logprobs if i == 0 else None,
                            "finish_reason": reason if i == len(deltas) - 1 else None,
                        }
                    ],
                }
            if out.finished:
                self.metrics.finished(out.outputs.finish_reason, out.metrics)
        if include_usage:
            yield {**base, "choices": [], "usage": usage_of(started, n, produced)}

    def _chat_logprobs(self, tokens, logprobs):
        entries = []
        for lp in logprobs:
            text = self.token_text(lp[0][0])
            entries.append(
                {
                    "token": text,
                    "logprob": lp[0][1],
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {"token": self.token_text(t), "logprob": p, "bytes": list(self.token_text(t).encode())}
                        for t, p in lp[1:]
                    ],
                }
            )
        return entries
