"""Typed channels: msgspec Structs over a ring (send) or a ring / inbox (receive).

The sender encodes into one reusable ``bytearray`` (no allocation per message)
and copies it into the ring; the receiver decodes with a decoder built once for
the inbox's union type. A record that does not decode is reported as a
:class:`ProtocolError` naming the link, never silently dropped.
"""

from __future__ import annotations

import msgspec

from fdcore.protocol import ENCODER, decoder_for


class ProtocolError(ValueError):
    """A record on a link that is not a valid message of the link's type."""


class Sender:
    """Sends Structs of one union type over a :class:`~fdcore.ipc.ring.Ring`."""

    def __init__(self, ring):
        self.ring = ring
        self._buffer = bytearray(256)
        self._encode_into = ENCODER.encode_into

    def send(self, message, timeout: float | None = None) -> None:
        """Encode and put one message, waiting up to ``timeout`` for room."""
        self._encode_into(message, self._buffer)
        self.ring.put(self._buffer, timeout)

    def send_nowait(self, message) -> None:
        self._encode_into(message, self._buffer)
        self.ring.put_nowait(self._buffer)

    def send_many(self, messages, timeout: float | None = None) -> int:
        """Put a batch with one publish (see ``Ring.put_many``)."""
        return self.ring.put_many([ENCODER.encode(m) for m in messages], timeout)

    def close(self) -> None:
        self.ring.close()


class Receiver:
    """Receives Structs of ``union`` from a ring or an inbox."""

    def __init__(self, source, union):
        self.source = source
        self._decode = decoder_for(union).decode

    def _decoded(self, raw: bytes):
        try:
            return self._decode(raw)
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"{self.source.name}: undecodable record ({exc}); "
                                f"first bytes {raw[:16]!r}") from None

    def recv(self, timeout: float | None = None):
        return self._decoded(self.source.get(timeout))

    def recv_nowait(self):
        return self._decoded(self.source.get_nowait())

    def recv_many(self, timeout: float | None = None) -> list:
        """Wait up to ``timeout`` for at least one message, then everything available."""
        return [self._decoded(raw) for raw in self.source.get_many(timeout=timeout)]

    def recv_many_nowait(self) -> list:
        return [self._decoded(raw) for raw in self.source.get_many_nowait()]

    def close(self) -> None:
        self.source.close()
