"""The scheduler actor (fdcore:scheduler): continuous batching across the actor tree.

It runs the pure policy (:class:`~fdcore.core.scheduler.Scheduler`: one catch-up
rule for prefill and decode, token budget, chunked prefill, FCFS, preemption by
recompute) against the cache manager actor through :class:`RemoteBlocks`, and
drives the worker one step at a time:

    AddSeq / FinishSeq (engine) -> schedule -> Step (worker) -> StepResult
    -> policy update -> SeqTokens (engine) -> next step

A step carries each sequence's full token ids only the first time the worker
sees it, and its block table only when the table changed; otherwise three
integers.

Scheduling is asynchronous (as in vLLM V1): up to ``PIPELINE_DEPTH`` steps are
in flight, so the worker finds its next step queued when it finishes one and
never waits for the scheduler's round trip; the scheduler accounts for a step
when it sends it (:meth:`Scheduler.launch`) and fills in the sampled tokens
when its result arrives, in order.
"""

from __future__ import annotations

from collections import deque

from fdcore.actors import faults, topology
from fdcore.actors.runtime import Actor, Interrupted
from fdcore.config import kv_outlives_workers
from fdcore.core.scheduler import BatchLimits, Request, ScheduledRequest, Scheduler
from fdcore.protocol import (
    AddSeq,
    Allocate,
    CacheReply,
    CacheReset,
    CacheStats,
    CacheStatsQuery,
    Computed,
    FinishSeq,
    Free,
    Grow,
    GrowMany,
    GrowReply,
    NewSeq,
    Resync,
    SchedulerMessage,
    SeqTokens,
    ServingStats,
    StatsQuery,
    Step,
    StepItem,
    StepResult,
    Stop,
    Suspects,
    WorkerSync,
)

PIPELINE_DEPTH = 2  # steps in flight: the one running and the next, queued


class RemoteBlocks:
    """The cache manager as the policy sees it: KVCacheManager's calls, made over the link.

    Every call reaches the cache actor in the order the policy makes it, so the
    allocator's decisions are exactly an in-process one's. Only what the policy
    must know at once waits for an answer: an allocation, and growth past the
    blocks a sequence already holds (one round trip per 16 tokens of a
    sequence). Frees and prefix registrations need no answer.
    """

    def __init__(self, actor: Actor, block_size: int, prefix_caching: bool, timeout: float):
        self.actor = actor
        self.outgoing: list = []  # fire-and-forget calls, sent with the next call or flush()
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.timeout = timeout
        self.tables: dict[int, list[int]] = {}
        self.registered: dict[int, int] = {}  # blocks of each sequence the cache has hashed
        self.stats = CacheStats()

    def _call(self, message, reply_type=CacheReply):
        prelude, self.outgoing = self.outgoing, []
        epoch = self.actor.epoch
        reply = self.actor.call(
            "cache",
            message,
            reply_type,
            self.timeout,
            prelude,
            accept=lambda r: r.epoch == epoch,
            interrupt=(Resync, Stop),
        )
        self.stats = reply.stats
        return reply

    def flush(self) -> None:
        """Send the queued fire-and-forget calls (in order, one record)."""
        if self.outgoing:
            self.actor.send_many("cache", self.outgoing)
            self.outgoing = []

    def grow_ahead(self, targets: list[tuple[int, int]]) -> None:
        """Grow several sequences in one round trip, in order, before the policy asks one by one.

        The cache applies them in the order given and stops at the first that does
        not fit; the policy's own append_slots calls then find the blocks in place
        (no round trip) up to that one, and from there on it runs its preemption
        logic call by call, exactly as it would have.
        """
        needed = [(seq, n) for seq, n in targets if -(-n // self.block_size) > len(self.tables[seq])]
        if not needed:
            return
        reply = self._call(GrowMany([s for s, _ in needed], [n for _, n in needed]), GrowReply)
        for (seq, _), table in zip(needed[: reply.granted], reply.tables, strict=True):
            self.tables[seq] = table

    def allocate(self, seq: int, token_ids: list[int], max_new_tokens: int, reuse_prefix: bool = True) -> int | None:
        reply = self._call(Allocate(seq, token_ids, max_new_tokens, reuse_prefix))
        if not reply.ok:
            return None
        self.tables[seq] = reply.blocks
        self.registered[seq] = reply.cached // self.block_size
        return reply.cached

    def append_slots(self, seq: int, num_tokens: int) -> bool:
        if -(-num_tokens // self.block_size) <= len(self.tables[seq]):
            return True
        reply = self._call(Grow(seq, num_tokens))
        if reply.ok:
            self.tables[seq] = reply.blocks  # a new list: the worker is sent tables that changed
        return reply.ok

    def cache_computed(self, seq: int, token_ids: list[int], num_computed: int) -> None:
        if not self.prefix_caching:
            return
        full = min(num_computed // self.block_size, len(self.tables[seq]))
        first = self.registered[seq]
        if full > first:
            size = self.block_size
            self.outgoing.append(Computed(seq, first, token_ids[first * size : full * size], num_computed))
            self.registered[seq] = full

    def free(self, seq: int) -> None:
        if self.tables.pop(seq, None) is not None:
            self.registered.pop(seq, None)
            self.outgoing.append(Free(seq))

    def block_table(self, seq: int) -> list[int]:
        return self.tables[seq]

    @property
    def num_free_blocks(self) -> int:
        """Free blocks as of the cache manager's last answer (each call brings its counts)."""
        return self.stats.num_free

    def refresh_stats(self) -> CacheStats:
        return self._call(CacheStatsQuery(-1)).stats


class SchedulerActor(Actor):
    inbox_type = SchedulerMessage
    suspects_to = "engine"

    def on_start(self) -> None:
        self.epoch: int | None = None  # nothing is scheduled before the engine's first Resync
        self.kv_survives = kv_outlives_workers(self.config)  # (a block computed before a restart stays true)
        self.poison = faults.poison_for("scheduler")
        self._reset()

    def _reset(self) -> None:
        c = self.config
        # An RPC is normally answered in microseconds; a dead or stalled cache manager is found (at most
        # a hang timeout), replaced (at most a start timeout) and announced (Resync), which interrupts
        # the wait (see Actor.call): the timeout is only the last resort past both.
        self.blocks = RemoteBlocks(
            self,
            c.cache.block_size,
            c.cache.enable_prefix_caching,
            c.supervisor.hang_timeout + c.supervisor.start_timeout,
        )
        self.policy = Scheduler(
            BatchLimits(
                c.scheduler.max_num_seqs,
                c.scheduler.max_num_batched_tokens,
                c.scheduler.max_model_len,
                c.cache.num_blocks,
                c.scheduler.long_prefill_tokens,
            ),
            self.blocks,
        )
        self.step_number = 0
        self.in_flight: deque[tuple[int, list[ScheduledRequest]]] = deque()
        self.unsent: dict[int, NewSeq] = {}  # sequences the worker has not been told about yet
        self.forget: list[int] = []  # finished sequences the worker may drop
        self.sent_tables: dict[int, list[int]] = {}  # the table object each sequence's worker copy has

    # ---------------------------------------------------------------- messages
    def handle(self, message) -> None:
        if isinstance(message, Resync):
            self._resync(message.epoch)
        elif self.epoch is None and isinstance(message, (AddSeq, FinishSeq, StepResult)):
            return  # sent to a scheduler that is gone; the engine re-sends after Resync
        else:
            self._handle(message)

    def _handle(self, message) -> None:
        match message:
            case AddSeq():
                self._add(message)
            case FinishSeq(seq=seq, reason=reason):
                self.policy.abort(seq, reason)
                self._forget(seq)
            case StepResult():
                self._on_result(message)
            case StatsQuery(nonce=nonce, client=client):
                self.send("engine", self._stats(nonce, client))
            case Suspects():
                self.send("engine", message)  # a worker's or the cache manager's crash report
            case CacheReply() | GrowReply():
                pass  # the answer to a call nobody waits for: ours was interrupted, or it was our predecessor's
            case _:
                super().handle(message)

    def _resync(self, epoch: int) -> None:
        """A new epoch: everything scheduled or allocated before is void; what was computed stays usable
        where the KV memory outlived the restart (the prefix cache and, of each sequence we were running,
        its last, partly filled block: the re-sent sequences then recompute only their last token)."""
        tails = []
        if self.kv_survives and self.epoch is not None:
            self.blocks.flush()  # (blocks registered by the last results: before the reset, on the same link)
            tails = self.policy.computed_tails([scheduled for _, scheduled in self.in_flight])
        self._reset()
        self.epoch = epoch
        self.send("cache", CacheReset(epoch, self.kv_survives, tails))
        self.send(topology.WORKERS, WorkerSync(epoch))

    def _add(self, m: AddSeq) -> None:
        self.handling = [m.seq]
        faults.check(self.poison, m.seq, m.prompt_token_ids)
        self.policy.add(
            Request(
                m.seq,
                list(m.prompt_token_ids),
                m.params,
                tuple(m.eos_token_ids),
                list(m.output_token_ids),
                tenant=m.tenant,
            )
        )
        self.unsent[m.seq] = NewSeq(m.seq, m.prompt_token_ids, m.output_token_ids, m.params, m.eos_token_ids)

    def _forget(self, seq: int) -> None:
        if self.unsent.pop(seq, None) is None:  # the worker knows it: tell it to drop it
            self.forget.append(seq)
        self.sent_tables.pop(seq, None)

    def _on_result(self, result: StepResult) -> None:
        if result.epoch != self.epoch or not self.in_flight or result.step != self.in_flight[0][0]:
            return  # a result of a step that no longer counts
        _, scheduled = self.in_flight.popleft()
        self.handling = list(result.seqs)
        requests = self.policy.requests
        seqs, tokens, logprobs = result.seqs, result.token_ids, result.logprobs or None
        live = [i for i, seq in enumerate(seqs) if seq in requests]
        scores = result.prompt_scores and [s for s in result.prompt_scores if s.seq in requests]
        if len(live) < len(seqs):  # some ended (an abort) while the step ran: not reported
            seqs, tokens = [seqs[i] for i in live], [tokens[i] for i in live]
            logprobs = logprobs and [logprobs[i] for i in live]
        finished = self.policy.update(scheduled, dict(zip(result.seqs, result.token_ids, strict=True)))
        reasons = {r.request_id: r.finish_reason for r in finished}
        self.send(
            "engine",
            SeqTokens(
                self.epoch,
                seqs,
                tokens,
                [reasons.get(s) for s in seqs] if reasons else [None] * len(seqs),
                logprobs,
                scores or None,
            ),
        )
        for request in finished:
            self._forget(request.request_id)

    def _stats(self, nonce: int, client: int) -> ServingStats:
        p = self.policy
        try:
            cache = self.blocks.refresh_stats() if self.epoch is not None else self.blocks.stats
        except Interrupted:
            cache = self.blocks.stats
        return ServingStats(
            nonce, len(p.running), len(p.waiting), len(p.requests), self.step_number, p.num_preemptions, cache, client
        )

    # ------------------------------------------------------------------- steps
    def after_messages(self) -> None:
        if self.epoch is None:
            return
        try:
            while len(self.in_flight) < PIPELINE_DEPTH and self.policy.has_work():
                if not self._launch():
                    break
        except Interrupted:
            return  # a Resync (or Stop) arrived mid-call: the loop handles it next, and it voids all this
        self.blocks.flush()

    def has_work(self) -> bool:
        """Work only we can move: requests to schedule while no step is out. With steps in flight we wait
        for the worker, whose own health says whether it is stalled: counted as busy here, a worker that
        stopped would cost the scheduler a restart too."""
        return not self.in_flight and self.policy.has_work()

    def _launch(self) -> bool:
        self.blocks.grow_ahead(self.policy.growth_plan())
        scheduled = self.policy.schedule()
        if not scheduled:
            return False
        self.handling = [s.request.request_id for s in scheduled]
        new, items, unsent, sent_tables = [], [], self.unsent, self.sent_tables
        for s in scheduled:
            seq = s.request.request_id
            if unsent and seq in unsent:
                new.append(unsent.pop(seq))
            table = s.block_table
            changed = sent_tables.get(seq) is not table
            if changed:
                sent_tables[seq] = table
            items.append(StepItem(seq, s.start, s.num_tokens, table if changed else None))
        self.policy.launch(scheduled)
        self.step_number += 1
        self.in_flight.append((self.step_number, scheduled))
        self.send(topology.WORKERS, Step(self.step_number, self.epoch, new, items, self.forget))
        self.forget = []
        return True
