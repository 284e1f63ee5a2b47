"""The ``fdcore`` console command: ``fdcore serve MODEL`` as a vLLM user would run it, and
``fdcore generate``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from tests.server.test_server import free_port
from tests.supervised import ROOT, Tree

pytestmark = pytest.mark.tree

FDCORE = os.path.join(os.path.dirname(sys.executable), "fdcore")  # the console script pip installed


def _fdcore(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [FDCORE, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        check=False,
    )


def test_serve_runs_the_server_with_the_flags_and_leaves_nothing(tmp_path):
    """The flags reach the server (port, the served model's name, the API key); SIGINT stops it cleanly.
    No configuration file (it holds the key) is ever written: the tree reads it from memory. Without
    OMP_NUM_THREADS the worker gets a math thread per core (as LLM's tree does), not the one thread a
    module of the command line once set for every child."""
    from fdcore.checkpoint import tiny

    model = tiny.make_tiny_model(str(tmp_path / "model"))
    private = tmp_path / "tmp"
    private.mkdir()
    port = free_port()
    tree = Tree(
        None,
        env={"TMPDIR": str(private), "OMP_NUM_THREADS": None},
        command=[
            FDCORE,
            "serve",
            model,
            "--port",
            str(port),
            "--served-model-name",
            "little",
            "--api-key",
            "sk-cli",
            "--max-model-len",
            "512",
        ],
    )
    try:
        ready = tree.wait("ready", timeout=120)
        assert list(private.iterdir()) == []
        assert int(ready["math_threads"]) == len(os.sched_getaffinity(0))  # (each worker's OMP_NUM_THREADS)
        base, auth = f"http://127.0.0.1:{port}", {"Authorization": "Bearer sk-cli"}
        assert httpx.get(f"{base}/v1/models", timeout=10).status_code == 401
        models = httpx.get(f"{base}/v1/models", headers=auth, timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["little"]
        out = httpx.post(
            f"{base}/v1/completions",
            headers=auth,
            timeout=60,
            json={"model": "little", "prompt": "def main():", "max_tokens": 4},
        ).json()
        assert out["usage"]["completion_tokens"] == 4
        too_long = httpx.post(
            f"{base}/v1/completions",
            headers=auth,
            timeout=60,
            json={"model": "little", "prompt": "x", "max_tokens": 600},
        )
        assert too_long.status_code == 400 and "512" in too_long.text  # --max-model-len reached the engine
        tree.proc.send_signal(signal.SIGINT)
        assert tree.exit_code(30) == 0
        assert list(private.iterdir()) == []
    finally:
        tree.destroy()


def test_flags_override_the_config_file_and_are_checked_as_its_keys(tmp_path):
    config = tmp_path / "base.toml"
    config.write_text('[scheduler]\nmax_num_seqs = 7\n[server]\nport = 9000\nmodel_name = "base"\n')
    done = _fdcore("serve", "--config", str(config), "--port", "9001", "--check")
    assert done.returncode == 0, done.stderr
    assert "max_num_seqs = 7" in done.stdout and "port = 9001" in done.stdout
    assert 'model_name = "base"' in done.stdout and "enabled = true" in done.stdout
    assert "# warm spare workers: on" in done.stdout  # (the default; what ready waits for)
    assert "# shared weights: auto" in done.stdout
    bad = _fdcore("serve", "--dtype", "float64", "--check")
    assert bad.returncode == 2 and "key 'model.dtype'" in bad.stderr and "float64" in bad.stderr
    far = _fdcore("serve", "--port", "70000", "--check")
    assert far.returncode == 2 and "key 'server.port' is 70000, must be <= 65535" in far.stderr
    missing = _fdcore("serve", str(tmp_path / "nowhere"), "--check")
    assert missing.returncode == 2 and "key 'model.path'" in missing.stderr


@pytest.mark.parametrize("where", [(), ("--in-process",)])
def test_generate_prints_one_line_per_prompt(where):
    """Through the actor tree and in one process: the same greedy text (the bundled tiny model)."""
    done = _fdcore("generate", *where, "def main():", "hello", "--max-tokens", "4", timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("'def main():' -> ") and lines[1].startswith("'hello' -> ")
    assert all(line.endswith("[4 tokens, length]") for line in lines)
    GREEDY.setdefault("lines", lines)
    assert lines == GREEDY["lines"]


GREEDY: dict = {}
