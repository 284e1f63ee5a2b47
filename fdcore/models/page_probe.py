"""Whether the shared weight file's pages stream as fast as private huge pages, measured at load."""

from __future__ import annotations

import numpy as np

from fdcore.models import cpu_env  # noqa: F401  (before paddle: math-library settings)

# isort: split
import paddle

from fdcore.checkpoint import ModelArgs
from fdcore.models.matrices import F32Matrix, f32_kernel, linear
from fdcore.models.shared_weights import shared_pages_cost

PAGE_COST_FLOOR = 16 << 20  # (bytes a decode pass streams below which page size is not measured)


def shared_pages_slowdown(args: ModelArgs, fd: int | None = None, budget: int = 256 << 20) -> float | None:
    """How much slower a batch-1 decode step's products stream their weights from the shared file ``fd``'s
    pages than from private huge pages here (fdcore.models.shared_weights.shared_pages_cost): one float32
    matrix of the model's hidden width, as many bytes as its layers stream up to ``budget``, one row through
    it in one call. One call, not the layers' shapes: a decode step reads its weights as one long stream,
    and a probe of many small calls measured Python's dispatch beside the memory, not the pages. None
    without the float32 kernel, and None for a model whose layers stream fewer than ``PAGE_COST_FLOOR``
    bytes: they stay in the caches and the TLB's reach, where the page size costs nothing and a
    measurement would read only the machine's noise."""
    if not f32_kernel():
        return None
    h, d, inner = args.hidden_size, args.head_dim, args.intermediate_size
    shapes = [((args.num_heads + 2 * args.num_kv_heads) * d, h), (h, args.num_heads * d), (2 * inner, h), (h, inner)]
    streamed = args.num_layers * sum(-(-rows // 32) * 32 * cols * 4 for rows, cols in shapes)
    if streamed < PAGE_COST_FLOOR:
        return None
    panels = min(streamed, budget) // (h * 32 * 4)
    row = paddle.ones([1, h], dtype=paddle.float32)

    def one_pass(array: np.ndarray) -> None:
        linear(row, F32Matrix(array[: panels * h * 32].reshape(panels, h, 32), panels * 32))

    return shared_pages_cost(one_pass, panels * h * 32 * 4, fd)
