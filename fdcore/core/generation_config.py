"""The model's own sampling defaults: generation_config.json, applied to what a request leaves unset.

As vLLM's ``generation_config="auto"`` (its ``get_diff_sampling_param``): the
checkpoint's ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty`` and ``max_new_tokens`` (as ``max_tokens``) become the
defaults of every request that does not set them; a request's own value always
wins. Like vLLM, ``do_sample`` is ignored: a checkpoint that says
``do_sample: false`` next to a temperature gets that temperature (send
``temperature: 0`` for greedy). ``model.generation_config = "none"`` switches
this off (fdcore's neutral defaults, :data:`fdcore.protocol.SAMPLING_DEFAULTS`).

Values no request could use (a negative temperature, top_p above 1) are a
:class:`CheckpointError` naming the file at start-up, not a 400 for every
request that happens not to set them.
"""

from __future__ import annotations

import os

from fdcore.checkpoint import CheckpointError, read_json_object
from fdcore.core.validation import ModelLimits, RequestError, check_sampling
from fdcore.protocol import SamplingParams

# generation_config.json key -> (SamplingParams field, type)
KEYS = {
    "temperature": ("temperature", float),
    "top_p": ("top_p", float),
    "top_k": ("top_k", int),
    "min_p": ("min_p", float),
    "repetition_penalty": ("repetition_penalty", float),
    "max_new_tokens": ("max_tokens", int),
}
MODES = ("auto", "none")


def generation_config_file(path: str) -> str:
    return os.path.join(path, "generation_config.json")


def read_sampling_defaults(path: str, mode: str = "auto") -> dict[str, int | float]:
    """The sampling defaults of the checkpoint at ``path``, in SamplingParams' names ({} for "none")."""
    if mode == "none":
        return {}
    if mode != "auto":
        raise ValueError(f"generation_config mode {mode!r} is not one of {', '.join(MODES)}")
    file = generation_config_file(path)
    if not os.path.exists(file):
        return {}
    data = read_json_object(file)
    return {
        field: _typed(data[key], kind, file, key) for key, (field, kind) in KEYS.items() if data.get(key) is not None
    }


def sampling_defaults(path: str, mode: str, limits: ModelLimits) -> dict[str, int | float]:
    """What the engine fills unset sampling fields with (see :func:`fit_to_model`)."""
    return fit_to_model(read_sampling_defaults(path, mode), limits, generation_config_file(path))


def fit_to_model(defaults: dict[str, int | float], limits: ModelLimits, source: str) -> dict[str, int | float]:
    """The defaults as the engine applies them: max_tokens capped at max_model_len (the scheduler
    stops there anyway) and top_k at the vocabulary (a larger top_k keeps every token, as in
    transformers); then range-checked like a request's, a bad value being the checkpoint's error."""
    fitted = dict(defaults)
    if "max_tokens" in fitted:
        fitted["max_tokens"] = min(fitted["max_tokens"], limits.max_model_len)
    if "top_k" in fitted:
        fitted["top_k"] = min(fitted["top_k"], limits.vocab_size)
    try:
        check_sampling(SamplingParams(**fitted), limits)  # type: ignore[arg-type]  # (each key a field of its type)
    except RequestError as exc:
        raise CheckpointError(f"{source}: {exc}") from None
    return fitted


def _typed(value: object, kind: type, file: str, key: str) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CheckpointError(f"{file}: {key} must be a number, got {value!r}")
    if kind is int:
        if not float(value).is_integer():
            raise CheckpointError(f"{file}: {key} must be an integer, got {value!r}")
        return int(value)
    return float(value)
