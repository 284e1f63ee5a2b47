"""Numpy arrays as Paddle tensors, without a copy.

fdcore keeps its arrays (KV cache, activations, sampling inputs) in numpy, where
the small operations are cheapest, and hands them to Paddle ops and fdcore's C++
kernels only where those are faster. The hand-over must not copy:
``paddle.to_tensor`` would copy megabytes per layer and step.
"""

from __future__ import annotations

import numpy as np

from fdcore.models import cpu_env  # noqa: F401  (before paddle: math-library settings)
import paddle  # noqa: E402


def as_paddle(array: np.ndarray) -> paddle.Tensor:
    """A zero-copy Paddle view of a numpy array (DLPack): writes through either are seen by both,
    so the array must outlive the tensor and stay as it is (contiguous, same dtype) meanwhile."""
    return paddle.utils.dlpack.from_dlpack(array)
