"""A digest of SmolLM2's logits in every dtype this CPU runs, at 1 and 2 threads: the check that a change to
the kernels (or their build) keeps every bit. Run it before and after; the lines must be equal.

Each setting prefills two golden chat prompts in one batch, then decodes 8 greedy steps of both together;
the digest is the SHA-256 of every step's float32 logits.

Usage: python tools/logits_digest.py [--threads 1 2] [--steps 8]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "..", "tests", "data", "gguf_reference.json")
SETTINGS = [("float32", "none"), ("bfloat16", "none"), ("float32", "wint8"), ("float32", "wint4")]
BLOCK = 16


def digests(steps: int) -> list[str]:
    """One line per setting this CPU runs (in this process's thread count)."""
    import numpy as np

    from fdcore.checkpoint import load_checkpoint
    from fdcore.checkpoint.fetch import fetch_smollm2
    from fdcore.core.batch import BatchInput
    from fdcore.models.kernels import missing_cpu_feature
    from fdcore.models.llama import LlamaModel

    path = fetch_smollm2()
    prompts = [chat["prompt"] for chat in json.load(open(GOLDEN))["chats"]][:2]
    lines = []
    for dtype, quantization in SETTINGS:
        missing = missing_cpu_feature(dtype if quantization == "none" else quantization)
        name = dtype if quantization == "none" else quantization
        if missing:
            lines.append(f"{name}: not on this CPU ({missing})")
            continue
        model = LlamaModel(load_checkpoint(path, progress=lambda *_: None), dtype, quantization)
        per_row = -(-(max(map(len, prompts)) + steps) // BLOCK)
        cache = model.new_cache(per_row * len(prompts), BLOCK)
        tables = [list(range(i * per_row, (i + 1) * per_row)) for i in range(len(prompts))]
        digest = hashlib.sha256()
        ids, starts = [list(p) for p in prompts], [0] * len(prompts)
        for _ in range(steps):
            logits = np.ascontiguousarray(
                model.forward(BatchInput(ids, starts, tables, [len(p) for p in prompts]), cache), dtype=np.float32
            )
            digest.update(logits.tobytes())
            starts = [s + len(i) for s, i in zip(starts, ids, strict=False)]
            ids = [[int(t)] for t in logits.argmax(axis=1)]
        lines.append(f"{name}: {digest.hexdigest()[:32]}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # (a child: this thread count)
    args = parser.parse_args()
    if args.one:
        sys.path.insert(0, os.path.join(HERE, ".."))
        print("\n".join(digests(args.steps)))
        return 0
    for threads in args.threads:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        out = subprocess.run(
            [sys.executable, __file__, "--one", "--steps", str(args.steps)],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        for line in out.splitlines():
            print(f"{threads} thread{'s' * (threads > 1)}, {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
