"""The Paddle model against Hugging Face transformers' greedy outputs, alone and in mixed batches."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from fdcore.checkpoint import CheckpointError, load_checkpoint, tiny
from fdcore.core.batch import BatchInput
from fdcore.models.kv_cache import PagedKVCache
from fdcore.models.llama import LlamaModel
from fdcore.models.sampling import SamplerRequest, sample
from fdcore.protocol import SamplingParams
from tests import DATA

pytestmark = pytest.mark.kernels

REFERENCE = json.load(open(os.path.join(DATA, "reference.json")))
BLOCK = 16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {
        name: tiny.make_tiny_model(str(root / name), **spec["options"])
        for name, spec in REFERENCE["checkpoints"].items()
    }


@pytest.fixture(scope="module")
def models(checkpoints):
    return {name: LlamaModel(load_checkpoint(path, progress=lambda *_: None)) for name, path in checkpoints.items()}


def run_greedy(
    model: LlamaModel,
    prompts: list[list[int]],
    new_tokens: int,
    chunk: int = 10_000,
    starts: list[int] | None = None,
    params: list | None = None,
) -> list[list[int]]:
    """Continuous batching in miniature: every step each sequence adds its next prompt chunk
    (at most ``chunk`` tokens) or its last sampled token; sequence i joins at step starts[i].
    Greedy, or sampled with ``params[i]`` (a SamplingParams) where given."""
    max_len = max(len(p) for p in prompts) + new_tokens
    blocks_per_seq = -(-max_len // BLOCK)
    cache = PagedKVCache(model.args, blocks_per_seq * len(prompts), BLOCK)
    # Interleave block ids across sequences so that tables are not contiguous ranges.
    tables = [list(range(i, blocks_per_seq * len(prompts), len(prompts))) for i in range(len(prompts))]
    done = [0] * len(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    starts = starts or [0] * len(prompts)
    step = 0
    while any(len(o) < new_tokens for o in outputs):
        batch, members = BatchInput([], [], [], []), []
        for i, prompt in enumerate(prompts):
            if step < starts[i] or len(outputs[i]) >= new_tokens:
                continue
            seq = prompt + outputs[i]
            ids = seq[done[i] : done[i] + chunk]
            batch.token_ids.append(ids)
            batch.start_positions.append(done[i])
            batch.block_tables.append(tables[i])
            batch.prompt_lengths.append(len(prompt))
            members.append(i)
        step += 1
        if not members:
            continue
        logits = model.forward(batch, cache)
        for row, i in enumerate(members):
            done[i] += len(batch.token_ids[row])
            if done[i] == len(prompts[i]) + len(outputs[i]):  # caught up: this step samples
                outputs[i].append(_pick(logits[row], prompts[i], outputs[i], params and params[i]))
    return outputs


def _pick(row, prompt, output, params) -> int:
    if params is None:
        return int(np.argmax(row))
    return sample(row[None], [SamplerRequest(params, prompt, output)])[0].token_id


@pytest.mark.parametrize("name", list(REFERENCE["checkpoints"]))
@pytest.mark.parametrize("case", ["short", "non_ascii", "long"])
def test_greedy_tokens_equal_transformers(models, name, case):
    expected = REFERENCE["checkpoints"][name]["cases"][case]
    got = run_greedy(models[name], [expected["prompt"]], REFERENCE["new_tokens"])
    assert got[0] == expected["output"]


def test_chunked_prefill_gives_the_same_tokens(models):
    expected = REFERENCE["checkpoints"]["llama-gqa"]["cases"]["long"]
    got = run_greedy(models["llama-gqa"], [expected["prompt"]], REFERENCE["new_tokens"], chunk=100)
    assert got[0] == expected["output"]


def test_a_request_alone_equals_itself_in_a_mixed_batch(models):
    cases = REFERENCE["checkpoints"]["qwen2-bias-tied"]["cases"]
    prompts = [
        cases["short"]["prompt"],
        cases["long"]["prompt"],
        cases["non_ascii"]["prompt"],
        cases["short"]["prompt"][:2],
    ]
    # Staggered joins and 64-token chunks: prefill chunks and decodes share steps.
    together = run_greedy(models["qwen2-bias-tied"], prompts, 24, chunk=64, starts=[0, 1, 5, 9])
    for prompt, output in zip(prompts, together, strict=True):
        assert output == run_greedy(models["qwen2-bias-tied"], [prompt], 24)[0]
    assert together[0] == cases["short"]["output"] and together[1] == cases["long"]["output"]


def test_a_seeded_sampled_request_is_identical_with_different_companions(models):
    cases = REFERENCE["checkpoints"]["llama-gqa"]["cases"]
    mine = SamplingParams(temperature=0.9, top_p=0.95, top_k=200, seed=42)
    prompt = cases["non_ascii"]["prompt"]
    first = run_greedy(
        models["llama-gqa"],
        [prompt, cases["short"]["prompt"]],
        20,
        chunk=8,
        params=[mine, SamplingParams(temperature=1.3)],
    )[0]
    second = run_greedy(
        models["llama-gqa"],
        [cases["long"]["prompt"], prompt],
        20,
        chunk=300,
        starts=[0, 2],
        params=[SamplingParams(temperature=0), mine],
    )[1]
    assert first == second
    assert first != cases["non_ascii"]["output"][:20]  # it really sampled


# ------------------------------------------------------------ bad checkpoints
def test_missing_config_names_the_file(tmp_path):
    path = tiny.make_tiny_model(str(tmp_path / "m"))
    os.remove(os.path.join(path, "config.json"))
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        load_checkpoint(path)


def test_unknown_architecture_lists_the_supported_ones(tmp_path):
    path = tiny.make_tiny_model(str(tmp_path / "m"))
    config = json.load(open(os.path.join(path, "config.json")))
    config["architectures"] = ["GPT2LMHeadModel"]
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel.*not supported.*LlamaForCausalLM"):
        load_checkpoint(path)


def test_shape_mismatch_names_the_tensor(tmp_path):
    path = tiny.make_tiny_model(str(tmp_path / "m"))
    config = json.load(open(os.path.join(path, "config.json")))
    config["intermediate_size"] = 512
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(
        CheckpointError, match=r"mlp\.gate_proj\.weight' has shape \(768, 256\), config.json implies \(512, 256\)"
    ):
        load_checkpoint(path)


def test_truncated_safetensors_names_the_file(tmp_path):
    path = tiny.make_tiny_model(str(tmp_path / "m"), shards=2)
    shard = os.path.join(path, "model-00002-of-00002.safetensors")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors: unreadable"):
        load_checkpoint(path)


def test_missing_shard_names_it_and_the_index(tmp_path):
    path = tiny.make_tiny_model(str(tmp_path / "m"), shards=2)
    os.remove(os.path.join(path, "model-00001-of-00002.safetensors"))
    with pytest.raises(CheckpointError, match="model-00001-of-00002.safetensors: missing .listed in"):
        load_checkpoint(path)


def test_the_kernels_equal_the_python_path(models):
    model = models["llama-gqa"]
    assert model.fused is not None, "the C++ kernels should build on this machine"
    rng = np.random.default_rng(3)
    prompts = [rng.integers(5, 4000, size=n).tolist() for n in (3, 17, 40, 64, 1)]
    cache = PagedKVCache(model.args, 64, BLOCK)
    tables = [list(range(i, 64, len(prompts)))[:8] for i in range(len(prompts))]
    model.forward(BatchInput(prompts, [0] * len(prompts), tables), cache)  # prefill every sequence
    decode = BatchInput([[7] for _ in prompts], [len(p) for p in prompts], tables)
    fast = model.forward(decode, cache)
    kernels, model.fused = model.fused, None
    try:
        slow = model.forward(decode, cache)
    finally:
        model.fused = kernels
    np.testing.assert_allclose(fast, slow, rtol=1e-4, atol=1e-4)


_FORWARD_ON_THREADS = """
import sys
import numpy as np
from fdcore.core.batch import BatchInput
from fdcore.models.llama import LlamaModel
from fdcore.checkpoint import load_checkpoint

given = np.load(sys.argv[1])
model = LlamaModel(load_checkpoint(str(given["path"]), progress=lambda *_: None), str(given["dtype"]))
assert model.fused is not None
prompts = [row[row >= 0].tolist() for row in given["prompts"]]
tables = [list(range(i, 160, len(prompts)))[:10] for i in range(len(prompts))]
cache = model.new_cache(160, 16)
prefill = model.forward(BatchInput(prompts, [0] * len(prompts), tables), cache)
decode = model.forward(BatchInput([[7] for _ in prompts], [len(p) for p in prompts], tables), cache)
np.savez(sys.argv[2], prefill=prefill, decode=decode)
"""


@pytest.mark.parametrize(
    "dtype, quantization", [("float32", "none"), ("float32", "wint8"), ("float32", "wint4"), ("bfloat16", "none")]
)
def test_a_row_gets_the_same_bits_prefilled_whole_in_chunks_or_step_by_step(checkpoints, dtype, quantization):
    """Crash-resume recomputes a sequence in other chunks and batches: position 44's logits are the same to
    the bit from a whole prefill (attention pairs rows 0-1, ..., 42-43: AttendHeadsPair; bfloat16's products
    in 16-row tiles where the CPU has AMX), from chunks cut at odd places (other pairs, rows alone between)
    and from decode steps beside another sequence."""
    from fdcore.models.kernels import kernel_path

    kind = dtype if quantization == "none" else quantization
    if kernel_path(kind) is None:
        pytest.skip(f"{kind} is refused on this CPU")
    model = LlamaModel(load_checkpoint(checkpoints["llama-gqa"], progress=lambda *_: None), dtype, quantization)
    rng = np.random.default_rng(4)
    prompt, other = rng.integers(5, 4000, 45).tolist(), rng.integers(5, 4000, 20).tolist()
    whole = model.forward(BatchInput([prompt], [0], [[0, 1, 2]]), model.new_cache(16, BLOCK))[0]
    chunks = model.new_cache(16, BLOCK)
    for start, end in ((0, 7), (7, 20), (20, 45)):
        logits = model.forward(BatchInput([prompt[start:end]], [start], [[4, 9, 2]]), chunks)
    assert np.array_equal(logits[-1], whole)
    steps = model.new_cache(16, BLOCK)
    model.forward(BatchInput([other], [0], [[5, 6, 8]]), steps)
    model.forward(BatchInput([prompt[:19]], [0], [[9, 3, 7]]), steps)
    for pos in range(19, 45):  # a decode step each, beside the other sequence's
        logits = model.forward(BatchInput([[prompt[pos]], [11]], [pos, 20 + pos - 19], [[9, 3, 7], [5, 6, 8]]), steps)
    assert np.array_equal(logits[0], whole)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_forward_pass_gives_the_same_bits_on_one_and_two_threads(checkpoints, on_threads, dtype):
    """The fused operators share rows (attention: rows x KV heads; SwiGLU: rows) out over OpenMP's
    threads, each computed whole by one thread: a crash recompute on another thread count, or a
    worker restarted with other settings, gets the same logits to the bit. 16 sequences: their decode step's
    16 rows are enough for the row-wise loops (norms, SwiGLU, rotary) to share them out too."""
    from fdcore.models.kernels import kernel_path

    if kernel_path(dtype) is None:
        pytest.skip(f"{dtype} is refused on this CPU")
    rng = np.random.default_rng(5)
    lengths = (150, 3, 77, 1, 120, 9, 2, 5, 30, 4, 11, 6, 17, 8, 3, 12)
    prompts = np.full((len(lengths), max(lengths)), -1)
    for row, n in enumerate(lengths):
        prompts[row, :n] = rng.integers(5, 4000, size=n)
    given = {"path": np.array(checkpoints["llama-gqa"]), "prompts": prompts, "dtype": np.array(dtype)}
    one, two = on_threads(_FORWARD_ON_THREADS, given, threads=1), on_threads(_FORWARD_ON_THREADS, given, threads=2)
    for name in ("prefill", "decode"):
        assert np.array_equal(one[name], two[name]), name


@pytest.mark.parametrize(
    "dtype, quantization, cache_dtype",
    [
        ("float32", "none", "float32"),
        ("float32", "wint8", "float32"),
        ("float32", "wint4", "float32"),
        ("bfloat16", "none", "float32"),
        ("bfloat16", "none", "bfloat16"),  # the tile attention: queries rounded once a row, o's rows handed rounded
    ],
)
def test_the_one_call_decoder_equals_the_per_layer_calls_to_the_bit(checkpoints, dtype, quantization, cache_dtype):
    """kernels/decoder.cc runs every layer in one operator call with the kernels the per-layer path
    calls from Python, in the same order: the same logits to the bit, prefill and decode, biases and
    GQA included (the Qwen2 variant has q/k/v biases); a bfloat16 model's o and down products add the residual
    stream in their epilogue (FoldsResidual), and over a bfloat16 cache its attention hands o its rows rounded."""
    from fdcore.models.kernels import kernel_path, missing_cpu_feature

    kind = dtype if quantization == "none" else quantization
    if kernel_path(kind) is None:
        pytest.skip(f"{dtype} / {quantization} is refused on this CPU (needs {missing_cpu_feature(kind)})")
    for name in ("llama-gqa", "qwen2-bias-tied"):
        model = LlamaModel(load_checkpoint(checkpoints[name], progress=lambda *_: None), dtype, quantization)
        if model.decoder is None:
            pytest.skip("the one-call decoder needs packed projections (AVX-512F or AVX2) and the C++ operators")
        rng = np.random.default_rng(11)
        prompts = [rng.integers(5, 4000, size=n).tolist() for n in (40, 1, 23)]
        tables = [list(range(i, 48, len(prompts)))[:8] for i in range(len(prompts))]
        results = []
        for decoder in (model.decoder, None):
            model.decoder = decoder
            cache = PagedKVCache(model.args, 48, BLOCK, cache_dtype)
            prefill = model.forward(BatchInput(prompts, [0] * len(prompts), tables), cache)
            decode = model.forward(BatchInput([[9] for _ in prompts], [len(p) for p in prompts], tables), cache)
            results.append((prefill, decode))
        (one_prefill, one_decode), (per_layer_prefill, per_layer_decode) = results
        assert np.array_equal(one_prefill, per_layer_prefill), name
        assert np.array_equal(one_decode, per_layer_decode), name


def test_reused_step_inputs_give_the_same_bits_as_fresh_views(checkpoints):
    """The one-call decoder's inputs go through StepInputs' reused buffers: decode steps of one and of two
    sequences, alternating shapes, give the logits of the same steps made with fresh views."""
    model = LlamaModel(load_checkpoint(checkpoints["llama-gqa"], progress=lambda *_: None))
    if model.decoder is None:
        pytest.skip("the one-call decoder needs packed projections (AVX-512F or AVX2) and the C++ operators")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(5, 4000, size=n).tolist() for n in (17, 9)]
    tables = [list(range(0, 8)), list(range(8, 16))]
    results = []
    for largest in (0, 1 << 18):  # 0: every input viewed afresh
        model.step_inputs.largest = largest
        cache = PagedKVCache(model.args, 16, BLOCK)
        logits = [model.forward(BatchInput(prompts, [0, 0], tables), cache)]
        lengths = [len(p) for p in prompts]
        for step in range(6):
            both = step % 3 == 2
            seqs = [0, 1] if both else [step % 2]
            batch = BatchInput([[11 + step] for _ in seqs], [lengths[s] for s in seqs], [tables[s] for s in seqs])
            logits.append(model.forward(batch, cache))
            for s in seqs:
                lengths[s] += 1
        results.append(logits)
    for fresh, reused in zip(*results, strict=True):
        assert np.array_equal(fresh, reused)
