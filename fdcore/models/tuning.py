"""Settings chosen by measuring them on the machine at hand: settings that change no result, only speed,
and whose best value differs between machines (and between hours of one shared host), so that no
constant is right everywhere."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence


def fastest(
    settings: Sequence,
    apply: Callable,
    run: Callable[[], object],
    rounds: int = 8,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[object, dict]:
    """The setting under which ``run()`` takes the least time, and each setting's median seconds.

    Every round runs each setting once, in an order rotated round by round, so a host whose speed drifts
    weighs on all alike; one untimed run per setting first (caches, page faults). ``apply(setting)`` makes
    a setting current; on return the chosen one is. A tie goes to the earlier setting (list the default first).
    """
    if not settings or rounds < 1:
        raise ValueError("fastest: at least one setting and one round")
    times: dict = {setting: [] for setting in settings}
    for setting in settings:
        apply(setting)
        run()
    for r in range(rounds):
        for i in range(len(settings)):
            setting = settings[(i + r) % len(settings)]
            apply(setting)
            start = clock()
            run()
            times[setting].append(clock() - start)
    medians = {setting: statistics.median(spent) for setting, spent in times.items()}
    best = min(settings, key=lambda setting: medians[setting])  # (min keeps the first of equals)
    apply(best)
    return best, medians


def rounds_for(rounds: int, pass_bytes: int, bytes_per_round: int, fewest: int = 3) -> int:
    """``rounds`` of ``fastest`` scaled down where one run streams more than ``bytes_per_round`` (its time
    grows with the bytes, and at load it is a restarted worker's pause too), but never below ``fewest``
    (nor above ``rounds``)."""
    if pass_bytes <= 0:
        return rounds
    return max(min(rounds, fewest), min(rounds, round(rounds * bytes_per_round / pass_bytes)))


class SwitchTrial:
    """Keeps re-measuring a two-valued speed setting while it is in use, for a host whose best value
    changes after the load (the int kernels' weight prefetch: fdcore.models.kernels.set_weight_prefetch).

    Every ``period`` steps that the setting can speed up (the caller decides which: batch-1 decode steps
    for the prefetch), the next ``2 * pairs`` such steps alternate other, current, other, current...; the
    other value takes over when the median of its pairs' time ratios is below ``1 - margin``. Adjacent
    steps of a decode see the same host minute and nearly the same work, which one long comparison
    would not. A step in a trial costs at most the difference between the two values, for 1 / period
    of the steps per value tried.
    """

    def __init__(
        self, current, other, period: int = 256, pairs: int = 8, margin: float = 0.02, first_after: int | None = 16
    ):
        """``first_after``: eligible steps before the first trial (default 16: a value chosen outside real
        steps, e.g. at load, is checked against them early); None: a whole period."""
        if period < 1 or pairs < 1 or not 0 <= margin < 1:
            raise ValueError("SwitchTrial: period and pairs at least 1, margin in [0, 1)")
        self.current, self.other = current, other
        self.period, self.pairs, self.margin = period, pairs, margin
        # eligible steps since the last trial ended (counted up to the period)
        self.steps = 0 if first_after is None else max(0, period - first_after)
        self.times: list[float] = []  # the running trial's step times, other's first in each pair
        self.last_ratio: float | None = None  # the last trial's median other / current

    @property
    def trying(self) -> bool:
        return self.steps >= self.period

    def next(self):
        """The value to use for the next eligible step."""
        if not self.trying:
            return self.current
        return self.other if len(self.times) % 2 == 0 else self.current

    def record(self, seconds: float) -> bool:
        """The eligible step run with ``next()``'s value took ``seconds``; True when this ended a trial that
        switched the values."""
        if not self.trying:
            self.steps += 1
            return False
        self.times.append(seconds)
        if len(self.times) < 2 * self.pairs:
            return False
        ratios = [self.times[i] / self.times[i + 1] for i in range(0, len(self.times), 2) if self.times[i + 1] > 0]
        self.times, self.steps = [], 0
        self.last_ratio = statistics.median(ratios) if ratios else None
        if self.last_ratio is not None and self.last_ratio < 1 - self.margin:
            self.current, self.other = self.other, self.current
            return True
        return False
