"""Rotary position embeddings as Hugging Face transformers computes them, scaling types included.

A checkpoint's ``rope_parameters`` (transformers 5) or ``rope_theta`` +
``rope_scaling`` (older) become a :class:`RopeSpec`; :meth:`RopeSpec.tables`
gives the cos / sin of any positions. Every formula follows transformers'
``modeling_rope_utils`` (float32 where it computes in float32), because a
rotary angle a few ulps off is a different model at long range.

| ``rope_type`` | inverse frequencies                                     | cos / sin scaled by |
|---------------|---------------------------------------------------------|---------------------|
| ``default``   | ``theta ** -(2i / dim)``                                | 1                   |
| ``linear``    | default / ``factor``                                    | 1                   |
| ``dynamic``   | default with ``theta`` grown for sequences longer than  | 1                   |
|               | ``max_position_embeddings`` (NTK-aware)                 |                     |
| ``yarn``      | interpolation / extrapolation blended by a linear ramp  | ``attention_factor``|
| ``llama3``    | low frequencies / ``factor``, a smooth band between     | 1                   |

NOTE: ``dynamic`` depends on the sequence length, as in transformers: a
forward pass over positions ``< L`` uses the frequencies for length ``L``
(transformers takes ``max(position_ids) + 1`` of the pass). In its generate
loop that is the prompt's length for every prompt token and ``p + 1`` for the
token generated at position ``p``; fdcore gives each position exactly that,
``max(p + 1, prompt length)``, so the result does not depend on how the
prompt was chunked or whether a request was recomputed after a crash.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import cast

import numpy as np

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


@dataclass(frozen=True)
class RopeSpec:
    """One model's rotary settings (every field as transformers names it)."""

    rope_type: str = "default"
    theta: float = 10000.0
    head_dim: int = 64
    max_position_embeddings: int = 2048
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @property
    def is_dynamic(self) -> bool:
        return self.rope_type == "dynamic"

    def inverse_frequencies(self, seq_len: int | None = None) -> tuple[np.ndarray, float]:
        """(inv_freq [head_dim / 2] float32, the factor cos / sin are multiplied by)."""
        return _INIT[self.rope_type](self, seq_len)

    @cached_property
    def _static_frequencies(self) -> tuple[np.ndarray, float]:
        """The frequencies of every step but dynamic scaling's: computed once, not per step."""
        return self.inverse_frequencies()

    def tables(self, positions: np.ndarray, seq_lens: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin, each [len(positions), head_dim / 2] float32, for rotate-half rotary.

        ``seq_lens`` (per position) matters only for ``dynamic``: each position gets the
        frequencies of its sequence's length."""
        if not self.is_dynamic or seq_lens is None:
            inv_freq, scale = self._static_frequencies
            return _cos_sin(positions, inv_freq[None, :], scale)
        lengths = np.maximum(seq_lens, self.max_position_embeddings)
        unique, index = np.unique(lengths, return_inverse=True)
        inv = np.stack([self.inverse_frequencies(int(length))[0] for length in unique])
        return _cos_sin(positions, inv[index], 1.0)


def _cos_sin(positions: np.ndarray, inv_freq: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    freqs = positions.astype(np.float32)[:, None] * inv_freq
    cos, sin = np.cos(freqs), np.sin(freqs)
    if scale != 1.0:
        cos, sin = cos * np.float32(scale), sin * np.float32(scale)
    return cos.astype(np.float32), sin.astype(np.float32)


def _exponents(dim: int) -> np.ndarray:
    """``arange(0, dim, 2) / dim`` in float32, as transformers builds it."""
    return np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)


def _default(spec: RopeSpec, seq_len: int | None) -> tuple[np.ndarray, float]:
    return (1.0 / np.float32(spec.theta) ** _exponents(spec.head_dim)).astype(np.float32), 1.0


def _linear(spec: RopeSpec, seq_len: int | None) -> tuple[np.ndarray, float]:
    inv_freq, _ = _default(spec, seq_len)
    return (inv_freq / np.float32(spec.factor)).astype(np.float32), 1.0


def _dynamic(spec: RopeSpec, seq_len: int | None) -> tuple[np.ndarray, float]:
    """NTK-aware: theta grows with the sequence past max_position_embeddings (in float32, as
    transformers computes it from a tensor length)."""
    dim, limit = spec.head_dim, spec.max_position_embeddings
    length = np.float32(max(seq_len or limit, limit))
    factor = np.float32(spec.factor)
    growth = (factor * length / np.float32(limit) - (factor - np.float32(1))) ** np.float32(dim / (dim - 2))
    base = np.float32(spec.theta) * np.float32(growth)
    return (np.float32(1.0) / base ** _exponents(dim)).astype(np.float32), 1.0


def _yarn(spec: RopeSpec, seq_len: int | None) -> tuple[np.ndarray, float]:
    dim, base = spec.head_dim, spec.theta
    original = cast(int, spec.original_max_position_embeddings)
    factor = spec.factor if spec.factor is not None else spec.max_position_embeddings / original
    attention_factor = spec.attention_factor
    if attention_factor is None:
        if spec.mscale and spec.mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, spec.mscale) / _yarn_mscale(factor, spec.mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = spec.beta_fast or 32, spec.beta_slow or 1
    low, high = _correction_range(beta_fast, beta_slow, dim, base, original, spec.truncate)
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_factor = np.float32(1) - ramp.astype(np.float32)
    inv_freq = interpolation * (np.float32(1) - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq.astype(np.float32), float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _correction_range(
    low_rot: float, high_rot: float, dim: int, base: float, max_positions: int, truncate: bool
) -> tuple[float, float]:
    def dimension(rotations: float) -> float:
        return (dim * math.log(max_positions / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dimension(low_rot), dimension(high_rot)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _llama3(spec: RopeSpec, seq_len: int | None) -> tuple[np.ndarray, float]:
    inv_freq, _ = _default(spec, seq_len)
    factor = np.float32(spec.factor)
    old_context = cast(int, spec.original_max_position_embeddings)
    low_wavelen = old_context / cast(float, spec.low_freq_factor)
    high_wavelen = old_context / cast(float, spec.high_freq_factor)
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq).astype(np.float32)
    smooth = (
        (np.float32(old_context) / wavelen - np.float32(spec.low_freq_factor))
        / np.float32(cast(float, spec.high_freq_factor) - cast(float, spec.low_freq_factor))
    ).astype(np.float32)
    smoothed = (np.float32(1) - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32), 1.0


_INIT = {"default": _default, "linear": _linear, "dynamic": _dynamic, "yarn": _yarn, "llama3": _llama3}
