"""Settings measured at load (fdcore.models.tuning): the chooser alone, on a fake clock, and the
kernels' weight prefetch (float32, int8, int4), which the model tunes and which must change no result."""

from __future__ import annotations

import numpy as np
import pytest

from fdcore.models.kernels import kernel_path
from fdcore.models.tuning import SwitchTrial, fastest, rounds_for

pytestmark = pytest.mark.kernels


class FakeHost:
    """A clock that a run advances by the current setting's cost, plus a drift per run."""

    def __init__(self, costs: dict, drift: float = 0.0):
        self.costs, self.drift, self.now, self.current, self.log = costs, drift, 0.0, None, []

    def apply(self, setting) -> None:
        self.current = setting

    def run(self) -> None:
        self.log.append(self.current)
        self.now += self.costs[self.current] + self.drift * len(self.log)

    def clock(self) -> float:
        return self.now


def test_the_cheaper_setting_wins_and_stays_applied():
    host = FakeHost({"on": 2.0, "off": 1.5})
    best, medians = fastest(("on", "off"), host.apply, host.run, rounds=4, clock=host.clock)
    assert best == "off" and host.current == "off"
    assert medians == {"on": 2.0, "off": 1.5}
    assert host.log.count("on") == host.log.count("off") == 5  # one untimed run each, then 4 rounds


def test_the_order_rotates_so_a_drifting_host_weighs_on_both():
    # each run costs more than the last: a fixed order would always time "on" first, and cheaper
    host = FakeHost({"on": 1.0, "off": 1.0}, drift=0.01)
    fastest(("on", "off"), host.apply, host.run, rounds=4, clock=host.clock)
    timed = host.log[2:]
    assert [timed[i] for i in range(0, 8, 2)] == ["on", "off", "on", "off"]  # who goes first alternates


def test_a_tie_keeps_the_first_setting():
    host = FakeHost({"on": 1.0, "off": 1.0})
    assert fastest(("on", "off"), host.apply, host.run, rounds=3, clock=host.clock)[0] == "on"


@pytest.mark.parametrize("pass_mb, expected", [(80, 8), (160, 8), (320, 4), (538, 3), (4000, 3), (0, 8)])
def test_a_pass_over_more_bytes_gets_fewer_rounds_but_never_below_three(pass_mb, expected):
    assert rounds_for(8, pass_mb << 20, 160 << 20) == expected
    assert rounds_for(2, pass_mb << 20, 160 << 20) <= 2  # (never more than asked)


@pytest.mark.parametrize("settings, rounds", [((), 3), (("on",), 0)])
def test_nothing_to_measure_is_an_error(settings, rounds):
    with pytest.raises(ValueError, match="at least one setting and one round"):
        fastest(settings, lambda s: None, lambda: None, rounds=rounds)


needs_int_kernels = pytest.mark.skipif(kernel_path("wint8") is None, reason="wint8 is refused on CPUs without AVX2")


@needs_int_kernels
def test_the_prefetch_setting_changes_no_bit_of_the_kernels():
    import paddle

    from fdcore.models.kernels import set_weight_prefetch, weight_prefetch
    from fdcore.models.matrices import F32Matrix, Int4Matrix, Int8Matrix, f32_kernel, linear, matrix_kind

    matrix_kind("float32", "wint4")  # loads the int kernels
    assert f32_kernel()  # (and the float32 one: the same flags or fewer)
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((9, 576)).astype(np.float32), rng.standard_normal((4160, 576)).astype(np.float32)
    saved = weight_prefetch()
    try:
        for cls in (F32Matrix, Int8Matrix, Int4Matrix):
            matrix = cls.pack(w)
            assert matrix.inputs == 576
            out = {}
            for on in (True, False):
                assert set_weight_prefetch(on) and weight_prefetch() is on
                out[on] = [linear(paddle.to_tensor(x[:m]), matrix).numpy() for m in (1, 9)]
            assert all(np.array_equal(a, b) for a, b in zip(out[True], out[False], strict=False))
            expected = x @ w.T  # (and the products are the products: 4-bit levels of Gaussians, ~9 % off)
            assert np.linalg.norm(out[True][1] - expected) < 0.15 * np.linalg.norm(expected)
    finally:
        set_weight_prefetch(saved)


@needs_int_kernels
@pytest.mark.parametrize("quantization", ["none", "wint8", "wint4"])
def test_a_model_of_streamed_matrices_measures_both_and_keeps_the_faster(tmp_path, quantization):
    from fdcore.checkpoint import load_checkpoint, tiny
    from fdcore.models.kernels import weight_prefetch
    from fdcore.models.llama import LlamaModel

    path = tiny.make_tiny_model(str(tmp_path / "tiny"))
    model = LlamaModel(load_checkpoint(path, progress=lambda *_: None), "float32", quantization)
    timing = model.prefetch_timing
    assert set(timing) == {True, False} and all(seconds > 0 for seconds in timing.values())
    assert weight_prefetch() is min((True, False), key=lambda on: timing[on])


@pytest.mark.skipif(kernel_path("bfloat16") is None, reason="bfloat16 is refused on CPUs without AVX512-BF16")
def test_a_bfloat16_model_has_nothing_to_tune(tmp_path):
    from fdcore.checkpoint import load_checkpoint, tiny
    from fdcore.models.llama import LlamaModel

    path = tiny.make_tiny_model(str(tmp_path / "tiny"))
    plain = LlamaModel(load_checkpoint(path, progress=lambda *_: None), "bfloat16")
    assert plain.prefetch_timing is None  # its kernel does not prefetch: nothing to choose


def _drive(trial: SwitchTrial, cost: dict, steps: int) -> list:
    """Runs ``steps`` eligible steps whose time is cost[value]; the values used, in order."""
    used = []
    for _ in range(steps):
        value = trial.next()
        used.append(value)
        trial.record(cost[value])
    return used


def test_a_trial_every_period_alternates_and_keeps_a_value_that_stays_faster():
    trial = SwitchTrial(True, False, period=10, pairs=3, first_after=None)
    used = _drive(trial, {True: 1.0, False: 1.2}, 16)
    assert used[:10] == [True] * 10  # the period: the current value only
    assert used[10:16] == [False, True] * 3  # then the trial: other first in each pair
    assert trial.current is True and trial.last_ratio == pytest.approx(1.2)
    assert _drive(trial, {True: 1.0, False: 1.2}, 10) == [True] * 10  # the next period starts over


def test_the_other_value_takes_over_when_the_host_changes_its_mind():
    trial = SwitchTrial(True, False, period=4, pairs=2, first_after=None)
    _drive(trial, {True: 1.0, False: 0.8}, 4 + 3)
    value = trial.next()
    assert trial.record(0.8 if value is False else 1.0) is True  # the trial's last step: switched
    assert trial.current is False and trial.other is True and trial.last_ratio == pytest.approx(0.8)
    assert _drive(trial, {True: 1.0, False: 0.8}, 4) == [False] * 4


def test_a_difference_inside_the_margin_switches_nothing():
    trial = SwitchTrial(True, False, period=2, pairs=2, margin=0.05, first_after=None)
    _drive(trial, {True: 1.0, False: 0.97}, 2 + 4)
    assert trial.current is True and trial.last_ratio == pytest.approx(0.97)


def test_a_trial_takes_the_median_so_one_slow_step_decides_nothing():
    trial = SwitchTrial(True, False, period=1, pairs=3, first_after=None)
    trial.record(1.0)  # the period
    for other, current in ((0.9, 1.0), (5.0, 1.0), (0.9, 1.0)):  # one preempted step of the other value
        assert trial.next() is False
        trial.record(other)
        assert trial.next() is True
        trial.record(current)
    assert trial.current is False


def test_the_first_trial_comes_early_then_one_a_period():
    trial = SwitchTrial(True, False, period=100, pairs=2, first_after=3)
    assert _drive(trial, {True: 1.0, False: 1.2}, 3 + 4 + 5) == [True] * 3 + [False, True] * 2 + [True] * 5
    assert trial.steps == 5 and not trial.trying  # the next trial after a whole period


@pytest.mark.parametrize("period, pairs, margin", [(0, 1, 0.0), (1, 0, 0.0), (1, 1, 1.0)])
def test_a_trial_without_steps_or_with_a_margin_of_everything_is_refused(period, pairs, margin):
    with pytest.raises(ValueError, match="period and pairs at least 1"):
        SwitchTrial(True, False, period=period, pairs=pairs, margin=margin)


@needs_int_kernels
def test_the_worker_tries_the_prefetch_at_batch_1_decode_steps_only(capsys):
    from fdcore.actors.worker import WorkerActor
    from fdcore.models.kernels import set_weight_prefetch, weight_prefetch
    from fdcore.models.matrices import matrix_kind

    matrix_kind("float32", "wint8")  # (builds and loads the kernels)
    saved = weight_prefetch()
    worker = WorkerActor.__new__(WorkerActor)  # the two methods alone: no process, no model
    worker.child_id, worker.prefetch_trial = "worker0", SwitchTrial(True, False, 1, 1, first_after=None)
    set_weight_prefetch(True)
    try:
        assert worker._prefetch_trial([[5, 6, 7]]) is None and worker._prefetch_trial([[5], [6]]) is None
        trial = worker._prefetch_trial([[5]])
        worker._prefetch_tried(trial, 1.0)  # the period's step, with the current value
        assert worker._prefetch_trial([[5]]) is trial and weight_prefetch() is False  # the trial's "other" step
        worker._prefetch_tried(trial, 0.5)
        assert worker._prefetch_trial([[5]]) is trial and weight_prefetch() is True
        worker._prefetch_tried(trial, 1.0)  # off took half the time: it takes over
        assert trial.current is False and "weight prefetch now off" in capsys.readouterr().err
        worker._prefetch_trial([[5]])
        assert weight_prefetch() is False
    finally:
        set_weight_prefetch(saved)
