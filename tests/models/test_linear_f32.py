"""float32 projections through fdcore's kernel (linear_f32.cc, F32Matrix): against float64 on every shape
edge, bit-identical whatever the batch around a row and the thread count, and the model's use of it."""

from __future__ import annotations

import numpy as np
import pytest

from fdcore.models.kernels import kernel_path

pytestmark = pytest.mark.kernels

needs_f32_kernel = pytest.mark.skipif(
    kernel_path("float32") is None, reason="float32 stays with MKL on CPUs without AVX-512F or AVX2"
)


def _linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    import paddle

    from fdcore.models.matrices import F32Matrix, f32_kernel, linear

    assert f32_kernel()
    return linear(paddle.to_tensor(x), F32Matrix.pack(w)).numpy()


def test_the_packed_layout_and_the_rows_it_gives_back():
    """packed[p, k, lane] = w[32 p + lane, k], the last panel padded with zeros; take_rows is w[ids]."""
    from fdcore.models.matrices import F32Matrix

    w = np.random.default_rng(0).standard_normal((70, 9)).astype(np.float32)
    matrix = F32Matrix.pack(w)
    assert matrix.array.shape == (3, 9, 32) and matrix.rows == 70 and matrix.numel() == 3 * 9 * 32
    assert np.array_equal(matrix.array.transpose(0, 2, 1).reshape(96, 9)[:70], w)
    assert not matrix.array[2, :, 6:].any()
    ids = np.array([69, 0, 31, 32, 5, 5], dtype=np.int64)
    assert np.array_equal(matrix.take_rows(ids), w[ids])
    assert np.array_equal(matrix.packed.numpy(), matrix.array)


@needs_f32_kernel
@pytest.mark.parametrize(
    "m, k, n",
    [
        (1, 576, 1536),
        (1, 33, 9),
        (1, 7, 130),
        (5, 100, 37),
        (8, 64, 64),
        (9, 1, 3),
        (33, 96, 130),
        (17, 1536, 576),
        (0, 16, 40),
    ],
)
def test_the_kernel_equals_a_float64_reference(m, k, n):
    """One row or several (8 at a time, then the rest: 5, 9, 17 and 33 rows leave 5, 1, 1 and 1), an
    inner dimension of 1 or odd, output counts that are not a multiple of the 32-row panels or of 16,
    no rows at all. Within float32's rounding of a K-term sum."""
    rng = np.random.default_rng(m * 1000 + k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    got = _linear(x, w)
    assert got.shape == (m, n) and got.dtype == np.float32
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    size = np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64)
    assert np.all(np.abs(got - exact) <= k * 2.0**-23 * size + 1e-30)


@needs_f32_kernel
def test_a_row_alone_equals_itself_in_any_batch():
    """Every output is one chain of FMAs over k in order, whatever tile (8 rows, or the rest) holds it:
    each row of a batch of 5 or of 33 is the row alone to the bit."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((33, 576)).astype(np.float32)
    w = rng.standard_normal((200, 576)).astype(np.float32)
    alone = np.concatenate([_linear(x[i : i + 1], w) for i in range(33)])
    assert np.array_equal(_linear(x[:5], w), alone[:5])
    assert np.array_equal(_linear(x, w), alone)
    assert np.array_equal(_linear(x[7:12], w), alone[7:12])


_THREADED = """
import sys
import numpy as np
import paddle
from fdcore.models.matrices import F32Matrix, f32_kernel, linear
assert f32_kernel()
data = np.load(sys.argv[1])
matrix = F32Matrix.pack(data["w"])
out = {f"{m}": linear(paddle.to_tensor(data["x"][:m]), matrix).numpy() for m in (1, 5, 33)}
np.savez(sys.argv[2], **out)
"""


@needs_f32_kernel
def test_two_threads_equal_one_thread_bit_for_bit(on_threads):
    """OMP_NUM_THREADS=2 (these shapes take the parallel path: the panels shared out) gives one thread's
    results to the bit: each output is computed whole by one thread."""
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((33, 576)).astype(np.float32), rng.standard_normal((1000, 576)).astype(np.float32)
    threaded = on_threads(_THREADED, {"x": x, "w": w})
    for m in (1, 5, 33):
        assert np.array_equal(threaded[f"{m}"], _linear(x[:m], w))


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from fdcore.checkpoint import tiny

    return tiny.make_tiny_model(str(tmp_path_factory.mktemp("f32") / "tiny"))


def _logits(model, prompts):
    from fdcore.core.batch import BatchInput
    from fdcore.models.kv_cache import PagedKVCache

    cache = PagedKVCache(model.args, 64, 16)
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(prompts))]
    first = model.forward(BatchInput(prompts, [0] * len(prompts), tables), cache)
    decode = BatchInput([[7] for _ in prompts], [len(p) for p in prompts], tables)
    return first, model.forward(decode, cache)


def test_without_avx2_float32_stays_with_mkl_and_agrees(tiny_path, monkeypatch):
    """The model packs float32 (projections and the tied head, which the embedding reads) where the CPU
    has AVX-512F or AVX2; without either (the flags faked here) it keeps plain tensors for MKL, is not
    refused, and gives the same logits to float32's rounding."""
    import paddle

    from fdcore.checkpoint import load_checkpoint
    from fdcore.models import kernels
    from fdcore.models.llama import LlamaModel
    from fdcore.models.matrices import F32Matrix

    prompts = [[5, 9, 300, 41], [17]]
    packed = LlamaModel(load_checkpoint(tiny_path, progress=lambda *_: None))
    if kernel_path("float32"):
        assert packed.f32_kernel and isinstance(packed.layers[0]["qkv"], F32Matrix)
        assert isinstance(packed.lm_head, F32Matrix)
        assert (packed.embed is packed.lm_head) == packed.args.tie_word_embeddings
    monkeypatch.setattr(kernels.cpu, "cpu_flags", lambda: "fpu sse2 sse4_2 avx")
    plain = LlamaModel(load_checkpoint(tiny_path, progress=lambda *_: None))
    assert not plain.f32_kernel and isinstance(plain.layers[0]["qkv"], paddle.Tensor)
    assert isinstance(plain.lm_head, paddle.Tensor) and isinstance(plain.embed, paddle.Tensor)
    for got, expected in zip(_logits(packed, prompts), _logits(plain, prompts), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


@needs_f32_kernel
def test_a_tied_head_is_one_copy_that_the_embedding_reads(tmp_path):
    """A tied model keeps its embedding once, packed as the head; the hidden states it starts from are
    the embedding's rows exactly."""
    from fdcore.checkpoint import load_checkpoint, tiny
    from fdcore.models.llama import LlamaModel
    from fdcore.models.matrices import F32Matrix

    path = tiny.make_tiny_model(str(tmp_path / "tied"), arch="qwen2")  # tied embeddings
    checkpoint = load_checkpoint(path, progress=lambda *_: None)
    embed = checkpoint.tensors["model.embed_tokens.weight"].copy()
    model = LlamaModel(checkpoint)
    assert model.args.tie_word_embeddings and isinstance(model.embed, F32Matrix) and model.lm_head is model.embed
    ids = np.array([0, 3, len(embed) - 1, 3], dtype=np.int64)
    assert np.array_equal(model._embed(ids), embed[ids])
