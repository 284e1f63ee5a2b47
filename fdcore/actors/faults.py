"""Test-only fault points, so that the tests can make the failures the supervisor claims to handle.

- ``FDCORE_TEST_POISON=<actor kind>:<token id>`` makes that actor kind (engine, scheduler, worker,
  cache) raise while it handles a request whose prompt holds that token. It stands in for any bug a
  particular request triggers (a template, a kernel, an allocator corner) so the tests can prove
  one bad request costs only itself (see :mod:`fdcore.core.quarantine`).
- ``FDCORE_TEST_FAULT=<child id>:<behaviour>[:<n>]`` gives one child a misbehaviour (see
  ``BEHAVIOURS``): it ignores the Stop message (the supervisor's SIGTERM step must end it), ignores
  SIGTERM too (the SIGKILL step must), or wedges on its n-th piece of work (default 1) with its
  heartbeat still ticking (hang detection's "busy without progress" must catch it). A wedge happens
  in the tree's first generation only, so that the restarted child works and the test can see the
  requests resume. ``stall_spare`` makes the child's spare (its standby) never finish loading, as one
  starved of CPU on a busy machine would not. ``slow_pass:<ms>`` makes a worker's every forward pass
  (the warm-up's too) take ``ms`` milliseconds more per token, inside the call and without a tick: a
  model too large for the CPU, whose legitimate passes outlast ``hang_timeout``.

Unset, each is one environment lookup at actor start and a ``None`` check per request.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Sequence

from fdcore import envs
from fdcore.actors import health
from fdcore.protocol import Ping, Stop

POISON_ENV = envs.TEST_POISON
FAULT_ENV = envs.TEST_FAULT
BEHAVIOURS = ("ignore_stop", "ignore_sigterm", "wedge", "stall_spare", "slow_pass")


class PoisonedRequest(RuntimeError):
    """Raised by a fault point: the request carries the test's poison token."""


def poison_for(kind: str) -> int | None:
    """The poison token id for this actor kind, or None (the fault point is off)."""
    value = envs.get(POISON_ENV)
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


def behaviour_for(child_id: str) -> tuple[str, int] | None:
    """The misbehaviour ``FDCORE_TEST_FAULT`` gives this child and its count, or None."""
    value = envs.get(FAULT_ENV)
    if not value:
        return None
    parts = value.split(":")
    count = parts[2] if len(parts) == 3 else "1"
    if len(parts) not in (2, 3) or parts[1] not in BEHAVIOURS or not count.isdigit() or int(count) < 1:
        raise ValueError(
            f"{FAULT_ENV}={value!r}: expected <child id>:<behaviour>[:<n>], behaviour one of {BEHAVIOURS}, n >= 1"
        )
    target, behaviour = parts[:2]
    return (behaviour, int(count)) if target == child_id else None


def install(actor) -> None:
    """Give ``actor`` the misbehaviour the environment names for it (nothing when unset)."""
    behaviour, count = behaviour_for(actor.child_id) or (None, 0)
    if behaviour in ("ignore_stop", "ignore_sigterm"):
        actor.handle = _deaf_to_stop(actor.handle)
    if behaviour == "ignore_sigterm":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if behaviour == "wedge":
        actor.dispatch = _wedge_on_work(actor, actor.dispatch, count)
    if behaviour == "stall_spare" and actor.standby:
        actor.on_start = _stall
    if behaviour == "slow_pass":
        _slow_passes(count / 1000)


def _slow_passes(per_token: float) -> None:
    """Every forward pass of this process's models (LlamaModel.forward goes through forward_rows) takes
    ``per_token`` seconds more per token, before it computes: the call simply lasts, as a slow kernel's."""
    from fdcore.models.llama import LlamaModel

    forward_rows = LlamaModel.forward_rows

    def slow_forward_rows(self, batch, cache, every_row_of):
        time.sleep(per_token * sum(len(t) for t in batch.token_ids))
        return forward_rows(self, batch, cache, every_row_of)

    LlamaModel.forward_rows = slow_forward_rows


def _stall() -> None:
    while True:  # (SIGTERM still ends it: the runtime's handler raises)
        signal.pause()


def _deaf_to_stop(handle):
    def handle_all_but_stop(message) -> None:
        if not isinstance(message, Stop):
            handle(message)

    return handle_all_but_stop


def _wedge_on_work(actor, dispatch, count: int):
    """The ``count``-th message that is not the supervisor's Ping never finishes: the heartbeat
    keeps ticking (as an actor spinning on a retry would; one stuck in a kernel would stop it, which
    is the other hang), its busy flag stays up and its progress counter stops."""
    seen = [0]

    def dispatch_or_wedge(item) -> None:
        message = item[1] if isinstance(item, tuple) else item
        if isinstance(message, Ping) or actor.board.read(actor.slot, health.GENERATION) != 0:
            dispatch(item)
            return
        seen[0] += 1
        if seen[0] < count:
            dispatch(item)
            return
        actor.board.write(actor.slot, health.BUSY, 1)
        while True:
            actor.heartbeat()
            time.sleep(actor.config.supervisor.heartbeat_interval / 2)

    return dispatch_or_wedge
