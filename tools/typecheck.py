"""mypy --strict over the packages held to it (``.ci/run`` and pre-commit run this): the shared-memory transport,
the serving policy, the messages and the checkpoint readers (issue 45), and the small modules beneath them.

Usage: python tools/typecheck.py
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
STRICT = [
    "fdcore/envs.py",
    "fdcore/logs.py",
    "fdcore/protocol.py",
    "fdcore/supervision.py",
    "fdcore/supervisor/events.py",
    "fdcore/ipc",
    "fdcore/core",
    "fdcore/checkpoint",
]
FLAGS = ["--strict", "--ignore-missing-imports", "--follow-imports=silent"]


def main() -> int:
    return subprocess.run([sys.executable, "-m", "mypy", *FLAGS, *STRICT], cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
