"""A checkpoint's config.json as the model's arguments (``ModelArgs``); every key is read (the table below),
known to change nothing, or refused (fdcore.checkpoint.config_keys).

Every problem is a :class:`CheckpointError` naming the file and what is wrong
with it (missing, unknown architecture, a key whose value fdcore does not
implement, a tensor missing or of the wrong shape, a truncated safetensors
file), so the supervisor can report it instead of restarting a worker that can
never start. A model served with a setting silently dropped answers wrong
without a word, the worst failure an inference engine can have: so every key
of ``config.json`` is either read (the table below), known to change nothing
at inference, or an error naming it (fdcore.checkpoint.config_keys).

config.json keys read (transformers' names; "arch" = every architecture unless noted):

| key                                   | meaning / what fdcore does                                  |
|---------------------------------------|-------------------------------------------------------------|
| architectures                         | Llama / Mistral / Qwen2 / Qwen3 ForCausalLM                 |
| hidden_size, intermediate_size        | widths                                                      |
| num_hidden_layers                     | depth                                                       |
| num_attention_heads                   | query heads                                                 |
| num_key_value_heads                   | KV heads (grouped-query attention); default = query heads   |
| head_dim                              | default hidden_size / num_attention_heads                   |
| vocab_size, max_position_embeddings   | vocabulary, context the model was trained for               |
| rms_norm_eps                          | RMSNorm epsilon                                             |
| hidden_act                            | only ``silu`` (SwiGLU)                                      |
| rope_parameters                       | transformers 5: rope_type, rope_theta and scaling fields    |
| rope_theta, rope_scaling              | older spelling of the same                                  |
| original_max_position_embeddings      | llama3 / yarn: the pre-training context (Phi-3 style)       |
| partial_rotary_factor                 | only 1.0                                                    |
| tie_word_embeddings                   | LM head = embedding matrix                                  |
| attention_bias                        | Llama / Qwen3: q, k, v and o biases (Qwen2: always q, k, v) |
| mlp_bias                              | Llama: gate, up and down projection biases                  |
| sliding_window                        | Mistral: every layer; Qwen2/3: the layers layer_types names |
| use_sliding_window, max_window_layers | Qwen2/3: sliding layers are those >= max_window_layers      |
| layer_types                           | Qwen2/3: per layer ``full_attention`` / ``sliding_attention``|
| eos_token_id                          | end of sequence (generation_config.json's first)           |

Qwen2 always has q/k/v biases (no o bias); Qwen3 normalises q and k per head
(``q_norm`` / ``k_norm``). Weights may be float32, bfloat16 or float16; each
tensor is converted to float32 as it is read (peak memory: the loaded weights
plus one tensor and the shard being read).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fdcore.checkpoint.config_keys import KeyReport, classify_keys
from fdcore.checkpoint.errors import CheckpointError
from fdcore.checkpoint.rope import ROPE_TYPES, RopeSpec

__all__ = ["CheckpointError", "ModelArgs"]

SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

ROPE_FIELDS = {  # rope parameter keys each type reads (beyond rope_type / type and rope_theta)
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "yarn": {
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    },
    "llama3": {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"},
}


@dataclass(frozen=True)
class ModelArgs:
    """The architecture as fdcore runs it, read from config.json (see the module's key table)."""

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
    rope: RopeSpec
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_windows: tuple[int, ...] = ()  # per layer: keys a query sees (0: all)
    keys: KeyReport = field(default=KeyReport(), compare=False)  # how config.json's keys were taken (config_keys)

    @property
    def family(self) -> str:
        return SUPPORTED[self.architecture]

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    def window(self, layer: int) -> int:
        return self.sliding_windows[layer] if self.sliding_windows else 0

    @classmethod
    def from_config(cls, config: dict[str, Any], source: str) -> ModelArgs:
        archs = config.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED), None)
        if arch is None:
            raise CheckpointError(
                f"{source}: architecture {archs or 'missing'} is not supported; supported: {', '.join(SUPPORTED)}"
            )
        family = SUPPORTED[arch]
        report = classify_keys(config, family, source)
        heads = _field(config, "num_attention_heads", source)
        hidden = _field(config, "hidden_size", source)
        layers = _field(config, "num_hidden_layers", source)
        head_dim = _optional_int(config, "head_dim", hidden // heads, source)
        max_positions = context_length(config, source)
        attention_bias = _flag(config, "attention_bias", source)
        args = cls(
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=_field(config, "intermediate_size", source),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=_optional_int(config, "num_key_value_heads", heads, source),
            head_dim=head_dim,
            vocab_size=_field(config, "vocab_size", source),
            max_position_embeddings=max_positions,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope=rope_spec(config, head_dim, max_positions, source),
            tie_word_embeddings=_flag(config, "tie_word_embeddings", source),
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=family in ("llama", "qwen3") and attention_bias,
            mlp_bias=_flag(config, "mlp_bias", source),
            qk_norm=family == "qwen3",
            sliding_windows=sliding_windows(config, family, layers, source),
            keys=report,
        )
        if args.num_heads % args.num_kv_heads:
            raise CheckpointError(
                f"{source}: num_attention_heads ({heads}) is not a multiple of "
                f"num_key_value_heads ({args.num_kv_heads})"
            )
        if args.head_dim % 2:
            raise CheckpointError(f"{source}: head_dim {args.head_dim} must be even for rotary embeddings")
        return args

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the model needs, in HF names and shapes."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        inter = self.intermediate_size
        shapes = {"model.embed_tokens.weight": (self.vocab_size, h), "model.norm.weight": (h,)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes.update(
                {
                    p + "self_attn.q_proj.weight": (q, h),
                    p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h),
                    p + "self_attn.o_proj.weight": (h, q),
                    p + "mlp.gate_proj.weight": (inter, h),
                    p + "mlp.up_proj.weight": (inter, h),
                    p + "mlp.down_proj.weight": (h, inter),
                    p + "input_layernorm.weight": (h,),
                    p + "post_attention_layernorm.weight": (h,),
                }
            )
            if self.qkv_bias:
                shapes.update(
                    {
                        p + "self_attn.q_proj.bias": (q,),
                        p + "self_attn.k_proj.bias": (kv,),
                        p + "self_attn.v_proj.bias": (kv,),
                    }
                )
            if self.o_bias:
                shapes[p + "self_attn.o_proj.bias"] = (h,)
            if self.mlp_bias:
                shapes.update(
                    {
                        p + "mlp.gate_proj.bias": (inter,),
                        p + "mlp.up_proj.bias": (inter,),
                        p + "mlp.down_proj.bias": (h,),
                    }
                )
            if self.qk_norm:
                shapes.update(
                    {p + "self_attn.q_norm.weight": (self.head_dim,), p + "self_attn.k_norm.weight": (self.head_dim,)}
                )
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes


def context_length(config: dict[str, Any], source: str) -> int:
    """The positions the model is served with: ``max_position_embeddings``, capped at a
    ``dual_chunk_attention_config``'s ``chunk_size`` (Qwen2.5-1M: below it, dual-chunk attention is ordinary
    full attention, which fdcore runs; vLLM's rotary caps there too)."""
    positions = _optional_int(config, "max_position_embeddings", 2048, source)
    dual = config.get("dual_chunk_attention_config")
    if dual:
        chunk = dual.get("chunk_size") if isinstance(dual, dict) else None
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0:
            raise CheckpointError(
                f"{source}: key 'dual_chunk_attention_config.chunk_size' = {chunk!r} must be a positive integer"
            )
        positions = min(positions, chunk)
    return positions


def rope_spec(config: dict[str, Any], head_dim: int, max_positions: int, source: str) -> RopeSpec:
    """The rotary settings from ``rope_parameters`` (transformers 5) or ``rope_theta`` +
    ``rope_scaling`` (older), merged as transformers' ``standardize_rope_params`` does."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if config.get("rope_parameters") and config.get("rope_scaling"):
        params = {**config["rope_scaling"], **config["rope_parameters"]}
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    theta = params.pop("rope_theta", None) or config.get("rope_theta") or 10000.0
    partial = params.pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    if partial not in (None, 1, 1.0):
        raise CheckpointError(f"{source}: key 'partial_rotary_factor' = {partial!r} is not implemented (only 1.0)")
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(
            f"{source}: key '{key}.rope_type' = {rope_type!r} is not implemented; implemented: {', '.join(ROPE_TYPES)}"
        )
    for name, value in params.items():
        if name not in ROPE_FIELDS[rope_type] and value is not None:
            raise CheckpointError(
                f"{source}: key '{key}.{name}' = {value!r} is not implemented for rope_type {rope_type!r}"
            )
    if rope_type in ("llama3", "yarn"):
        params.setdefault(
            "original_max_position_embeddings", config.get("original_max_position_embeddings") or max_positions
        )
    required = {
        "linear": ["factor"],
        "dynamic": ["factor"],
        "llama3": ["factor", "low_freq_factor", "high_freq_factor"],
    }
    for name in required.get(rope_type, []):
        if not isinstance(params.get(name), (int, float)):
            raise CheckpointError(f"{source}: key '{key}.{name}' is required for rope_type {rope_type!r}")
    return RopeSpec(
        rope_type=rope_type, theta=float(theta), head_dim=head_dim, max_position_embeddings=max_positions, **params
    )


def sliding_windows(config: dict[str, Any], family: str, layers: int, source: str) -> tuple[int, ...]:
    """Per layer, how many keys a query sees (0 = all), as transformers decides it."""
    window = config.get("sliding_window")
    if family == "mistral":
        return (_window(window, source),) * layers if window else ()
    if family not in ("qwen2", "qwen3"):
        return ()
    types = config.get("layer_types")
    if types is None:
        if not (config.get("use_sliding_window") and window):
            return ()
        first = _optional_int(config, "max_window_layers", 28, source)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if len(types) != layers or set(types) - {"full_attention", "sliding_attention"}:
        raise CheckpointError(
            f"{source}: key 'layer_types' = {types!r} must list 'full_attention' or "
            f"'sliding_attention' for each of the {layers} layers"
        )
    if "sliding_attention" not in types:
        return ()
    if not config.get("use_sliding_window", True) or not window:
        # transformers sets sliding_window to None without use_sliding_window: layers named sliding
        # attend to everything then.
        return ()
    size = _window(window, source)
    return tuple(size if kind == "sliding_attention" else 0 for kind in types)


def _window(value: Any, source: str) -> int:
    if not isinstance(value, int) or value <= 0:
        raise CheckpointError(f"{source}: key 'sliding_window' = {value!r} must be a positive integer")
    return value


def _field(config: dict[str, Any], key: str, source: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or value <= 0:
        raise CheckpointError(f"{source}: field {key!r} must be a positive integer, got {value!r}")
    return value


def _optional_int(config: dict[str, Any], key: str, default: int, source: str) -> int:
    return default if config.get(key) is None else _field(config, key, source)


def _flag(config: dict[str, Any], key: str, source: str) -> bool:
    value = config.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise CheckpointError(f"{source}: key {key!r} = {value!r} must be true or false")
    return value
