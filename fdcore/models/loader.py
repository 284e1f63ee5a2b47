"""Reading a Hugging Face checkpoint directory: config, weights (single or sharded), eos ids.

Every problem is a :class:`CheckpointError` naming the file and what is wrong
with it (missing, unknown architecture, a field out of range, a tensor of the
wrong shape, a truncated safetensors file), so the supervisor can report it
instead of restarting a worker that can never start.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

import numpy as np

SUPPORTED = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded, with the file and the reason."""


@dataclass(frozen=True)
class ModelArgs:
    """The architecture fields fdcore uses, read from config.json."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qkv_bias: bool

    @classmethod
    def from_config(cls, config: dict, source: str) -> "ModelArgs":
        archs = config.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED), None)
        if arch is None:
            raise CheckpointError(f"{source}: architecture {archs or 'missing'} is not supported; "
                                  f"supported: {', '.join(SUPPORTED)}")
        _refuse_unsupported(config, source)
        heads = _field(config, "num_attention_heads", source)
        hidden = _field(config, "hidden_size", source)
        args = cls(
            architecture=arch, hidden_size=hidden,
            intermediate_size=_field(config, "intermediate_size", source),
            num_layers=_field(config, "num_hidden_layers", source), num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab_size=_field(config, "vocab_size", source),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(config.get("rope_theta", 10000.0)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=SUPPORTED[arch] == "qwen2" or bool(config.get("attention_bias", False)),
        )
        if args.num_heads % args.num_kv_heads:
            raise CheckpointError(f"{source}: num_attention_heads ({heads}) is not a multiple of "
                                  f"num_key_value_heads ({args.num_kv_heads})")
        return args

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the model needs, in HF names and shapes."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shapes = {"model.embed_tokens.weight": (self.vocab_size, h), "model.norm.weight": (h,)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes.update({
                p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (self.intermediate_size, h),
                p + "mlp.up_proj.weight": (self.intermediate_size, h),
                p + "mlp.down_proj.weight": (h, self.intermediate_size),
                p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            })
            if self.qkv_bias:
                shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                               p + "self_attn.v_proj.bias": (kv,)})
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes


def _field(config: dict, key: str, source: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or value <= 0:
        raise CheckpointError(f"{source}: field {key!r} must be a positive integer, got {value!r}")
    return value


def _refuse_unsupported(config: dict, source: str) -> None:
    scaling = config.get("rope_scaling")
    if scaling:
        raise CheckpointError(f"{source}: rope_scaling {scaling!r} is not supported yet")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")


@dataclass
class Checkpoint:
    path: str
    args: ModelArgs
    eos_token_ids: tuple[int, ...]
    tensors: dict[str, np.ndarray]


def read_config(path: str) -> dict:
    return _read_json(os.path.join(path, "config.json"))


def load_checkpoint(path: str, progress=None) -> Checkpoint:
    """Read and check everything; ``progress(done, total)`` is called per file."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: checkpoint directory does not exist")
    config_file = os.path.join(path, "config.json")
    args = ModelArgs.from_config(_read_json(config_file), config_file)
    tensors = _read_weights(path, progress)
    _check_tensors(args, tensors, path)
    return Checkpoint(path, args, eos_ids(path, read_config(path)), tensors)


def eos_ids(path: str, config: dict) -> tuple[int, ...]:
    """EOS ids from generation_config.json (else config.json): an int or a list."""
    gen_file = os.path.join(path, "generation_config.json")
    source = _read_json(gen_file) if os.path.exists(gen_file) else config
    eos = source.get("eos_token_id", config.get("eos_token_id"))
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _read_json(file: str) -> dict:
    try:
        with open(file, "rb") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing") from None
    except ValueError as exc:
        raise CheckpointError(f"{file}: not valid JSON ({exc})") from None


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.exists(os.path.join(path, name)):
                raise CheckpointError(f"{os.path.join(path, name)}: missing (listed in {index})")
        return [os.path.join(path, name) for name in files]
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise CheckpointError(f"{single}: missing (and no model.safetensors.index.json)")
    return [single]


def _read_weights(path: str, progress) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    files = _weight_files(path)
    tensors: dict[str, np.ndarray] = {}
    for done, file in enumerate(files, 1):
        try:
            tensors.update(load_file(file))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{file}: unreadable safetensors ({exc})") from None
        (progress or _stderr_progress)(done, len(files))
    return tensors


def _check_tensors(args: ModelArgs, tensors: dict[str, np.ndarray], path: str) -> None:
    for name, shape in args.expected_shapes().items():
        if name not in tensors:
            raise CheckpointError(f"{path}: tensor {name!r} is missing")
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(f"{path}: tensor {name!r} has shape {tuple(tensors[name].shape)}, "
                                  f"config.json implies {shape}")


def _stderr_progress(done: int, total: int) -> None:
    width = 30
    bar = "#" * (width * done // total)
    sys.stderr.write(f"\rloading weights [{bar:<{width}}] {done}/{total} files")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()
