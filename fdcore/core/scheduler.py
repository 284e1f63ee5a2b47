"""Continuous batching with one rule for prefill and decode (the scheduler's policy).

Every request has ``num_computed_tokens`` and ``num_tokens`` (prompt plus
output so far); each step lets it catch up by as many tokens as the step's
budget allows. That one rule covers chunked prefill (a long prompt catches up
over several steps), decode (one token behind) and prefix caching (cached
tokens count as computed from the start). Running requests go first, oldest
first; when KV blocks run out, the newest running request is preempted by
recompute (blocks freed, computed count reset, back to the head of the queue),
so nothing is lost: it simply catches up again later. Pure: no processes.

Tenants (who a request is for: a client process, and behind the HTTP server a
peer) share fairly: where several have requests, each has a max-min fair share
of the cache's blocks (a tenant that wants less than an equal part leaves the
rest to the others). The next waiting request is
the oldest of the tenant that holds the fewest blocks; a tenant at its share is
admitted only with blocks to spare for the running requests' growth; one below
it that finds no room (blocks or sequences) displaces the newest request of the
tenant furthest over its share; and a preemption for growth takes that
tenant's newest too. So clients that send huge requests and
never read cannot keep another's first token waiting, and tenants over their
share do not preempt one another in turn. With one tenant all of this is the
plain order above.
"""

from __future__ import annotations

import enum
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, cast

from fdcore.core.kv_cache_manager import KVCacheManager
from fdcore.protocol import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)  # identity: list membership tests must not compare every field
class Request:
    """A request as the batching policy sees it (owned by :class:`Scheduler`, in the scheduler actor or
    EngineCore): tokens computed and pending, status, preemptions. Not the engine's ``TrackedRequest``:
    the policy holds no text, client or timing, and a restarted scheduler rebuilds it from the engine's
    table (AddSeq with the tokens produced so far)."""

    request_id: str | int
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_pending: int = 0  # trailing PLACEHOLDER tokens: sampled on the worker, not yet reported
    full_blocks_known: int = 0  # full computed blocks already offered to the prefix cache
    final_pending: bool = False  # its last token (by length) is being sampled: schedule no more
    tenant: str = ""  # who it is for: KV blocks are shared fairly between tenants

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


PLACEHOLDER = -1  # an output token the worker has sampled (or will) but the scheduler not yet seen


class ScheduledRequest:
    """One request's share of a step."""

    __slots__ = ("request", "start", "num_tokens", "block_table", "samples", "launched", "preemptions")

    def __init__(self, request: Request, start: int, num_tokens: int, block_table: list[int]):
        self.request = request
        self.start = start  # position of the first token computed this step
        self.num_tokens = num_tokens  # tokens computed this step
        self.block_table = block_table
        # this step brings the request level: its logits give the next token
        self.samples = start + num_tokens == request.num_tokens
        self.launched = False  # accounted for ahead of its result (see Scheduler.launch)
        self.preemptions = request.num_preemptions  # (another count at its result: these blocks are gone)

    @property
    def token_ids(self) -> list[int]:
        return self.request.all_token_ids[self.start : self.start + self.num_tokens]


@dataclass
class BatchLimits:
    """The policy's limits (the ``[scheduler]`` section's, config.SchedulerConfig, as the pure policy takes them)."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    kv_blocks: int = 0  # the KV cache's blocks (the tenants' fair share is a part of them; 0: not shared out)
    long_prefill_tokens: int = 0  # prompt tokens a step computes while others decode (0: the whole budget)


class Scheduler:
    def __init__(self, config: BatchLimits, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str | int, Request] = {}
        self.num_preemptions = 0  # since start
        self.tenants: Counter[str] = Counter()  # unfinished requests by tenant
        self._shares: dict[str, float] | None = None

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.tenants[request.tenant] += 1
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --------------------------------------------------------------- schedule
    def schedule(self) -> list[ScheduledRequest]:
        # NOTE: the per-step loops over running requests (here, growth_plan, launch, update) are the
        # scheduler actor's cost per sequence and step, which bounds the whole tree's step rate: they
        # read each attribute once into a local (64 sequences x 5 loops a step add up).
        budget = self.config.max_num_batched_tokens
        prefill = self._prefill_budget(budget)
        scheduled: list[ScheduledRequest] = []
        self._shares = None  # (the tenants' shares, worked out once a step where needed)
        for request in list(self.running):
            if request.status is not Status.RUNNING:  # preempted by an older one this step
                continue
            catching_up = request.num_tokens - request.num_computed_tokens > 1
            item = self._schedule_running(request, min(budget, prefill) if catching_up else budget, scheduled)
            if item is not None:
                scheduled.append(item)
                budget -= item.num_tokens
                prefill -= item.num_tokens if catching_up else 0
        while self.waiting and budget > 0 and prefill > 0:
            request = self._next_waiting()
            if not self._may_admit(request):
                break
            item = (
                self._schedule_waiting(request, min(budget, prefill))
                if len(self.running) < self.config.max_num_seqs
                else None
            )
            if item is None:
                if self._displace_for(request, scheduled):
                    continue
                break
            self.waiting.remove(request)
            self.running.append(item.request)
            scheduled.append(item)
            budget -= item.num_tokens
            prefill -= item.num_tokens
        return scheduled

    def _prefill_budget(self, budget: int) -> int:
        """Prompt tokens (any catch-up of more than one token) this step may compute: all of the budget,
        but only ``long_prefill_tokens`` while some running request waits for its next token, so that a
        long prompt (or a preempted request's recompute) never makes a step that keeps everyone else's
        token waiting (chunks change no result: a row's bits are its own)."""
        cap = self.config.long_prefill_tokens
        if not cap or cap >= budget:
            return budget
        decoding = any(r.num_tokens - r.num_computed_tokens <= 1 for r in self.running if not r.final_pending)
        return cap if decoding else budget

    # ---------------------------------------------------------------- tenants
    def _next_waiting(self) -> Request:
        """The oldest waiting request of the tenant holding the fewest blocks (the queue's head when
        every waiting request is one tenant's)."""
        head = self.waiting[0]
        if len(self.tenants) == 1 or all(r.tenant == head.tenant for r in self.waiting):
            return head
        held = self._blocks_by_tenant()
        return min(self.waiting, key=lambda r: held.get(r.tenant, 0))  # (min keeps the first of equals)

    def _blocks_by_tenant(self) -> dict[str, int]:
        held: dict[str, int] = {}
        for r in self.running:
            held[r.tenant] = held.get(r.tenant, 0) + len(self.kv.block_table(r.request_id))
        return held

    def _victim(self) -> Request:
        """Whom a preemption takes: the newest running request of the tenant furthest over its share
        (holding the most, where shares are not known)."""
        newest = self.running[-1]
        if len(self.tenants) == 1 or all(r.tenant == newest.tenant for r in self.running):
            return newest
        largest = self._most_over()
        return next(r for r in reversed(self.running) if r.tenant == largest)

    def _most_over(self) -> str:
        """The running tenant furthest over its fair share (or holding the most blocks)."""
        held = self._blocks_by_tenant()
        return max(held, key=lambda t: held[t] - (self._share(t) or 0.0))

    def _share(self, tenant: str) -> float | None:
        """A tenant's fair share of the cache's blocks (None with one tenant, or no known size): max-min
        fair, each tenant's demand (what it holds and what its waiting requests need) filled from the
        smallest up, so that a tenant wanting less than an equal part leaves the rest to the others."""
        if len(self.tenants) == 1 or not self.config.kv_blocks:
            return None
        if self._shares is None:
            demand = self._blocks_by_tenant()
            for r in self.waiting:
                demand[r.tenant] = demand.get(r.tenant, 0) + self._need(r)
            self._shares, left = {}, float(self.config.kv_blocks)
            for i, (t, wanted) in enumerate(sorted(demand.items(), key=lambda item: item[1])):
                self._shares[t] = min(wanted, left / (len(demand) - i))
                left -= self._shares[t]
        return self._shares.get(tenant, 0.0)

    def _need(self, request: Request) -> int:
        return -(-request.num_tokens // self.kv.block_size)

    def _may_admit(self, request: Request) -> bool:
        """A tenant at its share (or beyond, with this request) comes in only while blocks remain for
        every running request to grow by one: else its request would only be preempted again soon,
        its work lost (recompute), over and over."""
        share = self._share(request.tenant)
        if share is None:
            return True
        held = self._blocks_by_tenant().get(request.tenant, 0)
        if held + self._need(request) <= share:
            return True
        return self.kv.num_free_blocks - self._need(request) >= len(self.running)

    def _displace_for(self, request: Request, scheduled: list[ScheduledRequest]) -> bool:
        """Make room for a waiting request that found none and whose tenant stays within its share by
        preempting the newest request of the tenant holding the most, when that one is over its share.
        True when it did."""
        share = self._share(request.tenant)
        if share is None or not self.running:
            return False
        held = self._blocks_by_tenant()
        largest = self._most_over()
        if (
            largest == request.tenant
            or held[largest] <= cast(float, self._share(largest))
            or held.get(request.tenant, 0) + self._need(request) > share
        ):
            return False
        self._preempt(next(r for r in reversed(self.running) if r.tenant == largest), scheduled)
        return True

    def growth_plan(self) -> list[tuple[str | int, int]]:
        """(request id, tokens to hold) for each running request, as the next schedule() will
        ask for them if blocks do not run out: lets a remote block manager grow them all at once."""
        budget, plan = self.config.max_num_batched_tokens, []
        prefill = self._prefill_budget(budget)
        for request in self.running:
            if request.final_pending:
                continue
            computed = request.num_computed_tokens
            behind = request.num_tokens - computed
            count = min(behind, budget, prefill) if behind > 1 else min(behind, budget)
            if count > 0:
                plan.append((request.request_id, computed + count))
                budget -= count
                prefill -= count if behind > 1 else 0
        return plan

    def _schedule_running(
        self, request: Request, budget: int, scheduled: list[ScheduledRequest]
    ) -> ScheduledRequest | None:
        if request.final_pending:
            return None
        start = request.num_computed_tokens
        count = min(request.num_tokens - start, budget)
        if count <= 0:
            return None
        while not self.kv.append_slots(request.request_id, start + count):
            victim = self._victim()
            self._preempt(victim, scheduled)
            if victim is request:
                return None
        return ScheduledRequest(request, start, count, self.kv.block_table(request.request_id))

    def _schedule_waiting(self, request: Request, budget: int) -> ScheduledRequest | None:
        cached = self.kv.allocate(
            request.request_id, request.all_token_ids, budget, reuse_prefix=request.params.prompt_logprobs is None
        )
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
        victim.full_blocks_known = 0
        victim.status = Status.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    # ----------------------------------------------------------------- update
    def launch(self, scheduled: list[ScheduledRequest]) -> None:
        """Account for a step as sent, before its result (asynchronous scheduling).

        The next step can then be scheduled while this one runs: each sampling
        request gets a PLACEHOLDER output token (the worker knows the real one
        before it runs the next step), and a request whose token count reaches
        its length limit is scheduled no more. :meth:`update` fills in the real
        tokens. Only a request that stops early (EOS, stop id, stop string)
        costs one wasted slot in the step after.
        """
        max_model_len = self.config.max_model_len
        for item in scheduled:
            request = item.request
            item.launched = True
            request.num_computed_tokens += item.num_tokens
            if item.samples:
                output = request.output_token_ids
                output.append(PLACEHOLDER)
                request.num_pending += 1
                produced = len(output)
                if produced >= cast(int, request.params.max_tokens) or request.num_tokens >= max_model_len:
                    request.final_pending = True

    def update(self, scheduled: list[ScheduledRequest], sampled: dict[Any, int]) -> list[Request]:
        """Account for a finished step; returns the requests that finished."""
        finished = []
        block_size, running, finished_status = self.kv.block_size, Status.RUNNING, Status.FINISHED
        for item in scheduled:
            request = item.request
            if request.status is finished_status:  # ended while its step ran
                continue
            if not item.launched:
                request.num_computed_tokens += item.num_tokens
            if item.samples:
                token = sampled.get(request.request_id)
                if token is not None:
                    reason = self._record(request, item, token)
                    if reason:
                        self._finish(request, reason)
                        finished.append(request)
                        continue
            if request.status is running and item.preemptions == request.num_preemptions:
                # computed: what this step wrote, now that its result is in, not what a step still in flight
                # was given (a worker that crashes in it leaves a block half written, and a KV cache in shared
                # memory outlives the crash with the prefix cache still pointing at its blocks)
                known = min(item.start + item.num_tokens, request.num_tokens - request.num_pending)
                if known // block_size > request.full_blocks_known:  # a block filled up
                    request.full_blocks_known = known // block_size
                    self.kv.cache_computed(request.request_id, request.all_token_ids, known)
        return finished

    def _record(self, request: Request, item: ScheduledRequest, token: int) -> str | None:
        """Store a sampled token (in its placeholder when launched); the finish reason it causes."""
        output = request.output_token_ids
        if item.launched:
            produced = len(output) - request.num_pending + 1
            output[produced - 1] = token
            request.num_pending -= 1
        else:
            output.append(token)
            produced = len(output)
        reason = self._finish_reason(request, token, produced)
        if reason:
            del output[produced:]
            request.num_pending = 0
        return reason

    def computed_tails(self, in_flight: list[list[ScheduledRequest]]) -> list[tuple[str | int, int, list[int]]]:
        """For a restart that the KV memory outlives: each running request whose tokens computed by steps
        whose results came back (not those of ``in_flight``, the steps sent and unanswered, which the
        worker may have left half done) end inside a block: (request id, tokens computed, the tokens of
        that last block). The cache manager keeps those blocks for the requests re-sent
        (KVCacheManager.free_all)."""
        pending: Counter[str | int] = Counter()
        for scheduled in in_flight:
            for item in scheduled:
                if item.launched and item.preemptions == item.request.num_preemptions:
                    pending[item.request.request_id] += item.num_tokens
        size, tails = self.kv.block_size, []
        for request in self.running:
            computed = request.num_computed_tokens - pending[request.request_id]
            held = computed % size
            tokens = request.all_token_ids[computed - held : computed]
            if held and PLACEHOLDER not in tokens:
                tails.append((request.request_id, computed, tokens))
        return tails

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
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request.request_id)
        request.status = Status.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]
        self.tenants[request.tenant] -= 1
        if not self.tenants[request.tenant]:
            del self.tenants[request.tenant]

    def _finish_reason(self, request: Request, last: int, produced: int) -> str | None:
        p = request.params
        if produced >= p.min_tokens:
            if not p.ignore_eos and last in request.eos_token_ids:
                return "stop"
            if last in p.stop_token_ids:
                return "stop"
        if produced >= cast(int, p.max_tokens) or len(request.prompt_token_ids) + produced >= self.config.max_model_len:
            return "length"
        return None
