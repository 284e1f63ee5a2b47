"""Compiling fdcore's C++ operators (the ``.cc`` files beside this one) into one library for this CPU.

The build runs the compiler itself (``$CXX``, default ``g++``) rather than through Paddle's extension
builder, which adds ``-w``: every file compiles with ``-Wall -Werror`` against the one header of
cross-file prototypes (``kernels.h``), and the linked library must resolve every symbol at once
(``_check_symbols``), so a prototype that drifts from its definition fails the build, naming it, and
never a later load. The files compile in parallel, one per core, with exact progress.

Once per CPU, Paddle version, compiler flags and source snapshot (``kernel_dir``), under
``$FDCORE_KERNEL_DIR`` (default ``~/.cache/fdcore-kernels``), behind a file lock (concurrent builders
build it once) and atomically: the build runs in a directory of its own, renamed into place only once
whole, so a build killed half way leaves nothing a later one trips over. ``fdcore build-kernels`` runs
it, and so does a tree's supervisor before it starts any actor.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import os
import re
import select
import shutil
import subprocess
import sys
import warnings

from fdcore import envs
from fdcore.models.kernels.cpu import cpu_flags, march

HERE = os.path.dirname(os.path.abspath(__file__))
NAME = "fdcore_kernels"
# What decides the generated code besides the sources: part of the build directory's name. The code-generation
# flags are those Paddle's extension builder uses (with Python's -fwrapv and -DNDEBUG), so the library is the
# same code it built.
CXXFLAGS = [
    "-std=c++17",
    "-O3",
    "-fPIC",
    "-fwrapv",
    "-DNDEBUG",
    "-fopenmp",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-Wall",
    "-Werror",
    "-DPADDLE_WITH_CUSTOM_KERNEL",
    f"-DPADDLE_EXTENSION_NAME={NAME}",
    "-D_GLIBCXX_USE_CXX11_ABI=1",
]


class KernelBuildError(RuntimeError):
    """fdcore's C++ operators could not be built here (the message names the compiler's complaint)."""


def read_sources() -> dict[str, bytes]:
    """The operators' sources (``.cc``) and headers, read once: the build compiles this snapshot, never the
    files again, so an edit made while it builds cannot end up in a directory named after other sources."""
    sources = {}
    for path in sorted(glob.glob(os.path.join(HERE, "*.cc")) + glob.glob(os.path.join(HERE, "*.h"))):
        with open(path, "rb") as f:
            sources[os.path.basename(path)] = f.read()
    return sources


def compiler() -> str:
    """The C++ compiler the build runs: ``$CXX``, else ``g++``."""
    return os.environ.get("CXX") or "g++"


def kernel_dir(sources: dict[str, bytes] | None = None) -> str:
    """The build directory of these sources (default: as they are now) on this CPU, Paddle and compiler."""
    root = envs.kernel_root()
    import paddle

    recipe = [paddle.__version__, cpu_flags(), compiler(), *march(), *CXXFLAGS]
    digest = hashlib.sha256("\0".join(recipe).encode())
    for name, text in sorted((sources or read_sources()).items()):
        digest.update(name.encode() + b"\0" + text)
    return os.path.join(root, digest.hexdigest()[:16])


def library_path(directory: str) -> str:
    return os.path.join(directory, f"{NAME}.so")


def build(progress=None) -> str:
    """Build the operators for this CPU unless built already; the library's path. ``progress(done, total)``
    is called as source files compile. A failure raises :class:`KernelBuildError` with the compiler's first
    error line (its whole output stays in ``<directory>.log``)."""
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
    import psutil

    # a directory of this builder's own: a killed builder's compilers may still write into theirs a while
    building = f"{directory}.building-{os.getpid()}"
    for stale in glob.glob(directory + ".building-*"):
        if not psutil.pid_exists(int(stale.rsplit("-", 1)[1])):
            shutil.rmtree(stale, ignore_errors=True)
    shutil.rmtree(directory, ignore_errors=True)  # (never finished: it has no "ready")
    log = directory + ".log"
    try:
        units = _snapshot(sources, building)
        with open(log, "wb") as output:
            objects = _compile_all(units, output, progress)
            _run([compiler(), "-shared", *objects, "-o", library_path(building), *_link_flags()], "linking", output)
        _check_symbols(library_path(building))
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    open(os.path.join(building, "ready"), "w").close()
    os.rename(building, directory)
    os.unlink(log)


def _snapshot(sources: dict[str, bytes], directory: str) -> list[str]:
    """Write the sources read for the directory's name into it; the paths of those to compile (not the headers)."""
    os.makedirs(os.path.join(directory, "src"))
    paths = []
    for name, text in sources.items():
        path = os.path.join(directory, "src", name)
        with open(path, "wb") as f:
            f.write(text)
        if name.endswith(".cc"):
            paths.append(path)
    return paths


def _compile_all(units: list[str], output, progress) -> list[str]:
    """Compile ``units`` to objects beside them, as many at once as this process may use cores; the objects."""
    command = [compiler(), *CXXFLAGS, *_gcc_workarounds(), *march(), *_include_flags(), "-c"]
    waiting = list(units)
    running: dict[subprocess.Popen, str] = {}
    done = 0
    try:
        while waiting or running:
            while waiting and len(running) < len(os.sched_getaffinity(0)):
                source = waiting.pop(0)
                running[_start([*command, source, "-o", source[:-3] + ".o"], source)] = source
            proc = _wait_any(running)
            source = running.pop(proc)
            out = _output_of(source)
            output.write(out)
            if proc.returncode != 0:
                raise KernelBuildError(
                    _complaint(out, f"compiling {os.path.basename(source)}", proc.returncode, output.name)
                )
            done += 1
            if progress:
                progress(done, len(units))
    finally:
        for proc in running:
            proc.kill()
            proc.wait()
    return [source[:-3] + ".o" for source in units]


def _start(command: list[str], what: str) -> subprocess.Popen:
    """Run ``command`` with its output into ``<what>.out`` (a file: a pipe could fill while others run)."""
    try:
        with open(what + ".out", "wb") as out:
            return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    except OSError as exc:
        raise KernelBuildError(
            f"cannot run the compiler {command[0]!r} ({os.path.basename(what)}): {exc.strerror}"
        ) from None


def _output_of(what: str) -> bytes:
    with open(what + ".out", "rb") as f:
        return f.read()


def _wait_any(running: dict[subprocess.Popen, str]) -> subprocess.Popen:
    """The first of ``running`` to finish (waiting on their pidfds)."""
    fds = {os.pidfd_open(proc.pid): proc for proc in running}
    try:
        ready, _, _ = select.select(list(fds), [], [])
        proc = fds[ready[0]]
        proc.wait()
        return proc
    finally:
        for fd in fds:
            os.close(fd)


def _run(command: list[str], what: str, output) -> None:
    target = command[command.index("-o") + 1]
    proc = _start(command, target)
    proc.wait()
    out = _output_of(target)
    output.write(out)
    if proc.returncode != 0:
        raise KernelBuildError(_complaint(out, what, proc.returncode, output.name))


def _complaint(out: bytes, what: str, code: int, log: str) -> str:
    """One line: the compiler's first error line, else its name and exit status; where the rest is."""
    lines = [line.strip() for line in out.decode(errors="replace").splitlines()]
    first = next((line for line in lines if "error" in line.lower()), None)
    if first is None:
        first = f"the compiler {compiler()!r} failed {what} (exit status {code})"
    return f"{first[:300]} (full output: {log})"


def _gcc_workarounds() -> list[str]:
    """GCC before 13 reports its own AVX-512 headers: their _mm512_undefined_* (``__m512i __Y = __Y;``) is "used
    uninitialized" wherever a shift or reduction intrinsic is inlined (GCC bug 105593), and a diagnostic pragma
    around the include does not reach inlined code. There those two warnings are off (they change no code);
    every other compiler keeps them."""
    try:
        macros = subprocess.run(
            [compiler(), "-E", "-dM", "-x", "c++", os.devnull], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []  # (the compile fails next, naming the compiler)
    version = re.search(r"#define __GNUC__ (\d+)", macros)
    if "__clang__" in macros or not version or int(version.group(1)) >= 13:
        return []
    return ["-Wno-uninitialized", "-Wno-maybe-uninitialized"]


def _check_symbols(library: str) -> None:
    """Every symbol the library needs resolves now (dlopen with RTLD_NOW, beside Paddle, in a process of its own):
    a function declared and never defined fails the build, naming it, not a worker's start. (The link cannot
    say so with -Wl,--no-undefined: the library leaves Python's C API, which Paddle's headers call, to the
    interpreter that loads it.)"""
    code = "import ctypes, os, sys; import paddle; ctypes.CDLL(sys.argv[1], mode=os.RTLD_NOW | os.RTLD_LOCAL)"
    done = subprocess.run([sys.executable, "-c", code, library], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if "undefined symbol" in line or "OSError" in line]
        raise KernelBuildError(f"the library does not load: {(lines or done.stderr.splitlines() or ['?'])[-1]}")


def _include_flags() -> list[str]:
    """Paddle's and Python's headers, as system headers (their warnings are not ours to fail on)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="No ccache found")  # (Paddle's builder's, not ours)
        from paddle.utils.cpp_extension.extension_utils import find_paddle_includes, find_python_includes

    return [flag for path in [*find_paddle_includes(False), *find_python_includes()] for flag in ("-isystem", path)]


def _link_flags() -> list[str]:
    """libpaddle (the operators' registry and tensors) and OpenMP."""
    from paddle.utils.cpp_extension.extension_utils import _get_core_name, find_paddle_libraries

    libraries = find_paddle_libraries(False)
    return [
        "-fopenmp",
        *[f"-L{path}" for path in libraries],
        *[f"-Wl,--enable-new-dtags,-R{path}" for path in libraries],
        "-Wl,--no-as-needed",
        f"-l:{_get_core_name()}",
        "-Wl,--as-needed",
    ]
