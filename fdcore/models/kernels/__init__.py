"""fdcore's own Paddle C++ operators, compiled on first use (``paddle.utils.cpp_extension``).

``attention_block`` reads the KV cache's blocks in place (with rotary and the
cache write folded in): the Python path gathers every decoding sequence's
blocks into a contiguous copy per layer and then runs three Paddle ops, which at
batch 64 cost ~2 ms per layer; the operator does it in ~0.2 ms. ``add_rms_norm``
and ``silu_mul`` fuse the rest of a layer's small ops; ``gumbel_sample`` draws
tokens (see fdcore.sampling). The build (2-3 min of one core's time, once per
CPU model and source version; ``fdcore build-kernels``, and a tree's supervisor
before it starts any actor) goes to ``$FDCORE_KERNEL_DIR`` (default
``~/.cache/fdcore-kernels``) under a file lock, so concurrent processes build it
once, and atomically (a killed build leaves nothing behind). A build that fails
is an error naming the compiler's complaint; the Python path (slower, the same
results) runs only when asked for: ``model.kernels = "python"``
(``FDCORE_NO_KERNELS=1`` in the workers' environment).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import os
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = [os.path.join(HERE, name) for name in ("paged_attention.cc", "linear_bf16.cc", "linear_int8.cc",
                                                  "linear_int4.cc", "linear_f32.cc", "decoder.cc",
                                                  "exp2_bf16.h", "line_buffer.h", "bf16_bits.h")]
# (the headers: in the snapshot the build keys on, not compiled themselves)
_loaded: dict[str, object] = {}


def kernel_dir(sources: dict[str, bytes] | None = None) -> str:
    """The build directory of these sources (default: as they are now) on this CPU and Paddle."""
    root = os.environ.get("FDCORE_KERNEL_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "fdcore-kernels")
    import paddle

    digest = hashlib.sha256(paddle.__version__.encode() + cpu_flags().encode() + " ".join(_march()).encode())
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


ISA_VARIABLE = "FDCORE_ISA"  # "avx2": build for AVX2 + FMA only, as on a CPU without AVX-512
AVX2_MARCH = "x86-64-v3"     # AVX2, FMA, F16C, BMI1/2: what every kernel's AVX2 path needs


def capped_at_avx2() -> bool:
    """Whether ``FDCORE_ISA=avx2`` asks for the AVX2 paths on a CPU that has more (to run and
    measure them on an AVX-512 machine); any other value is an error naming the variable."""
    value = os.environ.get(ISA_VARIABLE, "").strip().lower()
    if value not in ("", "native", "avx2"):
        raise ValueError(f"{ISA_VARIABLE}={value!r}: 'native' (the default) or 'avx2'")
    return value == "avx2"


def kernel_flags() -> set[str]:
    """The CPU features the kernels are built for: /proc/cpuinfo's, without the AVX-512 and AMX ones
    under FDCORE_ISA=avx2."""
    flags = set(cpu_flags().split())
    if capped_at_avx2():
        flags = {flag for flag in flags if not flag.startswith(("avx512", "amx"))}
    return flags


def _march() -> list[str]:
    return [f"-march={AVX2_MARCH}", "-mtune=native"] if capped_at_avx2() else ["-march=native"]


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
    """``linear(x, packed, rows)``: x [M, K] float32 (rounded to bfloat16 here) or bfloat16 (taken as it is: rows
    already rounded, as the one-call decoder's norms give them) times a bfloat16 weight of ``rows`` outputs packed
    by fdcore.models.llama.Bf16Matrix, float32 out [M, rows]; AVX512-BF16 CPUs only (missing_cpu_feature).
    None when not built here."""
    ops = _ops()
    return ops and ops[4]


def linear_bf16_swiglu():
    """``swiglu(x, packed, bias, rows)``: silu(x gate^T + gate bias) * (x up^T + up bias), [M, rows / 2] in x's dtype
    (float32, or bfloat16: the activations rounded as the down product takes them), for a gated bfloat16 weight
    (fdcore.models.llama.Bf16Matrix.pack_gated: its gate and up, rows together); bias [rows] (the gate's, then up's)
    or an empty tensor. AVX512-BF16 CPUs only. None when not built here."""
    ops = _ops()
    return ops and ops[9]


def linear_int8():
    """``linear(x, packed, scales, rows)``: x [M, K] float32 times an int8 weight of ``rows`` outputs
    packed by fdcore.models.llama.Int8Matrix (per-row scales), float32 out [M, rows]; AVX512-VNNI or
    AVX2 (kernel_path). None when not built here."""
    ops = _ops()
    return ops and ops[5]


def linear_int4():
    """``linear(x, packed, rows)``: x [M, K] float32 times a 4-bit weight of ``rows`` outputs packed by
    fdcore.models.llama.Int4Matrix (per row and block of 32: float16 scale and minimum, as llama.cpp's
    Q4_1), float32 out [M, rows]; AVX512-VNNI or AVX2 (kernel_path). None when not built here."""
    ops = _ops()
    return ops and ops[6]


def set_weight_prefetch(on: bool) -> bool:
    """Whether the float32, int8 and int4 kernels prefetch the weights a one-row pass streams (linear_int8.cc: it
    helps on one machine and day and hurts on another, so LlamaModel measures it at load). The setting is
    the process's; it changes no result. False when the kernels are not built here."""
    library = _library()
    if library is None:
        return False
    library.fdcore_set_weight_prefetch(int(on))
    return True


def weight_prefetch() -> bool | None:
    """The float32, int8 and int4 kernels' prefetch setting (set_weight_prefetch); None when they are not built here."""
    library = _library()
    return None if library is None else bool(library.fdcore_weight_prefetch())


def set_bf16_tiles(on: bool) -> bool:
    """Whether the bfloat16 kernel may run on AMX tiles (linear_bf16.cc; on by default where the CPU has AMX-BF16
    and the OS grants the tile state): a setting to measure and test the AVX512-BF16 path on an AMX CPU. The
    two paths round differently, so a serving process never switches. False when the kernels are not built."""
    library = _library()
    if library is None:
        return False
    library.fdcore_set_bf16_tiles(int(on))
    return True


def bf16_tiles() -> bool:
    """Whether bfloat16 products (of an inner dimension a multiple of 32) run on AMX tiles in this process."""
    library = _library()
    return library is not None and bool(library.fdcore_bf16_tiles())


def _library():
    """The built library for ctypes (its plain C functions: settings, not operators), or None."""
    if not _ops():
        return None
    if "ctypes" not in _loaded:
        import ctypes

        _loaded["ctypes"] = ctypes.CDLL(_loaded["library"])  # (dlopen: the copy Paddle loaded, not a second)
    return _loaded["ctypes"]


# The /proc/cpuinfo flags each kernel needs, by path (the first the CPU has is built), with their usual name.
KERNEL_PATHS = {
    "float32": ((("avx512f",), "AVX-512F"), (("avx2", "fma"), "AVX2")),
    "bfloat16": ((("avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16"), "AMX-BF16"),
                 (("avx512f", "avx512bw", "avx512_bf16"), "AVX512-BF16")),
    "wint8": ((("avx512f", "avx512bw", "avx512_vnni"), "AVX512-VNNI"), (("avx2", "fma", "f16c"), "AVX2")),
    "wint4": ((("avx512f", "avx512bw", "avx512_vnni"), "AVX512-VNNI"), (("avx2", "fma", "f16c"), "AVX2")),
}


def kernel_path(kind: str) -> str | None:
    """The path (usual name) the kernel for ``kind`` runs on this CPU; None when it has none."""
    flags = kernel_flags()
    for needed, name in KERNEL_PATHS[kind]:
        if flags.issuperset(needed):
            return name
    return None


def attention_rounds_rows(groups: int, head_dim: int, block_size: int, window: int) -> bool:
    """Whether the one-call decoder's attention over a bfloat16 cache hands a bfloat16 o product its rows already
    rounded (paged_attention.cc's tiles: ``groups`` query heads a KV head, ``block_size``-token blocks, ``window``
    0 for none) in this process, as a measure of the step's products alone must know."""
    import ctypes

    library = _library()
    return library is not None and bool(library.fdcore_attention_rounds_rows(
        ctypes.c_int64(groups), ctypes.c_int64(head_dim), ctypes.c_int64(block_size), ctypes.c_int64(window)))


def int8_group_rows() -> int:
    """The output rows of one packed group of the int8 kernel (linear_int8.cc's kGroup for the path
    built here): 64 for AVX512-VNNI (4 x 16-lane vectors), 32 for AVX2, whose 16 registers hold 32
    rows' accumulators. A group's bytes are contiguous, so each thread streams whole groups."""
    return 64 if kernel_path("wint8") == "AVX512-VNNI" else 32


def needed_cpu_feature(kind: str) -> tuple[str, str]:
    """The least the kernel for ``kind`` needs: (its /proc/cpuinfo flags, joined; its usual name)."""
    needed, name = KERNEL_PATHS[kind][-1]
    return " ".join(needed), name


def linear_f32():
    """``linear(x, packed, rows)``: x [M, K] float32 times a float32 weight of ``rows`` outputs packed by
    fdcore.models.llama.F32Matrix, float32 out [M, rows]. None when not built here or on a CPU without
    AVX-512F or AVX2: float32 is never refused, its projections then stay Paddle tensors (MKL's matmul)."""
    if kernel_path("float32") is None:
        return None
    ops = _ops()
    return ops and ops[7]


def missing_cpu_feature(kind: str) -> str | None:
    """The feature (usual name) the kernel for ``kind`` needs and this CPU lacks; None when nothing
    is missing (or ``kind`` needs no kernel of its own: float32, which falls back to MKL)."""
    if kind not in KERNEL_PATHS or kind == "float32":
        return None
    return None if kernel_path(kind) else needed_cpu_feature(kind)[1]


def _ops():
    if "ops" not in _loaded:
        _loaded["ops"] = _build()
    return _loaded["ops"]


def _snapshot(sources: dict[str, bytes], directory: str) -> list[str]:
    """Write the sources read for the directory's name into it; the paths of those to compile (not the headers)."""
    os.makedirs(os.path.join(directory, "src"), exist_ok=True)
    paths = []
    for name, text in sources.items():
        path = os.path.join(directory, "src", name)
        with open(path, "wb") as f:
            f.write(text)
        if name.endswith(".cc"):
            paths.append(path)
    return paths


class KernelBuildError(RuntimeError):
    """fdcore's C++ operators could not be built here (the message names the compiler's complaint)."""


def library_path(directory: str) -> str:
    return os.path.join(directory, "fdcore_kernels", "fdcore_kernels.so")


def build(progress=None) -> str:
    """Build the operators for this CPU unless built already; the library's path. Atomic: the build runs
    in a directory of its own and is renamed into place only once whole, so a build killed half way
    leaves nothing a later one trips over (that one starts afresh). Concurrent builders wait on one lock
    (one builds, the others find it done). ``progress(done, total)`` is called as source files compile.
    A failure raises :class:`KernelBuildError` with the compiler's first error line."""
    sources = read_sources()
    directory = kernel_dir(sources)
    if os.path.exists(os.path.join(directory, "ready")):
        return library_path(directory)
    os.makedirs(os.path.dirname(directory), exist_ok=True)
    with open(directory + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(os.path.join(directory, "ready")):
            _build_into(sources, directory, progress)
    return library_path(directory)


def _build_into(sources: dict[str, bytes], directory: str, progress) -> None:
    """Compile in ``<directory>.building-<pid>``, then rename it to ``directory`` (under the caller's lock)."""
    import shutil

    # a directory of this builder's own: a killed builder's compilers may still write into theirs a while
    building = f"{directory}.building-{os.getpid()}"
    import psutil

    for stale in glob.glob(directory + ".building-*"):
        if not psutil.pid_exists(int(stale.rsplit("-", 1)[1])):
            shutil.rmtree(stale, ignore_errors=True)
    shutil.rmtree(directory, ignore_errors=True)  # (a directory of the old, unlocked scheme, never finished)
    compiled = _snapshot(sources, building)
    log = os.path.join(os.path.dirname(directory), os.path.basename(directory) + ".log")
    watch = _ProgressWatch(building, len(compiled), progress)
    try:
        with open(log, "w") as output, _output_to(output.fileno()), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="No ccache found")
            from paddle.utils.cpp_extension import load

            load(name="fdcore_kernels", sources=compiled, build_directory=building,
                 extra_cxx_cflags=["-O3", *_march(), "-fopenmp", "-fno-math-errno", "-fno-trapping-math"],
                 extra_ldflags=["-fopenmp"], verbose=False)
    except BaseException as exc:
        shutil.rmtree(building, ignore_errors=True)
        raise KernelBuildError(_complaint(log, exc)) from None
    finally:
        watch.stop()
    _loaded["registered"] = True  # (load() registered them with this process's Paddle)
    open(os.path.join(building, "ready"), "w").close()
    os.rename(building, directory)
    os.unlink(log)


def _complaint(log: str, exc: BaseException) -> str:
    """The compiler's first error line in the build's output, else the exception (one line)."""
    try:
        with open(log, errors="replace") as f:
            lines = [line.strip() for line in f if "error" in line.lower()]
    except OSError:
        lines = []
    return (lines[0] if lines else f"{type(exc).__name__}: {exc}".splitlines()[0])[:300] + f" (full output: {log})"


class _ProgressWatch:
    """Reports compiled object files as they appear in the build directory (a thread, once a second)."""

    def __init__(self, directory: str, total: int, progress):
        import threading

        self.directory, self.total, self.progress = directory, total, progress
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True) if progress else None
        if self.thread:
            self.thread.start()

    def _run(self) -> None:
        reported = -1
        while not self.done.wait(1.0):
            count = sum(name.endswith(".o") for _, _, files in os.walk(self.directory) for name in files)
            if count != reported:
                reported = count
                self.progress(min(count, self.total), self.total)

    def stop(self) -> None:
        self.done.set()
        if self.thread:
            self.thread.join()


@contextlib.contextmanager
def _output_to(fd: int):
    """The process's stdout and stderr (and so the compiler's) into ``fd`` for a while."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for copy in saved:
            os.close(copy)


def _build():
    """The operators, built here if need be and registered with Paddle; None under FDCORE_NO_KERNELS (the
    Python path, asked for). A build that fails raises: a tree's supervisor builds them before any worker
    starts and stops with the compiler's message, and nothing falls back to the slow path unasked."""
    if os.environ.get("FDCORE_NO_KERNELS"):
        return None
    library = build()
    if not _loaded.get("registered"):  # (a build in this process registered the operators already)
        # NOTE: registering the built library directly takes ~20 ms; paddle's load() re-runs its setup.py
        # to decide there is nothing to build (~1.7 s of every worker start, i.e. of every restart's pause).
        from paddle.utils.cpp_extension import load_op_meta_info_and_register_op

        load_op_meta_info_and_register_op(library)
    import paddle
    from paddle import _C_ops

    every_token = paddle.empty([0], dtype="int32")

    def gumbel(logits, keys, inv_temperature, allowed=None):
        """``allowed``: [rows, (vocab + 31) / 32] int32 bits of the tokens each row may draw, or None."""
        return _C_ops._run_custom_op("fdcore_gumbel_sample", logits, keys, inv_temperature,
                                     every_token if allowed is None else allowed)[0]

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

    def linear_swiglu(x, packed, bias, rows):
        return _C_ops._run_custom_op("fdcore_linear_bf16_swiglu", x, packed, bias, int(rows))[0]

    def linear_q8(x, packed, scales, rows):
        return _C_ops._run_custom_op("fdcore_linear_int8", x, packed, scales, int(rows))[0]

    def linear_q4(x, packed, rows):
        return _C_ops._run_custom_op("fdcore_linear_int4", x, packed, int(rows))[0]

    def linear_f32(x, packed, rows):
        return _C_ops._run_custom_op("fdcore_linear_f32", x, packed, int(rows))[0]

    no_group = paddle.empty([0], dtype="uint8")

    no_head = [paddle.empty([0], dtype="float32")] * 3

    def decoder(hidden, cos, sin, slots, tables, lengths, last_rows, k_caches, v_caches, weights, final_norm,
                meta, kind, num_heads, scale, eps, group=None, head=None):
        """(the final norm's output, the head's logits of ``last_rows`` or None). ``group``: (segment
        tensor, rank, world, capacity, timeout) of a tensor-parallel rank, or None; ``head``: (its
        [packed, scales, bias] tensors, kind, rows), or None: no logits."""
        segment, rank, world, capacity, timeout = group or (no_group, 0, 1, 0, 0.0)
        head_tensors, head_kind, head_rows = head or (no_head, -1, 0)
        normed, logits = _C_ops._run_custom_op(
            "fdcore_decoder_layers", hidden, cos, sin, slots, tables, lengths, last_rows, k_caches, v_caches,
            weights, final_norm, head_tensors, segment, list(meta), int(kind), int(num_heads), float(scale),
            float(eps), [int(rank), int(world), int(capacity)], float(timeout), int(head_kind), int(head_rows))
        return normed, (logits if head else None)

    _loaded["library"] = library
    return (gumbel, add_rms_norm, silu_mul, attention_block, linear, linear_q8, linear_q4, linear_f32,
            decoder, linear_swiglu)
