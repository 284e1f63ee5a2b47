"""fdcore's C++ operators are built before the tree starts: outside every start timeout, atomically (a
killed build poisons nothing), and a build that fails stops the start with the compiler's complaint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from fdcore.checkpoint import tiny
from tests.supervised import ROOT, Tree

pytestmark = pytest.mark.tree

FDCORE = os.path.join(os.path.dirname(sys.executable), "fdcore")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.make_tiny_model(str(tmp_path_factory.mktemp("kernels") / "tiny"))


def _tree(tmp_path, model_dir, kernel_dir, name: str, env: dict | None = None) -> Tree:
    config = tmp_path / f"{name}.toml"
    config.write_text(
        f'[model]\npath = "{model_dir}"\n[supervisor]\nstart_timeout = 20.0\n[workers]\nstandby = false\n'
    )
    return Tree(str(config), env={"FDCORE_KERNEL_DIR": str(kernel_dir), **(env or {})})


def test_a_broken_compiler_is_one_line_naming_it(tmp_path):
    done = subprocess.run(
        [FDCORE, "build-kernels"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "FDCORE_KERNEL_DIR": str(tmp_path / "k"), "CXX": "false"},
    )
    assert done.returncode == 1
    complaint = [line for line in done.stderr.splitlines() if line.startswith("fdcore: cannot build")]
    assert len(complaint) == 1 and "false" in complaint[0] and 'model.kernels = "python"' in complaint[0]
    assert not [p for p in (tmp_path / "k").iterdir() if not p.name.endswith((".lock", ".log"))]  # nothing half made


@pytest.mark.timeout(900)  # (a whole build on a busy 2-core machine: over 5 minutes in CI)
def test_the_build_counts_against_no_start_timeout_and_a_killed_one_poisons_nothing(tmp_path, model_dir):
    """An empty kernel cache and a 20 s start timeout (the build takes longer on a busy 2-core machine):
    the supervisor builds first, reporting progress; killed half way (and its builder with it), the next
    start builds afresh and comes up on the compiled path. A broken compiler stops a start with one line."""
    kernels = tmp_path / "kernels"
    first = _tree(tmp_path, model_dir, kernels, "first")
    try:
        builder = []
        deadline = time.monotonic() + 60
        while not builder:  # building (its compiler runs)
            assert time.monotonic() < deadline, "no build started"
            builder = [
                p
                for p in psutil.Process(first.proc.pid).children()
                if "build-kernels" in " ".join(p.cmdline()) and p.children(recursive=True)
            ]
            time.sleep(0.2)
        time.sleep(3)
        build = builder + builder[0].children(recursive=True)  # (the compilers)
        os.kill(first.proc.pid, signal.SIGKILL)
        gone, alive = psutil.wait_procs(build, timeout=10)
        assert not alive, "the build outlived its supervisor"
    finally:
        first.destroy()
    second = _tree(tmp_path, model_dir, kernels, "second")
    try:
        second.wait("ready", timeout=600)
        assert any("event=kernels_built" in line for line in second.log)
        assert not any("slower Python path" in line for line in second.log)
        assert [p.name for p in kernels.iterdir() if p.is_dir()] == [
            next(p.name for p in kernels.iterdir() if (p / "ready").exists())
        ]
        os.kill(second.proc.pid, signal.SIGTERM)
        assert second.exit_code(60) == 0
    finally:
        second.destroy()
    # (CC too: with CXX alone the compiles run and only the link fails, a minute later; see the test above)
    broken = _tree(tmp_path, model_dir, tmp_path / "other-kernels", "broken", env={"CC": "false", "CXX": "false"})
    try:
        failed = broken.wait("start_failed", timeout=300)
        assert "cannot build fdcore's C++ operators" in failed["reason"] and "false" in failed["reason"]
        assert broken.exit_code(60) == 1
        assert not any("event=started" in line for line in broken.log)
    finally:
        broken.destroy()
