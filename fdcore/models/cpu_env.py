"""Math-library settings that must be in the environment before Paddle is imported.

NOTE: Paddle's CPU wheel does its matrix products with Intel's MKL, which on a
non-Intel CPU picks its generic SSE code path, several times slower than its AVX2
one; ``MKL_DEBUG_CPU_TYPE=5`` makes that MKL use its AVX2 path. It is only set on
AMD CPUs (on Intel it would cap AVX-512 machines at AVX2) and never overrides a value
the user chose.

Two OpenMP runtimes share the worker: MKL's (Intel's libiomp5) and the one fdcore's
kernels are built with (GCC's libgomp). Intel's keeps its threads spinning for
200 ms after every parallel region (``KMP_BLOCKTIME``), so with more than one
thread they took the cores from libgomp's threads and from the other actors: a
bfloat16 decode step on 2 threads measured 873 ms against 16 ms on one, and
13.3 ms with ``KMP_BLOCKTIME=0``, which is set here unless the user chose a value.
"""

from __future__ import annotations

import os


def cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def configure(omp_threads: int = 1) -> None:
    """Set the variables (idempotent; call before ``import paddle``)."""
    os.environ.setdefault("OMP_NUM_THREADS", str(omp_threads))
    os.environ.setdefault("KMP_BLOCKTIME", "0")
    if cpu_vendor() == "AuthenticAMD":
        os.environ.setdefault("MKL_DEBUG_CPU_TYPE", "5")


configure()
