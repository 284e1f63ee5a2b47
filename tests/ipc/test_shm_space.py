"""/dev/shm too small, or filled under a running tree: every segment is committed when it is made, so a
start without room fails at once with one line naming the space, and a running tree never meets SIGBUS.

Each test runs the tree in a mount namespace of its own with a small tmpfs over /dev/shm (``unshare -m``:
the machine's /dev/shm is not touched); where the namespace cannot be made (no privilege) they skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from fdcore.actors import topology
from fdcore.checkpoint import tiny
from tests.supervised import ROOT, tree_config

pytestmark = pytest.mark.tree


def _can_mount() -> bool:
    try:
        return (
            subprocess.run(
                ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                capture_output=True,
                timeout=30,
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


pytestmark = pytest.mark.skipif(not _can_mount(), reason="cannot mount a tmpfs over /dev/shm in a namespace here")


def in_small_shm(size: int, script: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``python -c script`` with a ``size``-byte tmpfs as /dev/shm (its own mount namespace)."""
    command = f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec {sys.executable} -c "$0"'
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", command, textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.make_tiny_model(str(tmp_path_factory.mktemp("shm") / "tiny"))


def test_a_start_without_room_fails_at_once_with_one_line(model_dir, tmp_path):
    config = tmp_path / "tree.toml"
    config.write_text(f'[model]\npath = "{model_dir}"\n')
    done = in_small_shm(
        4 << 20,
        f"""
        import subprocess, sys
        sys.exit(subprocess.run([sys.executable, "-m", "fdcore.supervisor", "--config", "{config}"],
                                timeout=120).returncode)
    """,
    )
    assert done.returncode == 1, done.stderr
    assert "SIGBUS" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    failed = [line for line in done.stderr.splitlines() if "event=start_failed" in line]
    assert len(failed) == 1, done.stderr
    need, _ = topology.shared_memory_need(tree_config(model_dir))
    assert "/dev/shm has" in failed[0] and "bytes free; this tree needs" in failed[0], failed[0]
    assert f"{need:,} bytes" in failed[0], failed[0]
    assert "event=started" not in done.stderr  # refused before any actor was started


def test_check_prints_what_the_tree_needs_and_refuses_what_does_not_fit(model_dir, tmp_path):
    config = tmp_path / "tree.toml"
    config.write_text(f'[model]\npath = "{model_dir}"\n')
    script = f"""
        import subprocess, sys
        sys.exit(subprocess.run([sys.executable, "-m", "fdcore.supervisor", "--config", "{config}", "--check"],
                                timeout=120).returncode)
    """
    small = in_small_shm(4 << 20, script)
    need, _ = topology.shared_memory_need(tree_config(model_dir))
    assert small.returncode == 2 and f"this tree needs {need:,}" in small.stderr, small.stderr
    roomy = in_small_shm(need + (8 << 20), script)
    assert roomy.returncode == 0, roomy.stderr
    assert f"# shared memory: {need:,} bytes in" in roomy.stdout, roomy.stdout


def test_a_running_tree_whose_shm_fills_up_keeps_serving(model_dir):
    """/dev/shm just large enough; once the tree is ready a filler takes every byte left: requests
    still complete (no page of a segment is left to be allocated on first touch), nothing dies."""
    need, _ = topology.shared_memory_need(tree_config(model_dir))
    done = in_small_shm(
        need + (2 << 20),
        f"""
        import json, os
        from fdcore import LLM, SamplingParams
        from tests.supervised import tree_config

        with LLM(tree_config("{model_dir}")) as llm:
            with open("/dev/shm/filler", "wb") as f:  # every byte /dev/shm has left
                try:
                    while True:
                        f.write(b"x" * 65536)
                        f.flush()
                except OSError:
                    pass
            assert os.statvfs("/dev/shm").f_bavail == 0
            outs = llm.generate([[5 + i, 6, 7, 8] for i in range(16)],
                                SamplingParams(max_tokens=64, ignore_eos=True, temperature=0))
            print(json.dumps([(o.outputs.finish_reason, len(o.outputs.token_ids)) for o in outs]))
    """,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [["length", 64]] * 16
    assert "SIGBUS" not in done.stderr and "event=exited" not in done.stderr, done.stderr[-3000:]
