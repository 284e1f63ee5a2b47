"""Test-only fault points: ``FDCORE_TEST_POISON=<actor kind>:<token id>`` makes that actor kind
(engine, scheduler, worker, cache) raise while it handles a request whose prompt holds that token.

It stands in for any bug a particular request triggers (a template, a kernel, an allocator corner)
so the tests can prove one bad request costs only itself (see :mod:`fdcore.core.quarantine`). Unset,
it is one environment lookup at actor start and a ``None`` check per request.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

POISON_ENV = "FDCORE_TEST_POISON"


class PoisonedRequest(RuntimeError):
    """Raised by a fault point: the request carries the test's poison token."""


def poison_for(kind: str) -> int | None:
    """The poison token id for this actor kind, or None (the fault point is off)."""
    value = os.environ.get(POISON_ENV, "")
    if not value:
        return None
    target, sep, token = value.partition(":")
    if not sep or not token.isdigit():
        raise ValueError(f"{POISON_ENV}={value!r}: expected <actor kind>:<token id>, e.g. worker:3999")
    return int(token) if target == kind else None


def check(poison: int | None, seq: int, token_ids: Sequence[int]) -> None:
    """Raise PoisonedRequest when the fault point is on and ``token_ids`` hold the poison token."""
    if poison is not None and poison in token_ids:
        raise PoisonedRequest(f"request {seq} carries the test poison token {poison} ({POISON_ENV})")
