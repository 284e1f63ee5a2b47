"""Every message fdcore's actors exchange: msgspec Structs, one tagged union per inbox.

Conventions (msgspec's and vLLM V1's): messages are ``array_like`` (no field
names on the wire), ``frozen``, ``gc=False`` when they hold no cycles,
``forbid_unknown_fields`` is implied by array_like's fixed arity. Schema
evolution: new fields get defaults and are appended, never reordered. Each
inbox has one union (``ControlMessage``, ``EngineMessage``, ...) and one
decoder built once for it (:func:`decoder_for`).
"""

from __future__ import annotations

import msgspec


class Message(msgspec.Struct, array_like=True, frozen=True, gc=False, tag=True):
    """Base of all messages; the tag is the class name."""


# --------------------------------------------------------------- actor control
class Stop(Message):
    """Finish what can be finished and exit cleanly."""

    reason: str = ""


class Ping(Message):
    """Liveness probe; answered with a Pong carrying the same nonce."""

    nonce: int


class Pong(Message):
    nonce: int
    sender: str


# ----------------------------------------------------------------- sampling
class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """How to pick each token of one request (the seed's / vLLM's field names).

    ``temperature == 0`` is greedy. ``top_k == 0`` and ``top_p == 1`` and
    ``min_p == 0`` switch those filters off. ``seed`` makes sampling a pure
    function of (seed, position): the same tokens whatever shares the batch and
    however often the request is recomputed. ``logprobs = N`` returns the top-N.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None


# ----------------------------------------------------------- request tracking
class TokenDelta(Message):
    """New tokens of one request (engine -> client), sent as a delta."""

    request_id: str
    position: int
    token_ids: list[int]
    finished: bool = False


class Abort(Message):
    request_id: str


ControlMessage = Stop | Ping | Pong
ClientMessage = TokenDelta | Abort | Pong


_decoders: dict[object, msgspec.msgpack.Decoder] = {}


def decoder_for(union) -> msgspec.msgpack.Decoder:
    """The (cached) decoder for one inbox's union type."""
    decoder = _decoders.get(union)
    if decoder is None:
        decoder = _decoders[union] = msgspec.msgpack.Decoder(union)
    return decoder


ENCODER = msgspec.msgpack.Encoder()
