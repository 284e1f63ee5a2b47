"""StepInputs (fdcore.models.tensors): a step's small inputs copied into reused buffers' tensors."""

from __future__ import annotations

import numpy as np

from fdcore.models.tensors import StepInputs


def _step(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(rows, 8)).astype(np.float32), rng.integers(0, 100, size=rows, dtype=np.int64)


def test_a_step_of_a_recent_shape_gets_the_same_tensors_holding_its_own_values():
    inputs = StepInputs()
    first = inputs.views(_step(1, 0))
    arrays = _step(1, 1)
    second = inputs.views(arrays)
    assert all(a is b for a, b in zip(first, second, strict=True))
    for tensor, array in zip(second, arrays, strict=True):
        assert np.array_equal(np.from_dlpack(tensor), array)
        assert not np.shares_memory(np.from_dlpack(tensor), array)  # a copy: the caller's array may go


def test_shapes_alternate_without_mixing_values_and_the_oldest_is_dropped():
    inputs = StepInputs(capacity=2)
    one, two = inputs.views(_step(1, 0)), inputs.views(_step(2, 0))
    arrays = _step(1, 5)
    again = inputs.views(arrays)
    assert again[0] is one[0] and np.array_equal(np.from_dlpack(again[0]), arrays[0])
    assert np.array_equal(np.from_dlpack(two[0]), _step(2, 0)[0])  # the other shape's buffers untouched
    inputs.views(_step(3, 0))  # a third shape: the least recently used (2 rows) goes
    assert inputs.views(_step(2, 0))[0] is not two[0]
    assert inputs.views(_step(1, 0))[0] is not one[0]  # (dropped in turn when 2 rows came back)


def test_large_inputs_are_viewed_in_place():
    inputs = StepInputs(largest=64)
    arrays = _step(4, 0)  # 128 + 32 bytes
    views = inputs.views(arrays)
    assert all(np.shares_memory(np.from_dlpack(view), array) for view, array in zip(views, arrays, strict=True))
