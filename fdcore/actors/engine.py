"""The engine actor (fdcore:engine): requests in, tokens out, for every attached client.

- Intake: a client claims a slot (its own inbox, see :mod:`fdcore.client`) and
  says ``Hello``; its requests arrive as ``AddRequest`` with the body still
  encoded, so that a malformed field becomes a 400 naming that field instead of
  an undecodable record. The engine validates (every sampling parameter, token
  ids inside the vocabulary, prompt + min_tokens within ``max_model_len``),
  fills the sampling parameters it leaves unset with the model's defaults
  (generation_config.json), tokenizes text, token-id lists or chat messages
  (the checkpoint's chat template, with the request's tools, documents and
  template options), and hands the scheduler an ``AddSeq``. A bad request, or
  one the chat template fails on, is answered at once with
  ``finish_reason="error"`` and costs nobody else anything.
- Output: each step's sampled tokens (``SeqTokens``) are appended to the
  request table (the source of truth), detokenized incrementally (no broken
  characters, stop strings held back and never shown), and streamed to the
  owning client as ``Update`` deltas, one batched record per client per step.
  A client whose inbox is full is not waited for: its updates queue up here.
- Clients come and go: a slot whose owner died (its lock is free) has its
  requests aborted, so nothing runs for nobody.
- Clients are not trusted: a message's sender is the link it came by (the
  ``client`` fields in bodies are ignored), each link decodes only what its
  producer may send, and a client that sends garbage, a message out of place,
  or stops reading for ``engine.client_stall_timeout`` is disconnected alone.
- One request costs only itself: an exception while admitting or rendering it
  is its 500, and one that crashes the same kind of actor twice in a row is
  quarantined (:mod:`fdcore.core.quarantine`) instead of re-submitted.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import msgspec

from fdcore.actors import faults, health, topology
from fdcore.actors.engine_links import ClientLinks, ClientSlot
from fdcore.actors.runtime import Actor
from fdcore.config import model_path
from fdcore.core.detokenizer import IncrementalDetokenizer, byte_table
from fdcore.core.generation_config import sampling_defaults
from fdcore.core.quarantine import Quarantine
from fdcore.core.structured import Grammars
from fdcore.core.tokenizer import ModelTokenizer
from fdcore.core.validation import (
    RequestError,
    check_chat_options,
    check_length,
    check_one_prompt,
    check_sampling,
    check_token_ids,
    validate_request_id,
)
from fdcore.ipc import LinkReceiver, ProtocolError
from fdcore.protocol import (
    AddRequest,
    AddSeq,
    ClientToEngine,
    EngineMessage,
    FinishSeq,
    Metrics,
    RequestBody,
    Restarted,
    Resync,
    SamplingParams,
    SchedulerToEngine,
    SeqTokens,
    ServingStats,
    SupervisorToEngine,
    Suspects,
    Update,
)

EPOCHS_PER_GENERATION = 1_000_000
LIVENESS_INTERVAL = 0.5  # seconds between checks that each busy client slot still has its owner (README: a
# dead client's requests are aborted within a second)


@dataclass(eq=False)
class TrackedRequest:
    """One request in the engine's table: the tree's source of truth (owned by the engine actor). Which
    client and request id it answers, every token produced, its detokenizer and timing. A restarted
    scheduler or worker is fed from it; blocks and batches are the scheduler's ``Request``, not its."""

    seq: int
    client: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    arrival_time: float
    output_token_ids: list[int] = field(default_factory=list)
    first_token_time: float = 0.0
    announced: bool = False  # the client has been sent the prompt token ids
    prompt_scores: list | None = None  # prompt_logprobs: a PromptLogprob per prompt token (the first: None)
    tenant: str = ""  # whom it is for (its client slot, and the client's own tenant): shares are per tenant


class EngineActor(ClientLinks, Actor):
    inbox_type = EngineMessage

    def on_start(self) -> None:
        path = model_path(self.config)
        self.tokenizer = ModelTokenizer(path)  # a chat template that does not compile stops the start here
        c = self.config
        self.limits = self.tokenizer.limits(c.scheduler.max_model_len, c.cache.num_blocks * c.cache.block_size)
        self.sampling_defaults = sampling_defaults(path, c.model.generation_config, self.limits)
        self.grammars = Grammars(self.tokenizer.tokenizer, self.tokenizer.vocab_size, self.tokenizer.eos_token_ids)
        byte_table(self.tokenizer.tokenizer)  # made now, not in the first request's time to first token (~0.35 s)
        self.table: dict[int, TrackedRequest] = {}
        self.clients: dict[int, ClientSlot] = {}
        self.next_seq = 1
        self.next_liveness_check = time.monotonic() + LIVENESS_INTERVAL
        self._decode_body = msgspec.msgpack.Decoder(RequestBody).decode
        # Epochs only grow, across engine restarts too: the supervisor's restart generation
        # (which counts every restart of the tree) leads.
        self.epoch = self.first_epoch = self.board.read(self.slot, health.GENERATION) * EPOCHS_PER_GENERATION
        self.quarantine = Quarantine()
        self.disconnected = 0  # clients cut off for bad records or for not reading (ServingStats)
        self.poison = faults.poison_for("engine")
        self.send("scheduler", Resync(self.epoch))

    # ---------------------------------------------------------------- messages
    def make_receiver(self, inbox):
        """Each link decoded with what its producer may send; a client's bad record is returned,
        not raised (see dispatch)."""
        self.client_links = {
            link: topology.client_index(link) for link in inbox.links if topology.client_index(link) is not None
        }
        unions = {link: ClientToEngine for link in self.client_links}
        return LinkReceiver(inbox, {**unions, topology.SUPERVISOR: SupervisorToEngine, "scheduler": SchedulerToEngine})

    def dispatch(self, item) -> None:
        """The link names the sender: a client's message is handled as that client's whatever
        its body says, and a client that sends garbage or what only an actor may send is cut off
        (an actor's bad record is still a crash: that actor is broken)."""
        link, message = item
        client = self.client_links.get(link)
        if client is None:
            if isinstance(message, ProtocolError):
                raise message
            self.handle(message)
        elif isinstance(message, ProtocolError):
            self._disconnect(client, str(message))
        else:
            self._on_client(client, message)

    def handle(self, message) -> None:
        """A message of the supervisor or the scheduler."""
        match message:
            case SeqTokens():
                self._on_tokens(message)
            case Restarted():
                self._resync()
            case Suspects():
                self._on_suspects(message)
            case ServingStats():
                self._deliver(
                    message.client,
                    [
                        msgspec.structs.replace(
                            message, requests=len(self.table), disconnected_clients=self.disconnected
                        )
                    ],
                )
            case _:
                super().handle(message)

    def on_stop(self) -> None:
        """The tree is stopping: every unfinished request ends now with the reason. Stopped to be
        restarted (a sibling died under one_for_all / rest_for_one), the requests are not ours to
        end: each client sees this engine gone and re-submits its streams to the successor."""
        if self.restarting:
            return
        for tracked in list(self.table.values()):
            self._deliver(
                tracked.client,
                [
                    Update(
                        tracked.request_id,
                        [],
                        "",
                        "error",
                        error_code=503,
                        error_msg=f"fdcore stopped: {self.stop_reason}",
                    )
                ],
            )
            self._drop(tracked)
        for slot in self.clients.values():
            self._flush(slot)

    def _on_request(self, client: int, m: AddRequest) -> None:
        slot = self._slot(client)
        try:
            tracked = self._admit(m, slot)
        except RequestError as exc:
            self._deliver(client, [Update(m.request_id, [], "", "error", error_code=exc.code, error_msg=str(exc))])
            return
        except Exception as exc:  # a bug this request triggers is its own 500, not the engine's crash
            self._deliver(
                client,
                [
                    Update(
                        m.request_id,
                        [],
                        "",
                        "error",
                        error_code=500,
                        error_msg=f"request failed in fdcore:engine: {exc!r}",
                    )
                ],
            )
            return
        self.table[tracked.seq] = tracked
        slot.requests[m.request_id] = tracked.seq
        self.send(
            "scheduler",
            AddSeq(
                tracked.seq,
                tracked.prompt_token_ids,
                tracked.params,
                list(self.tokenizer.eos_token_ids),
                tracked.output_token_ids,
                tracked.tenant,
            ),
        )

    def _admit(self, m: AddRequest, slot: ClientSlot) -> TrackedRequest:
        """Validate and tokenize; raises RequestError naming the field."""
        validate_request_id(m.request_id)
        if m.request_id in slot.requests:
            raise RequestError(
                "request_id", f"{m.request_id!r} is already in use by an unfinished request of this client"
            )
        if len(self.table) >= self.config.engine.max_pending_requests:
            raise RequestError(
                "request",
                f"the engine already holds {len(self.table)} requests, its limit "
                "(engine.max_pending_requests); retry later",
                code=429,
            )
        body = self._body(m.body)
        check_one_prompt(body.prompt, body.prompt_token_ids, body.messages)  # before the sampling checks
        check_chat_options(body)
        params = check_sampling(body.sampling_params.with_defaults(self.sampling_defaults), self.limits)
        if params.structured_outputs is not None:  # compiled once, here: the workers get llguidance's form
            params = msgspec.structs.replace(params, structured_outputs=self.grammars.check(params.structured_outputs))
        prompt_ids = self.tokenizer.prompt_ids(body, self.limits)
        check_length(len(prompt_ids), params, self.limits)
        resumed = list(m.resume_token_ids)
        check_token_ids(resumed, self.limits, "resume_token_ids")
        scores = None
        if params.prompt_logprobs is not None:
            if resumed:  # the client had them with its first update: not computed again
                params = msgspec.structs.replace(params, prompt_logprobs=None)
            else:
                scores = [None] * len(prompt_ids)
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop)
        for token in resumed:
            detokenizer.add(token)
        # what the client has shown already (text held back then is still to come)
        detokenizer.emitted = min(m.resume_text_chars, len(detokenizer.text)) if resumed else 0
        return TrackedRequest(
            seq,
            slot.index,
            m.request_id,
            prompt_ids,
            params,
            detokenizer,
            m.arrival_time,
            resumed,
            announced=bool(resumed),
            prompt_scores=scores,
            tenant=f"{slot.index}/{m.tenant[:64]}",
        )

    def _body(self, raw) -> RequestBody:
        try:
            return self._decode_body(raw)
        except msgspec.ValidationError as exc:
            raise RequestError(*_explain_decode_error(str(exc))) from None
        except msgspec.DecodeError as exc:
            raise RequestError("body", f"not a valid request body ({exc})") from None
        except RecursionError:
            raise RequestError("body", "nested too deeply to decode") from None

    def _on_abort(self, client: int, request_id: str) -> None:
        slot = self.clients.get(client)
        seq = slot.requests.get(request_id) if slot else None
        if seq is None:
            return  # finished already, or never known: nothing to do
        tracked = self.table[seq]
        self.send("scheduler", FinishSeq(seq, "abort"))
        self._deliver(client, [self._update(tracked, [], tracked.detokenizer.finish(), "abort", None, time.time())])
        self._drop(tracked)

    # ------------------------------------------------------------------ tokens
    def _on_tokens(self, m: SeqTokens) -> None:
        if m.epoch != self.epoch:
            return  # computed before a restart: the new epoch recomputes these tokens
        now = time.time()
        for scores in m.prompt_scores or ():
            tracked = self.table.get(scores.seq)
            if tracked is not None and tracked.prompt_scores is not None:
                tracked.prompt_scores[scores.first : scores.first + len(scores.scores)] = scores.scores
        by_client: dict[int, list[Update]] = {}
        for i, seq in enumerate(m.seqs):
            tracked = self.table.get(seq)
            if tracked is None:
                continue  # aborted or stopped while its step ran
            try:
                update = self._render(tracked, m, i, now)
            except Exception as exc:  # this request's bug (detokenizer, stop strings): it alone fails
                self._fail(tracked, f"request failed in fdcore:engine: {exc!r}")
                continue
            by_client.setdefault(tracked.client, []).append(update)
            if update.finish_reason is not None:
                self._drop(tracked)
        for client, updates in by_client.items():
            self._deliver(client, updates)

    def _render(self, tracked: TrackedRequest, m: SeqTokens, i: int, now: float) -> Update:
        """One request's new token: appended, detokenized, checked for stop strings."""
        faults.check(self.poison, tracked.seq, tracked.prompt_token_ids)
        if tracked.prompt_scores is not None and None in tracked.prompt_scores[1:]:
            missing = tracked.prompt_scores[1:].count(None)
            raise RuntimeError(
                f"prompt_logprobs: {missing} prompt tokens were not scored (backend {self.config.model.backend!r})"
            )
        token, reason = m.token_ids[i], m.finish_reasons[i]
        tracked.output_token_ids.append(token)
        tracked.first_token_time = tracked.first_token_time or now
        detokenizer = tracked.detokenizer
        text = detokenizer.add(token)
        if detokenizer.stopped and reason is None:
            reason = "stop"
            self.send("scheduler", FinishSeq(tracked.seq, "stop"))
        elif reason is not None:
            text += detokenizer.finish()
        logprobs = [m.logprobs[i]] if m.logprobs and m.logprobs[i] is not None else None
        return self._update(tracked, [token], text, reason, logprobs, now)

    def _on_suspects(self, m: Suspects) -> None:
        """An actor crashed handling these requests: one named by two consecutive crashes of that
        kind of actor is failed alone, and never re-submitted into a third."""
        if m.epoch < self.first_epoch:
            return  # a crash from before this engine: its sequence numbers are not ours
        kind = topology.kind_of(m.child)
        for seq in sorted(self.quarantine.crashed(kind, m.seqs)):
            tracked = self.table.get(seq)
            if tracked is not None:
                self._fail(tracked, f"request crashed fdcore:{kind} twice")

    def _fail(self, tracked: TrackedRequest, reason: str, code: int = 500) -> None:
        """End one request with an error (the scheduler forgets it); nobody else is touched."""
        self.send("scheduler", FinishSeq(tracked.seq, "abort"))
        self._deliver(tracked.client, [Update(tracked.request_id, [], "", "error", error_code=code, error_msg=reason)])
        self._drop(tracked)

    def _update(
        self, t: TrackedRequest, tokens: list[int], text: str, reason: str | None, logprobs, now: float
    ) -> Update:
        prompt_ids, scores = None, None
        if not t.announced:
            prompt_ids, t.announced = t.prompt_token_ids, True
            if t.prompt_scores is not None:  # delivered now: a re-submission (restart) need not score again
                scores, t.prompt_scores = t.prompt_scores, None
                t.params = msgspec.structs.replace(t.params, prompt_logprobs=None)
        metrics = None
        if reason is not None:
            metrics = Metrics(t.arrival_time, t.first_token_time, now, len(t.prompt_token_ids), len(t.output_token_ids))
        return Update(t.request_id, tokens, text, reason, logprobs, prompt_ids, metrics, prompt_logprobs=scores)

    def _drop(self, tracked: TrackedRequest) -> None:
        del self.table[tracked.seq]
        self.quarantine.forget(tracked.seq)
        slot = self.clients.get(tracked.client)
        if slot is not None:
            slot.requests.pop(tracked.request_id, None)

    def _restore(self, slot: ClientSlot) -> None:
        """A slot whose owner is gone, made as the supervisor made it for the next owner: both rings
        empty at our positions, their headers rewritten (whatever the previous owner wrote there)."""
        inbound = self.receiver.source.link(topology.client_id(slot.index))
        inbound.drop_published()
        inbound.rewrite_header()
        slot.sender.ring.drop_unread()
        slot.sender.ring.rewrite_header()
        slot.outbox.clear()

    def after_messages(self) -> None:
        for slot in self.clients.values():
            self._flush(slot)
        now = time.monotonic()
        if now >= self.next_liveness_check:
            self.next_liveness_check = now + LIVENESS_INTERVAL
            for slot in self.clients.values():
                if slot.requests and not self._owner_alive(slot):
                    self._abandon(slot)
                    self._restore(slot)

    def wait_timeout(self, interval: float) -> float:
        if any(slot.outbox for slot in self.clients.values()):
            return 0.002
        return min(interval, LIVENESS_INTERVAL) if self.table else interval

    def close(self) -> None:
        for slot in self.clients.values():
            slot.sender.close()
            os.close(slot.lock_fd)
        super().close()


def _explain_decode_error(message: str) -> tuple[str, str]:
    """msgspec's 'Expected `float`, got `str` - at `$.sampling_params.top_p`' as (field, message)."""
    text, _, where = message.partition(" - at `$")
    path = where.rstrip("`").lstrip(".")
    if text.startswith("Object contains unknown field"):
        name = text.split("`")[1]
        return (f"{path}.{name}" if path else name).removeprefix("sampling_params."), "unknown field"
    field_name = path.removeprefix("sampling_params.") or "body"
    return field_name, text[0].lower() + text[1:] if text else "invalid value"
