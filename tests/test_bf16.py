"""bfloat16 projection weights: fdcore's kernel against a float64 reference, and the model in bf16
against float32 on the real SmolLM2."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from fdcore.models.kernels import bf16_path, cpu_flags, linear_bf16

HAS_BF16 = "avx512_bf16" in cpu_flags().split()
needs_bf16 = pytest.mark.skipif(not HAS_BF16, reason="bfloat16 compute is refused on CPUs without AVX512-BF16")


def _bf16(array: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest even) and widen back: the values a bf16 tensor holds."""
    bits = array.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


@needs_bf16
@pytest.mark.parametrize("m, k, n", [(1, 576, 1536), (1, 33, 9), (1, 7, 130), (3, 100, 37), (4, 64, 64),
                                     (5, 64, 8), (32, 96, 130), (9, 1, 3)])
def test_the_kernel_equals_a_float64_reference(m, k, n):
    """Every shape edge: one row or several (4 at a time, then the rest), an odd inner dimension,
    output counts that are not a multiple of the 64-row groups or of 16."""
    import paddle

    from fdcore.models.llama import Bf16Matrix

    rng = np.random.default_rng(m * 1000 + k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    matrix = Bf16Matrix.pack(w)
    got = linear_bf16()(paddle.to_tensor(x), matrix.packed, matrix.rows).numpy()
    expected = _bf16(x).astype(np.float64) @ _bf16(w).T.astype(np.float64)  # x is rounded to bf16 too
    assert got.shape == (m, n)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4 * np.sqrt(k))


def test_paddle_rounds_to_bfloat16_as_the_kernel_does():
    import paddle

    values = np.random.default_rng(1).standard_normal(10_000).astype(np.float32)
    assert np.array_equal(paddle.to_tensor(values).astype("bfloat16").astype("float32").numpy(), _bf16(values))


def test_the_path_follows_the_cpu_flags():
    assert bf16_path() == (1 if HAS_BF16 else 0)


@needs_bf16
def test_bf16_picks_float32s_token_wherever_float32_is_not_at_a_near_tie():
    """On the real SmolLM2, teacher-forced along float32's greedy path (16 tokens of each golden
    chat prompt): bf16's logits stay within 1.0 of float32's, and its top token is float32's at
    every step where float32's two best are more than 0.1 apart. (Rounding every weight to 8
    significant bits can flip a true near-tie: measured, 1 step in 144, at a margin of 0.007 —
    free-running greedy then follows another, equally likely continuation, as llama.cpp's BF16 does.)"""
    from fdcore.models.fetch import fetch_smollm2
    from fdcore.models.llama import BatchInput, LlamaModel, PagedKVCache
    from fdcore.models.loader import load_checkpoint

    reference = json.load(open(os.path.join(os.path.dirname(__file__), "data", "gguf_reference.json")))
    path = fetch_smollm2()
    models = {dtype: LlamaModel(load_checkpoint(path, progress=lambda *_: None), dtype)
              for dtype in ("float32", "bfloat16")}
    clear_steps = 0
    for chat in reference["chats"]:
        prompt = chat["prompt"]
        caches = {dtype: PagedKVCache(model.args, 64, 16) for dtype, model in models.items()}
        ids, start = prompt, 0
        for _ in range(16):
            batch = BatchInput([ids], [start], [list(range(64))], [len(prompt)])
            exact, bf16 = (models[d].forward(batch, caches[d])[0] for d in ("float32", "bfloat16"))
            assert np.abs(exact - bf16).max() < 1.0
            best, second = np.sort(exact)[-2:][::-1]
            if best - second > 0.1:
                assert int(np.argmax(bf16)) == int(np.argmax(exact))
                clear_steps += 1
            start, ids = start + len(ids), [int(np.argmax(exact))]
    assert clear_steps > 100  # the check really ran on most steps


@pytest.mark.skipif(HAS_BF16, reason="checks the refusal on CPUs without AVX512-BF16")
def test_bf16_is_refused_without_avx512_bf16(tmp_path):
    from fdcore.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match="needs a CPU with AVX512-BF16"):
        parse_config('[model]\ndtype = "bfloat16"\n')


@needs_bf16
def test_the_tree_serves_the_real_model_in_bf16():
    from fdcore import LLM, SamplingParams
    from fdcore.config import parse_config
    from fdcore.models.fetch import fetch_smollm2

    config = parse_config(f'[model]\npath = "{fetch_smollm2()}"\ndtype = "bfloat16"\n[workers]\nstandby = false\n')
    with LLM(config) as llm:
        out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0]
    assert out.error_code == 0 and "Paris" in out.outputs.text, out.outputs.text
