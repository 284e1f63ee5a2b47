"""The worker actor (fdcore:worker:N): owns the model and the KV cache of one device.

Ready means the checkpoint is loaded: config checked, every tensor read and
shape-checked, the model built and the KV cache allocated. Loading reports its
progress on the health board (and as a bar on stderr); a bad checkpoint is a
start-up crash whose message names the file, which the supervisor reports
instead of retrying.

Each :class:`~fdcore.protocol.Step` is one forward over a mixed batch and one
sampling pass. The worker keeps each sequence's tokens (the prompt, sent once,
and the tokens it sampled itself) and its block table (sent when it changes),
so a decode step costs the scheduler three integers per sequence.

A sequence with structured outputs also has a grammar matcher
(:mod:`fdcore.core.structured`): the step's masks are filled on a thread while
the forward runs, applied before sampling, and each drawn token advances it.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from fdcore import logs
from fdcore.actors import faults, health, topology
from fdcore.actors.runtime import Actor, StopRequested
from fdcore.config import model_path
from fdcore.core import placement
from fdcore.core.batch import BatchInput
from fdcore.core.step_cost import StepCost, parameter_count
from fdcore.models.tuning import SwitchTrial
from fdcore.protocol import PromptScores, SamplingParams, Step, StepResult, WorkerMessage, WorkerSync

_log = logs.logger(__name__)

# The worker's threads are counted (a stat of /proc/self/task: ~45 us a step after a batch-1 forward, half
# the actor loop's time between two steps) after each of its first steps, when OpenMP starts its threads,
# then at most every PLACEMENT_RECHECK seconds: a thread started later runs on its creator's CPUs that long.
PLACEMENT_FIRST_STEPS = 16
PLACEMENT_RECHECK = 0.5
GRAMMAR_GRACE = 3  # hang timeouts a step may wait for its grammar masks while the heartbeat ticks
SCORE_ROWS = 256  # prompt positions scored per LM-head call (their logits: rows x vocab floats)


@dataclass(eq=False)
class SeqState:
    """A sequence as the worker keeps it between steps (owned by the worker actor): the prompt, sent once,
    the tokens it sampled itself, its block table and grammar matcher, so that a decode step costs the
    scheduler three integers. It decides nothing (finishing and preemption are the scheduler's
    ``Request``) and is rebuilt from the steps' NewSeq after a WorkerSync."""

    prompt: list[int]
    output: list[int]
    params: SamplingParams
    eos: tuple[int, ...]
    blocks: list[int] = field(default_factory=list)
    matcher: object = None  # structured outputs: the grammar's matcher, built (replaying ``output``) when first needed

    @property
    def grammar(self) -> str | None:
        """Structured outputs: llguidance's grammar (the engine compiled every form to it)."""
        structured = self.params.structured_outputs
        return structured and structured.llguidance

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def scored_in(self, start: int, end: int) -> int:
        """How many prompt tokens positions start..end-1 score (prompt_logprobs): position p scores
        prompt token p + 1."""
        if self.params.prompt_logprobs is None:
            return 0
        return max(0, min(end, len(self.prompt) - 1) - start)

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt)
        if start >= n:
            return self.output[start - n : end - n]
        return (self.prompt + self.output)[start:end] if end > n else self.prompt[start:end]


class WorkerActor(Actor):
    inbox_type = WorkerMessage
    suspects_to = "scheduler"  # it forwards the report to the engine

    def on_start(self) -> None:
        self.seqs: dict[int, SeqState] = {}
        self.epoch: int | None = None  # no step is run before the scheduler's WorkerSync
        self.poison = faults.poison_for("worker")
        self.grammars = None  # built on the first constrained sequence
        self.placed_threads = 0  # the thread count when _place_threads last ran
        self.steps_run = 0
        self.placement_due = 0.0  # (time.monotonic) when the thread count is next checked
        self.masks = ThreadPoolExecutor(1, thread_name_prefix="fdcore-masks", initializer=self._off_the_main_cpu)
        self.rank, self.world = topology.worker_rank(self.child_id), self.config.workers.tensor_parallel_size
        self.prefetch_trial = None  # float32 / int weights: their prefetch, re-tried at batch-1 decode steps
        if self.config.model.backend == "null":
            from fdcore.models.null import NullModel

            self.model, self.cache = NullModel.from_path(model_path(self.config)), None
            return
        self._load_model()
        cache = self.config.cache
        self.cache = self.model.new_cache(cache.num_blocks, cache.block_size, cache.dtype, self.kv_fd)
        _log.info(
            f"{self.child_id}: KV cache in {self.cache.dtype}: {cache.num_blocks} blocks of "
            f"{cache.block_size} tokens{' in the rank shared memory' if self.kv_fd is not None else ''}"
        )
        if self.world == 1:  # a shared cache holds the serving worker's blocks: the warm-up writes one of its own
            self._warm_up(self.model.new_cache(1, cache.block_size, cache.dtype) if self.cache.shared else self.cache)
        if self.standby:  # its cache costs nothing until it takes over (the warm-up touched it all: huge pages)
            self.cache.release()

    def _load_model(self) -> None:
        """The model for this rank: its weights mapped from the shared file where another process packed them
        there, else read from the checkpoint (and packed into the file for the others); the weight prefetch
        setting measured at load and re-tried while serving."""
        from fdcore.checkpoint import Checkpoint, inspect_checkpoint, load_checkpoint
        from fdcore.models.llama import LlamaModel

        path, started = model_path(self.config), time.monotonic()
        args = inspect_checkpoint(path)
        if args.keys.unknown and self.rank == 0 and not self.standby:
            _log.warning(
                f"{self.child_id}: config.json keys no transformers model reads, not used: "
                f"{', '.join(args.keys.unknown)}"
            )
        self.step_cost = StepCost.unmeasured(
            parameter_count(  # (until a pass is timed: the warm-up's, or the first)
                args.hidden_size,
                args.intermediate_size,
                args.num_layers,
                args.num_heads,
                args.num_kv_heads,
                args.head_dim,
                args.vocab_size,
            )
        )
        shared = self._shared_weights(args)
        if shared is not None and shared.manifest is not None:  # mapped, not read: only the architecture
            checkpoint = Checkpoint(path, args, (), {})  # (the rank's shard: _join_group)
        else:
            checkpoint = load_checkpoint(path, progress=self._loading)
        try:
            checkpoint, group = self._join_group(checkpoint) if self.world > 1 else (checkpoint, None)
            dtype = "float32" if self.config.model.dtype == "auto" else self.config.model.dtype
            self.model = LlamaModel(checkpoint, dtype, self.config.model.quantization, group, shared)
        finally:
            if shared is not None and shared.manifest is None:  # we built it (or failed to: the next one will)
                if shared.full is not None:
                    shared.keep_private(shared.full)
                shared.unlock()
        self._say_where_the_weights_are(shared, time.monotonic() - started)
        timing = self.model.prefetch_timing
        if timing:  # (measured at load: fdcore.models.llama.LlamaModel.tune_weight_prefetch), then re-tried
            from fdcore.models.kernels import weight_prefetch

            chosen = weight_prefetch()  # (the load's choice, as the kernels hold it)
            self.prefetch_trial = SwitchTrial(chosen, not chosen)
            _log.info(
                f"{self.child_id}: weight prefetch {'on' if chosen else 'off'} (a pass over the "
                f"weights: on {timing[True] * 1e3:.2f} ms, off {timing[False] * 1e3:.2f} ms)"
            )

    def _shared_weights(self, args):
        """The rank's shared weight file (fdcore.models.shared_weights) attached, or locked for us to pack the
        weights into; None where this rank's processes keep private copies (``workers.shared_weights``,
        the file's PRIVATE state, or no file: a worker started without a supervisor)."""
        from fdcore.models.page_probe import shared_pages_slowdown
        from fdcore.models.shared_weights import EMPTY, PUBLISHED, SLOWER_MARGIN, WeightFile

        if self.weights_fd is None or self.config.workers.shared_weights == "off":
            return None
        shared = WeightFile(self.weights_fd)
        shared.lock()  # (held while another process of the rank packs: then we map what it packed)
        state, reason = shared.state()
        if state == PUBLISHED:
            shared.attach()
            shared.unlock()
            return shared
        if state == EMPTY and self.config.workers.shared_weights == "auto":
            try:
                slowdown = shared_pages_slowdown(args, shared.fd)
                if slowdown is not None and slowdown > SLOWER_MARGIN:  # a real cost shows twice; a busy moment not
                    slowdown = min(slowdown, shared_pages_slowdown(args, shared.fd))
            except OSError as exc:  # (the file's filesystem is full: the weights would not fit either)
                shared.keep_private(f"the shared file could not hold the page probe ({exc.strerror})")
                state, reason, slowdown = *shared.state(), None
            if slowdown is not None and slowdown > SLOWER_MARGIN:
                shared.keep_private(f"shared pages streamed {slowdown:.0%} slower than private huge pages here")
                state, reason = shared.state()
            elif slowdown is not None:
                _log.info(f"{self.child_id}: shared pages stream {slowdown:+.0%} against private huge pages")
        if state != EMPTY:
            _log.warning(f"{self.child_id}: weights kept private: {reason}")
            shared.unlock()
            shared.close()
            return None
        shared.begin(_physical_memory())
        return shared

    def _say_where_the_weights_are(self, shared, seconds: float) -> None:
        if shared is None:
            return
        how = (
            "mapped from"
            if shared.manifest is not None
            else "packed into"
            if shared.full is None
            else f"kept private ({shared.full}), partly in"
        )
        _log.info(
            f"{self.child_id}: weights {how} the rank's shared memory ({shared.used >> 20} MiB) in {seconds:.2f} s"
        )

    def _warm_up(self, cache) -> None:
        """A short prompt and a few decode steps before the worker counts as ready: the first forward
        passes pay one-time costs (OpenMP's threads started, operators' first calls, buffers made), which
        the first requests after start-up would otherwise pay, at a fraction of the steady rate. They
        write block 0 of ``cache`` only: the worker's private cache, whose block 0 every sequence overwrites
        before it reads it, or (where the KV cache is the rank's shared one, which holds the serving
        worker's blocks) a one-block cache of their own. (A rank of a group cannot: its peers start after
        it, and a forward waits for them.)"""
        size = self.config.cache.block_size
        tokens = list(range(1, min(size, 8) + 1))
        started = time.perf_counter()
        self.model.forward(BatchInput([tokens], [0], [[0]]), cache)
        self.step_cost.record(len(tokens), time.perf_counter() - started)  # (with its one-time costs: generous)
        for position in range(len(tokens), min(len(tokens) + 4, size)):
            started = time.perf_counter()
            self.model.forward(BatchInput([[1]], [position], [[0]]), cache)
            self.step_cost.record(1, time.perf_counter() - started)

    def _place_threads(self) -> None:
        """The main thread alone on its CPU, every other thread (OpenMP's, the grammar masks') on the
        rest of the rank's CPUs (fdcore.core.placement). Run after a step whenever the thread count
        changed: OpenMP starts its threads at the first parallel region, and a thread inherits the
        CPUs of the thread that starts it (here the main thread's one CPU)."""
        try:
            placement.pin_process_threads(self.placement.mains[self.rank], self.placement.helpers[self.rank])
        except OSError as exc:  # (CPUs taken away since the start, e.g. by a cgroup): run unpinned
            _log.warning(f"{self.child_id}: CPU placement given up: {exc}")
            self.placement = None
        self.placed_threads = placement.thread_count()

    def _check_placement(self) -> None:
        """After a step: the threads placed again if there are new ones (see PLACEMENT_RECHECK)."""
        self.steps_run += 1
        if self.placement is None or (self.steps_run > PLACEMENT_FIRST_STEPS and time.monotonic() < self.placement_due):
            return
        self.placement_due = time.monotonic() + PLACEMENT_RECHECK
        if placement.thread_count() != self.placed_threads:
            self._place_threads()

    def _off_the_main_cpu(self) -> None:
        """A helper thread's start: onto the rank's other CPUs, away from the main thread's."""
        if self.placement is not None:
            placement.pin_this_thread(self.placement.helpers[self.rank])  # (set by on_start, before any submit)

    def _join_group(self, checkpoint):
        """A rank of a tensor-parallel group: its shard of the checkpoint, and the group's communicator
        (the supervisor's segment; a rank that waits for a peer longer than the hang timeout fails,
        and the supervisor restarts the whole group)."""
        import os

        from fdcore.ipc.allreduce import ShmCommunicator
        from fdcore.models.tensor_parallel import (
            PaddleCommunicator,
            TensorGroup,
            communicator_capacity,
            shard_checkpoint,
        )

        capacity = communicator_capacity(checkpoint.args, self.config.scheduler, self.world)
        checkpoint, shard = shard_checkpoint(checkpoint, self.rank, self.world)
        if self.config.workers.communicator == "paddle":
            comm = PaddleCommunicator(self.rank, self.world, os.environ[topology.GROUP_MASTER_ENV])
        else:
            comm = ShmCommunicator.attach(
                topology.group_name(self.instance_id),
                self.rank,
                self.world,
                capacity,
                timeout=self.config.supervisor.hang_timeout,
            )
        return checkpoint, TensorGroup(shard, comm)

    def _loading(self, done: int, total: int) -> None:
        if not self.standby:  # a spare's slot belongs to the worker it may replace
            self.board.write(self.slot, health.LOADING, 1000 * done // total)
        _log.info(f"{self.child_id}: loading weights {done}/{total}")

    def handle(self, message) -> None:
        if isinstance(message, Step):
            if message.epoch == self.epoch:  # else: a step of an epoch that ended (or of our predecessor)
                result = self._group_step(message)
                if result is not None:  # (rank 0 answers for its group)
                    self.send("scheduler", result)
                self._check_placement()
        elif isinstance(message, WorkerSync):
            self.seqs.clear()
            self.epoch = message.epoch
        else:
            super().handle(message)

    def _group_step(self, step: Step) -> StepResult | None:
        """run_step; a rank whose group the supervisor aborted (a peer died) stops, to be restarted with it."""
        try:
            return self.run_step(step)
        except Exception:
            group = getattr(self.model, "group", None)  # (the null model has none)
            if group is not None and group.comm.aborted():
                raise StopRequested("the worker group was aborted: a rank is gone") from None
            raise

    def run_step(self, step: Step) -> StepResult | None:
        # (long: one step's phases share its per-row lists, in order; apart, each would take a dozen of them)
        from fdcore.models.sampling import SamplerRequest, sample

        started = time.perf_counter()
        for seq in step.finished:
            self.seqs.pop(seq, None)
        for new in step.new:
            self.handling = [new.seq]
            faults.check(self.poison, new.seq, new.prompt_token_ids)
            self.seqs[new.seq] = SeqState(
                list(new.prompt_token_ids), list(new.output_token_ids), new.params, tuple(new.eos_token_ids)
            )
        self.handling = [item.seq for item in step.items]  # a failing forward names the whole batch
        token_ids, starts, tables, prompt_lengths, sampling, scoring = [], [], [], [], [], []
        states = self.seqs
        for row, item in enumerate(step.items):  # (per sequence and step: kept flat)
            state = states[item.seq]
            if item.blocks is not None:
                state.blocks = item.blocks
            start = item.start
            end = start + item.num_tokens
            prompt_length = len(state.prompt)
            token_ids.append(state.tokens(start, end))
            starts.append(start)
            tables.append(state.blocks)
            prompt_lengths.append(prompt_length)
            if end == state.num_tokens:
                sampling.append((row, item.seq, state))
            if state.scored_in(start, end):
                scoring.append((row, item, state))
        seqs = [seq for _, seq, _ in sampling]
        if self.cache is None and self.rank > 0:
            return None  # the null model computes nothing: rank 0 answers alone
        if self.cache is None:  # the null model: a token per position, nothing computed
            tokens = [self.model.next_token(state.num_tokens) for _, _, state in sampling]
            for (_, _, state), token in zip(sampling, tokens, strict=True):
                state.output.append(token)
            return StepResult(step.step, step.epoch, seqs, tokens, None, time.perf_counter() - started)
        constrained = [state for _, _, state in sampling if state.grammar is not None and self.rank == 0]
        masks = self.masks.submit(self._allowed, constrained) if constrained else None  # beside the forward
        batch = BatchInput(token_ids, starts, tables, prompt_lengths)
        trial = self._prefetch_trial(token_ids)
        tokens = sum(len(t) for t in token_ids)
        # one call into the kernels, no tick until it returns: long for a big model and a full prefill budget
        self.board.write(self.slot, health.GRACE, time.monotonic_ns() + int(self.step_cost.grace(tokens) * 1e9))
        forward_started = time.perf_counter()
        logits, hidden = self.model.forward_rows(batch, self.cache, tuple(row for row, _, _ in scoring))
        elapsed = time.perf_counter() - forward_started
        self.heartbeat()  # (before the grace ends: silence would count from the tick before the pass)
        self.board.write(self.slot, health.GRACE, 0)
        self.step_cost.record(tokens, elapsed)
        if trial is not None:
            self._prefetch_tried(trial, elapsed)
        # every rank scores (the LM head's gather is a collective); rank 0 sends them
        scores = [self._score_prompt(item, state, hidden[row]) for row, item, state in scoring] or None
        if self.rank > 0:
            self._follow(sampling)
            return None
        if not sampling:
            return StepResult(step.step, step.epoch, [], [], None, time.perf_counter() - started, scores)
        requests = [SamplerRequest(s.params, s.prompt, s.output, s.eos) for _, _, s in sampling]
        if masks is not None:
            _constrain(requests, sampling, self._await(masks))
        rows = [row for row, _, _ in sampling]
        picks = sample(logits if len(rows) == len(logits) else logits[np.asarray(rows)], requests)
        logprobs = None
        if any(s.params.logprobs is not None for _, _, s in sampling):
            logprobs = [
                None if p.logprob is None else [(p.token_id, p.logprob), *(p.top_logprobs or [])] for p in picks
            ]
        if self.world > 1:  # the other ranks append them too (their next steps' inputs)
            self.model.group.comm.broadcast(np.asarray([p.token_id for p in picks], dtype=np.int64))
        for (_, _, state), pick in zip(sampling, picks, strict=True):
            state.output.append(pick.token_id)
            if state.matcher is not None:
                state.matcher.consume_token(pick.token_id)  # (a token the mask allowed: it cannot fail)
        return StepResult(
            step.step, step.epoch, seqs, [p.token_id for p in picks], logprobs, time.perf_counter() - started, scores
        )

    def _prefetch_trial(self, token_ids: list) -> SwitchTrial | None:
        """The weight-prefetch trial a step takes part in, its value applied: batch-1 decode steps only (the
        one-row passes are the ones that prefetch); None for any other step or model."""
        trial = self.prefetch_trial
        if trial is None or len(token_ids) != 1 or len(token_ids[0]) != 1:
            return None
        from fdcore.models.kernels import set_weight_prefetch

        set_weight_prefetch(trial.next())  # (a store to one C int: the kernels hold the setting, not us)
        return trial

    def _prefetch_tried(self, trial: SwitchTrial, seconds: float) -> None:
        if trial.record(seconds):
            _log.info(
                f"{self.child_id}: weight prefetch now {'on' if trial.current else 'off'} (batch-1 "
                f"steps alternating: {'off' if trial.current else 'on'} took {1 / trial.last_ratio:.3f}x "
                f"the time)"
            )

    def _follow(self, sampling: list) -> None:
        """A rank above 0: the tokens rank 0 drew this step, appended as if drawn here. Rank 0 may first
        wait up to GRAMMAR_GRACE hang timeouts for a grammar (``_await``): this rank waits as long (and
        a hang timeout more), its heartbeat ticking, instead of taking a slow start for a dead peer. A
        rank 0 that really hangs is the supervisor's to find (its heartbeat stops) and abort."""
        if not sampling:
            return
        patience = (GRAMMAR_GRACE + 1) * self.config.supervisor.hang_timeout
        tokens = self.model.group.comm.broadcast(None, patience=patience, waiting=self.heartbeat)
        for (_, _, state), token in zip(sampling, tokens, strict=True):
            state.output.append(int(token))

    def _score_prompt(self, item, state: SeqState, hidden) -> PromptScores:
        """prompt_logprobs: how this step's positions of the sequence scored the prompt tokens after them."""
        from fdcore.models.sampling import score_tokens

        count, scores = state.scored_in(item.start, item.start + item.num_tokens), []
        for first in range(0, count, SCORE_ROWS):
            last = min(first + SCORE_ROWS, count)
            following = state.prompt[item.start + first + 1 : item.start + last + 1]
            scores += score_tokens(self.model.logits(hidden[first:last]), following, state.params.prompt_logprobs)
        return PromptScores(item.seq, item.start + 1, scores)

    def _await(self, masks: Future) -> np.ndarray:
        """The mask thread's answer. The first constrained sequence a worker sees builds the grammar
        tokenizer (seconds, for a GGUF file's vocabulary): the heartbeat keeps ticking meanwhile, for
        up to GRAMMAR_GRACE hang timeouts, so the supervisor does not take a slow start for a hang."""
        supervisor = self.config.supervisor
        deadline = time.monotonic() + GRAMMAR_GRACE * supervisor.hang_timeout
        while True:
            try:
                return masks.result(timeout=supervisor.heartbeat_interval)
            except TimeoutError:
                if time.monotonic() < deadline:
                    self.heartbeat()

    def _allowed(self, states: list[SeqState]) -> np.ndarray:
        """The next tokens each constrained sequence's grammar allows (on the mask thread): a sequence
        new to this worker gets its matcher first, replaying the tokens it already has."""
        if self.grammars is None:
            from fdcore.core.structured import Grammars
            from fdcore.core.tokenizer import load_tokenizer

            self.grammars = Grammars(load_tokenizer(model_path(self.config)), self.model.args.vocab_size, states[0].eos)
        for state in states:
            if state.matcher is None:
                state.matcher = self.grammars.matcher(state.grammar, state.output)
        return self.grammars.allowed([state.matcher for state in states])


def _constrain(requests: list, sampling: list, masks: np.ndarray) -> None:
    """Each constrained request's row of the step's masks (in the order ``_allowed`` got them)."""
    rows = iter(masks)
    for request, (_, _, state) in zip(requests, sampling, strict=True):
        if state.grammar is not None:
            request.allowed = next(rows)


def _physical_memory() -> int:
    """The machine's memory in bytes: a weight file's address-space reserve (nothing packed can be larger)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
