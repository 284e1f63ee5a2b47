"""What is on disk: checkpoints as people download them, read without Paddle.

A Hugging Face directory's ``config.json`` becomes the model's arguments (``model_args``: every key read,
known to change nothing, or refused), its safetensors the float32 arrays by name (``loader``); a GGUF
file (``gguf_file``: the container; ``gguf_metadata``; ``gguf``: config and weights; ``gguf_tokenizer``)
the same, with its quantized tensors kept as ggml blocks (``ggml_blocks``); rotary scaling (``rope``);
the bundled tiny model (``tiny``) and the documented download (``fetch``). fdcore.models computes from
what this package reads; nothing here imports Paddle (a test checks).
"""

from fdcore.checkpoint.loader import (
    Checkpoint,
    eos_ids,
    inspect_checkpoint,
    is_gguf,
    load_checkpoint,
    read_config,
    read_json_object,
)
from fdcore.checkpoint.model_args import CheckpointError, ModelArgs

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "ModelArgs",
    "eos_ids",
    "inspect_checkpoint",
    "is_gguf",
    "load_checkpoint",
    "read_config",
    "read_json_object",
]
