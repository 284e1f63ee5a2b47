"""The supervisor's event lines on stderr: ``fdcore.supervisor: event=NAME key=value ...``, machine-readable
(values with spaces JSON-quoted; fdcore.logs formats them)."""

from __future__ import annotations

from fdcore import logs

_events = logs.logger("fdcore.supervisor")


def log(event: str, **fields: object) -> None:
    """One event line: its name and its fields, in order."""
    _events.info(event, extra={"fields": fields})
