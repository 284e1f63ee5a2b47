"""Reading a GGUF file (llama.cpp's format): the model config, the weights and the tokenizer.

A GGUF holds what a Hugging Face checkpoint directory spreads over several
files: ``config.json`` and the tokenizer are metadata keys, the weights are
(often quantized) tensors under llama.cpp's names. :func:`read_gguf` turns it
into what :mod:`fdcore.checkpoint.loader` produces for a directory (an HF-style
config dict, float32 tensors under HF names in HF ``[out, in]`` layout, the
eos ids); :func:`gguf_tokenizer` builds a ``tokenizers.Tokenizer`` and the
``tokenizer_config.json``-like settings from the vocabulary in the metadata.

Every problem is a :class:`~fdcore.checkpoint.loader.CheckpointError` naming the
file and the metadata key or tensor: an architecture, tensor type, rope
scaling or pre-tokenizer that is not implemented is refused, never guessed.

Metadata keys read (``{arch}`` is ``general.architecture``)::

    key                                        becomes                          if absent
    -----------------------------------------  -------------------------------  ------------------------
    general.architecture                       architectures (llama/qwen2/      error
                                               qwen3; llama named *mistral*
                                               -> MistralForCausalLM)
    general.name, general.basename             (tell Mistral from Llama)        -
    {arch}.embedding_length                    hidden_size                      error
    {arch}.feed_forward_length                 intermediate_size                error
    {arch}.block_count                         num_hidden_layers                error
    {arch}.attention.head_count                num_attention_heads              error
    {arch}.attention.head_count_kv             num_key_value_heads              = head_count
    {arch}.attention.key_length                head_dim                         hidden / heads
    {arch}.attention.value_length              (must equal head_dim)            -
    {arch}.rope.dimension_count                (must equal head_dim)            -
    {arch}.context_length                      max_position_embeddings          error
    {arch}.attention.layer_norm_rms_epsilon    rms_norm_eps                     error
    {arch}.rope.freq_base                      rope_theta                       10000
    {arch}.rope.scaling.type                   rope_scaling.rope_type           none (linear/yarn only)
    {arch}.rope.scaling.factor                 rope_scaling.factor              error if type is set
    {arch}.rope.scale_linear                   rope_scaling (linear, old key)   -
    {arch}.rope.scaling.original_context_length  rope_scaling.original_max_position_embeddings
    {arch}.rope.scaling.yarn_beta_fast/_slow   rope_scaling.beta_fast/beta_slow -
    {arch}.rope.scaling.attn_factor, yarn_attn_factor, yarn_ext_factor, yarn_log_multiplier: refused
    {arch}.attention.sliding_window            sliding_window (+ Qwen:          (no key)
                                               use_sliding_window, layer_types
                                               all sliding)
    {arch}.vocab_size                          vocab_size                       len(tokenizer.ggml.tokens)
    tokenizer.ggml.bos_token_id                bos_token_id                     (no key)
    tokenizer.ggml.eos_token_id                eos_token_id, eos ids            (no key)
    tokenizer.ggml.eot_token_id / eom_token_id eos ids (end of turn/message)    -
    tokenizer.ggml.model                       gpt2: byte-level BPE,            error
                                               llama: SentencePiece-style BPE
    tokenizer.ggml.pre                         the pre-tokenizer (byte-level)   GPT-2's split
    tokenizer.ggml.tokens                      the vocabulary                   error
    tokenizer.ggml.token_type                  special / user-defined tokens    all normal
    tokenizer.ggml.merges                      BPE merges                       from scores (llama)
    tokenizer.ggml.scores                      merge order (llama, no merges)   -
    tokenizer.ggml.add_bos_token / add_eos_token   BOS / EOS added on encode    BOS: llama yes, gpt2 no
    tokenizer.ggml.add_space_prefix            Metaspace prepend (llama)        yes
    tokenizer.ggml.unknown_token_id            BPE unk token (llama)            -
    tokenizer.chat_template                    chat_template                    None

Tensors: ``token_embd`` / ``output_norm`` / ``output`` (absent: tied) and per
block ``attn_norm``, ``attn_{q,k,v,output}``, ``attn_{q,k}_norm`` (qwen3), ``ffn_norm``,
``ffn_{gate,up,down}``, and ``.bias`` ones (q/k/v: qwen2 always; q/k/v/o: attention_bias;
gate/up/down: mlp_bias). ``rope_freqs`` (Llama 3.1's rope
scaling, which llama.cpp bakes into per-dimension frequency divisors instead of
metadata) becomes ``rope_scaling`` {"rope_type": "llama3", ...} when its values fit
that formula, and is refused otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from fdcore.checkpoint.ggml_blocks import Blocks, from_ggml
from fdcore.checkpoint.gguf_metadata import Metadata, float32_value, open_gguf
from fdcore.checkpoint.model_args import CheckpointError

if TYPE_CHECKING:
    from fdcore.checkpoint.gguf_file import GgufFile, GgufTensor

# general.architecture -> the HF class (Mistral files say "llama": see _hf_architecture)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# ggml type names read here; gguf.quants.dequantize implements each. Q5_0 / Q5_1 are the fallbacks
# llama.cpp picks for a Q4_K / Q5_K file's rows whose width is not a multiple of 256.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")

# llama.cpp tensor names (after "blk.N.") -> HF names (after "model.layers.N.")
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


# ---------------------------------------------------------------------- config
def _hf_architecture(meta: Metadata) -> tuple[str, str]:
    """(gguf architecture, HF class name). llama.cpp converts Mistral with its Llama code and
    writes "llama"; only the model's name tells them apart (transformers does the same)."""
    arch = meta.require("general.architecture")
    if arch not in ARCHITECTURES:
        raise meta.error(
            "general.architecture", f"architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    names = f"{meta.get('general.name', '')} {meta.get('general.basename', '')}".lower()
    if arch == "llama" and "mistral" in names:
        return arch, "MistralForCausalLM"
    return arch, ARCHITECTURES[arch]


def _head_dim(meta: Metadata, arch: str, hidden: int, heads: int) -> int:
    """key_length when written (Qwen3's head_dim is not hidden / heads), else hidden / heads.
    A rotary width or value width other than head_dim is a model fdcore does not implement."""
    head_dim = meta.integer(f"{arch}.attention.key_length", hidden // heads)
    for key in (f"{arch}.attention.value_length", f"{arch}.rope.dimension_count"):
        value = meta.get(key)
        if value is not None and value != head_dim:
            raise meta.error(
                key,
                f"{value} differs from head_dim {head_dim} (partial rotary or different value width is not supported)",
            )
    return head_dim


def _rope_scaling(meta: Metadata, arch: str) -> dict[str, Any] | None:
    """HF ``rope_scaling`` from the rope.scaling.* keys: linear and YaRN; others are refused."""
    prefix = f"{arch}.rope.scaling."
    kind = meta.get(prefix + "type")
    if kind is None and f"{arch}.rope.scale_linear" in meta:  # the key before rope.scaling.* existed
        factor = meta.number(f"{arch}.rope.scale_linear")
        return None if factor == 1.0 else {"rope_type": "linear", "factor": factor}
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise meta.error(prefix + "type", f"rope scaling {kind!r} is not supported (linear, yarn)")
    scaling = {"rope_type": kind, "factor": meta.number(prefix + "factor")}
    if kind == "yarn":
        scaling["original_max_position_embeddings"] = meta.integer(prefix + "original_context_length")
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if prefix + key in meta:
                scaling[name] = meta.number(prefix + key)
    # Attention-scale overrides: llama.cpp's and HF's definitions differ per model; not guessed.
    for key in ("attn_factor", "yarn_attn_factor", "yarn_ext_factor", "yarn_log_multiplier"):
        if prefix + key in meta:
            raise meta.error(prefix + key, f"{meta.get(prefix + key)!r} is not supported")
    return scaling


def _llama3_rope_scaling(factors: np.ndarray, head_dim: int, theta: float, file: str) -> dict[str, Any] | None:
    """HF's llama3 ``rope_scaling`` that reproduces llama.cpp's ``rope_freqs`` divisors.

    llama.cpp stores, per rotary frequency, the divisor f_i that Llama 3.1's scaling applies: 1 for
    short wavelengths, ``factor`` for long ones, and between them 1 / ((1 - s) / factor + s) with
    s = (L / wavelength - low) / (high - low), L the original context. s is linear in 1 / wavelength
    with slope L / (high - low) and offset low / (high - low), which the middle band determines;
    taking low = 1 gives the parameters (other (L, low, high) with the same slope and offset make
    the same divisors). Refused unless the recomputed divisors match the file's.
    """
    f = factors.astype(np.float64).reshape(-1)
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if f.shape != inv_freq.shape or not np.all(f >= 1.0 - 1e-6):
        raise CheckpointError(
            f"{file}: tensor 'rope_freqs.weight' has {f.size} values >= 1 expected {inv_freq.size} (head_dim / 2)"
        )
    factor = float(f.max())
    if factor <= 1.0 + 1e-6:
        return None
    middle = (f > 1.0 + 1e-6) & (f < factor * (1 - 1e-6))
    if middle.sum() < 2:
        raise CheckpointError(
            f"{file}: tensor 'rope_freqs.weight' has too few smoothed frequencies to recover llama3 rope scaling from"
        )
    inverse_wavelength = inv_freq / (2 * np.pi)
    smooth = (1 / f[middle] - 1 / factor) / (1 - 1 / factor)
    slope, offset = np.polyfit(inverse_wavelength[middle], smooth, 1)
    low, high = 1.0, round(1.0 - 1.0 / offset, 4)
    scaling = {
        "rope_type": "llama3",
        "factor": float32_value(factor),
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": round(float(slope) * (high - low)),
    }
    if not np.allclose(_llama3_divisors(scaling, inv_freq), f, rtol=1e-4):
        raise CheckpointError(f"{file}: tensor 'rope_freqs.weight' does not follow llama3 rope scaling")
    return scaling


def _llama3_divisors(scaling: dict[str, Any], inv_freq: np.ndarray) -> np.ndarray:
    """The per-frequency divisors llama3 rope scaling applies (HF's _compute_llama3_parameters)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelength = 2 * np.pi / inv_freq
    smooth = np.clip((old / wavelength - low) / (high - low), 0.0, 1.0)
    return cast(np.ndarray, 1.0 / ((1 - smooth) / factor + smooth))


def _config(meta: Metadata, tensors_by_name: dict[str, GgufTensor]) -> dict[str, Any]:
    """The config.json dict that the metadata and the tensors (by llama.cpp name) describe."""
    tensor_names = tensors_by_name.keys()
    arch, hf_arch = _hf_architecture(meta)
    hidden = meta.integer(f"{arch}.embedding_length")
    heads = meta.integer(f"{arch}.attention.head_count")
    vocab = meta.get(f"{arch}.vocab_size") or meta.count("tokenizer.ggml.tokens")
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": {"MistralForCausalLM": "mistral"}.get(hf_arch, arch),
        "hidden_size": hidden,
        "intermediate_size": meta.integer(f"{arch}.feed_forward_length"),
        "num_hidden_layers": meta.integer(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.integer(f"{arch}.attention.head_count_kv", heads),
        "head_dim": _head_dim(meta, arch, hidden, heads),
        "vocab_size": vocab,
        "max_position_embeddings": meta.integer(f"{arch}.context_length"),
        "rms_norm_eps": meta.number(f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": meta.number(f"{arch}.rope.freq_base", 10000.0),
        "hidden_act": "silu",
        # llama.cpp writes output.weight only when it is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    # Biases are optional tensors to llama.cpp; HF says it in the config (Qwen2 always has q/k/v ones).
    if arch != "qwen2":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    if arch == "llama":
        config["mlp_bias"] = "blk.0.ffn_gate.bias" in tensor_names
    if not isinstance(vocab, int) or vocab <= 0:
        raise meta.error(f"{arch}.vocab_size", "missing, and no tokenizer.ggml.tokens to count")
    if (scaling := _rope_scaling(meta, arch)) is not None:
        config["rope_scaling"] = scaling
    if "rope_freqs.weight" in tensors_by_name:
        if "rope_scaling" in config:
            raise meta.error(f"{arch}.rope.scaling.type", "set together with a rope_freqs tensor")
        factors = _dequantize(tensors_by_name["rope_freqs.weight"], meta.file)
        scaling = _llama3_rope_scaling(factors, config["head_dim"], config["rope_theta"], meta.file)
        if scaling is not None:
            config["rope_scaling"] = scaling
    if (window := meta.get(f"{arch}.attention.sliding_window")) is not None:
        config["sliding_window"] = window  # every layer (HF Llama has none: ModelArgs refuses it)
        if arch in ("qwen2", "qwen3"):
            config.update(use_sliding_window=True, layer_types=["sliding_attention"] * config["num_hidden_layers"])
    for key in ("bos", "eos"):
        if (token := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None:
            config[f"{key}_token_id"] = token
    return config


def _eos_ids(meta: Metadata) -> tuple[int, ...]:
    """End-of-sequence ids: eos, and the end-of-turn / end-of-message ids chat models stop at
    (what generation_config.json lists for them; llama.cpp stops at all of them too)."""
    ids: list[int] = []
    for key in ("eos", "eot", "eom"):
        token = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token is not None and token not in ids:
            ids.append(int(token))
    return tuple(ids)


# ---------------------------------------------------------------------- tensors
@dataclass(frozen=True)
class _Expected:
    """One tensor the model needs: its llama.cpp name, HF name and HF shape."""

    gguf_name: str
    hf_name: str
    shape: tuple[int, ...]


def _expected_tensors(config: dict[str, Any]) -> list[_Expected]:
    """Every tensor the config implies, with llama.cpp's name and HF's name and shape."""
    c = config
    h, inter, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    out = [
        _Expected("token_embd.weight", "model.embed_tokens.weight", (c["vocab_size"], h)),
        _Expected("output_norm.weight", "model.norm.weight", (h,)),
    ]
    if not c["tie_word_embeddings"]:
        out.append(_Expected("output.weight", "lm_head.weight", (c["vocab_size"], h)))
    layer = {
        "attn_norm.weight": (h,),
        "ffn_norm.weight": (h,),
        "attn_q.weight": (q, h),
        "attn_k.weight": (kv, h),
        "attn_v.weight": (kv, h),
        "attn_output.weight": (h, q),
        "ffn_gate.weight": (inter, h),
        "ffn_up.weight": (inter, h),
        "ffn_down.weight": (h, inter),
    }
    if c["model_type"] == "qwen2" or c.get("attention_bias"):
        layer.update({"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)})
    if c.get("attention_bias"):  # HF Llama / Qwen3: o_proj has one too
        layer["attn_output.bias"] = (h,)
    if c.get("mlp_bias"):
        layer.update({"ffn_gate.bias": (inter,), "ffn_up.bias": (inter,), "ffn_down.bias": (h,)})
    if c["model_type"] == "qwen3":
        layer.update({"attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,)})
    for i in range(c["num_hidden_layers"]):
        out += [
            _Expected(f"blk.{i}.{name}", f"model.layers.{i}.{_LAYER_TENSORS[name]}", shape)
            for name, shape in layer.items()
        ]
    return out


def _unpermute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's LlamaModel.permute of q/k rows (weight or bias).

    llama.cpp's rotary pairs neighbouring dimensions (x0, x1), HF's pairs each half
    (x_i, x_{i+d/2}); its converter reorders each head's rows from
    ``[half0 | half1]`` to interleaved ``[h0_0, h1_0, h0_1, h1_1, ...]``, i.e. a
    (2, d/2) -> (d/2, 2) transpose per head. This is the inverse, (d/2, 2) -> (2, d/2).
    """
    half = weight.shape[0] // heads // 2
    return np.ascontiguousarray(weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape))


def _dequantize(tensor: GgufTensor, file: str) -> np.ndarray:
    """One tensor as a fresh float32 array in numpy (HF) order: ggml lists dims innermost first."""
    from gguf.quants import dequantize

    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise CheckpointError(
            f"{file}: tensor {tensor.name!r} has type {kind}, which is not supported ({', '.join(SUPPORTED_TYPES)})"
        )
    data = dequantize(tensor.data, tensor.tensor_type)
    if kind == "F32":  # a view of the memory map: copied, so nothing keeps the file mapped
        data = np.array(data, copy=True)
    shape = tuple(int(n) for n in reversed(tensor.shape))
    return np.ascontiguousarray(data.astype(np.float32, copy=False).reshape(shape))


def _hf_name(gguf_name: str, file: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _BLOCK.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_TENSORS:
        return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}"
    raise CheckpointError(f"{file}: tensor {gguf_name!r} is not part of the architectures fdcore implements")


def _convert(tensor: GgufTensor, config: dict[str, Any], file: str) -> tuple[np.ndarray, Blocks | None]:
    """Dequantize (and keep the blocks of a kind fdcore's matrices take as they are: see
    fdcore.checkpoint.ggml_blocks), then undo the q/k row permutation that llama.cpp applies to llama files
    only (rows are whole blocks, so the blocks are permuted alike)."""
    weight = _dequantize(tensor, file)
    blocks = from_ggml(tensor.tensor_type.name, tensor.data, weight.shape) if weight.ndim == 2 else None
    heads = _permuted_heads(tensor.name, config)
    if heads:
        weight = _unpermute_rows(weight, heads)
        if blocks is not None:
            blocks = Blocks(
                blocks.kind,
                *cast(
                    Iterator[Any],
                    (
                        None if a is None else _unpermute_rows(a, heads)
                        for a in (blocks.levels, blocks.scale, blocks.minimum)
                    ),
                ),
            )
    return weight, blocks


def _permuted_heads(name: str, config: dict[str, Any]) -> int:
    """The heads whose rows llama.cpp permuted in this tensor (llama files' q and k); 0: none."""
    if config["model_type"] not in ("llama", "mistral"):
        return 0
    if ".attn_q." in name:
        return cast(int, config["num_attention_heads"])
    if ".attn_k." in name:
        return cast(int, config["num_key_value_heads"])
    return 0


def _read_tensors(
    reader: GgufFile, config: dict[str, Any], file: str, progress: Callable[[int, int], None] | None
) -> tuple[dict[str, np.ndarray], dict[str, Blocks]]:
    """Every tensor, dequantized one at a time (peak memory: the float32 result + one tensor), and
    the blocks of those a packed matrix takes as they are."""
    expected = {e.gguf_name: e for e in _expected_tensors(config)}
    present = {t.name for t in reader.tensors}
    for e in expected.values():
        if e.gguf_name not in present:
            raise CheckpointError(f"{file}: tensor {e.gguf_name!r} ({e.hf_name}) is missing")
    tensors: dict[str, np.ndarray] = {}
    native: dict[str, Blocks] = {}
    total = len(reader.tensors)
    for done, tensor in enumerate(reader.tensors, 1):
        if tensor.name == "rope_freqs.weight":  # already read into config["rope_scaling"]
            continue
        hf_name = _hf_name(tensor.name, file)
        if tensor.name not in expected:
            raise CheckpointError(
                f"{file}: tensor {tensor.name!r} ({hf_name}) is not expected by "
                f"a {config['architectures'][0]} with this metadata"
            )
        shape = tuple(int(n) for n in reversed(tensor.shape))
        if shape != expected[tensor.name].shape:
            raise CheckpointError(
                f"{file}: tensor {tensor.name!r} has shape {shape}, the metadata implies {expected[tensor.name].shape}"
            )
        tensors[hf_name], blocks = _convert(tensor, config, file)
        if blocks is not None:
            native[hf_name] = blocks
        if progress is not None:
            progress(done, total)
    return tensors, native


def read_gguf(
    file: str, progress: Callable[[int, int], None] | None = None
) -> tuple[dict[str, Any], dict[str, np.ndarray], tuple[int, ...], dict[str, Blocks]]:
    """Read a Llama / Mistral / Qwen2 / Qwen3 GGUF file completely, as fdcore's loader reads a directory.

    Returns ``(config, tensors, eos_ids, blocks)``:

    - ``config``: a ``config.json``-style dict synthesized from the metadata (``architectures``,
      ``model_type``, ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
      ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``vocab_size``,
      ``max_position_embeddings``, ``rms_norm_eps``, ``rope_theta``, ``hidden_act`` ("silu"),
      ``tie_word_embeddings`` (no ``output.weight`` tensor), ``attention_bias`` (llama, mistral,
      qwen3: the file has q/k/v/o biases), ``mlp_bias`` (llama: the file has MLP biases), and
      where the file has them ``rope_scaling`` (HF's older spelling: rope_type linear / yarn from
      metadata, llama3 from a ``rope_freqs`` tensor), ``sliding_window`` (qwen: with
      ``use_sliding_window`` and ``layer_types`` all "sliding_attention"), ``bos_token_id``, ``eos_token_id``).
      Every key is one fdcore's ``ModelArgs.from_config`` reads or ignores.
    - ``tensors``: HF name -> contiguous float32 numpy array in HF layout (``[out, in]`` for
      projections): ``model.embed_tokens.weight``, ``model.norm.weight``, ``lm_head.weight``
      (only when not tied), ``model.layers.N.{input_layernorm, post_attention_layernorm}.weight``,
      ``model.layers.N.self_attn.{q,k,v,o}_proj.weight``, ``...{q,k,v}_proj.bias`` (qwen2, or
      with attention_bias, then ``o_proj.bias`` too), ``...self_attn.{q,k}_norm.weight`` (qwen3),
      ``model.layers.N.mlp.{gate,up,down}_proj.weight`` (``.bias`` with mlp_bias). Quantized
      tensors are dequantized (one at a time) and llama files' q/k rows (and biases) are
      un-permuted back to HF's rotary layout. A tied model has no ``lm_head.weight``: the model
      uses ``model.embed_tokens.weight``.
    - ``eos_ids``: the eos token id followed by the end-of-turn / end-of-message ids when the file
      names them (deduplicated); empty when it names none.
    - ``blocks``: HF name -> :class:`~fdcore.checkpoint.ggml_blocks.Blocks` for each projection or
      embedding the file holds as Q8_0, Q4_0, Q4_1 or Q4_K (the same rows as its float32 array): what a
      wint8 / wint4 matrix packs level for level instead of quantizing the float32 array again.

    ``progress(done, total)`` is called after each tensor when given.
    Raises CheckpointError (naming the file and the key or tensor) for anything not implemented
    or inconsistent: unknown architecture, unsupported tensor type, missing or unexpected
    tensor, wrong shape, missing metadata key, an unsupported rope scaling.
    """
    reader = open_gguf(file)
    meta = Metadata(reader, file)
    config = _config(meta, {t.name: t for t in reader.tensors})
    tensors, blocks = _read_tensors(reader, config, file, progress)
    return config, tensors, _eos_ids(meta), blocks


def read_gguf_config(file: str) -> tuple[dict[str, Any], tuple[int, ...]]:
    """``(config, eos_ids)`` as :func:`read_gguf` gives them, without reading any tensor data
    (for the engine, which needs the limits and eos ids but not the weights)."""
    reader = open_gguf(file)
    meta = Metadata(reader, file)
    return _config(meta, {t.name: t for t in reader.tensors}), _eos_ids(meta)
