"""Continuous batching with one rule for prefill and decode (the scheduler's policy).

Every request has ``num_computed_tokens`` and ``num_tokens`` (prompt plus
output so far); each step lets it catch up by as many tokens as the step's
budget allows. That one rule covers chunked prefill (a long prompt catches up
over several steps), decode (one token behind) and prefix caching (cached
tokens count as computed from the start). Running requests go first, oldest
first; when KV blocks run out, the newest running request is preempted by
recompute (blocks freed, computed count reset, back to the head of the queue),
so nothing is lost: it simply catches up again later. Pure: no processes.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from fdcore.core.kv_cache_manager import KVCacheManager
from fdcore.protocol import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: list membership tests must not compare every field
class Request:
    request_id: str | int
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass
class ScheduledRequest:
    request: Request
    start: int            # position of the first token computed this step
    num_tokens: int       # tokens computed this step
    block_table: list[int]

    @property
    def samples(self) -> bool:
        """True when this step brings the request level: its logits give the next token."""
        return self.start + self.num_tokens == self.request.num_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.request.all_token_ids[self.start:self.start + self.num_tokens]


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0  # since start

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --------------------------------------------------------------- schedule
    def schedule(self) -> list[ScheduledRequest]:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        for request in list(self.running):
            if request not in self.running:  # preempted by an older one this step
                continue
            item = self._schedule_running(request, budget, scheduled)
            if item is not None:
                scheduled.append(item)
                budget -= item.num_tokens
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            item = self._schedule_waiting(self.waiting[0], budget)
            if item is None:
                break
            self.waiting.popleft()
            self.running.append(item.request)
            scheduled.append(item)
            budget -= item.num_tokens
        return scheduled

    def _schedule_running(self, request: Request, budget: int, scheduled) -> ScheduledRequest | None:
        count = min(request.num_tokens - request.num_computed_tokens, budget)
        if count <= 0:
            return None
        while not self.kv.append_slots(request.request_id, request.num_computed_tokens + count):
            victim = self.running[-1]
            self._preempt(victim, scheduled)
            if victim is request:
                return None
        return ScheduledRequest(request, request.num_computed_tokens, count,
                                self.kv.block_table(request.request_id))

    def _schedule_waiting(self, request: Request, budget: int) -> ScheduledRequest | None:
        cached = self.kv.allocate(request.request_id, request.all_token_ids, budget)
        if cached is None:
            return None
        request.num_computed_tokens = cached
        count = min(request.num_tokens - cached, budget)
        request.status = Status.RUNNING
        return ScheduledRequest(request, cached, count, self.kv.block_table(request.request_id))

    def _preempt(self, victim: Request, scheduled: list[ScheduledRequest]) -> None:
        """Recompute later: free its blocks, forget its progress, put it first in line."""
        self.running.remove(victim)
        scheduled[:] = [s for s in scheduled if s.request is not victim]
        self.kv.free(victim.request_id)
        victim.num_computed_tokens = 0
        victim.status = Status.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    # ----------------------------------------------------------------- update
    def update(self, scheduled: list[ScheduledRequest], sampled: dict[str, int]) -> list[Request]:
        """Account for a finished step; returns the requests that finished."""
        finished = []
        for item in scheduled:
            request = item.request
            if request.status is not Status.RUNNING:  # aborted or preempted while the step ran
                continue
            request.num_computed_tokens += item.num_tokens
            self.kv.cache_computed(request.request_id, request.all_token_ids, request.num_computed_tokens)
            if item.samples and request.request_id in sampled:
                request.output_token_ids.append(sampled[request.request_id])
                reason = self._finish_reason(request)
                if reason:
                    self._finish(request, reason)
                    finished.append(request)
        return finished

    def abort(self, request_id: str | int, reason: str = "abort") -> Request | None:
        """Stop a request at any point (abort, or a stop string the engine saw); its blocks
        are freed at once."""
        request = self.requests.get(request_id)
        if request is None or request.status is Status.FINISHED:
            return None
        if request in self.waiting:
            self.waiting.remove(request)
        self._finish(request, reason)
        return request

    def _finish(self, request: Request, reason: str) -> None:
        if request in self.running:
            self.running.remove(request)
        self.kv.free(request.request_id)
        request.status = Status.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]

    def _finish_reason(self, request: Request) -> str | None:
        p, last, produced = request.params, request.output_token_ids[-1], len(request.output_token_ids)
        if produced >= p.min_tokens:
            if not p.ignore_eos and last in request.eos_token_ids:
                return "stop"
            if last in p.stop_token_ids:
                return "stop"
        if produced >= p.max_tokens or request.num_tokens >= self.config.max_model_len:
            return "length"
        return None
