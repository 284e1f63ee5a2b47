"""Poison-request quarantine as a plain object, and the test-only fault point that drives it."""

from __future__ import annotations

import pytest

from fdcore.actors import faults
from fdcore.core.quarantine import Quarantine


def test_a_request_named_by_two_consecutive_crashes_of_one_kind_is_convicted():
    q = Quarantine()
    assert q.crashed("worker", [1, 2, 3]) == set()  # one crash convicts nobody
    assert q.crashed("worker", [3, 4]) == {3}


def test_crashes_of_other_kinds_do_not_count_together():
    q = Quarantine()
    q.crashed("worker", [7])
    assert q.crashed("scheduler", [7]) == set()
    assert q.crashed("worker", [7]) == {7}  # consecutive among the worker's own reports


def test_only_consecutive_reports_count():
    q = Quarantine()
    q.crashed("scheduler", [5])
    q.crashed("scheduler", [6])
    assert q.crashed("scheduler", [5]) == set()


def test_a_finished_request_is_forgotten():
    q = Quarantine()
    q.crashed("worker", [1, 2])
    q.forget(1)
    assert q.crashed("worker", [1, 2]) == {2}


def test_a_report_needs_its_actor_kind():
    with pytest.raises(ValueError, match="kind"):
        Quarantine().crashed("", [1])


def test_the_fault_point_is_off_unless_set_for_that_kind(monkeypatch):
    monkeypatch.delenv(faults.POISON_ENV, raising=False)
    assert faults.poison_for("worker") is None
    faults.check(None, 1, [2, 3])  # off: nothing raised
    monkeypatch.setenv(faults.POISON_ENV, "worker:3")
    assert faults.poison_for("worker") == 3 and faults.poison_for("engine") is None
    with pytest.raises(faults.PoisonedRequest, match="request 1 carries the test poison token 3"):
        faults.check(3, 1, [2, 3])
    faults.check(3, 1, [2, 4])


@pytest.mark.parametrize("value", ["worker", "worker:x", "3"])
def test_a_malformed_fault_point_is_refused(monkeypatch, value):
    monkeypatch.setenv(faults.POISON_ENV, value)
    with pytest.raises(ValueError, match="FDCORE_TEST_POISON"):
        faults.poison_for("worker")
