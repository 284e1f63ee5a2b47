"""Where a model's packed weights lie in a shared weight file (fdcore.models.shared_weights), as msgspec data:
what the first worker writes and every later process of its rank maps."""

from __future__ import annotations

import msgspec
import numpy as np

from fdcore.models import cpu_env  # noqa: F401  (before paddle: math-library settings)

# isort: split
import paddle

from fdcore.models.matrices import Bf16Matrix, F32Matrix, Int4Matrix, Int8Matrix
from fdcore.models.shared_weights import Stored, WeightFile

# a packed matrix's arrays, as a shared weight file stores them (LlamaModel._weights_manifest)
PARTS = {
    F32Matrix: lambda m: [m.array],
    Bf16Matrix: lambda m: [m.packed],
    Int8Matrix: lambda m: [m.packed, m.scales],
    Int4Matrix: lambda m: [m.packed],
}


class StoredMatrix(msgspec.Struct, tag="m", array_like=True):
    """A packed matrix in a shared weight file: its class's name, its arrays (PARTS), rows, gated."""

    kind: str
    parts: list[Stored]
    rows: int
    gated: bool = False


class WeightsManifest(msgspec.Struct):
    """Where a model's weights lie in a shared weight file (fdcore.models.shared_weights): the model's
    attributes of the same names; a layer's entries as its dict holds them (an int: its window)."""

    model: str  # what the weights were packed for (LlamaModel._packed_for): a process of another refuses them
    tied: bool  # the embedding and the LM head are one matrix
    embed: Stored | StoredMatrix
    embed_rows: Stored | None
    lm_head: Stored | StoredMatrix
    norm: Stored
    layers: list[dict[str, Stored | StoredMatrix | int | None]]


def stored_value(shared: WeightFile, value):
    """``value`` (an array or tensor packed into ``shared``; an int or None as it is) as the manifest holds it."""
    if value is None or isinstance(value, int):
        return value
    if isinstance(value, np.ndarray):
        return shared.stored(value)
    if value.dtype == paddle.bfloat16:
        return shared.stored(np.from_dlpack(value.view(paddle.int16)), tensor=True, dtype="bfloat16")
    return shared.stored(np.from_dlpack(value), tensor=True)
