"""Settings measured at load (fdcore.models.tuning): the chooser alone, on a fake clock, and the int
kernels' weight prefetch, which the model tunes and which must change no result."""

from __future__ import annotations

import numpy as np
import pytest

from fdcore.models.kernels import kernel_path
from fdcore.models.tuning import fastest


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


@pytest.mark.parametrize("settings, rounds", [((), 3), (("on",), 0)])
def test_nothing_to_measure_is_an_error(settings, rounds):
    with pytest.raises(ValueError, match="at least one setting and one round"):
        fastest(settings, lambda s: None, lambda: None, rounds=rounds)


needs_int_kernels = pytest.mark.skipif(kernel_path("wint8") is None, reason="wint8 is refused on CPUs without AVX2")


@needs_int_kernels
def test_the_prefetch_setting_changes_no_bit_of_the_int_kernels():
    import paddle

    from fdcore.models.kernels import set_weight_prefetch, weight_prefetch
    from fdcore.models.llama import Int4Matrix, Int8Matrix, _matrix_kind, linear

    _matrix_kind("float32", "wint4")  # loads both kernels
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((9, 576)).astype(np.float32), rng.standard_normal((4160, 576)).astype(np.float32)
    saved = weight_prefetch()
    try:
        for cls in (Int8Matrix, Int4Matrix):
            matrix = cls.pack(w)
            assert matrix.inputs == 576
            out = {}
            for on in (True, False):
                assert set_weight_prefetch(on) and weight_prefetch() is on
                out[on] = [linear(paddle.to_tensor(x[:m]), matrix).numpy() for m in (1, 9)]
            assert all(np.array_equal(a, b) for a, b in zip(out[True], out[False]))
    finally:
        set_weight_prefetch(saved)


@needs_int_kernels
@pytest.mark.parametrize("quantization", ["wint8", "wint4"])
def test_a_quantized_model_measures_both_and_keeps_the_faster(tmp_path, quantization):
    from fdcore.models import tiny
    from fdcore.models.kernels import weight_prefetch
    from fdcore.models.llama import LlamaModel
    from fdcore.models.loader import load_checkpoint

    path = tiny.make_tiny_model(str(tmp_path / "tiny"))
    model = LlamaModel(load_checkpoint(path, progress=lambda *_: None), "float32", quantization)
    timing = model.prefetch_timing
    assert set(timing) == {True, False} and all(seconds > 0 for seconds in timing.values())
    assert weight_prefetch() is min((True, False), key=lambda on: timing[on])
    plain = LlamaModel(load_checkpoint(path, progress=lambda *_: None))
    assert plain.prefetch_timing is None  # nothing of int8 or int4 to stream
