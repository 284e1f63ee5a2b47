"""fdcore's own Paddle C++ operators, compiled on first use (``paddle.utils.cpp_extension``).

``attention_block`` reads the KV cache's blocks in place (with rotary and the
cache write folded in): the Python path gathers every decoding sequence's
blocks into a contiguous copy per layer and then runs three Paddle ops, which at
batch 64 cost ~2 ms per layer; the operator does it in ~0.2 ms. ``add_rms_norm``
and ``silu_mul`` fuse the rest of a layer's small ops; ``gumbel_sample`` draws
tokens (see fdcore.sampling). The build (~15 s, once per CPU model and source
version) goes to ``$FDCORE_KERNEL_DIR`` (default ``~/.cache/fdcore-kernels``)
under a file lock, so concurrent processes build it once. Anything that goes
wrong (no compiler, no Paddle headers) is reported once and the model falls
back to the Python path: slower, same results.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = [os.path.join(HERE, name) for name in ("paged_attention.cc", "linear_bf16.cc", "linear_int8.cc",
                                                  "linear_int4.cc", "linear_f32.cc", "decoder.cc")]
_loaded: dict[str, object] = {}


def kernel_dir(sources: dict[str, bytes] | None = None) -> str:
    """The build directory of these sources (default: as they are now) on this CPU and Paddle."""
    root = os.environ.get("FDCORE_KERNEL_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "fdcore-kernels")
    import paddle

    digest = hashlib.sha256(paddle.__version__.encode() + cpu_flags().encode())
    for text in (sources or read_sources()).values():
        digest.update(text)
    return os.path.join(root, digest.hexdigest()[:16])


def read_sources() -> dict[str, bytes]:
    """The operators' sources, read once: the build compiles this snapshot, never the files again,
    so an edit made while it builds cannot end up in a directory named after other sources."""
    sources = {}
    for path in SOURCES:
        with open(path, "rb") as f:
            sources[os.path.basename(path)] = f.read()
    return sources


def cpu_flags() -> str:
    """The CPU's feature flags: the build uses -march=native, so a library built on one CPU is
    kept apart from another's (loading it on an older CPU would die of SIGILL)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def gumbel_sample():
    """The compiled Gumbel-max sampling operator, or None when it cannot be built here."""
    ops = _ops()
    return ops and ops[0]


def fused_ops():
    """(add_rms_norm, silu_mul, attention_block) compiled, or None when they cannot be built here."""
    ops = _ops()
    return ops and ops[1:4]


def decoder_layers():
    """``decoder_layers(hidden, cos, sin, slots, tables, lengths, k_caches, v_caches, weights, final_norm,
    meta, kind, num_heads, scale, eps)``: every decoder layer of a step in one call (decoder.cc), the
    final norm's output; None when not built here."""
    ops = _ops()
    return ops and ops[8]


def linear_bf16():
    """``linear(x, packed, rows)``: x [M, K] float32 times a bfloat16 weight of ``rows`` outputs packed
    by fdcore.models.llama.Bf16Matrix, float32 out [M, rows]; AVX512-BF16 CPUs only (missing_cpu_feature).
    None when not built here."""
    ops = _ops()
    return ops and ops[4]


def linear_int8():
    """``linear(x, packed, scales, rows)``: x [M, K] float32 times an int8 weight of ``rows`` outputs
    packed by fdcore.models.llama.Int8Matrix (per-row scales), float32 out [M, rows]; AVX512-VNNI
    CPUs only. None when not built here."""
    ops = _ops()
    return ops and ops[5]


def linear_int4():
    """``linear(x, packed, rows)``: x [M, K] float32 times a 4-bit weight of ``rows`` outputs packed by
    fdcore.models.llama.Int4Matrix (per row and block of 32: float16 scale and minimum, as llama.cpp's
    Q4_1), float32 out [M, rows]; AVX512-VNNI CPUs only. None when not built here."""
    ops = _ops()
    return ops and ops[6]


F32_KERNEL_FEATURE = "avx512f"  # the /proc/cpuinfo flag linear_f32 needs (without it: MKL, no refusal)


def linear_f32():
    """``linear(x, packed, rows)``: x [M, K] float32 times a float32 weight of ``rows`` outputs packed by
    fdcore.models.llama.F32Matrix, float32 out [M, rows]. None when not built here or on a CPU without
    AVX-512F: float32 is never refused, its projections then stay Paddle tensors (MKL's matmul)."""
    if F32_KERNEL_FEATURE not in cpu_flags().split():
        return None
    ops = _ops()
    return ops and ops[7]


# The CPU feature each low-precision kernel is built on: (/proc/cpuinfo flag, its usual name).
NEEDED_CPU_FEATURE = {"bfloat16": ("avx512_bf16", "AVX512-BF16"), "wint8": ("avx512_vnni", "AVX512-VNNI"),
                      "wint4": ("avx512_vnni", "AVX512-VNNI")}


def missing_cpu_feature(kind: str) -> str | None:
    """The feature (usual name) the kernel for ``kind`` needs and this CPU lacks; None when nothing
    is missing (or ``kind`` needs no kernel of its own, e.g. float32)."""
    needed = NEEDED_CPU_FEATURE.get(kind)
    return needed[1] if needed and needed[0] not in cpu_flags().split() else None


def _ops():
    if "ops" not in _loaded:
        _loaded["ops"] = _build()
    return _loaded["ops"]


def _snapshot(sources: dict[str, bytes], directory: str) -> list[str]:
    """Write the sources read for the directory's name into it; their paths, to compile."""
    os.makedirs(os.path.join(directory, "src"), exist_ok=True)
    paths = []
    for name, text in sources.items():
        paths.append(os.path.join(directory, "src", name))
        with open(paths[-1], "wb") as f:
            f.write(text)
    return paths


@contextlib.contextmanager
def _stdout_to_stderr():
    """Paddle's builder prints progress on stdout (and its compiler subprocess inherits fd 1):
    keep the caller's stdout clean for its own output."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _build():
    if os.environ.get("FDCORE_NO_KERNELS"):
        return None
    try:
        sources = read_sources()
        directory = kernel_dir(sources)
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, ".lock"), "w") as lock, _stdout_to_stderr():
            fcntl.flock(lock, fcntl.LOCK_EX)
            library = os.path.join(directory, "fdcore_kernels", "fdcore_kernels.so")
            ready = os.path.join(directory, "ready")
            if not os.path.exists(ready):
                from paddle.utils.cpp_extension import load

                load(name="fdcore_kernels", sources=_snapshot(sources, directory), build_directory=directory,
                     extra_cxx_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno",
                                       "-fno-trapping-math"], extra_ldflags=["-fopenmp"], verbose=False)
                open(ready, "w").close()
            else:
                # NOTE: registering the built library directly takes ~20 ms; paddle's load() re-runs
                # its setup.py to decide there is nothing to build (~1.7 s of every worker start,
                # i.e. of every worker restart's pause).
                from paddle.utils.cpp_extension import load_op_meta_info_and_register_op

                load_op_meta_info_and_register_op(library)
        from paddle import _C_ops

        def gumbel(logits, keys, inv_temperature):
            return _C_ops._run_custom_op("fdcore_gumbel_sample", logits, keys, inv_temperature)[0]

        def add_rms_norm(hidden, delta, weight, eps):
            return _C_ops._run_custom_op("fdcore_add_rms_norm", hidden, delta, weight, float(eps))

        def silu_mul(gate_up):
            return _C_ops._run_custom_op("fdcore_silu_mul", gate_up)[0]

        def attention_block(qkv, cos, sin, slots, k_cache, v_cache, tables, lengths, q_norm, k_norm,
                            num_heads, scale, window, norm_eps):
            return _C_ops._run_custom_op("fdcore_attention_block", qkv, cos, sin, slots, k_cache, v_cache,
                                         tables, lengths, q_norm, k_norm, int(num_heads), float(scale),
                                         int(window), float(norm_eps))[0]

        def linear(x, packed, rows):
            return _C_ops._run_custom_op("fdcore_linear_bf16", x, packed, int(rows))[0]

        def linear_q8(x, packed, scales, rows):
            return _C_ops._run_custom_op("fdcore_linear_int8", x, packed, scales, int(rows))[0]

        def linear_q4(x, packed, rows):
            return _C_ops._run_custom_op("fdcore_linear_int4", x, packed, int(rows))[0]

        def linear_f32(x, packed, rows):
            return _C_ops._run_custom_op("fdcore_linear_f32", x, packed, int(rows))[0]

        def decoder(hidden, cos, sin, slots, tables, lengths, k_caches, v_caches, weights, final_norm, meta, kind,
                    num_heads, scale, eps):
            return _C_ops._run_custom_op("fdcore_decoder_layers", hidden, cos, sin, slots, tables, lengths,
                                         k_caches, v_caches, weights, final_norm, list(meta), int(kind),
                                         int(num_heads), float(scale), float(eps))[0]

        return (gumbel, add_rms_norm, silu_mul, attention_block, linear, linear_q8, linear_q4, linear_f32,
                decoder)
    except Exception as exc:  # a missing compiler must not stop serving
        sys.stderr.write(f"fdcore: C++ operators unavailable ({type(exc).__name__}: {exc}); "
                         "using the slower Python path\n")
        return None
