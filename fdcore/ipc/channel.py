"""Typed channels: msgspec Structs over a ring (send) or a ring / inbox (receive).

The sender encodes into one reusable ``bytearray`` (no allocation per message)
and copies it into the ring; the receiver decodes with a decoder built once for
the inbox's union type. A record that does not decode is reported as a
:class:`ProtocolError` naming the link, never silently dropped.

Batches (``send_many``) travel as *one* record: the byte ``BATCH`` followed by a
msgpack array of the messages, encoded and decoded in one msgspec call each.
A single message never starts with that byte (msgpack Structs start with an
array header, 0x90-0x9f or 0xdc-0xdd), so the receiver can tell them apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from fdcore.ipc.codec import ENCODER, decoder_for
from fdcore.ipc.ring_layout import RingCorrupted

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from fdcore.ipc.inbox import Inbox
    from fdcore.ipc.ring import Ring

BATCH = 0x01
_BATCH_PREFIX = bytes([BATCH])


class ProtocolError(ValueError):
    """A record on a link that is not a valid message of the link's type."""


class Sender:
    """Sends Structs of one union type over a :class:`~fdcore.ipc.ring.Ring`."""

    def __init__(self, ring: Ring) -> None:
        self.ring = ring
        self._buffer = bytearray(256)
        self._batch_buffer = bytearray([BATCH])
        self._encode_into = ENCODER.encode_into

    def send(self, message: object, timeout: float | None = None) -> None:
        """Encode and put one message, waiting up to ``timeout`` for room."""
        self._encode_into(message, self._buffer)
        self.ring.put(self._buffer, timeout)

    def send_nowait(self, message: object) -> None:
        self._encode_into(message, self._buffer)
        self.ring.put_nowait(self._buffer)

    def send_many(self, messages: Sequence[object], timeout: float | None = None) -> None:
        """Send a list of messages as one record (one copy, one publish, one wake-up)."""
        self._encode_into(messages, self._batch_buffer, 1)
        self.ring.put(self._batch_buffer, timeout)

    def close(self) -> None:
        self.ring.close()


class Receiver:
    """Receives Structs of ``union`` from a ring or an inbox."""

    def __init__(self, source: Ring | Inbox, union: Any) -> None:
        self.source = source
        self._decode = decoder_for(union).decode
        self._decode_batch: Callable[[bytes | memoryview], list[Any]] = decoder_for(list[union]).decode
        self._pending: list[Any] = []  # rest of a batch that recv() is handing out one by one

    def _decoded(self, raw: bytes) -> list[Any]:
        """The messages of one record (a batch record holds several)."""
        try:
            if raw[:1] == _BATCH_PREFIX:
                return self._decode_batch(memoryview(raw)[1:])
            return [self._decode(raw)]
        except msgspec.DecodeError as exc:
            raise ProtocolError(
                f"{self.source.name}: undecodable record ({exc}); first bytes {bytes(raw[:16])!r}"
            ) from None

    def recv(self, timeout: float | None = None) -> Any:
        """One message, waiting up to ``timeout`` seconds (None: forever)."""
        while not self._pending:
            self._pending = self._decoded(self.source.get(timeout))[::-1]
        return self._pending.pop()

    def recv_nowait(self) -> Any:
        while not self._pending:
            self._pending = self._decoded(self.source.get_nowait())[::-1]
        return self._pending.pop()

    def recv_many(self, timeout: float | None = None, max_records: int = 64) -> list[Any]:
        """Wait up to ``timeout`` for at least one message, then what is available.

        At most ``max_records`` records (each a message or a batch) per link and
        call: bounded work per call keeps an actor's loop responsive and its
        allocations young.
        """
        if self._pending:
            return self.recv_many_nowait(max_records)
        return self._flatten(self.source.get_many(max_records, timeout))

    def recv_many_nowait(self, max_records: int = 64) -> list[Any]:
        out, self._pending = self._pending[::-1], []
        return out + self._flatten(self.source.get_many_nowait(max_records))

    def _flatten(self, records: list[bytes]) -> list[Any]:
        if len(records) == 1:
            return self._decoded(records[0])
        return [message for raw in records for message in self._decoded(raw)]

    def close(self) -> None:
        self.source.close()


class LinkReceiver:
    """Receives from an inbox link by link, for a consumer that must not trust its producers: each
    link decodes only the union its producer may send, and a record that does not decode as one of
    those (garbage, or a message out of place) comes back as a :class:`ProtocolError` for that link
    instead of being raised, so one bad producer cannot stop the consumer."""

    def __init__(self, inbox: Inbox, unions: dict[str, Any]) -> None:
        self.source = inbox
        self._decoders = {
            link: (decoder_for(union).decode, decoder_for(list[union]).decode)  # type: ignore[valid-type]
            for link, union in unions.items()  # (above: a union held in a variable, not a type alias)
        }

    def recv_many(self, timeout: float | None = None, max_records: int = 64) -> list[tuple[str, object]]:
        """Wait up to ``timeout`` for a record, then (link, message or ProtocolError) for all there is."""
        return [
            item
            for link, raw in self.source.get_many_by_link(max_records, timeout)
            for item in self._decoded(link, raw)
        ]

    def _decoded(self, link: str, raw: bytes | RingCorrupted) -> list[tuple[str, object]]:
        if isinstance(raw, RingCorrupted):  # (the inbox has emptied the link)
            return [(link, ProtocolError(f"{self.source.name}.{link}: corrupted ring ({raw})"))]
        decode, decode_batch = self._decoders[link]
        try:
            if raw[:1] == _BATCH_PREFIX:
                return [(link, message) for message in decode_batch(memoryview(raw)[1:])]
            return [(link, decode(raw))]
        except (msgspec.DecodeError, RecursionError) as exc:  # garbage, or nested past the stack's depth
            return [
                (
                    link,
                    ProtocolError(
                        f"{self.source.name}.{link}: undecodable record ({exc!r}); first bytes {bytes(raw[:16])!r}"
                    ),
                )
            ]

    def close(self) -> None:
        self.source.close()
