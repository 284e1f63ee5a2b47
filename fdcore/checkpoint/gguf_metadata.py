"""A GGUF file's key/value section, with errors that name the file and the key (fdcore.checkpoint.gguf reads
the model from it, fdcore.checkpoint.gguf_tokenizer the tokenizer)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from fdcore.checkpoint.gguf_file import GgufFile, GgufFormatError
from fdcore.checkpoint.model_args import CheckpointError


class Metadata:
    """The key/value section of one GGUF file, with errors that name the file and the key."""

    def __init__(self, reader: GgufFile, file: str):
        self.fields, self.file = reader.fields, file

    def __contains__(self, key: str) -> bool:
        return key in self.fields

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.fields:
            raise CheckpointError(f"{self.file}: metadata key {key!r} is missing")
        return self.get(key)

    def count(self, key: str) -> int | None:
        """Length of an array value."""
        field = self.fields.get(key)
        return None if field is None else len(field)

    def integer(self, key: str, default: int | None = None) -> int:
        value = self.require(key) if default is None else self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise CheckpointError(f"{self.file}: metadata key {key!r} must be a positive integer, got {value!r}")
        return value

    def number(self, key: str, default: float | None = None) -> float:
        value = self.require(key) if default is None else self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CheckpointError(f"{self.file}: metadata key {key!r} must be a number, got {value!r}")
        return float32_value(value)

    def error(self, key: str, message: str) -> CheckpointError:
        return CheckpointError(f"{self.file}: metadata key {key!r}: {message}")


def float32_value(value: float) -> float:
    """GGUF stores floats as float32: 9.999999747e-06 is the 1e-05 that config.json had, so give
    that back (shortest decimal of the float32) instead of float32 noise in the config."""
    return float(str(np.float32(value)))


def open_gguf(file: str) -> GgufFile:
    """The file's metadata and tensor directory (tensors are read lazily, one at a time)."""
    if not os.path.isfile(file):
        raise CheckpointError(f"{file}: GGUF file does not exist")
    try:
        return GgufFile(file)
    except (GgufFormatError, OSError) as exc:
        raise CheckpointError(f"{file}: not a readable GGUF file ({exc})") from None
