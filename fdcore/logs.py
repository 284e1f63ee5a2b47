"""fdcore's diagnostics, through the standard ``logging`` module: one logger per module (``logs.logger(__name__)``),
all under the ``fdcore`` logger, which writes one line per record to the process's stderr.

A record logged with ``extra={"fields": {...}}`` is an event and is formatted machine-readably as
``<logger>: event=<message> key=value ...`` (values with spaces or empty JSON-quoted): the supervisor's lines,
which tests, tools and people's log pipelines read. Any other record is its message as it is. Progress bars and
a command's own answers are not diagnostics and stay plain writes and prints.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is when a record comes (a test's capture, a descriptor redirected)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


class EventFormatter(logging.Formatter):
    """An event record as ``<logger>: event=NAME key=value ...``; any other record as its message."""

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None)
        if fields is None:
            return super().format(record)
        text = " ".join(f"{key}={quote(value)}" for key, value in fields.items())
        return f"{record.name}: event={record.getMessage()} {text}"


def quote(value: object) -> str:
    """A field's value as an event line writes it: JSON-quoted when it has a space or is empty."""
    text = str(value)
    return json.dumps(text) if (" " in text or not text) else text


def logger(name: str) -> logging.Logger:
    """The logger of module ``name`` (under ``fdcore``), the process's stderr handler installed once."""
    root = logging.getLogger("fdcore")
    if not any(isinstance(handler, _Stderr) for handler in root.handlers):
        handler = _Stderr()
        handler.setFormatter(EventFormatter("%(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False
    return logging.getLogger(name)
