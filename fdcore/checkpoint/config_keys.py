"""Every key of a checkpoint's config.json in one of three sets: read (fdcore implements it), known to change
nothing at inference, or not implemented, which is an error naming the file, the key and its value. A model served
with a setting silently dropped answers wrong without a word, so a key that changes the maths is never ignored;
but a key that changes nothing is no reason to refuse a checkpoint.

Known to change nothing: bookkeeping and training-only settings, exporters' notes and vendor blocks, token ids
read elsewhere (the tokenizer, generation_config.json), a null or false value of a feature fdcore does not have,
and a key whose value is what fdcore does anyway (``rotary_emb_base`` equal to ``rope_theta``). A key no
transformers model class reads (``transformers_config_keys.txt``, written by tools/transformers_config_keys.py),
or one whose name says it is private (``_...``), changes nothing either: it is accepted with a warning naming it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from fdcore.checkpoint.errors import CheckpointError

# Keys that change nothing when serving: bookkeeping, training-only settings, token ids
# read elsewhere (the tokenizer and generation_config.json), and generation settings that
# older transformers wrote into config.json.
IGNORED = frozenset(
    {
        "_name_or_path",
        "architectures",
        "model_type",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "bos_token_id",
        "pad_token_id",
        "initializer_range",
        "use_cache",
        "attention_dropout",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "problem_type",
        "id2label",
        "label2id",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "is_decoder",
        "add_cross_attention",
        "tie_encoder_decoder",
        "cross_attention_hidden_size",
        "torchscript",
        "use_bfloat16",
        "tf_legacy_loss",
        "pruned_heads",
        "pretraining_tp",
        "tokenizer_class",
        "prefix",
        "sep_token_id",
        "decoder_start_token_id",
        "task_specific_params",
        "finetuning_task",
        "fdcore_tiny_version",
        "max_length",
        "min_length",
        "do_sample",
        "early_stopping",
        "num_beams",
        "num_beam_groups",
        "diversity_penalty",
        "temperature",
        "top_k",
        "top_p",
        "typical_p",
        "repetition_penalty",
        "length_penalty",
        "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size",
        "bad_words_ids",
        "num_return_sequences",
        "output_scores",
        "return_dict_in_generate",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "remove_invalid_values",
        "exponential_decay_length_penalty",
        "suppress_tokens",
        "begin_suppress_tokens",
        # exporters' own notes (SmolLM2's nanotron export, transformers.js, unsloth)
        "is_llama_config",
        "transformers.js_config",
        "unsloth_version",
        "unsloth_fixed",
    }
)
READ = frozenset(
    {
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "rms_norm_eps",
        "hidden_act",
        "rope_parameters",
        "rope_theta",
        "rope_scaling",
        "partial_rotary_factor",
        "tie_word_embeddings",
        "attention_bias",
        "mlp_bias",
        "sliding_window",
        "use_sliding_window",
        "max_window_layers",
        "layer_types",
        "eos_token_id",
        "original_max_position_embeddings",
    }
)
# What each architecture has beyond the common keys (a key of another family is refused:
# e.g. transformers' Llama has no sliding window, so a Llama config asking for one is not served).
FAMILY_KEYS = {
    "llama": {"attention_bias", "mlp_bias"},
    "mistral": {"sliding_window"},
    "qwen2": {
        "attention_bias",
        "sliding_window",
        "use_sliding_window",
        "max_window_layers",
        "layer_types",
        "dual_chunk_attention_config",  # (Qwen2.5-1M: the context capped at its chunk size, model_args)
    },
    "qwen3": {"attention_bias", "sliding_window", "use_sliding_window", "max_window_layers", "layer_types"},
}

# Keys that change nothing, beyond IGNORED, seen in published checkpoints: transformers' GGUF reader writes
# _model_name_or_path and unk_token_id (a re-save keeps them); transformers 4.47-4.48 wrote _attn_implementation
# (_autoset); Qwen-1's seq_length; the LLaMA-1 lineage's max_sequence_length; exporters' end_token_id and
# kv_cache_torch_dtype; hardware vendors' blocks.
KNOWN_INERT = frozenset(
    {
        "_model_name_or_path",
        "unk_token_id",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "seq_length",
        "max_sequence_length",
        "end_token_id",
        "kv_cache_torch_dtype",
        "neuron",
    }
)


def _rope_theta(config: dict[str, Any]) -> object:
    """The rotary base fdcore reads: rope_parameters' (transformers 5), else rope_theta, else 10000."""
    return (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 10000.0))


# Keys equal to a value fdcore reads change nothing: key -> (what it must equal, how to read that value).
SAME_AS: dict[str, tuple[str, Callable[[dict[str, Any]], object]]] = {"rotary_emb_base": ("rope_theta", _rope_theta)}
# Keys that change the maths in a way fdcore does not implement yet, with what they ask for.
NOT_IMPLEMENTED = {
    "quantization_config": "pre-quantized weights",
    "attn_logit_softcapping": "logit soft-capping (Gemma 2)",
    "final_logit_softcapping": "logit soft-capping (Gemma 2)",
    "query_pre_attn_scalar": "another attention scale (Gemma)",
    "num_experts": "a mixture of experts",
    "num_local_experts": "a mixture of experts",
    "rope_interleaved": "an interleaved rotary layout (fdcore runs rotate-half)",
}


@dataclass(frozen=True)
class KeyReport:
    """How a config's keys were taken (``--check`` lists them; a worker warns of the unknown ones)."""

    read: tuple[str, ...] = ()
    inert: tuple[str, ...] = ()  # known to change nothing
    unknown: tuple[str, ...] = ()  # no transformers model reads them, or private: accepted with a warning


@cache
def transformers_keys() -> frozenset[str]:
    """The config keys some transformers model class reads (the shipped list)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "transformers_config_keys.txt")
    with open(path) as f:
        return frozenset(line.strip() for line in f if line.strip() and not line.startswith("#"))


def classify_keys(config: dict[str, Any], family: str, source: str) -> KeyReport:
    """Each key of ``config`` read, inert or unknown; a CheckpointError naming the first one that would change the
    maths and is not implemented (for this family: a key of another family is refused, e.g. transformers' Llama
    has no sliding window, so a Llama config asking for one is not served)."""
    common = READ - set().union(*FAMILY_KEYS.values())
    readable = common | FAMILY_KEYS[family]
    read, inert, unknown = [], [], []
    for key, value in config.items():
        if key in readable:
            read.append(key)
        elif key in IGNORED or key in KNOWN_INERT or value is None or value is False:
            inert.append(key)
        elif key in SAME_AS:
            other, read_other = SAME_AS[key]
            if value != read_other(config):
                raise CheckpointError(
                    f"{source}: key {key!r} = {value!r} differs from {other!r} = {read_other(config)!r}; "
                    "fdcore reads only the latter"
                )
            inert.append(key)
        elif key in NOT_IMPLEMENTED:
            raise CheckpointError(
                f"{source}: key {key!r} = {_short(value)} is not implemented by fdcore ({NOT_IMPLEMENTED[key]})"
            )
        elif key.startswith("_") or (key not in READ and key not in transformers_keys()):
            unknown.append(key)
        else:
            raise CheckpointError(
                f"{source}: key {key!r} = {_short(value)} is not implemented by fdcore for {family} models"
            )
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{source}: key 'hidden_act' = {act!r} is not implemented (only 'silu')")
    # (rope_interleaved, nanotron's: false is HF's rotate-half, which fdcore runs; true is refused above)
    return KeyReport(tuple(read), tuple(inert), tuple(unknown))


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
