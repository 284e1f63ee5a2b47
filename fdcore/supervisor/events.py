"""The supervisor's event lines on stderr: ``fdcore.supervisor: event=NAME key=value ...``, machine-readable
(values with spaces JSON-quoted)."""

from __future__ import annotations

import json
import sys


def log(event: str, **fields) -> None:
    text = " ".join(f"{k}={_quote(v)}" for k, v in fields.items())
    sys.stderr.write(f"fdcore.supervisor: event={event} {text}\n")
    sys.stderr.flush()


def _quote(value) -> str:
    text = str(value)
    return json.dumps(text) if (" " in text or not text) else text
