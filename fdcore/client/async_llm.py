"""``AsyncLLM``: requests as async streams of outputs (FastDeploy's convention: each output carries the new
tokens and text since the previous one)."""

from __future__ import annotations

import asyncio
import functools
import uuid

from fdcore.client.base import Client
from fdcore.client.outputs import chat_prompt, output_of, refused
from fdcore.client.router import Backoff, LoopSink
from fdcore.client.tree import check_health
from fdcore.ipc import RingFull
from fdcore.protocol import (
    SamplingParams,
    ServingStats,
)


# -------------------------------------------------------------------- async
class AsyncLLM(Client):
    """Asynchronous client: many concurrent streaming requests, from one event loop or several
    (each in its own thread)."""

    # ---------------------------------------------------------------- public
    async def generate(
        self,
        prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        wait: bool = False,
        tenant: str = "",
    ):
        """Stream ``RequestOutput`` deltas of one request until it finishes. ``wait=True``: while the
        engine is full (429), the request waits in this client and is sent again as room frees,
        instead of ending with the 429 error. ``tenant``: whom it is for, where this client serves
        several (the KV cache is shared fairly between tenants). Raises :class:`EngineDeadError` when
        the tree is gone."""
        request_id = request_id or uuid.uuid4().hex
        params = sampling_params or SamplingParams()
        answers: asyncio.Queue = asyncio.Queue()
        sink = LoopSink(asyncio.get_running_loop())
        finished, prompt_ids, backoff = False, None, Backoff()
        await self._submit(request_id, prompt, params, sink, answers, tenant)
        try:
            while not finished:
                update = await answers.get()
                if isinstance(update, BaseException):
                    finished = True
                    raise update
                if wait and refused(update):
                    await asyncio.sleep(backoff.next())
                    await self._submit(request_id, prompt, params, sink, answers, tenant)
                    continue
                prompt_ids = update.prompt_token_ids or prompt_ids
                out = output_of(request_id, prompt, update, prompt_ids)
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._router.forget(request_id)  # the caller stopped listening: stop computing

    async def _submit(self, request_id: str, prompt, params: SamplingParams, sink, answers, tenant: str) -> None:
        """Submit without blocking the event loop: only when the engine's link is full does the
        (blocking) wait for room move to a worker thread."""
        submit = functools.partial(self._router.submit, request_id, prompt, params, sink, answers, tenant=tenant)
        try:
            submit(timeout=0.0)
        except RingFull:
            await asyncio.get_running_loop().run_in_executor(None, submit)

    async def chat(
        self,
        messages: list[dict],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        **options,
    ):
        """Stream the answer to one conversation; ``options`` as :func:`chat_prompt` (tools, ...)."""
        async for out in self.generate(chat_prompt(messages, **options), sampling_params, request_id):
            yield out

    async def abort(self, request_id: str) -> None:
        self._router.abort(request_id)

    async def check_health(self) -> tuple[bool, str]:
        return check_health(self._tree)

    async def stats(self, timeout: float = 10.0) -> ServingStats:
        """Running / waiting requests, steps, preemptions, KV-cache usage and prefix hit rate."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def answer(result) -> None:
            loop.call_soon_threadsafe(settle, future, result)

        nonce = self._router.query_stats(answer)
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self._router.stats_waiters.pop(nonce, None)

    async def shutdown(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._close)

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()


def settle(future: asyncio.Future, result) -> None:
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
