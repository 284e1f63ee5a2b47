"""The residual add + RMSNorm operator (rms_norm.cc's AddRmsNormInto): a row's sum and normed values against a
float64 reference, and each row's bits its own, whether it comes alone, in any run of the rows whose scales are
computed together (RmsScales: four at a time) or on any thread count (a crash's recompute gets other batches)."""

from __future__ import annotations

import numpy as np
import pytest

from fdcore.models.kernels import operators

pytestmark = pytest.mark.kernels

needs_ops = pytest.mark.skipif(operators() is None, reason="fdcore's C++ operators do not build here")

_ON_THREADS = """
import sys
import numpy as np
import paddle
from fdcore.models.kernels import operators
given = np.load(sys.argv[1])
add_rms_norm = operators().add_rms_norm
total, normed = add_rms_norm(paddle.to_tensor(given["h"]), paddle.to_tensor(given["d"]), paddle.to_tensor(given["w"]),
                             1e-5)
np.savez(sys.argv[2], total=total.numpy(), normed=normed.numpy())
"""


def _rows(count: int, width: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "h": (rng.standard_normal((count, width)) * 3).astype(np.float32),
        "d": rng.standard_normal((count, width)).astype(np.float32),
        "w": rng.uniform(0.5, 1.5, width).astype(np.float32),
    }


@needs_ops
@pytest.mark.parametrize("width", [576, 100, 37, 16, 5])
def test_each_row_is_normed_alone_to_its_own_bits(width):
    """11 rows (runs of 4, 4 and 3) of a width with whole 16-value chunks and a tail, or a tail alone: the float64
    reference's values, the sum exactly h + d, and every row's bits the same as normed alone and in a run of 2."""
    import paddle

    add_rms_norm = operators().add_rms_norm
    given = _rows(11, width, seed=width)
    h, d, w = (paddle.to_tensor(given[name]) for name in ("h", "d", "w"))
    total, normed = (out.numpy() for out in add_rms_norm(h, d, w, 1e-5))
    assert np.array_equal(total, given["h"] + given["d"])
    s = total.astype(np.float64)
    expected = s / np.sqrt((s * s).mean(axis=1, keepdims=True) + 1e-5) * given["w"]
    np.testing.assert_allclose(normed, expected, rtol=2e-6, atol=1e-6)
    for row in range(11):
        alone = add_rms_norm(h[row : row + 1], d[row : row + 1], w, 1e-5)[1].numpy()
        assert np.array_equal(alone[0], normed[row]), row
    pair = add_rms_norm(h[5:7], d[5:7], w, 1e-5)[1].numpy()
    assert np.array_equal(pair, normed[5:7])


@needs_ops
def test_a_norm_gives_the_same_bits_on_one_and_two_threads(on_threads):
    """37 rows of 576 (shared out from 8 rows: runs of 4 on each thread, the last run 1 row)."""
    given = _rows(37, 576, seed=2)
    one, two = on_threads(_ON_THREADS, given, threads=1), on_threads(_ON_THREADS, given, threads=2)
    for name in ("total", "normed"):
        assert np.array_equal(one[name], two[name]), name
