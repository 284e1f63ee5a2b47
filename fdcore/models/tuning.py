"""Settings chosen by measuring them on the machine at hand: settings that change no result, only speed,
and whose best value differs between machines (and between hours of one shared host), so that no
constant is right everywhere."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence


def fastest(settings: Sequence, apply: Callable, run: Callable[[], object], rounds: int = 8,
            clock: Callable[[], float] = time.perf_counter) -> tuple[object, dict]:
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
