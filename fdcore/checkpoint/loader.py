"""Reading a checkpoint: a Hugging Face directory (config, weights single or sharded, eos ids) or a GGUF file
(fdcore.checkpoint.gguf), into float32 arrays by Hugging Face name.

Every problem is a :class:`CheckpointError` naming the file and what is wrong with it (missing, a tensor
missing or of the wrong shape, a truncated safetensors file), so the supervisor can report it instead of
restarting a worker that can never start. Weights may be float32, bfloat16 or float16; each tensor is
converted to float32 as it is read (peak memory: the loaded weights plus one tensor and the shard being read).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fdcore.checkpoint.ggml_blocks import Blocks
from fdcore.checkpoint.model_args import CheckpointError, ModelArgs


@dataclass
class Checkpoint:
    path: str
    args: ModelArgs
    eos_token_ids: tuple[int, ...]
    tensors: dict[str, np.ndarray]  # float32, HF names; the model takes (pops) them as it builds
    # a GGUF file's Q8_0 / Q4_0 / Q4_1 / Q4_K tensors as their levels (fdcore.checkpoint.ggml_blocks), by HF name:
    # a wint8 / wint4 model packs these as they are instead of quantizing the float32 arrays again
    blocks: dict[str, Blocks] = field(default_factory=dict)


def is_gguf(path: str) -> bool:
    """A llama.cpp GGUF file rather than a Hugging Face directory (see fdcore.checkpoint.gguf)."""
    return path.endswith(".gguf") and os.path.isfile(path)


def read_config(path: str) -> dict[str, Any]:
    if is_gguf(path):
        from fdcore.checkpoint.gguf import read_gguf_config

        return read_gguf_config(path)[0]
    return read_json_object(os.path.join(path, "config.json"))


def load_checkpoint(path: str, progress: Callable[[int, int], None] | None = None) -> Checkpoint:
    """Read and check everything; ``progress(done, total)`` is called per file (per tenth of the
    tensors for a GGUF file)."""
    if is_gguf(path):
        return _load_gguf(path, progress or _stderr_progress)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: checkpoint directory does not exist")
    config_file = os.path.join(path, "config.json")
    config = read_json_object(config_file)
    args = ModelArgs.from_config(config, config_file)
    tensors = _read_weights(path, args, progress)
    _check_shapes(args, {name: array.shape for name, array in tensors.items()}, path)
    return Checkpoint(path, args, eos_ids(path, config), tensors)


def inspect_checkpoint(path: str) -> ModelArgs:
    """Every check ``load_checkpoint`` makes that needs no tensor data (config keys and values; each
    file's tensor names, dtypes and shapes from its header), without reading the weights: what
    ``--check`` runs, so a checkpoint the worker would refuse is refused before the tree starts
    (a GGUF file: its metadata; its tensors are checked as they are read)."""
    if is_gguf(path):
        from fdcore.checkpoint.gguf import read_gguf_config

        return ModelArgs.from_config(read_gguf_config(path)[0], path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: checkpoint directory does not exist")
    config_file = os.path.join(path, "config.json")
    args = ModelArgs.from_config(read_json_object(config_file), config_file)
    shapes = {}
    for file in _weight_files(path):
        with _safetensors(file) as f:
            shapes.update({name: shape for name, (_, shape) in _checked_headers(f, file, args).items()})
    _check_shapes(args, shapes, path)
    return args


def _load_gguf(path: str, progress: Callable[[int, int], None]) -> Checkpoint:
    from fdcore.checkpoint.gguf import read_gguf

    def tenths(done: int, total: int) -> None:
        if done == total or done % max(1, total // 10) == 0:
            progress(done, total)

    config, tensors, eos, blocks = read_gguf(path, tenths)
    args = ModelArgs.from_config(config, path)
    _check_shapes(args, {name: array.shape for name, array in tensors.items()}, path)
    return Checkpoint(path, args, eos, tensors, blocks)


def eos_ids(path: str, config: dict[str, Any]) -> tuple[int, ...]:
    """EOS ids from generation_config.json (else config.json): an int or a list (a GGUF file's
    from its metadata)."""
    if is_gguf(path):
        from fdcore.checkpoint.gguf import read_gguf_config

        return read_gguf_config(path)[1]
    gen_file = os.path.join(path, "generation_config.json")
    source = read_json_object(gen_file) if os.path.exists(gen_file) else config
    eos = source.get("eos_token_id", config.get("eos_token_id"))
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def read_json_object(file: str, missing_ok: bool = False) -> dict[str, Any]:
    """One of a checkpoint's JSON files as a dict; a CheckpointError naming the file when it is
    missing (``missing_ok``: an empty dict instead), unreadable, not JSON or not an object."""
    try:
        with open(file, "rb") as f:
            data = json.load(f)
    except FileNotFoundError:
        if missing_ok:
            return {}
        raise CheckpointError(f"{file}: missing") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: not a JSON object")
    return data


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = read_json_object(index).get("weight_map")
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


# Tensors a checkpoint may carry that inference does not use (rotary caches some exporters save).
UNUSED_TENSOR_SUFFIXES = (".rotary_emb.inv_freq",)


def _read_weights(path: str, args: ModelArgs, progress: Callable[[int, int], None] | None) -> dict[str, np.ndarray]:
    """Every wanted tensor as float32, converted one tensor at a time; any other tensor is an
    error (weights fdcore would not use mean a model it does not run), except known leftovers."""
    files = _weight_files(path)
    tensors: dict[str, np.ndarray] = {}
    for done, file in enumerate(files, 1):
        _read_file(file, args, tensors)
        (progress or _stderr_progress)(done, len(files))
    return tensors


@contextlib.contextmanager
def _safetensors(file: str) -> Iterator[Any]:
    """The file opened with safetensors' numpy reader; a file it cannot read is a CheckpointError."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, framework="numpy") as f:
            yield f
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{file}: unreadable safetensors ({exc})") from None


def _checked_headers(f: Any, file: str, args: ModelArgs) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The tensors of one open safetensors file the model reads, ``name -> (dtype, shape)`` from its
    header, each checked to be one the architecture uses and of a float dtype. A tied model's saved
    copy of the embedding as lm_head is the same matrix: left out (not read)."""
    wanted = set(args.expected_shapes())
    skip = {"lm_head.weight"} if args.tie_word_embeddings else set()
    slices = {
        name: f.get_slice(name) for name in f.keys() if not name.endswith(UNUSED_TENSOR_SUFFIXES) and name not in skip
    }
    headers = {name: (part.get_dtype(), tuple(part.get_shape())) for name, part in slices.items()}
    for name, (dtype, _) in headers.items():
        if name not in wanted:
            raise CheckpointError(
                f"{file}: tensor {name!r} is not used by this architecture (config.json does not ask for it)"
            )
        if dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{file}: tensor {name!r} has dtype {dtype}; fdcore reads {', '.join(FLOAT_DTYPES)}")
    return headers


def _read_file(file: str, args: ModelArgs, out: dict[str, np.ndarray]) -> None:
    with _safetensors(file) as f:
        headers = _checked_headers(f, file, args)
        for name, (dtype, _) in headers.items():
            if dtype != "BF16":
                out[name] = _float32(f.get_tensor(name))
    bfloat16 = [name for name, (dtype, _) in headers.items() if dtype == "BF16"]
    if bfloat16:
        out.update(_read_bfloat16(file, bfloat16))


def _read_bfloat16(file: str, names: list[str]) -> dict[str, np.ndarray]:
    """bfloat16 tensors widened to float32 (a bf16 value is the upper half of its float32).

    NOTE: numpy has no bfloat16, so safetensors' numpy reader refuses these tensors, and going
    through Paddle's bfloat16 left ~50% more resident memory behind (its allocator keeps the freed
    intermediates). So the raw bits are read straight from the file at the offsets in its header
    (safetensors' format: an 8-byte little-endian header length, a JSON header giving each
    tensor's ``data_offsets`` after it), one tensor at a time, and shifted into place.
    """
    with open(file, "rb") as f:
        header_size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_size))
        tensors = {}
        for name in names:
            start, end = header[name]["data_offsets"]
            count = (end - start) // 2
            f.seek(8 + header_size + start)
            raw = np.fromfile(f, dtype="<u2", count=count)
            if raw.size != count:
                raise CheckpointError(f"{file}: tensor {name!r} is truncated")
            wide = np.empty(header[name]["shape"], dtype=np.float32)
            np.left_shift(raw.reshape(wide.shape), 16, out=wide.view(np.uint32), dtype=np.uint32)
            tensors[name] = wide
        return tensors


FLOAT_DTYPES = ("F32", "BF16", "F16")


def _float32(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array, dtype=np.float32)


def _check_shapes(args: ModelArgs, shapes: dict[str, tuple[int, ...]], path: str) -> None:
    for name, shape in args.expected_shapes().items():
        if name not in shapes:
            raise CheckpointError(f"{path}: tensor {name!r} is missing")
        if tuple(shapes[name]) != shape:
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {tuple(shapes[name])}, config.json implies {shape}"
            )


def _stderr_progress(done: int, total: int) -> None:
    width = 30
    bar = "#" * (width * done // total)
    sys.stderr.write(f"\rloading weights [{bar:<{width}}] {done}/{total} files")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()
