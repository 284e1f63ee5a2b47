"""The bundled tiny model: ``python -m fdcore.checkpoint.tiny DIR`` writes an HF-format Llama checkpoint.

No download and no training at run time: the tokenizer (byte-level BPE, 4096
tokens) ships with the package (``tiny_tokenizer.json``, made by
``tools/train_tiny_tokenizer.py``), and the weights are drawn from numpy's
PCG64 generator with a fixed seed, so every machine makes the same bytes. The
directory is what Hugging Face publishes (``config.json``,
``generation_config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json``), so transformers and vLLM load it too.

The weights are random: generations are gibberish, but deterministic, which is
what tests and benchmarks need (4 layers, hidden 256, 4 heads, 2 KV heads,
vocabulary 4096; ~5 M parameters, 21 MB in float32).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

TOKENIZER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_tokenizer.json")
SEED = 20261130
VERSION = 1

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 4096,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
    "fdcore_tiny_version": VERSION,
}

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "pad_token": "<unk>",
    "model_max_length": 2048,
    "add_bos_token": False,
    "chat_template": CHAT_TEMPLATE,
}

FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


QWEN2_CONFIG = {
    **CONFIG,
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "attention_bias": True,
}


def weights(seed: int = SEED, config: dict[str, Any] = CONFIG) -> dict[str, np.ndarray]:
    """Every tensor, in HF names and shapes ([out, in] for projections)."""
    rng = np.random.default_rng(seed)
    c = config
    hidden, inter, head_dim = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q_out, kv_out = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim

    def normal(*shape: int, std: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float32)

    # Tied embeddings double as the output head: a small scale keeps the model from
    # simply predicting its last input token again.
    embed_std = 0.05 if c["tie_word_embeddings"] else 1.0
    tensors = {"model.embed_tokens.weight": normal(c["vocab_size"], hidden, std=embed_std)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = normal(q_out, hidden, std=hidden**-0.5)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv_out, hidden, std=hidden**-0.5)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv_out, hidden, std=hidden**-0.5)
        tensors[p + "self_attn.o_proj.weight"] = normal(hidden, q_out, std=q_out**-0.5)
        tensors[p + "mlp.gate_proj.weight"] = normal(inter, hidden, std=hidden**-0.5)
        tensors[p + "mlp.up_proj.weight"] = normal(inter, hidden, std=hidden**-0.5)
        tensors[p + "mlp.down_proj.weight"] = normal(hidden, inter, std=inter**-0.5)
        tensors[p + "input_layernorm.weight"] = np.ones(hidden, np.float32)
        tensors[p + "post_attention_layernorm.weight"] = np.ones(hidden, np.float32)
        if c["attention_bias"]:
            for name, size in (("q", q_out), ("k", kv_out), ("v", kv_out)):
                tensors[p + f"self_attn.{name}_proj.bias"] = normal(size, std=0.1)
    tensors["model.norm.weight"] = np.ones(hidden, np.float32)
    if not c["tie_word_embeddings"]:
        tensors["lm_head.weight"] = normal(c["vocab_size"], hidden, std=hidden**-0.5)
    return tensors


def make_tiny_model(path: str, seed: int = SEED, *, arch: str = "llama", shards: int = 1) -> str:
    """Write the checkpoint to ``path`` (atomically: a complete directory or none).

    ``arch="qwen2"`` makes the Qwen2 variant (q/k/v biases, tied embeddings);
    ``shards > 1`` splits the weights into ``model-0000k-of-0000n.safetensors``
    files with their index, as large checkpoints are published.
    """
    config = QWEN2_CONFIG if arch == "qwen2" else CONFIG
    with atomic_directory(path, prefix=".tiny-") as tmp:
        _write_json(os.path.join(tmp, "config.json"), config)
        _write_json(
            os.path.join(tmp, "generation_config.json"), {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}
        )
        _write_json(os.path.join(tmp, "tokenizer_config.json"), TOKENIZER_CONFIG)
        shutil.copyfile(TOKENIZER, os.path.join(tmp, "tokenizer.json"))
        save_weights(tmp, weights(seed, config), shards)
    return path


@contextlib.contextmanager
def atomic_directory(path: str, prefix: str = ".partial-") -> Iterator[str]:
    """Yield a fresh sibling directory of ``path`` to write a checkpoint into; when the block ends
    it becomes ``path`` (replacing any directory there; files 0644), or on an error is removed: a
    reader sees a complete directory or none."""
    parent = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        yield tmp
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o644)
        os.chmod(tmp, 0o755)
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_weights(directory: str, tensors: dict[str, np.ndarray], shards: int, dtype: str = "float32") -> None:
    """safetensors files as transformers writes them: one, or ``shards`` with an index.

    float32 goes through safetensors' numpy writer; bfloat16 / float16 as safetensors' own records
    (numpy has no bfloat16)."""
    save, converted = _writer(tensors, dtype)
    if shards == 1:
        save(converted, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(converted)
    weight_map = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: converted[n] for n in names[k::shards]}
        save(part, os.path.join(directory, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    total = sum(t.size * (4 if dtype == "float32" else 2) for t in tensors.values())
    _write_json(
        os.path.join(directory, "model.safetensors.index.json"),
        {"metadata": {"total_size": total}, "weight_map": weight_map},
    )


def _writer(tensors: dict[str, np.ndarray], dtype: str) -> tuple[Callable[..., None], dict[str, np.ndarray]]:
    """(save, tensors to save): numpy arrays for float32; for bfloat16 / float16 the values rounded to nearest
    even, handed to safetensors as its framework writers hand theirs (a TensorSpec over the array's bytes)."""
    if dtype == "float32":
        from safetensors.numpy import save_file

        return save_file, tensors
    from safetensors import TensorSpec, serialize_file

    def save(arrays: dict[str, np.ndarray], file: str, metadata: dict[str, str]) -> None:
        serialize_file(
            {
                name: TensorSpec(
                    dtype=dtype, shape=list(array.shape), data_ptr=array.ctypes.data, data_len=array.nbytes
                )
                for name, array in arrays.items()
            },
            file,
            metadata=metadata,
        )

    return save, {name: _rounded(array, dtype) for name, array in tensors.items()}


def _rounded(array: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values as float16, or as bfloat16 bits (the upper half, rounded to nearest even)."""
    if dtype == "float16":
        return np.ascontiguousarray(array, dtype=np.float32).astype(np.float16)
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def is_complete(path: str) -> bool:
    """True when ``path`` holds this version of the tiny model."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            if json.load(f).get("fdcore_tiny_version") != VERSION:
                return False
    except (OSError, ValueError):
        return False
    return all(os.path.isfile(os.path.join(path, name)) for name in FILES)


def ensure_tiny_model(path: str) -> str:
    """Make the tiny model at ``path`` unless it is already there."""
    return path if is_complete(path) else make_tiny_model(path)


def digest(path: str) -> str:
    """SHA-256 over every file of the checkpoint (to show it is byte-identical)."""
    h = hashlib.sha256()
    for name in FILES:
        with open(os.path.join(path, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()


def _write_json(path: str, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fdcore.checkpoint.tiny", description=__doc__.splitlines()[0])
    parser.add_argument("dir", help="where to write the checkpoint")
    args = parser.parse_args(argv)
    make_tiny_model(args.dir)
    print(f"{args.dir}: tiny Llama checkpoint, sha256 {digest(args.dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
