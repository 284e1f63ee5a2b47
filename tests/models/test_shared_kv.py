"""The KV cache in a shared file (cache.shared_memory; fdcore.models.kv_cache.PagedKVCache with ``fd``): what one
worker wrote, its successor reads, so a stream resumes after a crash without recomputing its blocks."""

from __future__ import annotations

import os

import numpy as np
import pytest

from fdcore.checkpoint import load_checkpoint, tiny
from fdcore.core.batch import BatchInput
from fdcore.models.kv_cache import PagedKVCache
from fdcore.models.llama import LlamaModel

pytestmark = pytest.mark.kernels

BLOCK = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tiny.make_tiny_model(str(tmp_path_factory.mktemp("kv") / "tiny"))
    return LlamaModel(load_checkpoint(path, progress=lambda *_: None), "float32", "none")


@pytest.fixture
def kv_fd():
    fd = os.memfd_create("fdcore-test-kv", os.MFD_CLOEXEC)
    yield fd
    os.close(fd)


def test_a_successor_decodes_from_the_blocks_its_predecessor_wrote(model, kv_fd):
    """A prompt prefilled into the shared cache by one cache object (the worker that then dies); a second
    one over the same file (its successor) decodes the next token with the same logits, to the bit, as the
    first would have, having computed nothing of the prompt; a private cache would read zeros there."""
    prompt, table = list(range(7, 7 + 37)), [5, 2, 9]
    first = model.new_cache(12, BLOCK, "float32", kv_fd)
    model.forward(BatchInput([prompt], [0], [table]), first)
    expected = model.forward(BatchInput([[11]], [len(prompt)], [table]), first)
    successor = model.new_cache(12, BLOCK, "float32", kv_fd)
    assert successor.shared and not model.new_cache(12, BLOCK, "float32").shared
    got = model.forward(BatchInput([[11]], [len(prompt)], [table]), successor)
    np.testing.assert_array_equal(got, expected)
    fresh = model.forward(BatchInput([[11]], [len(prompt)], [table]), model.new_cache(12, BLOCK, "float32"))
    assert not np.array_equal(fresh, expected)


def test_the_layers_arrays_do_not_overlap_and_a_file_made_for_another_cache_is_refused(model, kv_fd):
    cache = PagedKVCache(model.args, 4, BLOCK, "float32", kv_fd)
    arrays = cache.k + cache.v
    for i, array in enumerate(arrays):
        array[...] = i + 1
    assert [float(a.min()) for a in arrays] == [float(a.max()) for a in arrays] == list(range(1, len(arrays) + 1))
    cache.release()  # (a shared cache keeps its contents: they are the serving worker's)
    assert float(cache.k[0].min()) == 1.0
    with pytest.raises(ValueError, match="made for others"):
        PagedKVCache(model.args, 2, BLOCK, "float32", kv_fd)
