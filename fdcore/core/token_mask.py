"""A grammar's set of allowed tokens as a packed bit mask: bit t % 32 of int32 word t // 32, little-endian
within words (what llguidance fills, fdcore.core.structured makes per step and the Gumbel kernel reads)."""

from __future__ import annotations

import numpy as np


def mask_words(vocab_size: int) -> int:
    """int32 words of a packed mask over ``vocab_size`` tokens (bit t % 32 of word t // 32)."""
    return (vocab_size + 31) // 32


def allowed_tokens(bits: np.ndarray, vocab_size: int) -> np.ndarray:
    """[vocab_size] bool of a grammar's packed mask (little-endian bit order within int32 words)."""
    return np.unpackbits(np.ascontiguousarray(bits).view(np.uint8), bitorder="little")[:vocab_size].view(bool)


def pack_allowed(allowed: np.ndarray) -> np.ndarray:
    """The packed form of a [vocab] bool mask (what llguidance fills and the Gumbel kernel reads)."""
    words = np.zeros(mask_words(allowed.size) * 32, dtype=bool)
    words[: allowed.size] = allowed
    return np.packbits(words, bitorder="little").view(np.int32)
