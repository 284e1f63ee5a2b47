"""Every environment variable fdcore reads or sets: its name, what it means, and its one reader.

No other module names an ``FDCORE_*`` variable (a test checks): they import the name from here and read
it through :func:`get` (or the typed readers below), so this file is the whole list. The modules that
own a variable's meaning parse its value (fdcore.actors.faults its fault specs, fdcore.core.placement
its CPU list) and name the variable in their errors.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# For users
HOME = "FDCORE_HOME"  # fdcore's files: the bundled and fetched models, the weight files (~/.cache/fdcore)
KERNEL_DIR = "FDCORE_KERNEL_DIR"  # where the C++ operators are built (~/.cache/fdcore-kernels)
ISA = "FDCORE_ISA"  # "avx2": build the AVX2 kernels on a CPU that has more (to measure them); "native"
API_KEY = "FDCORE_API_KEY"  # the HTTP server's key (overrides server.api_key)

# Set by a tree for its own processes
NO_KERNELS = "FDCORE_NO_KERNELS"  # "1": the workers run the Python path (model.kernels = "python")
BUILD_FOR_PID = "FDCORE_BUILD_FOR_PID"  # a kernel build's supervisor: the build dies with it
CPUS = "FDCORE_CPUS"  # the CPUs the supervisor started with, "0,1,..."
GROUP_MASTER = "FDCORE_GROUP_MASTER"  # a tensor-parallel group's rendezvous host:port
INSTANCE_TAG = "FDCORE_INSTANCE_TAG"  # up to 4 hex digits that begin this process tree's instance ids

# For tests (fault injection)
TEST_FAULT = "FDCORE_TEST_FAULT"  # "<child id>:<behaviour>[:<n>]": one child misbehaves
TEST_POISON = "FDCORE_TEST_POISON"  # "<actor kind>:<token id>": a token that makes that actor raise

VARIABLES = (
    HOME,
    KERNEL_DIR,
    ISA,
    API_KEY,
    NO_KERNELS,
    BUILD_FOR_PID,
    CPUS,
    GROUP_MASTER,
    INSTANCE_TAG,
    TEST_FAULT,
    TEST_POISON,
)


def get(name: str, environ: Mapping[str, str] | None = None) -> str:
    """The variable's value ("" when unset) in ``environ`` (default: this process's environment)."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not one of fdcore's environment variables (fdcore.envs)")
    return (os.environ if environ is None else environ).get(name, "")


def fdcore_home() -> str:
    """``$FDCORE_HOME``, by default ``~/.cache/fdcore``."""
    return get(HOME) or os.path.join(os.path.expanduser("~"), ".cache", "fdcore")


def kernel_root() -> str:
    """``$FDCORE_KERNEL_DIR``, by default ``~/.cache/fdcore-kernels``."""
    return get(KERNEL_DIR) or os.path.join(os.path.expanduser("~"), ".cache", "fdcore-kernels")


def no_kernels() -> bool:
    return bool(get(NO_KERNELS))


def build_for_pid() -> int | None:
    value = get(BUILD_FOR_PID)
    return int(value) if value else None
