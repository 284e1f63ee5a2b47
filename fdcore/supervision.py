"""Supervision policy, OTP-style, as plain objects with no processes inside.

- :class:`ChildSpec`: a child as data (id, what to start, restart type, shutdown timeout).
- :func:`to_restart`: which children a strategy restarts when one fails.
- :func:`plan_restart`: the same as the supervisor acts on it: which running siblings to stop
  first (reverse start order) and what to start again (start order).
- :func:`should_restart`: whether a child's restart type wants a restart after an exit.
- :class:`Backoff`: exponentially growing pauses between respawns of something that keeps
  failing (a warm standby worker).
- :class:`RestartIntensity`: more than ``max_restarts`` restarts within ``period``
  seconds means the tree cannot heal itself: stop everything and exit with the reason.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Collection, Sequence
from typing import Literal

import msgspec

Strategy = Literal["one_for_one", "one_for_all", "rest_for_one"]
RestartType = Literal["permanent", "transient", "temporary"]


class ChildSpec(msgspec.Struct, frozen=True):
    """A child as data (OTP's child spec): its id and kind, what runs it ("module:Class"), who may
    send to it (its inbox's links), whether its restart loses request state, and how it is
    restarted and stopped."""

    id: str
    kind: str
    restart: RestartType = "permanent"
    shutdown_timeout: float = 5.0
    actor_class: str = ""
    producers: tuple[str, ...] = ()
    stateful: bool = False


def to_restart(strategy: Strategy, order: list[str], failed: str) -> list[str]:
    """The children to restart, in start order, when ``failed`` has died."""
    if strategy == "one_for_one":
        return [failed]
    if strategy == "one_for_all":
        return list(order)
    if strategy == "rest_for_one":
        return order[order.index(failed) :]
    raise ValueError(f"unknown strategy {strategy!r}")


class RestartPlan(msgspec.Struct, frozen=True):
    """What one failure makes the supervisor do, in this order."""

    stop: list[str]  # running siblings to stop for the restart, in reverse start order
    start: list[str]  # children to start again, in start order (the failed one among them)


def plan_restart(
    strategy: Strategy,
    order: list[str],
    failed: str,
    running: Collection[str],
    groups: Sequence[Sequence[str]] = (),
) -> RestartPlan:
    """The restart of ``failed`` (no longer running) under ``strategy``: as OTP, siblings the
    strategy takes along are stopped in reverse start order, then everything is started again in
    start order. ``order`` is the start order of the children that may be restarted. A child of one
    of ``groups`` (a tensor-parallel worker group: its ranks share state no rank can rebuild alone)
    fails as its whole group, as if the group's first child had failed."""
    if failed in running:
        raise ValueError(f"{failed!r} is still running: only a child that is gone is restarted")
    group = next((g for g in groups if failed in g), [failed])
    members = [c for c in order if c in group]
    affected = set(members) | set(to_restart(strategy, order, members[0]))
    start = [c for c in order if c in affected]
    return RestartPlan([c for c in reversed(start) if c in running], start)


def should_restart(restart: RestartType, abnormal: bool) -> bool:
    """permanent: always; transient: only after an abnormal exit; temporary: never."""
    return restart == "permanent" or (restart == "transient" and abnormal)


class RestartIntensity:
    """A sliding window of restart times."""

    def __init__(self, max_restarts: int, period: float, clock: Callable[[], float] = time.monotonic):
        self.max_restarts = max_restarts
        self.period = period
        self.clock = clock
        self._times: collections.deque[float] = collections.deque()

    def record(self) -> bool:
        """Note one restart; True while still within the allowed intensity."""
        now = self.clock()
        self._times.append(now)
        while self._times and self._times[0] <= now - self.period:
            self._times.popleft()
        return len(self._times) <= self.max_restarts

    @property
    def recent(self) -> int:
        return len(self._times)

    def describe(self) -> str:
        return f"{self.recent} restarts within {self.period:g} s (at most {self.max_restarts} allowed)"


class Backoff:
    """How long to wait before respawning something that keeps dying: ``base`` after the first
    failure, doubling with each failure that follows within ``reset_after`` seconds of the previous
    one, at most ``cap``. A respawn loop then costs a few processes a minute, not twenty a second."""

    def __init__(
        self,
        base: float = 0.1,
        cap: float = 30.0,
        reset_after: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not 0 < base <= cap:
            raise ValueError(f"backoff needs 0 < base ({base}) <= cap ({cap})")
        self.base, self.cap, self.reset_after, self.clock = base, cap, reset_after, clock
        self.failures = 0
        self._last_failure = self._not_before = float("-inf")

    def failed(self) -> float:
        """Note a failure; the delay before the next attempt."""
        now = self.clock()
        if now - self._last_failure > self.reset_after:
            self.failures = 0
        self.failures += 1
        self._last_failure = now
        delay = float(min(self.cap, self.base * 2 ** (self.failures - 1)))
        self._not_before = now + delay
        return delay

    def ready(self) -> bool:
        """True once the delay after the last failure has passed."""
        return self.clock() >= self._not_before

    def succeeded(self) -> None:
        """It worked (a spare took over): the next failure starts from ``base`` again."""
        self.failures = 0
        self._not_before = float("-inf")
