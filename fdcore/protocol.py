"""Every message fdcore's actors exchange: msgspec Structs, one tagged union per inbox.

Conventions (msgspec's and vLLM V1's): messages are ``array_like`` (no field
names on the wire), ``frozen``, ``gc=False`` when they hold no cycles,
``forbid_unknown_fields`` is implied by array_like's fixed arity. Schema
evolution: new fields get defaults and are appended, never reordered. Each
inbox has one union (``ControlMessage``, ``EngineMessage``, ...) and one
decoder built once for it (:func:`decoder_for`).
"""

from __future__ import annotations

from typing import Any

import msgspec


class Message(msgspec.Struct, array_like=True, frozen=True, gc=False, tag=True):
    """Base of all messages; the tag is the class name."""


# --------------------------------------------------------------- actor control
class Stop(Message):  # type: ignore[misc]  # (msgspec: a frozen Struct's subclasses are frozen too)
    """Finish what can be finished and exit cleanly. ``restart``: the supervisor stops this actor
    only to start it again (a sibling died under one_for_all / rest_for_one), so open requests are
    not failed: the successor takes them over (the clients re-submit to a new engine)."""

    reason: str = ""
    restart: bool = False


class Ping(Message):  # type: ignore[misc]  # (msgspec: a frozen Struct's subclasses are frozen too)
    """Liveness probe; answered with a Pong carrying the same nonce."""

    nonce: int


class Pong(Message):  # type: ignore[misc]  # (msgspec: a frozen Struct's subclasses are frozen too)
    nonce: int
    sender: str


# ----------------------------------------------------------------- sampling
class StructuredOutputs(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Constrain the output to a language (vLLM's ``StructuredOutputsParams``): exactly one of a JSON
    schema (an object or its JSON text), any JSON object, a regular expression, a choice of strings,
    a context-free grammar (Lark, or llama.cpp's GBNF) or a grammar in llguidance's own JSON form.

    The engine checks it against the model's tokenizer and sends it on as ``llguidance`` only (every
    form compiled to that one), so the workers' matchers and the engine's check cannot disagree.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    llguidance: str | None = None


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """How to pick each token of one request (the seed's / vLLM's field names).

    ``temperature == 0`` is greedy. ``top_k == 0`` and ``top_p == 1`` and
    ``min_p == 0`` switch those filters off. ``seed`` makes sampling a pure
    function of (seed, position): the same tokens whatever shares the batch and
    however often the request is recomputed. ``logprobs = N`` returns the top-N.
    ``prompt_logprobs = N`` scores the prompt too: each of its tokens after the first gets its logprob
    and rank under the model given the tokens before it, and the top-N there (vLLM's field). Such a
    request computes its whole prompt (no prefix-cache hits).
    ``logit_bias`` adds to the given tokens' logits before anything else decides (100 forces a token,
    -100 bans it); logprobs stay the model's own. ``structured_outputs`` lets only tokens that keep
    the output inside a language be drawn (logprobs, again, stay the model's own).

    The fields of :data:`SAMPLING_DEFAULTS` are None when the request leaves them
    unset: the engine fills them from the model's generation_config.json (as
    vLLM's ``generation_config="auto"``), else with those neutral values
    (:meth:`with_defaults`); the scheduler and workers see them filled.
    """

    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI's, -100 to 100)
    structured_outputs: StructuredOutputs | None = None  # the output must match this (JSON schema, regex...)
    prompt_logprobs: int | None = None  # each prompt token's logprob (after the first), and the top-N there

    def with_defaults(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """Every unset field filled: from ``defaults`` (the model's) where it has one, else neutral."""
        if None not in (self.temperature, self.top_p, self.top_k, self.min_p, self.repetition_penalty, self.max_tokens):
            return self  # the common case on the hot path: already filled
        defaults = defaults or {}
        return msgspec.structs.replace(
            self,
            **{
                name: defaults.get(name, neutral)
                for name, neutral in SAMPLING_DEFAULTS.items()
                if getattr(self, name) is None
            },
        )


# What an unset field means when the model has no default for it (vLLM's and OpenAI's values;
# max_tokens as vLLM's SamplingParams).
SAMPLING_DEFAULTS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "max_tokens": 16,
}


# ------------------------------------------------------------ client <-> engine
class Hello(Message):  # type: ignore[misc]  # (msgspec: a frozen Struct's subclasses are frozen too)
    """A client took slot ``client``: forget the slot's previous session (its
    requests are aborted) and answer ``Welcome`` with the same session number, so
    the client can drop whatever the slot's previous owner left in its ring."""

    client: int
    session: int


class Welcome(Message):  # type: ignore[misc]  # (msgspec: a frozen Struct's subclasses are frozen too)
    session: int
    vocab_size: int
    max_model_len: int
    model: str
    engine_pid: int = 0  # a client watches it: when it dies, the client re-submits to the next engine
    sampling_defaults: dict[str, int | float] = {}  # what the engine fills unset sampling fields with


class AddRequest(Message):  # type: ignore[misc]  # (msgspec: a frozen Struct's subclasses are frozen too)
    """One request. ``body`` is a msgpack map decoded by the engine into
    :class:`RequestBody`, so a malformed field is the sender's error (400 naming
    the field), never an undecodable record on the engine's inbox."""

    client: int
    request_id: str
    body: msgspec.Raw
    arrival_time: float
    resume_token_ids: list[int] = []  # tokens the client already received (engine restart)
    resume_text_chars: int = 0  # characters of text the client already received
    tenant: str = ""  # whom it is for, within the client (the HTTP server: the peer)


class AbortRequest(Message):  # type: ignore[misc]  # (msgspec: a frozen Struct's subclasses are frozen too)
    client: int
    request_id: str


class RequestBody(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """What the engine validates: exactly one prompt form, and the sampling parameters.

    A chat request (``messages``) may add how its template is rendered: vLLM's and
    transformers' ``apply_chat_template`` names (None = not given: the template
    gets no tools / documents, a generation prompt unless the final message is
    continued, no extra variables, and the model's default template)."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[Any] | None = None  # [{role, content, ...}], checked by the engine (field-named errors)
    sampling_params: SamplingParams = SamplingParams()
    tools: list[dict[Any, Any]] | None = None
    documents: list[dict[Any, Any]] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # the name of one of the model's templates (e.g. "tool_use")


class PromptLogprob(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """How the model scored one prompt token given the tokens before it."""

    token_id: int
    logprob: float
    rank: int  # 1 + how many tokens the model found likelier there
    top: list[tuple[int, float]]  # the top-N (id, logprob) there, best first


class PromptScores(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Prompt tokens ``first``, ``first + 1``, ... of sequence ``seq``, scored in one step (a
    prefill chunk scores the tokens its positions predict)."""

    seq: int
    first: int
    scores: list[PromptLogprob]


class Metrics(msgspec.Struct, array_like=True, omit_defaults=True):
    arrival_time: float = 0.0
    first_token_time: float = 0.0
    finished_time: float = 0.0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0


class Update(Message):  # type: ignore[misc]  # (msgspec: a frozen Struct's subclasses are frozen too)
    """New output of one request (engine -> client): a delta of tokens and text."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list[list[tuple[int, float]]] | None = None  # per new token: (id, logprob) best first
    prompt_token_ids: list[int] | None = None  # first update only
    metrics: Metrics | None = None  # last update only
    error_code: int = 0
    error_msg: str = ""
    prompt_logprobs: list[PromptLogprob | None] | None = None  # first update only, if asked: one per prompt token


# -------------------------------------------------------- engine <-> scheduler
class AddSeq(Message):  # type: ignore[misc]  # (msgspec: a frozen Struct's subclasses are frozen too)
    """A validated, tokenized request (engine -> scheduler). ``seq`` is the
    engine's handle for it; ``output_token_ids`` are tokens already produced
    (a resumed request catches up by recomputing them)."""

    seq: int
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int]
    output_token_ids: list[int] = []
    tenant: str = ""  # the client slot and its tenant: the scheduler shares KV blocks fairly between tenants


class FinishSeq(Message):  # type: ignore[misc]  # (msgspec: a frozen Struct's subclasses are frozen too)
    """The engine ended a request (abort, stop string, client gone): free it now."""

    seq: int
    reason: str


class SeqTokens(Message):  # type: ignore[misc]  # (msgspec: a frozen Struct's subclasses are frozen too)
    """One step's sampled tokens (scheduler -> engine), one entry per sampling sequence."""

    epoch: int
    seqs: list[int]
    token_ids: list[int]
    finish_reasons: list[str | None]
    logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_scores: list[PromptScores] | None = None  # of requests that asked for prompt_logprobs


class Resync(Message):  # type: ignore[misc]  # (msgspec: a frozen Struct's subclasses are frozen too)
    """Engine -> scheduler: a new epoch. Drop every request, step and block of the old one
    (reset the cache manager and the worker too); the engine re-sends what is unfinished,
    each with the tokens its client already has."""

    epoch: int


class Restarted(Message):  # type: ignore[misc]  # (msgspec: a frozen Struct's subclasses are frozen too)
    """Supervisor -> engine: an actor was restarted and is ready (its state is gone)."""

    child: str
    generation: int


class Suspects(Message):  # type: ignore[misc]  # (msgspec: a frozen Struct's subclasses are frozen too)
    """A crashing actor's last word (scheduler -> engine; a worker's or cache manager's through the
    scheduler): the requests it was handling when it raised. Two consecutive reports of one actor
    kind naming a request get it quarantined (:mod:`fdcore.core.quarantine`)."""

    child: str
    epoch: int
    seqs: list[int]


# ------------------------------------------------------ scheduler <-> cache
# The scheduler's block calls, one message each, applied in order by the cache
# manager. Only calls whose answer the scheduler needs wait for one (allocate,
# grow beyond the blocks held, statistics); frees and prefix registrations are
# fire-and-forget (the link keeps them in order).
class Allocate(Message):  # type: ignore[misc]  # (msgspec: a frozen Struct's subclasses are frozen too)
    seq: int
    token_ids: list[int]
    max_new_tokens: int
    reuse_prefix: bool = True  # False: compute every token (a request scoring its prompt)


class Grow(Message):  # type: ignore[misc]  # (msgspec: a frozen Struct's subclasses are frozen too)
    seq: int
    num_tokens: int


class GrowMany(Message):  # type: ignore[misc]  # (msgspec: a frozen Struct's subclasses are frozen too)
    """Several grows in order, stopping at the first that does not fit (answered by GrowReply)."""

    seqs: list[int]
    num_tokens: list[int]


class Free(Message):  # type: ignore[misc]  # (msgspec: a frozen Struct's subclasses are frozen too)
    seq: int


class Computed(Message):  # type: ignore[misc]  # (msgspec: a frozen Struct's subclasses are frozen too)
    """Blocks of ``seq`` computed up to ``num_computed`` tokens; ``token_ids`` start at
    block ``first_block`` (the blocks registered before need not be sent again)."""

    seq: int
    first_block: int
    token_ids: list[int]
    num_computed: int


class CacheStatsQuery(Message):  # type: ignore[misc]  # (msgspec: a frozen Struct's subclasses are frozen too)
    nonce: int


class CacheReset(Message):  # type: ignore[misc]  # (msgspec: a frozen Struct's subclasses are frozen too)
    """Forget every allocation (a new epoch), and every cached prefix unless ``keep_prefixes``: the
    KV cache lives in shared memory that outlived whatever restarted, so each computed block registered
    in the prefix cache still holds what its hash says, and each of ``tails`` (a sequence whose computed
    tokens end inside a block) keeps that block for the same tokens re-sent (KVCacheManager.free_all).
    A cache manager ignores everything before its first CacheReset (stale calls of a dead scheduler or
    of an epoch that ended)."""

    epoch: int
    keep_prefixes: bool = False
    tails: list[tuple[int, int, list[int]]] = []  # (seq, tokens computed, the tokens of its last block)


class CacheStats(msgspec.Struct, array_like=True, frozen=True):
    num_blocks: int = 0
    num_free: int = 0
    num_cached: int = 0
    usage: float = 0.0
    hit_rate: float = 0.0
    queried_tokens: int = 0
    hit_tokens: int = 0


class CacheReply(Message):  # type: ignore[misc]  # (msgspec: a frozen Struct's subclasses are frozen too)
    """Answer to Allocate / Grow / CacheStatsQuery. ``cached`` is the prefix-cached token
    count of an allocation (-1: no room, nothing held); ``ok`` whether a grow fit."""

    seq: int
    ok: bool
    blocks: list[int]
    cached: int
    stats: CacheStats
    epoch: int = 0


class GrowReply(Message):  # type: ignore[misc]  # (msgspec: a frozen Struct's subclasses are frozen too)
    """The tables of the first ``granted`` sequences of a GrowMany (the rest were not grown)."""

    granted: int
    tables: list[list[int]]
    stats: CacheStats
    epoch: int = 0


class StatsQuery(Message):  # type: ignore[misc]  # (msgspec: a frozen Struct's subclasses are frozen too)
    """Client -> engine -> scheduler: ask for the serving statistics."""

    nonce: int
    client: int = -1


class ServingStats(Message):  # type: ignore[misc]  # (msgspec: a frozen Struct's subclasses are frozen too)
    nonce: int
    running: int = 0
    waiting: int = 0
    requests: int = 0  # requests the engine is tracking
    steps: int = 0
    preemptions: int = 0
    cache: CacheStats = CacheStats()
    client: int = -1  # who asked (the engine answers that client)
    disconnected_clients: int = 0  # clients the engine cut off (bad records, stopped reading)


# ----------------------------------------------------- scheduler <-> workers
class NewSeq(msgspec.Struct, array_like=True, gc=False):
    seq: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int]


class StepItem(msgspec.Struct, array_like=True, gc=False):
    seq: int
    start: int  # position of the first token computed
    num_tokens: int  # tokens computed this step
    blocks: list[int] | None = None  # the full block table when it changed, else None


class WorkerSync(Message):  # type: ignore[misc]  # (msgspec: a frozen Struct's subclasses are frozen too)
    """Scheduler -> worker: a new epoch; forget every sequence. A worker ignores steps of
    any other epoch (a restarted worker finds its predecessor's steps in its inbox)."""

    epoch: int


class Step(Message):  # type: ignore[misc]  # (msgspec: a frozen Struct's subclasses are frozen too)
    step: int
    epoch: int
    new: list[NewSeq]
    items: list[StepItem]
    finished: list[int] = []  # sequences the worker may forget


class StepResult(Message):  # type: ignore[misc]  # (msgspec: a frozen Struct's subclasses are frozen too)
    step: int
    epoch: int
    seqs: list[int]
    token_ids: list[int]
    logprobs: list[list[tuple[int, float]] | None] | None = None
    seconds: float = 0.0
    prompt_scores: list[PromptScores] | None = None


ControlMessage = Stop | Ping | Pong
ClientMessage = Welcome | Update | ServingStats | Pong
# The engine decodes each link with what its producer may send (a client's ``client`` fields are
# ignored: the link says who sent it); EngineMessage is all of them.
SupervisorToEngine = Stop | Ping | Restarted
SchedulerToEngine = SeqTokens | ServingStats | Suspects
ClientToEngine = Hello | AddRequest | AbortRequest | StatsQuery
EngineMessage = SupervisorToEngine | SchedulerToEngine | ClientToEngine
SchedulerMessage = (
    Stop | Ping | Resync | AddSeq | FinishSeq | StatsQuery | StepResult | CacheReply | GrowReply | Suspects
)
CacheMessage = Stop | Ping | Allocate | Grow | GrowMany | Free | Computed | CacheStatsQuery | CacheReset
WorkerMessage = Stop | Ping | WorkerSync | Step
