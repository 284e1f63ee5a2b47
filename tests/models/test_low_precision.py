"""bfloat16, int8 (wint8) and 4-bit (wint4) projection weights: fdcore's kernels against float64
references, and the model in each against float32 on the real SmolLM2."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from fdcore.models.kernels import kernel_flags, kernel_path, linear_bf16, missing_cpu_feature
from fdcore.models.matrices import Int4Matrix, Int8Matrix
from tests import DATA

pytestmark = [pytest.mark.tree, pytest.mark.kernels]

HAS_BF16 = kernel_path("bfloat16") is not None
needs_bf16 = pytest.mark.skipif(not HAS_BF16, reason="bfloat16 compute is refused on CPUs without AVX512-BF16")


def _bf16(array: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest even) and widen back: the values a bf16 tensor holds."""
    bits = array.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


@pytest.mark.parametrize(
    "m, k, n",
    [
        (1, 576, 1536),
        (1, 33, 9),
        (1, 7, 130),
        (3, 100, 37),
        (4, 64, 64),
        (5, 64, 8),
        (32, 96, 130),
        (9, 1, 3),
        (16, 64, 33),
        (17, 96, 40),
        (40, 64, 50),
        (70, 128, 20),
    ],
)
def test_the_kernel_equals_a_float64_reference(bf16_path, m, k, n):
    """Every shape edge: one row or several (8 at a time, then 4, then the rest; on tiles: a tile of fewer
    than 16 rows, pairs of 16-row tiles, a last single tile, padding rows), an odd inner dimension and one
    that is not a multiple of 32 (which the tiles leave to AVX512-BF16), output counts that are not a
    multiple of the 32-row groups or of 16; and each row's bits are the row's alone."""
    import paddle

    from fdcore.models.matrices import Bf16Matrix

    rng = np.random.default_rng(m * 1000 + k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    matrix = Bf16Matrix.pack(w)
    got = linear_bf16()(paddle.to_tensor(x), matrix.packed, matrix.rows).numpy()
    expected = _bf16(x).astype(np.float64) @ _bf16(w).T.astype(np.float64)  # x is rounded to bf16 too
    assert got.shape == (m, n)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4 * np.sqrt(k))
    for i in range(m):  # a row's bits whatever pass it falls in (8 rows, 4, or 1; a tile): a crash's recompute
        alone = linear_bf16()(paddle.to_tensor(x[i : i + 1]), matrix.packed, matrix.rows).numpy()
        np.testing.assert_array_equal(got[i], alone[0])


@pytest.mark.parametrize(
    "m, k, inner, bias",
    [
        (1, 576, 1536, False),
        (1, 64, 24, True),
        (5, 33, 16, False),
        (17, 96, 40, True),
        (40, 64, 8, False),
        (70, 128, 50, True),
    ],
)
def test_the_gated_kernel_is_silu_of_the_gate_times_up(bf16_path, m, k, inner, bias):
    """A gated matrix (gate and up packed 16 rows each by turns) gives silu(x gate^T + its bias) (x up^T + its
    bias) straight from the product: against float64 on the bfloat16 values within the exponential's 1e-4 (the
    products to float32's rounding), an intermediate size that is not a multiple of 16, with a bias and without,
    tiles of fewer than 16 rows and pairs of them (AMX) or passes of 8, 4 and 1 (AVX512-BF16); the plain product
    of the same matrix is its gate and up columns by turns (what a GEMM floor times); each row's bits its own."""
    import paddle

    from fdcore.models.kernels import linear_bf16_swiglu
    from fdcore.models.matrices import Bf16Matrix

    rng = np.random.default_rng(m * 1000 + k + inner)
    x = rng.standard_normal((m, k)).astype(np.float32)
    gate, up = (rng.standard_normal((inner, k)).astype(np.float32) / np.sqrt(k) * 4 for _ in range(2))
    b = rng.standard_normal(2 * inner).astype(np.float32) if bias else None
    matrix = Bf16Matrix.pack_gated(gate, up)
    assert matrix.gated and matrix.rows == 2 * inner
    none = paddle.to_tensor(b) if bias else paddle.empty([0], dtype="float32")
    got = linear_bf16_swiglu()(paddle.to_tensor(x), matrix.packed, none, matrix.rows).numpy()
    xr = _bf16(x).astype(np.float64)
    gate_product, up_product = xr @ _bf16(gate).T.astype(np.float64), xr @ _bf16(up).T.astype(np.float64)
    g, u = (gate_product + b[:inner], up_product + b[inner:]) if bias else (gate_product, up_product)
    expected = g / (1 + np.exp(-g)) * u
    assert got.shape == (m, inner)
    # the exponential's relative 7.5e-5 (and the reciprocal's 2^-27) of the result, plus the float32 products'
    # rounding (as the plain kernel's: 1e-4 sqrt(k)) carried through silu(g) u
    product_error = 1e-4 * np.sqrt(k) * (np.abs(u) + np.abs(g / (1 + np.exp(-g))) + 1e-3)
    assert (np.abs(got - expected) <= 1e-4 * np.abs(expected) + product_error).all()
    product = linear_bf16()(paddle.to_tensor(x), matrix.packed, matrix.rows).numpy()
    blocks = -(-inner // 16)
    by_turns = np.zeros((m, blocks * 32), dtype=np.float32)
    by_turns[:, : 2 * inner] = product
    turns = by_turns.reshape(m, blocks, 2, 16)
    np.testing.assert_allclose(
        turns[:, :, 0].reshape(m, -1)[:, :inner], gate_product, rtol=1e-5, atol=1e-4 * np.sqrt(k)
    )
    np.testing.assert_allclose(
        turns[:, :-1, 1].reshape(m, -1), up_product[:, : 16 * (blocks - 1)], rtol=1e-5, atol=1e-4 * np.sqrt(k)
    )  # (the last group's up outputs past 2 I are not kept)
    for i in range(m):
        alone = linear_bf16_swiglu()(paddle.to_tensor(x[i : i + 1]), matrix.packed, none, matrix.rows).numpy()
        np.testing.assert_array_equal(got[i], alone[0])


@pytest.mark.parametrize("m, k, inner", [(1, 64, 24), (5, 33, 17), (16, 96, 40), (40, 64, 8), (70, 128, 50)])
def test_rows_already_rounded_give_the_float32_rows_bits(bf16_path, m, k, inner):
    """The products of x given as bfloat16 (rows already rounded, as the one-call decoder's norms and SwiGLU hand
    them on) equal those of x given as float32 and rounded in the kernel, to the bit: x's own memory where its rows
    are the kernel's layout (an even K, whole tiles of rows), a padded copy where not (an odd K, 5, 40 or 70 rows);
    the gated product of bfloat16 rows gives its activations as bfloat16, the float32 ones rounded."""
    import paddle

    from fdcore.models.kernels import linear_bf16_swiglu
    from fdcore.models.matrices import Bf16Matrix

    rng = np.random.default_rng(m * 1000 + k + inner)
    x = paddle.to_tensor(rng.standard_normal((m, k)).astype(np.float32))
    gate, up = (rng.standard_normal((inner, k)).astype(np.float32) / np.sqrt(k) * 4 for _ in range(2))
    plain, gated = Bf16Matrix.pack(gate), Bf16Matrix.pack_gated(gate, up)
    rounded = x.astype("bfloat16")  # (Paddle rounds to nearest even, as the kernels: test below)
    np.testing.assert_array_equal(
        linear_bf16()(rounded, plain.packed, plain.rows).numpy(), linear_bf16()(x, plain.packed, plain.rows).numpy()
    )
    none = paddle.empty([0], dtype="float32")
    activations = linear_bf16_swiglu()(rounded, gated.packed, none, gated.rows)
    assert activations.dtype == paddle.bfloat16 and activations.shape == [m, inner]
    expected = _bf16(linear_bf16_swiglu()(x, gated.packed, none, gated.rows).numpy())
    np.testing.assert_array_equal(activations.astype("float32").numpy(), expected)


def test_the_gated_kernel_keeps_far_negative_gates_finite(bf16_path):
    """silu(g) for g far below zero is ~0 (0 past g = -69.3, where g e^g < 7e-29), neither NaN (1 / (1 + e^-g) with
    e^-g past float32's range) nor g times a capped e^g; a NaN gate stays NaN."""
    import paddle

    from fdcore.models.kernels import linear_bf16_swiglu
    from fdcore.models.matrices import Bf16Matrix

    gates = np.array([-1e30, -1e4, -200.0, -88.0, -69.0, 0.0, 5.0, 100.0, np.nan], dtype=np.float32)
    inner = len(gates)
    x = np.ones((1, 2), dtype=np.float32)
    gate = np.zeros((inner, 2), dtype=np.float32)  # x gate^T = 0: the bias is the gate
    up = np.ones((inner, 2), dtype=np.float32) * 0.5  # x up^T = 1
    bias = np.concatenate([gates, np.zeros(inner, dtype=np.float32)])
    matrix = Bf16Matrix.pack_gated(gate, up)
    got = linear_bf16_swiglu()(paddle.to_tensor(x), matrix.packed, paddle.to_tensor(bias), matrix.rows).numpy()[0]
    assert np.isnan(got[-1]) and np.isfinite(got[:-1]).all()
    np.testing.assert_allclose(
        got[:-1],
        [0, 0, 0, -88 / (1 + np.exp(88.0)), -69 / (1 + np.exp(69.0)), 0, 5 / (1 + np.exp(-5.0)), 100],
        rtol=1e-4,
        atol=1e-25,
    )


@needs_bf16
@pytest.mark.parametrize("intermediate, lengths", [(None, (40, 1, 23)), (None, (40, 1, 22)), (99, (40, 1, 22))])
def test_a_bfloat16_mlp_adds_its_biases_in_the_gated_product(tmp_path, bf16_path, intermediate, lengths):
    """A checkpoint with MLP biases in bfloat16: the gated gate_up adds them in its epilogue, in the one-call decoder
    (decoder.cc) and the per-layer calls (swiglu) alike, to the bit, prefill and decode; the logits stay within
    bfloat16's rounding of float32's (measured 0.02 on logits up to 4.3; without the MLP biases they are 0.41 off).
    The one-call decoder hands its norms' and SwiGLU's rows to the products already rounded, the per-layer calls
    float32 rows the products round: the same bits also where a prompt's rows are not whole tiles (63: a padding
    row) and where the MLP's width is odd (99: the down product's rows end in a zero, on the AVX512-BF16 path), on
    each bfloat16 path (bf16_path)."""
    from fdcore.checkpoint import load_checkpoint
    from fdcore.core.batch import BatchInput
    from fdcore.models.llama import LlamaModel
    from tests.checkpoints import make_checkpoint

    changes = {"intermediate_size": intermediate} if intermediate else None
    path = make_checkpoint(str(tmp_path / "m"), "llama-attention-and-mlp-bias", changes=changes)
    exact = LlamaModel(load_checkpoint(path, progress=lambda *_: None))
    model = LlamaModel(load_checkpoint(path, progress=lambda *_: None), "bfloat16")
    assert model.layers[0]["gate_up"].gated and model.decoder is not None
    rng = np.random.default_rng(3)
    prompts = [rng.integers(5, 4000, size=n).tolist() for n in lengths]
    tables = [list(range(i, 48, len(prompts)))[:8] for i in range(len(prompts))]

    def steps(m):
        cache = m.new_cache(48, 16)
        prefill = m.forward(BatchInput(prompts, [0] * len(prompts), tables), cache)
        return prefill, m.forward(BatchInput([[9]] * len(prompts), [len(p) for p in prompts], tables), cache)

    expected = steps(exact)
    one_call = steps(model)
    model.decoder = None
    per_layer = steps(model)
    for got, alone, want in zip(one_call, per_layer, expected, strict=False):
        assert np.array_equal(got, alone)
        assert np.abs(got - want).max() < 0.1


def test_amx_cpus_multiply_bfloat16_on_tiles():
    """Where the CPU has AMX-BF16, the bfloat16 kernel uses it (the OS granted the tile state): without it a
    bfloat16 batch or prefill runs 2-4x slower, which nothing else would notice."""
    from fdcore.models.kernels import bf16_tiles

    has_amx = {"amx_tile", "amx_bf16"} <= kernel_flags()
    assert bf16_tiles() == (HAS_BF16 and has_amx)
    assert kernel_path("bfloat16") == ("AMX-BF16" if has_amx and HAS_BF16 else "AVX512-BF16" if HAS_BF16 else None)


_ROUNDED = """
import sys
import numpy as np
import paddle
from fdcore.models.kernels import linear_bf16
from fdcore.models.matrices import Bf16Matrix
data = np.load(sys.argv[1])
matrix = Bf16Matrix.pack(data["w"])
np.savez(sys.argv[2], y=linear_bf16()(paddle.to_tensor(data["x"]), matrix.packed, matrix.rows).numpy())
"""


@needs_bf16
@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_rounds_x_to_nearest_even(on_threads, threads):
    """x goes to bfloat16 16 lanes at a time, its rows shared out across the threads (16 rows of 4097: the
    parallel path, an odd row with its padded last pair): picked out by a weight of unit rows, each
    output is one input as _bf16 rounds it, ties (exactly half a step) to even in both directions."""
    rng = np.random.default_rng(3)
    m, k = 16, 4097
    x = rng.standard_normal((m, k)).astype(np.float32)
    bits = x.view(np.uint32)
    bits[:, ::3] = (bits[:, ::3] & 0xFFFF0000) | 0x8000  # ties: odd and even upper halves alike
    ties = x[:, ::3]
    assert (_bf16(ties) > ties).any() and (_bf16(ties) < ties).any()
    picked = np.concatenate([rng.choice(k - 1, 63, replace=False), [k - 1]])
    w = np.zeros((len(picked), k), dtype=np.float32)
    w[np.arange(len(picked)), picked] = 1.0
    got = on_threads(_ROUNDED, {"x": x, "w": w}, threads=threads)["y"]
    assert np.array_equal(got, _bf16(x)[:, picked])


_BF16_ON_THREADS = """
import sys
import numpy as np
import paddle
from fdcore.models.kernels import linear_bf16
from fdcore.models.matrices import Bf16Matrix
given = np.load(sys.argv[1])
matrix = Bf16Matrix.pack(given["w"])
np.savez(sys.argv[2], y=linear_bf16()(paddle.to_tensor(given["x"]), matrix.packed, matrix.rows).numpy())
"""


@needs_bf16
@pytest.mark.parametrize("m, n", [(200, 130), (150, 640)])
def test_the_bfloat16_kernel_gives_the_same_bits_on_one_two_and_three_threads(on_threads, m, n):
    """A prompt's rows against a matrix of not many more outputs are shared out by rows on tiles (200 rows, 130
    outputs: 7 pairs of row tiles, the last a single tile with padding rows, split 3 + 4 on 2 threads, 2 + 2 + 3 on
    3), else by groups of outputs (150 rows, 640 outputs): each output still computed whole by one thread, the same
    way, so the same bits on any thread count, each row's its own (a row alone agrees), and the float64 reference's
    values."""
    import paddle

    from fdcore.models.matrices import Bf16Matrix

    rng = np.random.default_rng(m + n)
    x, w = rng.standard_normal((m, 576)).astype(np.float32), rng.standard_normal((n, 576)).astype(np.float32)
    one = on_threads(_BF16_ON_THREADS, {"x": x, "w": w}, threads=1)["y"]
    expected = _bf16(x).astype(np.float64) @ _bf16(w).T.astype(np.float64)
    np.testing.assert_allclose(one, expected, rtol=1e-5, atol=1e-4 * np.sqrt(576))
    for threads in (2, 3):
        assert np.array_equal(one, on_threads(_BF16_ON_THREADS, {"x": x, "w": w}, threads=threads)["y"]), threads
    matrix = Bf16Matrix.pack(w)
    for row in (0, 100, m - 1):
        alone = linear_bf16()(paddle.to_tensor(x[row : row + 1]), matrix.packed, matrix.rows).numpy()
        np.testing.assert_array_equal(one[row], alone[0])


def test_paddle_rounds_to_bfloat16_as_the_kernel_does():
    import paddle

    values = np.random.default_rng(1).standard_normal(10_000).astype(np.float32)
    assert np.array_equal(paddle.to_tensor(values).astype("bfloat16").astype("float32").numpy(), _bf16(values))


def test_the_needed_features_follow_the_cpu_flags():
    assert missing_cpu_feature("bfloat16") == (None if HAS_BF16 else "AVX512-BF16")
    assert missing_cpu_feature("wint8") == (None if {"avx2", "fma", "f16c"} <= kernel_flags() else "AVX2")
    assert missing_cpu_feature("wint4") == missing_cpu_feature("wint8")
    assert missing_cpu_feature("float32") is None


@pytest.mark.parametrize(
    "setting, margin, spread, most_flips",
    [
        (("bfloat16", "none"), 0.1, 1.0, 6),
        (("float32", "wint8"), 0.0, 0.05, 0),  # issue 15: float32's greedy tokens, all 16 of every prompt
        (("float32", "wint4"), 0.0, 0.05, 0),
    ],
)
def test_low_precision_picks_float32s_token_wherever_float32_is_not_at_a_near_tie(setting, margin, spread, most_flips):
    """On the real SmolLM2, teacher-forced along float32's greedy path (16 tokens of each golden
    chat prompt), each model with the KV cache it is served with (LlamaModel.new_cache): the logits stay
    within ``spread`` of float32's, and the top token is float32's at every step where float32's two best
    are more than ``margin`` apart. Rounding can flip a true near-tie; measured: bf16 4 steps in 144
    (margins 0.002 to 0.027, logits within 0.49; its cache in bfloat16, attention's products in bf16: with a
    float32 cache 1 step, margin 0.007, within 0.36) — free-running greedy then follows another, about as
    likely continuation. wint8 and wint4 keep the activations at 16 bits (linear_int8.cc) and this file's
    weights exactly (a Q4_1 file: its 4-bit levels are wint4's and wint8's as they are; the int8 LM head
    holds its embedding's blocks too), so they flip none: on a Xeon with AVX-512 their logits were within
    0.008 of float32's and the closest top two 0.0019 apart, so every step is checked (margin 0), which
    is issue 15's bar (float32's greedy tokens for 16 on every golden prompt). With 8-bit activations
    (until 2026-12-04) wint8 flipped 5-7 steps in 144 (margins up to 0.44) and wint4 3-7, logits within
    1.6-1.9: quantized activations make a model discontinuous, so each CPU's float32 summation order drew
    another set of flips."""
    kind = setting[0] if setting[1] == "none" else setting[1]
    if kernel_path(kind) is None:
        pytest.skip(f"{setting} is refused on this CPU (needs {missing_cpu_feature(kind)})")
    from fdcore.checkpoint import load_checkpoint
    from fdcore.checkpoint.fetch import fetch_smollm2
    from fdcore.core.batch import BatchInput
    from fdcore.models.llama import LlamaModel

    reference = json.load(open(os.path.join(DATA, "gguf_reference.json")))
    path = fetch_smollm2()
    models = {
        "exact": LlamaModel(load_checkpoint(path, progress=lambda *_: None)),
        "low": LlamaModel(load_checkpoint(path, progress=lambda *_: None), *setting),
    }
    clear_steps = flips = 0
    for chat in reference["chats"]:
        prompt = chat["prompt"]
        caches = {name: model.new_cache(64, 16) for name, model in models.items()}  # as served
        ids, start = prompt, 0
        for _ in range(16):
            batch = BatchInput([ids], [start], [list(range(64))], [len(prompt)])
            exact, low = (models[name].forward(batch, caches[name])[0] for name in ("exact", "low"))
            assert np.abs(exact - low).max() < spread
            best, second = np.sort(exact)[-2:][::-1]
            if best - second > margin:
                assert int(np.argmax(low)) == int(np.argmax(exact))
                clear_steps += 1
            flips += int(np.argmax(low)) != int(np.argmax(exact))
            start, ids = start + len(ids), [int(np.argmax(exact))]
    assert clear_steps > 100  # the check really ran on most steps
    assert flips <= most_flips  # near-ties flip, but rarely


@pytest.mark.skipif(HAS_BF16, reason="checks the refusal on CPUs without AVX512-BF16")
def test_bf16_is_refused_without_avx512_bf16(tmp_path):
    from fdcore.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match="needs a CPU with AVX512-BF16"):
        parse_config('[model]\ndtype = "bfloat16"\n')


@pytest.mark.parametrize(
    "setting, kind",
    [
        ('quantization = "wint8"', "wint8"),  # (bf16: the same plumbing)
        ('quantization = "wint4"', "wint4"),
    ],
)
def test_the_tree_serves_the_real_model_in_low_precision(setting, kind):
    """The setting reaches the worker's model. The prompt asks for a sentence: float32's greedy answer
    to the bare question starts at a near-tie ('The' 0.08 above 'L', then "L'Étoile, la Marseillaise"),
    which a low-precision model may take either way (wint4 does)."""
    if kernel_path(kind) is None:
        pytest.skip(f"{setting} is refused on this CPU (needs {missing_cpu_feature(kind)})")
    from fdcore import LLM, SamplingParams
    from fdcore.checkpoint.fetch import fetch_smollm2
    from fdcore.config import parse_config

    config = parse_config(f'[model]\npath = "{fetch_smollm2()}"\n{setting}\n[workers]\nstandby = false\n')
    with LLM(config) as llm:
        out = llm.chat(
            [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
            SamplingParams(temperature=0.0, max_tokens=16),
            use_tqdm=False,
        )[0]
    assert out.error_code == 0 and "Paris" in out.outputs.text, out.outputs.text


needs_int_kernels = pytest.mark.skipif(kernel_path("wint8") is None, reason="wint8 is refused on CPUs without AVX2")


def _quantized_x(block: np.ndarray) -> np.ndarray:
    """Rows of a block of x (up to 32 float32 values each) as the int kernels quantize them, in float64:
    16-bit fixed point in two parts, top / 32258 (254 hi + lo) (linear_int8.cc's QuantizeBlock), with the
    kernels' float32 rounding up to there."""
    top = np.abs(block).max(axis=1, keepdims=True)
    inverse = np.divide(np.float32(127), top, out=np.zeros_like(top), where=top > 0)
    t = block * inverse
    hi = np.rint(t)
    lo = np.rint((t - hi) * np.float32(254))
    assert np.abs(hi).max() <= 127 and np.abs(lo).max() <= 127
    return (254 * hi.astype(np.float64) + lo) * (top / np.float32(32258)).astype(np.float64)


def _int_reference(x: np.ndarray, levels: np.ndarray, scale: np.ndarray, minimum: np.ndarray) -> np.ndarray:
    """What the int8 and 4-bit kernels compute, in float64 past the rounding they do in float32: x quantized
    per row and block of 32 (_quantized_x) times the weights the levels stand for (scale * level + minimum)."""
    m, k = x.shape
    total = np.zeros((m, levels.shape[0]))
    for block_index, start in enumerate(range(0, k, 32)):
        xq = _quantized_x(x[:, start : start + 32])
        weights = (
            levels[:, start : start + xq.shape[1]].T.astype(np.float64) * scale[:, block_index]
            + minimum[:, block_index]
        )
        total += xq @ weights
    return total


@needs_int_kernels
@pytest.mark.parametrize("kind", ["wint8", "wint4"])
def test_x_keeps_16_bits_in_the_int_kernels(kind):
    """Through an identity weight (a file's exact levels: 1 on the diagonal), each kernel gives x back to
    within 1/64516 of its block's largest value: 128 times finer than 8-bit activations (llama.cpp's Q8),
    which changed float32's greedy tokens on SmolLM2 within 16 tokens on 4 of 9 golden prompts. An
    outlier costs the rest of its block no more than that, and the kernel's x is the reference's."""
    import paddle

    from fdcore.checkpoint.ggml_blocks import Blocks
    from fdcore.models.matrices import linear, matrix_kind

    matrix_kind("float32", "wint4")  # loads both kernels
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((64, 96)) * np.exp(rng.standard_normal((64, 3)).repeat(32, axis=1) * 3)).astype(np.float32)
    x[0, 5] = 1e4
    ones = np.ones((96, 3), dtype=np.float32)
    if kind == "wint8":
        matrix = Int8Matrix.from_blocks(Blocks("wint8", np.eye(96, dtype=np.int8), ones))
    else:
        matrix = Int4Matrix.from_blocks(Blocks("wint4", np.eye(96, dtype=np.uint8), ones, 0 * ones))
    got = np.concatenate(
        [linear(paddle.to_tensor(x[i : i + 1]), matrix).numpy() for i in (0, 1)]
        + [linear(paddle.to_tensor(x[2:]), matrix).numpy()]
    )
    top = np.abs(x).reshape(64, 3, 32).max(axis=2).repeat(32, axis=1)
    assert np.all(np.abs(got - x) <= top / 64516 * 1.01)
    assert np.abs(got[0, 6:32] - x[0, 6:32]).max() < 1e4 / 60000
    np.testing.assert_allclose(
        got, np.concatenate([_quantized_x(x[:, i : i + 32]) for i in (0, 32, 64)], axis=1), rtol=1e-6, atol=0
    )


@needs_int_kernels
@pytest.mark.parametrize("m, k, n", [(1, 576, 1536), (1, 33, 9), (2, 64, 64), (3, 100, 37), (32, 96, 130), (5, 1, 3)])
def test_the_int8_kernel_equals_its_float64_reference(m, k, n):
    import paddle

    from fdcore.models.kernels import linear_int8
    from fdcore.models.matrices import Int8Matrix

    rng = np.random.default_rng(m * 7 + k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    matrix = Int8Matrix.pack(w)
    u, scale, minimum = Int8Matrix.quantize(w)
    restored = (u.reshape(n, -1, 32) * scale[:, :, None] + minimum[:, :, None]).reshape(n, -1)[:, :k]
    assert np.all(np.abs(restored - w) <= np.repeat(scale, 32, axis=1)[:, :k] / 2 * (1 + 1e-5) + 1e-7)
    got = linear_int8()(paddle.to_tensor(x), matrix.packed, matrix.scales, matrix.rows).numpy()
    size = _int_reference(np.abs(x), u + 128.0, np.abs(scale), np.abs(minimum))  # (a bound on the terms' sizes)
    assert np.all(np.abs(got - _int_reference(x, u, scale, minimum)) <= 1e-6 * size + 1e-6)
    for i in range(m):  # a row's bits whatever pass it falls in (4 rows, 2, or 1)
        alone = linear_int8()(paddle.to_tensor(x[i : i + 1]), matrix.packed, matrix.scales, matrix.rows).numpy()
        np.testing.assert_array_equal(got[i], alone[0])
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    assert np.abs(got - exact).max() < 0.05 * np.abs(exact).max() + 0.05  # close to float32's too


_INT8_ON_THREADS = """
import sys
import numpy as np
import paddle
from fdcore.models.kernels import linear_int8
from fdcore.models.matrices import Int8Matrix
given = np.load(sys.argv[1])
matrix = Int8Matrix.pack(given["w"])
y = linear_int8()(paddle.to_tensor(given["x"]), matrix.packed, matrix.scales, matrix.rows).numpy()
np.savez(sys.argv[2], y=y)
"""


@needs_int_kernels
@pytest.mark.parametrize("batch", [13, 258])
def test_the_int8_kernel_gives_the_same_bits_on_one_two_and_three_threads(on_threads, batch):
    """Below 256 rows a batch's threads take equal runs of 16-row blocks, which may start or end inside a
    packed group (200 rows: 13 blocks; 2 threads split a group, 3 threads do not); from 256 rows they take
    shares of the rows (258: 128 + 130 on 2 threads, 84 + 88 + 86 on 3, ending in one-row passes). Each
    output is still computed whole by one thread, the same way, and a row alone (one-row passes keep whole
    groups) agrees."""
    import paddle

    from fdcore.models.kernels import linear_int8
    from fdcore.models.matrices import Int8Matrix

    rng = np.random.default_rng(8)
    x, w = rng.standard_normal((batch, 576)).astype(np.float32), rng.standard_normal((200, 576)).astype(np.float32)
    one = on_threads(_INT8_ON_THREADS, {"x": x, "w": w}, threads=1)["y"]
    np.testing.assert_allclose(one, _int_reference(x, *Int8Matrix.quantize(w)), rtol=1e-4, atol=1e-4)
    for threads in (2, 3):
        assert np.array_equal(one, on_threads(_INT8_ON_THREADS, {"x": x, "w": w}, threads=threads)["y"]), threads
    matrix = Int8Matrix.pack(w)
    for row in (5, batch - 1):
        alone = linear_int8()(paddle.to_tensor(x[row : row + 1]), matrix.packed, matrix.scales, matrix.rows).numpy()
        np.testing.assert_array_equal(one[row], alone[0])


@needs_int_kernels
@pytest.mark.parametrize(
    "m, k, n",
    [
        (1, 576, 1536),
        (1, 33, 9),
        (1, 1536, 576),
        (5, 100, 37),
        (5, 576, 33),
        (2, 64, 64),
        (3, 1, 3),
        (32, 96, 130),
        (70, 64, 47),
    ],
)
def test_the_int4_kernel_equals_its_float64_reference(m, k, n):
    """Batch 1 and several rows (4 at a time, then the rest; over 64: a second chunk), inner dimensions
    that are not a multiple of 32, output counts that are not a multiple of the 32-row groups or of 16.
    The reference has the same quantized weights, so the kernel matches it to float32's rounding."""
    import paddle

    from fdcore.models.kernels import linear_int4
    from fdcore.models.matrices import Int4Matrix

    rng = np.random.default_rng(m * 7 + k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32) + rng.standard_normal((n, 1)).astype(np.float32)
    matrix = Int4Matrix.pack(w)
    q, scale, minimum = Int4Matrix.quantize(w)
    got = linear_int4()(paddle.to_tensor(x), matrix.packed, matrix.rows).numpy()
    expected = _int_reference(x, q, scale, minimum)
    size = _int_reference(np.abs(x), q, np.abs(scale), np.abs(minimum))  # the sum of the terms' sizes
    assert got.shape == (m, n)
    assert np.all(np.abs(got - expected) <= 1e-6 * size + 1e-6)
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    assert np.sqrt(np.mean((got - exact) ** 2)) < 0.15 * np.sqrt(np.mean(exact**2))  # near float32's too


def test_the_int4_format_is_off_by_at_most_half_a_step():
    """Per row and block of 32: q in [0, 15], scale and minimum float16 values, and every weight within
    scale / 2 of scale * q + minimum, on blocks of every kind: centred, offset far from 0, tiny,
    constant, zero, and a partial last block."""
    from fdcore.models.matrices import Int4Matrix

    rng = np.random.default_rng(4)
    w = rng.standard_normal((96, 200)).astype(np.float32) * 0.05
    w[1] += 3.0  # the whole row far from 0: the minimum carries it
    w[2] *= 1e-4  # float16's subnormal range
    w[3] = 0.7  # constant
    w[4] = 0.0
    w[5, :32] = np.linspace(-1, 1, 32)  # exactly 16 levels' worth of range
    q, scale, minimum = Int4Matrix.quantize(w)
    assert q.shape == (96, 224) and q.max() <= 15 and scale.shape == minimum.shape == (96, 7)
    for values in (scale, minimum):
        assert np.array_equal(values.astype(np.float16).astype(np.float32), values)
    restored = (q.reshape(96, -1, 32) * scale[:, :, None] + minimum[:, :, None]).reshape(96, -1)[:, :200]
    step = np.repeat(scale, 32, axis=1)[:, :200]
    assert np.all(np.abs(restored - w) <= step / 2 * (1 + 1e-5) + 1e-7 * np.abs(w))
    assert np.abs(restored[3] - 0.7).max() < 1e-3 and not restored[4].any()
    typical = w[np.r_[0, 6:96]]  # Gaussian weights: a step is about 1/4 of their spread
    error = restored[np.r_[0, 6:96]] - typical
    assert np.sqrt(np.mean(error**2)) < 0.1 * np.sqrt(np.mean(typical**2))


def test_wint4_is_refused_without_avx2(monkeypatch):
    """Whatever this CPU has: with its flags lacking AVX2 (and AVX512-VNNI), the config check and the
    model refuse wint4 and name the field and the flags."""
    from fdcore.config import ConfigError, parse_config
    from fdcore.models import kernels
    from fdcore.models.matrices import matrix_kind

    monkeypatch.setattr(kernels.cpu, "cpu_flags", lambda: "avx fpu sse2 sse4_2")
    with pytest.raises(
        ConfigError,
        match=r"key 'model.quantization' is 'wint4', which needs a CPU with "
        r"AVX2 \(avx2 fma f16c in /proc/cpuinfo\).*use 'none'",
    ):
        parse_config('[model]\nquantization = "wint4"\n')
    with pytest.raises(ValueError, match="wint4 needs a CPU with AVX2"):
        matrix_kind("float32", "wint4")


ROWS = (1, 70, 120)  # 120 x 576: the activations' quantization is shared out too (M K >= 2^16)
_THREADED = """
import sys
import numpy as np
import paddle
from fdcore.models.matrices import Int4Matrix, Int8Matrix, matrix_kind, linear
from fdcore.models.kernels import operators
matrix_kind("float32", "wint4")  # loads both kernels
data = np.load(sys.argv[1])
out = {}
for kind, cls in (("int8", Int8Matrix), ("int4", Int4Matrix)):
    matrix = cls.pack(data["w"])
    for m in ROWS:
        out[f"{kind}-{m}"] = linear(paddle.to_tensor(data["x"][:m]), matrix).numpy()
summed, normed = operators().add_rms_norm(paddle.to_tensor(data["x"]), paddle.to_tensor(data["delta"]),
                                paddle.to_tensor(data["norm"]), 1e-5)
out["sum"], out["normed"] = summed.numpy(), normed.numpy()
np.savez(sys.argv[2], **out)
""".replace("ROWS", repr(ROWS))


@needs_int_kernels
def test_the_int_kernels_give_the_same_result_on_two_threads(on_threads):
    """OMP_NUM_THREADS=2 (the shapes take the parallel paths: groups of output rows shared out, for
    wint4 also chunks of 64 rows of x; at 120 rows the activations' quantization and the residual
    norm shared out by rows) gives one thread's results to the bit. The int8 kernel once read its
    thread_local activations inside the parallel loop, i.e. each helper thread's empty copy: a SIGSEGV
    whenever more than one thread ran."""
    import paddle

    from fdcore.models.kernels import operators
    from fdcore.models.matrices import Int4Matrix, Int8Matrix, linear, matrix_kind

    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((120, 576)).astype(np.float32), rng.standard_normal((960, 576)).astype(np.float32)
    delta, norm = rng.standard_normal((120, 576)).astype(np.float32), rng.standard_normal(576).astype(np.float32)
    threaded = on_threads(_THREADED, {"x": x, "w": w, "delta": delta, "norm": norm})
    matrix_kind("float32", "wint4")
    for kind, cls in (("int8", Int8Matrix), ("int4", Int4Matrix)):
        matrix = cls.pack(w)
        for m in ROWS:
            assert np.array_equal(threaded[f"{kind}-{m}"], linear(paddle.to_tensor(x[:m]), matrix).numpy())
    summed, normed = operators().add_rms_norm(
        paddle.to_tensor(x), paddle.to_tensor(delta), paddle.to_tensor(norm), 1e-5
    )
    assert np.array_equal(threaded["sum"], summed.numpy()) and np.array_equal(threaded["normed"], normed.numpy())
