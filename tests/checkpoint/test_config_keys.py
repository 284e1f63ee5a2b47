"""config.json's keys, each read, known to change nothing, or refused (fdcore.checkpoint.config_keys): a key that
changes the maths is never ignored, and one that changes nothing is no reason to refuse a checkpoint."""

from __future__ import annotations

import json
import os

import pytest

from fdcore.checkpoint import CheckpointError, ModelArgs
from fdcore.checkpoint.config_keys import KNOWN_INERT, NOT_IMPLEMENTED, transformers_keys
from tests import DATA

FROM_GGUF = os.path.join(DATA, "configs", "smollm2_from_gguf.json")


def _config(**changes) -> dict:
    config = json.load(open(FROM_GGUF))
    config.update(changes)
    return config


def test_the_directory_transformers_writes_from_a_gguf_file_is_accepted():
    """transformers' GGUF reader writes _model_name_or_path and unk_token_id (SOURCES.md: its tokens are fdcore's)."""
    args = ModelArgs.from_config(_config(), FROM_GGUF)
    assert {"_model_name_or_path", "unk_token_id"} <= set(args.keys.inert)
    assert args.keys.unknown == () and args.num_layers == 30 and args.rope_theta == 100000.0


@pytest.mark.parametrize(
    "changes",
    [
        {"rotary_emb_base": 100000.0, "seq_length": 65536},  # CodeQwen1.5's pair: the base equals rope_theta
        {"max_sequence_length": 2048},  # the LLaMA-1 fine-tunes' lineage
        {"_attn_implementation": "sdpa", "_attn_implementation_autoset": True},  # transformers 4.47-4.48
        {"end_token_id": 2, "kv_cache_torch_dtype": "float16"},
        {"neuron": {"batch_size": 1, "compiler_version": "2.15"}},  # a vendor's block
    ],
)
def test_keys_that_change_nothing_are_accepted_and_listed(changes):
    args = ModelArgs.from_config(_config(**changes), "config.json")
    assert set(changes) <= set(args.keys.inert) and not args.keys.unknown
    assert args == ModelArgs.from_config(_config(), "config.json")  # the same model


def test_a_base_that_differs_from_rope_theta_is_refused_naming_both():
    with pytest.raises(CheckpointError, match=r"'rotary_emb_base' = 1000000.0 differs from 'rope_theta'"):
        ModelArgs.from_config(_config(rotary_emb_base=1000000.0, rope_theta=100000.0), "config.json")


def test_a_key_no_transformers_model_reads_is_a_warning_not_a_refusal():
    args = ModelArgs.from_config(_config(my_exporters_note=3, _private_thing={"a": 1}), "config.json")
    assert set(args.keys.unknown) == {"my_exporters_note", "_private_thing"}


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("layer_norm_eps", 1e-5, r"key 'layer_norm_eps' = 1e-05 is not implemented by fdcore for llama models"),
        ("attn_logit_softcapping", 50.0, r"key 'attn_logit_softcapping' = 50.0 is not implemented.*soft-capping"),
        ("quantization_config", {"quant_method": "gptq", "bits": 4}, r"key 'quantization_config' = .*pre-quantized"),
        ("rope_interleaved", True, r"key 'rope_interleaved' = True is not implemented.*interleaved"),
    ],
)
def test_a_key_that_changes_some_models_maths_is_refused_with_its_value(key, value, message):
    """layer_norm_eps: no key of fdcore's families, but read by transformers' models, so it may change the maths."""
    assert key in transformers_keys() or key in NOT_IMPLEMENTED
    with pytest.raises(CheckpointError, match=r"config\.json: " + message):
        ModelArgs.from_config(_config(**{key: value}), "config.json")


def test_a_null_or_false_value_of_a_missing_feature_changes_nothing():
    args = ModelArgs.from_config(_config(attn_logit_softcapping=None, rope_interleaved=False), "config.json")
    assert {"attn_logit_softcapping", "rope_interleaved"} <= set(args.keys.inert)


def test_the_known_inert_keys_are_in_no_other_set():
    from fdcore.checkpoint.config_keys import FAMILY_KEYS, READ

    assert not KNOWN_INERT & (READ | set().union(*FAMILY_KEYS.values()) | set(NOT_IMPLEMENTED))


def test_dual_chunk_attention_is_served_as_full_attention_below_its_chunk():
    """Qwen2.5-1M's key: accepted, the context capped at its chunk size (vLLM's rotary caps there too)."""
    qwen2 = _config(architectures=["Qwen2ForCausalLM"], model_type="qwen2", max_position_embeddings=1010000)
    qwen2["dual_chunk_attention_config"] = {
        "chunk_size": 262144,
        "local_size": 8192,
        "original_max_position_embeddings": 262144,
    }
    args = ModelArgs.from_config(qwen2, "config.json")
    assert args.max_position_embeddings == 262144 and "dual_chunk_attention_config" in args.keys.read
    qwen2["dual_chunk_attention_config"] = {"local_size": 8192}
    with pytest.raises(CheckpointError, match=r"'dual_chunk_attention_config.chunk_size' = None must be a positive"):
        ModelArgs.from_config(qwen2, "config.json")
