"""fdcore's own Paddle C++ operators (this directory's ``.cc`` files, declared in ``kernels.h``).

``operators()`` gives them by name, built for this CPU on first use (``build.py``; ``fdcore build-kernels``
and a tree's supervisor build them before any actor starts) and registered with Paddle. A build that fails
raises :class:`KernelBuildError` naming the compiler's complaint; the Python path (slower, the same
results) runs only when asked for: ``model.kernels = "python"`` (``FDCORE_NO_KERNELS=1`` in the workers'
environment), and then ``operators()`` is None.

The operators: ``attention_block`` reads the KV cache's blocks in place (rotary and the cache write folded
in); ``add_rms_norm`` and ``silu_mul`` fuse a layer's small ops; ``gumbel_sample`` draws tokens
(fdcore.models.sampling); the ``linear_*`` products multiply by the packed matrices of fdcore.models.llama;
``decoder`` runs every decoder layer of a step in one call (decoder.cc). The process-wide settings
(weight prefetch, AMX tiles) are plain C functions reached through ctypes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fdcore import envs
from fdcore.models.kernels.build import HERE, KernelBuildError, build, kernel_dir, read_sources
from fdcore.models.kernels.cpu import (
    ISA_VARIABLE,
    KERNEL_PATHS,
    capped_at_avx2,
    cpu_flags,
    int8_group_rows,
    kernel_flags,
    kernel_path,
    missing_cpu_feature,
    needed_cpu_feature,
)

__all__ = [
    "DECODER_KINDS",
    "DECODER_META",
    "DECODER_SLOTS",
    "HERE",
    "ISA_VARIABLE",
    "KERNEL_PATHS",
    "KernelBuildError",
    "Operators",
    "attention_rounds_rows",
    "bf16_tiles",
    "build",
    "capped_at_avx2",
    "cpu_flags",
    "decoder_layers",
    "gumbel_sample",
    "int8_group_rows",
    "kernel_dir",
    "kernel_flags",
    "kernel_path",
    "linear_bf16",
    "linear_bf16_swiglu",
    "linear_f32",
    "linear_int4",
    "linear_int8",
    "missing_cpu_feature",
    "needed_cpu_feature",
    "operators",
    "read_sources",
    "set_bf16_tiles",
    "set_weight_prefetch",
    "weight_prefetch",
]

_loaded: dict[str, Any] = {}

# The one-call decoder's contract, mirrored from kernels.h (a test reads the header and compares):
DECODER_KINDS = ("float32", "bfloat16", "int8", "int4")  # enum Kind: how every layer's projections are packed
DECODER_SLOTS = (
    "in_norm",
    "qkv",
    "qkv_scales",
    "qkv_bias",
    "o",
    "o_scales",
    "o_bias",
    "post_norm",
    "gate_up",
    "gate_up_scales",
    "gate_up_bias",
    "down",
    "down_scales",
    "down_bias",
    "q_norm",
    "k_norm",
)  # enum Slot: a layer's tensors in `weights`, in this order
DECODER_META = ("qkv", "o", "gate_up", "down", "window")  # kMeta: a layer's `meta` (its products' rows, window)


@dataclass(frozen=True)
class Operators:
    """The compiled operators, each a Python function over Paddle tensors."""

    gumbel_sample: Callable
    """``(logits, keys, inv_temperature, allowed=None)``: a token a row by Gumbel-max; ``allowed``: [rows,
    (vocab + 31) / 32] int32 bits of the tokens each row may draw, or None."""
    add_rms_norm: Callable
    """``(hidden, delta, weight, eps)``: (hidden + delta, its RMSNorm times weight)."""
    silu_mul: Callable
    """``(gate_up)``: silu(gate) * up of [T, 2 I] -> [T, I]."""
    attention_block: Callable
    """``(qkv, cos, sin, slots, k_cache, v_cache, tables, lengths, q_norm, k_norm, num_heads, scale, window,
    norm_eps)``: rotary, the cache write and paged attention of one layer."""
    linear_bf16: Callable
    """``(x, packed, rows)``: x [M, K] float32 (rounded to bfloat16 here) or bfloat16 (rows already rounded)
    times a bfloat16 weight packed by fdcore.models.matrices.Bf16Matrix, float32 [M, rows]; AVX512-BF16 only."""
    linear_bf16_swiglu: Callable
    """``(x, packed, bias, rows)``: silu(x gate^T + gate bias) * (x up^T + up bias), [M, rows / 2] in x's dtype,
    for a gated bfloat16 weight (Bf16Matrix.pack_gated); bias [rows] or an empty tensor. AVX512-BF16 only."""
    linear_int8: Callable
    """``(x, packed, scales, rows)``: x [M, K] float32 times an int8 weight packed by Int8Matrix (per-row
    scales), float32 [M, rows]; AVX512-VNNI or AVX2 (kernel_path)."""
    linear_int4: Callable
    """``(x, packed, rows)``: x [M, K] float32 times a 4-bit weight packed by Int4Matrix (llama.cpp's Q4_1
    blocks), float32 [M, rows]; AVX512-VNNI or AVX2."""
    linear_f32: Callable
    """``(x, packed, rows)``: x [M, K] float32 times a float32 weight packed by F32Matrix, float32 [M, rows]."""
    decoder: Callable
    """``(hidden, cos, sin, slots, tables, lengths, last_rows, k_caches, v_caches, weights, final_norm, meta,
    kind, num_heads, scale, eps, group=None, head=None)``: every decoder layer of a step in one call; (the
    final norm's output, the head's logits of ``last_rows`` or None). ``group``: (segment tensor, rank,
    world, capacity, timeout) of a tensor-parallel rank; ``head``: ([packed, scales, bias], kind, rows)."""


def operators() -> Operators | None:
    """The operators, built here if need be and registered with Paddle; None under FDCORE_NO_KERNELS."""
    if "ops" not in _loaded:
        _loaded["ops"] = _load()
    return _loaded["ops"]


def gumbel_sample() -> Callable | None:
    ops = operators()
    return ops and ops.gumbel_sample


def decoder_layers() -> Callable | None:
    ops = operators()
    return ops and ops.decoder


def linear_bf16() -> Callable | None:
    ops = operators()
    return ops and ops.linear_bf16


def linear_bf16_swiglu() -> Callable | None:
    ops = operators()
    return ops and ops.linear_bf16_swiglu


def linear_int8() -> Callable | None:
    ops = operators()
    return ops and ops.linear_int8


def linear_int4() -> Callable | None:
    ops = operators()
    return ops and ops.linear_int4


def linear_f32() -> Callable | None:
    """The float32 product, or None where it is not built or the CPU has neither AVX-512F nor AVX2: float32 is
    never refused, its projections then stay Paddle tensors (MKL's matmul)."""
    if kernel_path("float32") is None:
        return None
    ops = operators()
    return ops and ops.linear_f32


def set_weight_prefetch(on: bool) -> bool:
    """Whether the float32, int8 and int4 kernels prefetch the weights a one-row pass streams (it helps on one
    machine and day and hurts on another, so LlamaModel measures it at load). The setting is the process's;
    it changes no result. False when the kernels are not built here."""
    library = _library()
    if library is None:
        return False
    library.fdcore_set_weight_prefetch(int(on))
    return True


def weight_prefetch() -> bool | None:
    """The prefetch setting (set_weight_prefetch); None when the kernels are not built here."""
    library = _library()
    return None if library is None else bool(library.fdcore_weight_prefetch())


def set_bf16_tiles(on: bool) -> bool:
    """Whether the bfloat16 kernel may run on AMX tiles (on by default where the CPU has AMX-BF16 and the OS
    grants the tile state): a setting to measure and test the AVX512-BF16 path on an AMX CPU. The two paths
    round differently, so a serving process never switches. False when the kernels are not built."""
    library = _library()
    if library is None:
        return False
    library.fdcore_set_bf16_tiles(int(on))
    return True


def bf16_tiles() -> bool:
    """Whether bfloat16 products (of an inner dimension a multiple of 32) run on AMX tiles in this process."""
    library = _library()
    return library is not None and bool(library.fdcore_bf16_tiles())


def attention_rounds_rows(groups: int, head_dim: int, block_size: int, window: int) -> bool:
    """Whether the one-call decoder's attention over a bfloat16 cache hands a bfloat16 o product its rows already
    rounded (attention_tiles.h: ``groups`` query heads a KV head, ``block_size``-token blocks, ``window`` 0 for
    none) in this process, as a measure of the step's products alone must know."""
    import ctypes

    library = _library()
    return library is not None and bool(
        library.fdcore_attention_rounds_rows(
            ctypes.c_int64(groups), ctypes.c_int64(head_dim), ctypes.c_int64(block_size), ctypes.c_int64(window)
        )
    )


def _library():
    """The built library for ctypes (its plain C functions: settings, not operators), or None."""
    if not operators():
        return None
    if "ctypes" not in _loaded:
        import ctypes

        _loaded["ctypes"] = ctypes.CDLL(_loaded["library"])  # (dlopen: the copy Paddle loaded, not a second)
    return _loaded["ctypes"]


def _load() -> Operators | None:
    """Build (if need be) and register the library; its operators as Python functions."""
    if envs.no_kernels():
        return None
    library = build()
    # NOTE: registering the built library directly takes ~20 ms; Paddle's own load() re-runs a setup.py to
    # decide there is nothing to build (~1.7 s of every worker start, i.e. of every restart's pause).
    from paddle.utils.cpp_extension import load_op_meta_info_and_register_op

    load_op_meta_info_and_register_op(library)
    _loaded["library"] = library
    return _bind()


def _bind() -> Operators:
    # (long: one binding per operator, beside its signature: apart, a name and its arguments would drift)
    import paddle
    from paddle import _C_ops

    run = _C_ops._run_custom_op
    every_token = paddle.empty([0], dtype="int32")
    no_group = paddle.empty([0], dtype="uint8")
    no_head = [paddle.empty([0], dtype="float32")] * 3

    def gumbel(logits, keys, inv_temperature, allowed=None):
        return run("fdcore_gumbel_sample", logits, keys, inv_temperature, every_token if allowed is None else allowed)[
            0
        ]

    def attention_block(
        qkv, cos, sin, slots, k_cache, v_cache, tables, lengths, q_norm, k_norm, num_heads, scale, window, norm_eps
    ):
        return run(
            "fdcore_attention_block",
            qkv,
            cos,
            sin,
            slots,
            k_cache,
            v_cache,
            tables,
            lengths,
            q_norm,
            k_norm,
            int(num_heads),
            float(scale),
            int(window),
            float(norm_eps),
        )[0]

    def decoder(
        hidden,
        cos,
        sin,
        slots,
        tables,
        lengths,
        last_rows,
        k_caches,
        v_caches,
        weights,
        final_norm,
        meta,
        kind,
        num_heads,
        scale,
        eps,
        group=None,
        head=None,
    ):
        segment, rank, world, capacity, timeout = group or (no_group, 0, 1, 0, 0.0)
        head_tensors, head_kind, head_rows = head or (no_head, -1, 0)
        normed, logits = run(
            "fdcore_decoder_layers",
            hidden,
            cos,
            sin,
            slots,
            tables,
            lengths,
            last_rows,
            k_caches,
            v_caches,
            weights,
            final_norm,
            head_tensors,
            segment,
            list(meta),
            int(kind),
            int(num_heads),
            float(scale),
            float(eps),
            [int(rank), int(world), int(capacity)],
            float(timeout),
            int(head_kind),
            int(head_rows),
        )
        return normed, (logits if head else None)

    return Operators(
        gumbel_sample=gumbel,
        add_rms_norm=lambda hidden, delta, weight, eps: run("fdcore_add_rms_norm", hidden, delta, weight, float(eps)),
        silu_mul=lambda gate_up: run("fdcore_silu_mul", gate_up)[0],
        attention_block=attention_block,
        linear_bf16=lambda x, packed, rows: run("fdcore_linear_bf16", x, packed, int(rows))[0],
        linear_bf16_swiglu=lambda x, packed, bias, rows: run("fdcore_linear_bf16_swiglu", x, packed, bias, int(rows))[
            0
        ],
        linear_int8=lambda x, packed, scales, rows: run("fdcore_linear_int8", x, packed, scales, int(rows))[0],
        linear_int4=lambda x, packed, rows: run("fdcore_linear_int4", x, packed, int(rows))[0],
        linear_f32=lambda x, packed, rows: run("fdcore_linear_f32", x, packed, int(rows))[0],
        decoder=decoder,
    )
