"""Checkpoints in the shapes people download: fdcore's greedy tokens equal transformers' on each.

The variants (tests/checkpoints.py) cover bfloat16 / float16 / sharded weights,
transformers 5's ``rope_parameters``, llama3 / yarn / linear / dynamic rotary
scaling with prompts longer than the original context, Mistral and Qwen2
sliding windows with prompts longer than the window, attention and MLP
biases, and Qwen3. The expected tokens come from transformers
(tools/make_checkpoint_reference.py), bf16 / f16 weights run upcast to float32.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from fdcore.checkpoint import CheckpointError, load_checkpoint
from fdcore.models.llama import LlamaModel
from tests import DATA
from tests.checkpoints import VARIANTS, make_checkpoint
from tests.models.test_model import run_greedy

pytestmark = [pytest.mark.tree, pytest.mark.kernels]

REFERENCE = json.load(open(os.path.join(DATA, "checkpoint_reference.json")))


def transformers_checkpoint(path: str, name: str) -> str:
    """The variant with the config.json transformers wrote for it (every default key it saves)."""
    make_checkpoint(path, name)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(REFERENCE["configs"][name], f)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("variants")
    return {
        name: LlamaModel(load_checkpoint(transformers_checkpoint(str(root / name), name), progress=lambda *_: None))
        for name in VARIANTS
    }


@pytest.mark.parametrize("name", list(VARIANTS))
def test_our_config_and_the_one_transformers_writes_mean_the_same_model(name):
    from fdcore.checkpoint import ModelArgs
    from tests.checkpoints import config_of

    ours = ModelArgs.from_config(config_of(name), "ours")
    assert ModelArgs.from_config(REFERENCE["configs"][name], "transformers'") == ours


def test_every_variant_has_a_reference():
    assert set(REFERENCE["variants"]) == set(VARIANTS) == set(REFERENCE["configs"])


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("case", ["short", "medium", "long"])
def test_greedy_tokens_equal_transformers(models, name, case):
    expected = REFERENCE["variants"][name][case]
    got = run_greedy(models[name], [expected["prompt"]], REFERENCE["new_tokens"])
    assert got[0] == expected["output"]


@pytest.mark.parametrize("name", ["dynamic-scaling", "mistral-sliding-window", "qwen2-sliding-window", "qwen3"])
def test_chunked_prefill_and_the_python_path_agree(models, name):
    """Chunks of 50 (the window, the dynamic length and the block boundaries fall mid-chunk), and
    the Python path instead of the C++ operators, give transformers' tokens too."""
    model = models[name]
    expected = REFERENCE["variants"][name]["long"]
    assert run_greedy(model, [expected["prompt"]], REFERENCE["new_tokens"], chunk=50)[0] == expected["output"]
    kernels, model.fused = model.fused, None
    try:
        assert run_greedy(model, [expected["prompt"]], REFERENCE["new_tokens"])[0] == expected["output"]
    finally:
        model.fused = kernels


def test_exporters_notes_pass_and_a_layout_they_ask_for_does_not():
    """SmolLM2's own config.json carries nanotron's and transformers.js's notes."""
    from fdcore.checkpoint import ModelArgs
    from tests.checkpoints import config_of

    config = {
        **config_of("llama-float16"),
        "is_llama_config": True,
        "rope_interleaved": False,
        "transformers.js_config": {"kv_cache_dtype": {"q4f16": "float16"}},
    }
    assert ModelArgs.from_config(config, "c") == ModelArgs.from_config(config_of("llama-float16"), "c")
    with pytest.raises(CheckpointError, match="key 'rope_interleaved' = True is not implemented"):
        ModelArgs.from_config({**config, "rope_interleaved": True}, "c")


def test_the_settings_were_read(models):
    """Guard against a variant silently testing the default path."""
    args = {name: model.args for name, model in models.items()}
    assert args["llama-rope-parameters-bf16"].rope.theta == 100000.0
    assert args["llama3-scaling"].rope.rope_type == "llama3"
    assert args["yarn-scaling"].rope.rope_type == "yarn" and args["yarn-scaling"].tie_word_embeddings
    assert args["linear-scaling"].rope.factor == 2.0
    assert args["dynamic-scaling"].rope.is_dynamic
    assert args["mistral-sliding-window"].sliding_windows == (48, 48, 48)
    assert args["qwen2-sliding-window"].sliding_windows == (0, 48, 48)
    assert args["qwen3"].qk_norm and args["qwen3"].o_bias and args["qwen3"].head_dim == 48
    assert args["llama-attention-and-mlp-bias"].mlp_bias and args["llama-attention-and-mlp-bias"].o_bias


# ------------------------------------------------------------ what is refused, by name
def _edit_config(path: str, **changes) -> None:
    file = os.path.join(path, "config.json")
    config = json.load(open(file))
    config.update(changes)
    json.dump(config, open(file, "w"))


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"rope_scaling": {"rope_type": "longrope", "factor": 2.0}},
            r"'rope_scaling.rope_type' = 'longrope' is not implemented",
        ),
        (
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0, "extra_knob": 3}},
            r"'rope_parameters.extra_knob' = 3 is not implemented for rope_type 'linear'",
        ),
        ({"rope_scaling": {"type": "llama3", "factor": 8.0}}, r"'rope_scaling.low_freq_factor' is required"),
        ({"partial_rotary_factor": 0.5}, r"'partial_rotary_factor' = 0.5 is not implemented"),
        ({"hidden_act": "gelu"}, r"'hidden_act' = 'gelu' is not implemented"),
        ({"sliding_window": 64}, r"key 'sliding_window' = 64 is not implemented by fdcore for llama"),
        ({"quantization_config": {"quant_method": "awq"}}, r"key 'quantization_config' = .* is not implemented"),
        ({"attention_bias": "yes"}, r"'attention_bias' = 'yes' must be true or false"),
    ],
)
def test_an_unimplemented_setting_is_named_with_its_file(tmp_path, changes, message):
    path = make_checkpoint(str(tmp_path / "m"), "llama-float16")
    _edit_config(path, **changes)
    with pytest.raises(CheckpointError, match=r"config\.json: .*" + message):
        load_checkpoint(path, progress=lambda *_: None)


def test_an_unused_tensor_is_named(tmp_path):
    from safetensors.numpy import save_file

    path = make_checkpoint(str(tmp_path / "m"), "llama-attention-and-mlp-bias")
    _edit_config(path, mlp_bias=False)  # the checkpoint has MLP biases its config does not ask for
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.0.mlp.*bias' is not used"):
        load_checkpoint(path, progress=lambda *_: None)
    save_file({"x": np.zeros(2, np.float32)}, os.path.join(path, "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'x' is not used"):
        load_checkpoint(path, progress=lambda *_: None)


def test_an_integer_tensor_is_refused_by_dtype(tmp_path):
    from safetensors.numpy import load_file, save_file

    path = make_checkpoint(str(tmp_path / "m"), "llama-attention-and-mlp-bias")
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int32)
    save_file(tensors, file)
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' has dtype I32"):
        load_checkpoint(path, progress=lambda *_: None)


def test_bfloat16_is_widened_exactly(tmp_path):
    """Every bf16 value becomes the float32 with the same upper 16 bits."""
    path = make_checkpoint(str(tmp_path / "m"), "llama-rope-parameters-bf16")
    loaded = load_checkpoint(path, progress=lambda *_: None).tensors["model.layers.0.self_attn.q_proj.weight"]
    assert loaded.dtype == np.float32 and loaded.flags.c_contiguous
    assert not np.any(loaded.view(np.uint32) & 0xFFFF)
    from tests.checkpoints import config_of, weights

    original = weights(config_of("llama-rope-parameters-bf16"), 7)["model.layers.0.self_attn.q_proj.weight"]
    np.testing.assert_allclose(loaded, original, rtol=2**-8)


# NOTE: VmHWM, not getrusage's ru_maxrss: the latter survives exec, so a child of a big pytest
# process would report the parent's peak.
MEMORY_PROBE = r"""
import json, sys
import psutil
from fdcore.models.llama import LlamaModel
from fdcore.checkpoint import load_checkpoint

def high_water_mark():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

before = psutil.Process().memory_info().rss
model = LlamaModel(load_checkpoint(sys.argv[1], progress=lambda *_: None))
peak = high_water_mark()
weights = sum(int(t.numel()) * 4 for layer in model.layers for t in layer.values() if hasattr(t, "numel"))
weights += sum(int(t.numel()) * 4 for t in {id(model.embed): model.embed, id(model.lm_head): model.lm_head}.values())
print(json.dumps({"before": before, "peak": peak, "weights": weights}))
"""


def test_loading_a_sharded_bf16_checkpoint_peaks_below_1_3x_the_weights(tmp_path):
    """Each bf16 tensor is widened as it is read and the model takes the arrays without copying:
    the process grows by the float32 weights plus one shard and one layer, not by twice the weights."""
    import subprocess
    import sys

    from fdcore.checkpoint.tiny import save_weights
    from tests.checkpoints import weights

    config = {
        **json.load(open(make_checkpoint(str(tmp_path / "m"), "llama-sharded-bf16") + "/config.json")),
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 6,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "vocab_size": 4096,
    }
    path = str(tmp_path / "m")
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    for name in os.listdir(path):
        if name.startswith("model-"):
            os.remove(os.path.join(path, name))
    save_weights(path, weights(config, 1), 6, "bfloat16")
    out = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, path],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "FDCORE_NO_KERNELS": "1"},
    )
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    growth = figures["peak"] - figures["before"]
    assert figures["weights"] > 250e6  # float32, i.e. twice the files
    assert growth < 1.3 * figures["weights"], figures


def test_prefix_caching_is_off_for_dynamic_rotary_scaling(tmp_path):
    """A dynamic-rope key depends on its prompt's length: shared prefix blocks would be wrong."""
    from fdcore.actors.cache import prefix_caching_is_exact
    from fdcore.config import parse_config

    for name, exact in (("dynamic-scaling", False), ("llama3-scaling", True), ("qwen3", True)):
        path = transformers_checkpoint(str(tmp_path / name), name)
        assert prefix_caching_is_exact(parse_config(f'[model]\npath = "{path}"\n')) is exact
