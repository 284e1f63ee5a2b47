"""Small random checkpoints in the shapes real ones come in (bf16, rope scaling, sliding windows...).

Each variant is a config.json as transformers writes it plus weights drawn from
numpy with a fixed seed, saved in float32, bfloat16 or float16 safetensors
(bfloat16 and float16 through Paddle's dtypes: numpy has no bfloat16), one
file or several shards. The bundled tiny tokenizer (vocabulary 4096) goes with
each. ``tools/make_reference.py`` writes each variant with this module (in the
project's environment) and records transformers' greedy tokens for it;
tests/checkpoint/test_checkpoints.py makes the same bytes and compares fdcore's tokens.

    python -m tests.checkpoints DIR VARIANT      # write one variant
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np

from fdcore.checkpoint import tiny

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 4096,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "transformers_version": "5.24.0",
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
}
QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
MISTRAL = {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}

# name: (config changes (None removes a key), dtype, shards)
VARIANTS: dict[str, tuple[dict, str, int]] = {
    "llama-rope-parameters-bf16": (
        {"rope_theta": None, "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}},
        "bfloat16",
        1,
    ),
    "llama-float16": ({"rope_theta": 500000.0}, "float16", 1),
    "llama-attention-and-mlp-bias": ({"attention_bias": True, "mlp_bias": True}, "float32", 1),
    "llama3-scaling": (
        {"rope_theta": None, "max_position_embeddings": 1024, "rope_parameters": LLAMA3_ROPE},
        "bfloat16",
        1,
    ),
    "yarn-scaling": (
        {
            **QWEN2,
            "head_dim": None,
            "max_position_embeddings": 512,
            "tie_word_embeddings": True,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
        },
        "float32",
        1,
    ),
    "linear-scaling": (
        {"max_position_embeddings": 256, "rope_scaling": {"type": "linear", "factor": 2.0}},
        "float32",
        1,
    ),
    "dynamic-scaling": (
        {"max_position_embeddings": 128, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
        "float32",
        1,
    ),
    "mistral-sliding-window": ({**MISTRAL, "sliding_window": 48}, "bfloat16", 1),
    "qwen2-sliding-window": (
        {**QWEN2, "head_dim": None, "use_sliding_window": True, "sliding_window": 48, "max_window_layers": 1},
        "float32",
        1,
    ),
    "qwen3": ({**QWEN3, "head_dim": 48, "attention_bias": True}, "bfloat16", 1),
    "llama-sharded-bf16": ({}, "bfloat16", 3),
}


def config_of(variant: str) -> dict:
    changes = VARIANTS[variant][0]
    config = {**BASE, **changes}
    return {k: v for k, v in config.items() if v is not None}


def weights(config: dict, seed: int) -> dict[str, np.ndarray]:
    """Every tensor the config asks for, float32, with scales that keep a random model's
    activations in range (so greedy tokens depend on every part of the network)."""
    rng = np.random.default_rng(seed)
    c = config
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    head_dim = c.get("head_dim") or hidden // c["num_attention_heads"]
    q_out, kv_out = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim

    def normal(*shape, std):
        return (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float32)

    def norm(size):
        return (1.0 + normal(size, std=0.1)).astype(np.float32)

    tied = c["tie_word_embeddings"]
    t = {"model.embed_tokens.weight": normal(c["vocab_size"], hidden, std=0.05 if tied else 1.0)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, out, inp in (
            ("q", q_out, hidden),
            ("k", kv_out, hidden),
            ("v", kv_out, hidden),
            ("o", hidden, q_out),
        ):
            t[p + f"self_attn.{name}_proj.weight"] = normal(out, inp, std=inp**-0.5)
        for name, out, inp in (("gate", inter, hidden), ("up", inter, hidden), ("down", hidden, inter)):
            t[p + f"mlp.{name}_proj.weight"] = normal(out, inp, std=inp**-0.5)
        t[p + "input_layernorm.weight"] = norm(hidden)
        t[p + "post_attention_layernorm.weight"] = norm(hidden)
        qkv_bias = c["model_type"] == "qwen2" or c.get("attention_bias")
        if qkv_bias:
            for name, size in (("q", q_out), ("k", kv_out), ("v", kv_out)):
                t[p + f"self_attn.{name}_proj.bias"] = normal(size, std=0.1)
        if c.get("attention_bias") and c["model_type"] != "qwen2":
            t[p + "self_attn.o_proj.bias"] = normal(hidden, std=0.1)
        if c.get("mlp_bias"):
            for name, size in (("gate", inter), ("up", inter), ("down", hidden)):
                t[p + f"mlp.{name}_proj.bias"] = normal(size, std=0.1)
        if c["model_type"] == "qwen3":
            t[p + "self_attn.q_norm.weight"] = norm(head_dim)
            t[p + "self_attn.k_norm.weight"] = norm(head_dim)
    t["model.norm.weight"] = norm(hidden)
    if not tied:
        t["lm_head.weight"] = normal(c["vocab_size"], hidden, std=hidden**-0.5)
    return t


def make_checkpoint(path: str, variant: str, seed: int = 7, changes: dict | None = None) -> str:
    """Write ``variant`` to ``path`` (replacing it) and return the path; ``changes``: config keys set on top of the
    variant's (a shape no reference covers, for tests that compare fdcore with itself)."""
    _, dtype, shards = VARIANTS[variant]
    config = {**config_of(variant), **(changes or {})}
    if os.path.isdir(path):
        shutil.rmtree(path)
    os.makedirs(path)
    _write_json(os.path.join(path, "config.json"), {**config, "dtype": dtype})
    _write_json(os.path.join(path, "generation_config.json"), {"bos_token_id": 1, "eos_token_id": 2})
    _write_json(os.path.join(path, "tokenizer_config.json"), tiny.TOKENIZER_CONFIG)
    shutil.copyfile(tiny.TOKENIZER, os.path.join(path, "tokenizer.json"))
    tiny.save_weights(path, weights(config, seed), shards, dtype)
    return path


def _write_json(path: str, data) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)


if __name__ == "__main__":
    print(make_checkpoint(sys.argv[1], sys.argv[2]))
