"""msgpack codecs for the links: one encoder, and one decoder per union type (built once, cached).

Generic (any msgspec types), so the transport layer does not import the message definitions
(fdcore.protocol), as vLLM keeps its serial utilities apart from its message types.
"""

from __future__ import annotations

from typing import Any

import msgspec

_decoders: dict[object, msgspec.msgpack.Decoder[Any]] = {}


def decoder_for(union: Any) -> msgspec.msgpack.Decoder[Any]:
    """The (cached) decoder for one inbox's union type."""
    decoder = _decoders.get(union)
    if decoder is None:
        decoder = _decoders[union] = msgspec.msgpack.Decoder(union)
    return decoder


ENCODER = msgspec.msgpack.Encoder()
