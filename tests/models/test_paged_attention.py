"""Attention over the float32 paged cache (attention.cc): against a float64 reference for every head size
and heads-per-pass split, block size, sliding window and key count, on this CPU's build and on the AVX2 one
(and its scalar path); the cache's layout (keys transposed within a block) the same whether the operator or
the Python path wrote it."""

from __future__ import annotations

import types

import numpy as np
import pytest

from fdcore.models import kernels
from fdcore.models.kernels import operators
from tests.attention import attend, reference

pytestmark = pytest.mark.kernels

needs_ops = pytest.mark.skipif(operators() is None, reason="fdcore's C++ operators do not build here")

CASES = [
    (9, 3, 64, 16, 0),  # SmolLM2: pairs of rows, 3 heads a pass
    (5, 1, 64, 16, 0),  # a pass of 4 heads then 1
    (4, 2, 128, 16, 0),  # 2 heads a pass at 128
    (3, 1, 256, 8, 0),  # 1 head a pass past 128; blocks of 8 (runs of 8 keys)
    (2, 2, 32, 5, 0),  # blocks that cut the 16-key runs
    (4, 2, 80, 32, 0),  # a head size of 5 vectors (a masked one); two runs a block
    (4, 2, 64, 16, 7),  # a sliding window (runs start mid-block)
    (2, 1, 16, 16, 0),  # one vector a head: the most runs a pass
    (3, 1, 12, 16, 0),  # not a multiple of 8: masked on AVX-512, the scalar path on AVX2
]
LENGTHS = [1, 2, 17, 40, 33, 70]  # odd and even key counts, a pair left over, one and several runs


def _check(case) -> None:
    heads, kv_heads, dim, block, window = case
    out, q, k, v, rows = attend(heads, kv_heads, dim, block, window, LENGTHS, "float32", seed=dim + block)
    expected = reference(q, k, v, rows, heads, kv_heads, window)
    np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5 * np.abs(v).max())


@needs_ops
@pytest.mark.parametrize("case", CASES)
def test_the_float32_cache_attention_equals_its_float64_reference(case):
    _check(case)


_ON_AVX2 = """
import sys
import numpy as np
from fdcore.models import kernels
from tests.models.test_paged_attention import CASES, _check
assert kernels.kernel_path("float32") == "AVX2"
for case in CASES:
    _check(case)
np.savez(sys.argv[2], done=np.array(len(CASES)))
"""


@needs_ops
@pytest.mark.skipif(kernels.kernel_path("wint8") is None, reason="no AVX2 here")
def test_the_avx2_build_equals_the_reference_too(on_threads):
    assert int(on_threads(_ON_AVX2, {}, threads=1, env={"FDCORE_ISA": "avx2"})["done"]) == len(CASES)


@needs_ops
def test_the_operator_and_the_python_path_lay_the_cache_out_alike():
    """The operator writes a key as a column of its block ([head_dim, block_size]); PagedKVCache.write does the
    same, and gather gives the keys back as rows."""
    import paddle

    from fdcore.models.kv_cache import PagedKVCache

    heads, kv_heads, dim, block = 4, 2, 32, 8
    rng = np.random.default_rng(1)
    tokens = 21
    slots = rng.permutation(4 * block)[:tokens].astype(np.int64)  # anywhere in 4 blocks
    qkv = rng.standard_normal((tokens, (heads + 2 * kv_heads) * dim)).astype(np.float32)
    args = types.SimpleNamespace(num_kv_heads=kv_heads, head_dim=dim, num_layers=1)
    by_op, by_python = PagedKVCache(args, 4, block), PagedKVCache(args, 4, block)
    assert by_op.k[0].shape == (kv_heads, 4, dim, block) and by_op.v[0].shape == (kv_heads, 4, block, dim)
    k_cache, v_cache = by_op.tensors(0)
    operators().attention_block(
        paddle.to_tensor(qkv),
        paddle.ones([tokens, dim // 2]),
        paddle.zeros([tokens, dim // 2]),
        paddle.to_tensor(slots),
        k_cache,
        v_cache,
        paddle.to_tensor(np.zeros((tokens, 4), dtype=np.int64)),
        paddle.to_tensor(np.ones(tokens, dtype=np.int64)),
        paddle.empty([0], dtype="float32"),
        paddle.empty([0], dtype="float32"),
        heads,
        1.0,
        0,
        1e-6,
    )
    split = qkv.reshape(tokens, heads + 2 * kv_heads, dim)
    keys, values = split[:, heads : heads + kv_heads], split[:, heads + kv_heads :]
    by_python.write(0, slots, keys, values)
    assert np.array_equal(by_op.k[0], by_python.k[0]) and np.array_equal(by_op.v[0], by_python.v[0])
    k, v = by_python.gather(0, np.arange(4))
    assert np.array_equal(k[:, slots], keys.transpose(1, 0, 2))
    assert np.array_equal(v[:, slots], values.transpose(1, 0, 2))
