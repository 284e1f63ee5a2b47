"""The KV cache in bfloat16 (``cache.dtype``): half the memory a token, attention's products in AVX512-BF16's
``vdpbf16ps`` (attention_bf16.h's AttendHeadsBf16), or AMX tiles where the CPU has them (AttendRowsTiles). Against a
float64 reference of the same roundings, every
head size and heads-per-pass split, block size, sliding window and odd key count; a row's bits its own
(chunks, decode steps); where it is refused, a message naming the key."""

from __future__ import annotations

import numpy as np
import pytest

from fdcore.models import kernels
from fdcore.models.kernels import kernel_path, operators
from tests.attention import attend, reference

pytestmark = pytest.mark.kernels


def _bf16(array: np.ndarray) -> np.ndarray:
    """float32 rounded to bfloat16 (nearest even), widened to float64."""
    bits = np.asarray(array, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).astype(np.uint32)
    return rounded.view(np.float32).astype(np.float64)


@pytest.mark.parametrize(
    "heads, kv_heads, dim, block, window",
    [
        (9, 3, 64, 16, 0),  # SmolLM2: 3 heads a KV head, 4 a pass (tiles: 5 rows of 3 heads)
        (5, 1, 64, 16, 0),  # a pass of 4 heads then 1
        (4, 2, 128, 16, 0),  # 2 heads a pass at 128
        (3, 1, 256, 8, 0),  # 1 head a pass past 128; blocks of 8
        (2, 2, 32, 5, 0),  # blocks that cut the 16-key groups and the key pairs
        (4, 2, 64, 16, 7),  # a sliding window (odd: pairs start mid-block)
        (4, 2, 32, 16, 0),  # tiles: 32 dims, 8 rows of 2 heads
        (14, 2, 64, 32, 0),  # tiles: Qwen2.5's 7 heads a KV head, 2 rows; blocks of 32
        (16, 1, 64, 16, 0),  # tiles: 16 heads, a row a tile
    ],
)
def test_the_bf16_cache_attention_equals_its_float64_reference(bf16_path, heads, kv_heads, dim, block, window):
    lengths = [1, 2, 17, 40, 33]  # odd and even key counts, a pair left over, one and several 16-key groups
    out, q, k, v, rows = attend(heads, kv_heads, dim, block, window, lengths, "bfloat16", seed=dim + block)
    # what the bfloat16 path computes, in float64 past its roundings: q, k and v rounded to bfloat16, softmax
    # weights e = exp(s - max) rounded to bfloat16 for the weighted sum, divided by the sum of e
    expected = reference(q, k, v, rows, heads, kv_heads, window, rounded=_bf16)
    # float32 sums in another order, and exp within 2 ulp (a weight may round to the next bfloat16)
    np.testing.assert_allclose(out, expected, rtol=2e-3, atol=2e-3 * np.abs(v).max())
    exact, *_ = attend(heads, kv_heads, dim, block, window, lengths, "float32", seed=dim + block)
    assert np.abs(out - exact).max() < 0.05 * np.abs(v).max()  # close to the float32 cache's too


def test_a_row_gets_the_same_bits_in_any_chunk_or_step(bf16_path, tmp_path):
    """Crash-resume recomputes a sequence in other chunks and batches: a bfloat16 model's logits, with its
    bfloat16 cache, are the same to the bit prefilled whole, in chunks, or token by token beside others (on
    tiles: a row among 16 / G others of its prompt, or its heads alone)."""
    from fdcore.checkpoint import load_checkpoint, tiny
    from fdcore.core.batch import BatchInput
    from fdcore.models.llama import LlamaModel

    model = LlamaModel(load_checkpoint(tiny.make_tiny_model(str(tmp_path / "m")), progress=lambda *_: None), "bfloat16")
    rng = np.random.default_rng(4)
    prompt, other = rng.integers(5, 4000, 45).tolist(), rng.integers(5, 4000, 20).tolist()
    whole_cache = model.new_cache(16, 16)
    assert whole_cache.dtype == "bfloat16"
    whole = model.forward(BatchInput([prompt], [0], [[0, 1, 2]]), whole_cache)[0]  # position 44's logits
    parts_cache = model.new_cache(16, 16)
    model.forward(BatchInput([other], [0], [[5, 6, 8]]), parts_cache)
    model.forward(BatchInput([prompt[:19]], [0], [[9, 3, 7]]), parts_cache)
    for pos in range(19, 45):  # a decode step each, beside the other sequence's
        logits = model.forward(
            BatchInput([[prompt[pos]], [11]], [pos, 20 + pos - 19], [[9, 3, 7], [5, 6, 8]]), parts_cache
        )
    assert np.array_equal(logits[0], whole)


def test_auto_follows_the_model_and_refusals_name_the_key(tmp_path, monkeypatch):
    from fdcore.checkpoint import load_checkpoint, tiny
    from fdcore.config import ConfigError, parse_config
    from fdcore.models.kv_cache import PagedKVCache
    from fdcore.models.llama import LlamaModel
    from tests.checkpoints import make_checkpoint

    f32 = LlamaModel(load_checkpoint(tiny.make_tiny_model(str(tmp_path / "m")), progress=lambda *_: None))
    assert f32.new_cache(4, 16).dtype == "float32"
    if kernel_path("bfloat16") is not None and operators() is not None:
        assert f32.new_cache(4, 16, "bfloat16").dtype == "bfloat16"  # asked for: a float32 model may have one
        qwen3 = LlamaModel(
            load_checkpoint(make_checkpoint(str(tmp_path / "q"), "qwen3"), progress=lambda *_: None), "bfloat16"
        )
        assert qwen3.args.head_dim == 48 and qwen3.new_cache(4, 16).dtype == "float32"
        with pytest.raises(
            ValueError,
            match=r"cache.dtype is 'bfloat16', which needs head_dim a multiple of 32 "
            r"\(this model's is 48\)",
        ):
            qwen3.new_cache(4, 16, "bfloat16")
    with pytest.raises(ValueError, match="PagedKVCache: dtype 'float16'"):
        PagedKVCache(f32.args, 4, 16, "float16")
    with pytest.raises(RuntimeError, match="read and written by fdcore's C\\+\\+ operators only"):
        PagedKVCache(f32.args, 4, 16, "bfloat16").write(
            0, np.zeros(1, dtype=np.int64), np.zeros((1, 2, 64)), np.zeros((1, 2, 64))
        )
    monkeypatch.setattr(kernels.cpu, "cpu_flags", lambda: "avx2 f16c fma sse2")
    with pytest.raises(ConfigError, match="key 'cache.dtype' is 'bfloat16', which needs a CPU with AVX512-BF16"):
        parse_config('[cache]\ndtype = "bfloat16"\n')
    assert parse_config('[cache]\ndtype = "auto"\n').cache.dtype == "auto"
