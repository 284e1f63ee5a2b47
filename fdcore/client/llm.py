"""``LLM``: whole outputs for a list of prompts, keeping a window of requests in the engine and sending
refused ones again (never a 429), with an optional progress bar."""

from __future__ import annotations

import collections
import queue
import sys
import time
import uuid

from fdcore.client.base import INITIAL_WINDOW, Client
from fdcore.client.outputs import RequestOutput, accumulate, as_prompt_list, chat_prompt, refused
from fdcore.client.router import Backoff, Router
from fdcore.client.tree import check_health
from fdcore.protocol import (
    SamplingParams,
    ServingStats,
    Update,
)


# --------------------------------------------------------------------- sync
class LLM(Client):
    """Synchronous helper: ``LLM(config).generate(prompts, params) -> list[RequestOutput]``; safe to
    call from several threads at once."""

    def generate(
        self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order of ``prompts``. However many there
        are, none is refused: a window of requests is kept in the engine and refilled as they
        finish, shrunk to what the engine accepts when it answers 429 (the refused ones are sent
        again). Raises :class:`EngineDeadError` if the tree goes away."""
        prompts = as_prompt_list(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts")
        return Batch(self._router, prompts, params, Progress(len(prompts), enabled=use_tqdm), self._window).run()

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        **options,
    ) -> list[RequestOutput]:
        """Answer one conversation, or each of a list of them; ``options`` as :func:`chat_prompt`."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([chat_prompt(c, **options) for c in conversations], sampling_params, use_tqdm)

    def check_health(self) -> tuple[bool, str]:
        return check_health(self._tree)

    def stats(self, timeout: float = 10.0) -> ServingStats:
        answers: queue.SimpleQueue = queue.SimpleQueue()
        nonce = self._router.query_stats(answers.put)
        try:
            result = answers.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no statistics from the engine within {timeout:g} s") from None
        finally:
            self._router.stats_waiters.pop(nonce, None)
        if isinstance(result, BaseException):
            raise result
        return result

    def shutdown(self) -> None:
        self._close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


class Batch:
    """One ``LLM.generate`` call: keeps a window of its requests in the engine, refills it as they
    finish and sends refused (429) ones again, so any number of prompts goes through and the
    client holds state only for the window (plus each finished output).

    NOTE: the window is learnt as TCP learns its congestion window: it starts at the engine's
    limit (its configured one when this client started the tree, else the default); every 429 shrinks it to the
    requests still in flight (a burst's refusals arrive
    together, so it settles on what the engine accepted), every finished request grows it by
    1/window (one more request per window's worth of answers), probing for room other clients
    freed. With nothing in flight, a refused request waits a doubling back-off before it retries.
    """

    growth = 1.0  # requests the window grows by per window's worth of finished ones (0: a fixed window)

    def __init__(self, router: Router, prompts: list, params: list, bar: Progress, window: int = INITIAL_WINDOW):
        self.router, self.prompts, self.params, self.bar = router, prompts, params, bar
        self.results: list[RequestOutput | None] = [None] * len(prompts)
        self.tag = uuid.uuid4().hex[:8]
        self.answers: queue.SimpleQueue = queue.SimpleQueue()
        self.flying: set[int] = set()
        self.retry: collections.deque[int] = collections.deque()
        self.next = 0
        self.done = 0
        self.window = float(window)
        self.backoff, self.hold_until = Backoff(), 0.0

    def run(self) -> list[RequestOutput]:
        try:
            while self.done < len(self.prompts):
                self._fill()
                self._receive()
        except BaseException:
            for i in self.flying:
                self.router.forget(self._id(i))
            raise
        finally:
            self.bar.close()
        return self.results

    def _id(self, i: int) -> str:
        return f"{self.tag}-{i}"

    def _fill(self) -> None:
        """Send requests (refused ones first) while the window has room."""
        if time.monotonic() < self.hold_until:
            return
        while len(self.flying) < self.window and (self.retry or self.next < len(self.prompts)):
            if self.retry:
                i = self.retry.popleft()
            else:
                i, self.next = self.next, self.next + 1
            self.router.submit(self._id(i), self.prompts[i], self.params[i] or SamplingParams(), self.answers.put, i)
            self.flying.add(i)

    def _receive(self) -> None:
        """Take every batch of answers the reader has routed to us (wait for the first)."""
        timeout = None if self.flying else max(0.0, self.hold_until - time.monotonic())
        try:
            items = self.answers.get(timeout=timeout)
        except queue.Empty:
            return
        while True:
            for i, update in items:
                if isinstance(update, BaseException):
                    raise update
                self._take(i, update)
            try:
                items = self.answers.get_nowait()
            except queue.Empty:
                return

    def _take(self, i: int, update: Update) -> None:
        if refused(update):
            self.flying.discard(i)
            self.retry.append(i)
            self.window = max(1.0, float(len(self.flying)))
            if not self.flying:
                self.hold_until = time.monotonic() + self.backoff.next()
            return
        out = self.results[i]
        if out is None:
            out = self.results[i] = RequestOutput(self._id(i), self.prompts[i])
        accumulate(out, update)
        if out.finished:
            self.flying.discard(i)
            self.done += 1
            self.window += self.growth / self.window
            self.backoff = Backoff()
            self.bar.advance()


class Progress:
    """A one-line progress bar on stderr (only when it is a terminal, or forced)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done = total, 0
        self.enabled = enabled and sys.stderr.isatty()
        self.started = time.monotonic()

    def advance(self) -> None:
        self.done += 1
        if self.enabled:
            filled = 30 * self.done // self.total
            rate = self.done / max(1e-9, time.monotonic() - self.started)
            sys.stderr.write(
                f"\rgenerating [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} ({rate:.1f} req/s)"
            )
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
