"""This CPU's features, and which path each of fdcore's kernels takes on it.

The kernels are built with ``-march=native`` for the CPU at hand (``FDCORE_ISA=avx2`` builds the AVX2 paths on
a CPU that has more, to run and measure them there), so the features come from ``/proc/cpuinfo`` at run time,
never from what another machine had."""

from __future__ import annotations

import platform

from fdcore import envs

ISA_VARIABLE = envs.ISA  # "avx2": build for AVX2 + FMA only, as on a CPU without AVX-512
AVX2_MARCH = "x86-64-v3"  # AVX2, FMA, F16C, BMI1/2: what every kernel's AVX2 path needs

# The /proc/cpuinfo flags each kernel needs, by path (the first the CPU has is built), with their usual name.
KERNEL_PATHS = {
    "float32": ((("avx512f",), "AVX-512F"), (("avx2", "fma"), "AVX2")),
    "bfloat16": (
        (("avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16"), "AMX-BF16"),
        (("avx512f", "avx512bw", "avx512_bf16"), "AVX512-BF16"),
    ),
    "wint8": ((("avx512f", "avx512bw", "avx512_vnni"), "AVX512-VNNI"), (("avx2", "fma", "f16c"), "AVX2")),
    "wint4": ((("avx512f", "avx512bw", "avx512_vnni"), "AVX512-VNNI"), (("avx2", "fma", "f16c"), "AVX2")),
}


def cpu_flags() -> str:
    """The CPU's feature flags, sorted: the build uses -march=native, so a library built on one CPU is kept
    apart from another's (loading it on an older CPU would die of SIGILL)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.processor() or platform.machine()


def capped_at_avx2() -> bool:
    """Whether ``FDCORE_ISA=avx2`` asks for the AVX2 paths on a CPU that has more; any other value than
    "native" or "avx2" is an error naming the variable."""
    value = envs.get(ISA_VARIABLE).strip().lower()
    if value not in ("", "native", "avx2"):
        raise ValueError(f"{ISA_VARIABLE}={value!r}: 'native' (the default) or 'avx2'")
    return value == "avx2"


def kernel_flags() -> set[str]:
    """The CPU features the kernels are built for: /proc/cpuinfo's, without the AVX-512 and AMX ones under
    FDCORE_ISA=avx2."""
    flags = set(cpu_flags().split())
    if capped_at_avx2():
        flags = {flag for flag in flags if not flag.startswith(("avx512", "amx"))}
    return flags


def march() -> list[str]:
    """The compiler's target flags for those features."""
    return [f"-march={AVX2_MARCH}", "-mtune=native"] if capped_at_avx2() else ["-march=native"]


def kernel_path(kind: str) -> str | None:
    """The path (usual name) the kernel for ``kind`` runs on this CPU; None when it has none."""
    flags = kernel_flags()
    for needed, name in KERNEL_PATHS[kind]:
        if flags.issuperset(needed):
            return name
    return None


def needed_cpu_feature(kind: str) -> tuple[str, str]:
    """The least the kernel for ``kind`` needs: (its /proc/cpuinfo flags, joined; its usual name)."""
    needed, name = KERNEL_PATHS[kind][-1]
    return " ".join(needed), name


def missing_cpu_feature(kind: str) -> str | None:
    """The feature (usual name) the kernel for ``kind`` needs and this CPU lacks; None when nothing is missing
    (or ``kind`` needs no kernel of its own: float32, which falls back to MKL)."""
    if kind not in KERNEL_PATHS or kind == "float32":
        return None
    return None if kernel_path(kind) else needed_cpu_feature(kind)[1]


def int8_group_rows() -> int:
    """The output rows of one packed group of the int8 kernel (linear_int8.cc's kGroup for the path built
    here): 64 for AVX512-VNNI (4 x 16-lane vectors), 32 for AVX2, whose 16 registers hold 32 rows'
    accumulators. A group's bytes are contiguous, so each thread streams whole groups."""
    return 64 if kernel_path("wint8") == "AVX512-VNNI" else 32
