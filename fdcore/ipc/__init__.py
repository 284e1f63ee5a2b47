"""fdcore's shared-memory message layer: rings, inboxes, typed channels, names."""

from fdcore.ipc.broadcast import BroadcastRing
from fdcore.ipc.channel import LinkReceiver, ProtocolError, Receiver, Sender
from fdcore.ipc.doorbell import Doorbell
from fdcore.ipc.inbox import Inbox, InboxStatistics
from fdcore.ipc.names import new_instance_id, object_name, sweep
from fdcore.ipc.ring import Ring
from fdcore.ipc.ring_layout import (
    RecordTooLarge,
    RingClosed,
    RingCorrupted,
    RingEmpty,
    RingError,
    RingFull,
    RingStatistics,
)

__all__ = [
    "Ring",
    "BroadcastRing",
    "RingStatistics",
    "RingError",
    "RingCorrupted",
    "RingClosed",
    "RingEmpty",
    "RingFull",
    "RecordTooLarge",
    "Inbox",
    "InboxStatistics",
    "Doorbell",
    "Sender",
    "Receiver",
    "LinkReceiver",
    "ProtocolError",
    "new_instance_id",
    "object_name",
    "sweep",
]
