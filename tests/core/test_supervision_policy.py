"""Supervision policy as plain objects: strategies, restart types, intensity (fake clock), stalls."""

from __future__ import annotations

import pytest

from fdcore.actors.health import StallWatch, silence_ns
from fdcore.core.step_cost import StepCost, parameter_count
from fdcore.supervision import Backoff, RestartIntensity, RestartPlan, plan_restart, should_restart, to_restart

ORDER = ["cache", "worker0", "scheduler", "engine"]


@pytest.mark.parametrize(
    "strategy, failed, expected",
    [
        ("one_for_one", "scheduler", ["scheduler"]),
        ("one_for_all", "scheduler", ORDER),
        ("rest_for_one", "worker0", ["worker0", "scheduler", "engine"]),
        ("rest_for_one", "engine", ["engine"]),
        ("rest_for_one", "cache", ORDER),
    ],
)
def test_strategies_choose_the_children_to_restart(strategy, failed, expected):
    assert to_restart(strategy, ORDER, failed) == expected


def test_unknown_strategy_is_an_error():
    with pytest.raises(ValueError, match="unknown strategy"):
        to_restart("one_for_some", ORDER, "cache")


@pytest.mark.parametrize(
    "strategy, failed, running, stop",
    [
        ("one_for_one", "scheduler", ["cache", "worker0", "engine"], []),
        ("one_for_all", "worker0", ["cache", "scheduler", "engine"], ["engine", "scheduler", "cache"]),
        ("rest_for_one", "scheduler", ["cache", "worker0", "engine"], ["engine"]),
        ("rest_for_one", "cache", ["worker0", "engine"], ["engine", "worker0"]),  # scheduler died too
    ],
)
def test_a_restart_stops_running_siblings_in_reverse_order_then_starts_in_order(strategy, failed, running, stop):
    plan = plan_restart(strategy, ORDER, failed, set(running))
    assert plan == RestartPlan(stop, to_restart(strategy, ORDER, failed))


GROUP_ORDER = ["cache", "worker0", "worker1", "scheduler", "engine"]


@pytest.mark.parametrize(
    "strategy, failed, stop, start",
    [
        ("one_for_one", "worker1", ["worker0"], ["worker0", "worker1"]),  # a rank takes its group along
        ("one_for_one", "worker0", ["worker1"], ["worker0", "worker1"]),
        (
            "rest_for_one",
            "worker1",
            ["engine", "scheduler", "worker0"],  # as if rank 0 had failed
            ["worker0", "worker1", "scheduler", "engine"],
        ),
        ("one_for_all", "worker1", ["engine", "scheduler", "worker0", "cache"], GROUP_ORDER),
        ("one_for_one", "scheduler", [], ["scheduler"]),  # outside the group: as before
    ],
)
def test_a_worker_group_fails_as_a_whole(strategy, failed, stop, start):
    running = {c for c in GROUP_ORDER if c != failed}
    assert plan_restart(strategy, GROUP_ORDER, failed, running, [["worker0", "worker1"]]) == RestartPlan(stop, start)


def test_a_running_child_cannot_be_planned_for_restart():
    with pytest.raises(ValueError, match="still running"):
        plan_restart("one_for_all", ORDER, "engine", {"engine"})


@pytest.mark.parametrize(
    "restart, abnormal, expected",
    [
        ("permanent", False, True),
        ("permanent", True, True),
        ("transient", False, False),
        ("transient", True, True),
        ("temporary", False, False),
        ("temporary", True, False),
    ],
)
def test_restart_types(restart, abnormal, expected):
    assert should_restart(restart, abnormal) is expected


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_intensity_allows_max_restarts_within_the_period_then_refuses():
    clock = FakeClock()
    window = RestartIntensity(max_restarts=3, period=10.0, clock=clock)
    assert [window.record() for _ in range(3)] == [True, True, True]
    assert window.record() is False
    assert window.describe() == "4 restarts within 10 s (at most 3 allowed)"


def test_intensity_forgets_restarts_older_than_the_period():
    clock = FakeClock()
    window = RestartIntensity(max_restarts=2, period=10.0, clock=clock)
    window.record()
    clock.now += 6
    window.record()
    clock.now += 5  # the first one is now 11 s old
    assert window.record() is True and window.recent == 2
    assert RestartIntensity(0, 10.0, clock).record() is False


S = 1_000_000_000


def test_the_stall_watch_sees_a_stopped_heartbeat_and_busy_without_progress():
    watch = StallWatch(now_ns=0)
    assert watch.look(heartbeat_ns=100 * S, progress=5, busy=False, now_ns=105 * S, hang_timeout_ns=10 * S) is None
    assert watch.look(100 * S, 5, False, 111 * S, 10 * S) == "no heartbeat for 11.0 s"
    assert watch.look(0, 5, False, 200 * S, 10 * S) is None  # not ticking yet; idle: no progress owed
    watch = StallWatch(now_ns=0)
    assert watch.look(98 * S, 5, True, 98 * S, 10 * S) is None  # progressed: owes from now
    assert watch.look(107 * S, 5, True, 107 * S, 10 * S) is None
    assert watch.look(110 * S, 5, True, 110 * S, 10 * S) == "busy without progress for 12.0 s"
    assert watch.look(111 * S, 6, True, 111 * S, 10 * S) is None  # it moved


def test_inside_its_grace_an_actor_owes_no_tick_and_no_progress():
    """A worker in a long forward pass (its grace: until 130 s) neither ticks nor progresses; it is not
    hung before the grace ends, and past it the hang timeout counts from the grace's end."""
    watch = StallWatch(now_ns=0)
    assert watch.look(100 * S, 5, True, 100 * S, 10 * S, grace_ns=130 * S) is None
    assert watch.look(100 * S, 5, True, 125 * S, 10 * S, grace_ns=130 * S) is None  # 25 s silent, in grace
    assert watch.look(100 * S, 5, True, 139 * S, 10 * S, grace_ns=130 * S) is None  # 9 s past it
    assert watch.look(100 * S, 5, True, 141 * S, 10 * S, grace_ns=130 * S) == "no heartbeat for 11.0 s"
    assert silence_ns(100 * S, 0, 105 * S) == 5 * S  # no grace: since the tick


def test_the_step_cost_learns_from_measured_passes():
    """A pass's expected cost: a one-token part and a per-token part, the unmeasured bound replaced by
    the first measurement, a slow pass raising it at once and the estimate sinking back slowly."""
    cost = StepCost.unmeasured(parameter_count(576, 1536, 30, 9, 3, 64, 49152))  # SmolLM2's shape
    assert cost.expected(1) > 0.2 and cost.expected(1024) > 100  # a slow CPU's bound: generous
    cost.record(8, 0.08)  # the warm-up's prompt, before any one-token pass: all of it per token
    cost.record(1, 0.02)
    assert cost.per_pass == 0.02 and abs(cost.per_token - 0.08 / 7) < 1e-12
    cost.record(101, 0.02 + 100 * 0.005)  # cheaper tokens in a big batch: the estimate sinks, slowly
    assert 0.005 < cost.per_token < 0.08 / 7
    cost.record(1, 0.5)  # one slow pass (a busy machine): raised at once
    assert cost.per_pass == 0.5
    assert cost.grace(1000) == 4 * (cost.per_pass + 999 * cost.per_token)


def test_an_actor_idle_for_long_owes_no_progress_the_moment_it_gets_work():
    """Counting from the last progress called a cache manager hung at the first message after a
    long model load (idle for 50 s, then busy for one look)."""
    watch = StallWatch(now_ns=0)
    assert watch.look(49 * S, 0, False, 50 * S, 10 * S) is None
    assert watch.look(50 * S, 0, True, 50 * S + S // 10, 10 * S) is None
    assert watch.look(61 * S, 0, True, 61 * S, 10 * S) == "busy without progress for 11.0 s"


def test_the_first_look_only_sets_the_baseline():
    """A tree that took 13.6 s to load: the cache manager, spawned first, was busy with its first
    message at the supervisor's first look after ready, and was called hung for its start-up."""
    watch = StallWatch(now_ns=0)
    assert watch.look(13 * S, 0, True, 13 * S + S // 2, 10 * S) is None
    assert watch.look(24 * S, 0, True, 24 * S, 10 * S) == "busy without progress for 10.5 s"


def test_backoff_doubles_up_to_its_cap_and_waits_that_long():
    clock = FakeClock()
    backoff = Backoff(base=0.1, cap=0.5, reset_after=60.0, clock=clock)
    assert backoff.ready()
    assert [backoff.failed() for _ in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    assert not backoff.ready()
    clock.now += 0.5
    assert backoff.ready()


def test_backoff_starts_over_after_a_success_or_a_quiet_while():
    clock = FakeClock()
    backoff = Backoff(base=1.0, cap=30.0, reset_after=60.0, clock=clock)
    backoff.failed(), backoff.failed()
    backoff.succeeded()
    assert backoff.ready() and backoff.failed() == 1.0
    clock.now += 61
    assert backoff.failed() == 1.0


@pytest.mark.parametrize("base, cap", [(0.0, 1.0), (2.0, 1.0)])
def test_backoff_refuses_nonsense(base, cap):
    with pytest.raises(ValueError, match="backoff"):
        Backoff(base=base, cap=cap)
