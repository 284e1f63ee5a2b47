"""Loading a checkpoint: fdcore beside vLLM's CPU build, on the same sharded bfloat16 files, in one run.

The default checkpoint has SmolLM2-135M's shape (30 layers, hidden 576,
vocabulary 49152; 135 M parameters) with random weights, saved as bfloat16
in 2 shards, as checkpoints are published (``--model DIR`` takes any other).
The files are read once first, so every run reads from the page cache. Each
figure is the median of ``--repeat`` fresh processes:

- fdcore weights: ``load_checkpoint`` (read + widen to float32 + check) and
  the model built from it, in a process that has already imported Paddle;
  peak memory growth over that (VmHWM) against the float32 weights;
- fdcore ready: ``LLM(config)`` from nothing to a tree that serves (every
  actor started, the worker's model and KV cache in place);
- vLLM: ``LLM(model=...)`` to ready, and the weights part of it as vLLM's own
  log reports it ("Loading weights took ..."), in float32 and bfloat16.

Usage: python benchmarks/bench_load.py [--model DIR] [--repeat 3] [--peer-dir /tmp/vllm-peer] [--no-peer]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fdcore.checkpoint import tiny

SMOLLM2_SHAPE = {
    **tiny.CONFIG,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}

FDCORE_PROBE = r"""
import json, sys, time
import psutil
from fdcore.models.llama import LlamaModel
from fdcore.checkpoint import load_checkpoint

def high_water_mark():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

before = psutil.Process().memory_info().rss
t0 = time.perf_counter()
checkpoint = load_checkpoint(sys.argv[1], progress=lambda *_: None)
t1 = time.perf_counter()
model = LlamaModel(checkpoint)
t2 = time.perf_counter()
weights = sum(int(t.numel()) * 4 for layer in model.layers for t in layer.values() if hasattr(t, "numel"))
weights += int(model.embed.numel()) * 4 * (1 if model.lm_head is model.embed else 2)
print(json.dumps({"read_s": t1 - t0, "build_s": t2 - t1, "growth": high_water_mark() - before, "weights": weights}))
"""

VLLM_PROBE = r"""
import json, sys, time
from vllm import LLM
t0 = time.time()
llm = LLM(model=sys.argv[1], dtype=sys.argv[2], max_model_len=1024, seed=0)
print(json.dumps({"ready_s": time.time() - t0}))
"""


def make_checkpoint(path: str) -> str:
    if os.path.exists(os.path.join(path, "model.safetensors.index.json")):
        return path
    os.makedirs(path, exist_ok=True)
    config = {k: v for k, v in SMOLLM2_SHAPE.items() if k != "fdcore_tiny_version"}
    tiny.save_weights(path, tiny.weights(1, config), 2, "bfloat16")
    for name, data in (
        ("config.json", config),
        ("tokenizer_config.json", tiny.TOKENIZER_CONFIG),
        ("generation_config.json", {"bos_token_id": 1, "eos_token_id": 2}),
    ):
        with open(os.path.join(path, name), "w") as f:
            json.dump(data, f, indent=2)
    with open(tiny.TOKENIZER, "rb") as src, open(os.path.join(path, "tokenizer.json"), "wb") as dst:
        dst.write(src.read())
    return path


def warm_page_cache(path: str) -> int:
    total = 0
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            while chunk := f.read(1 << 24):
                total += len(chunk)
    return total


def fdcore_weights(path: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", FDCORE_PROBE, path],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "FDCORE_NO_KERNELS": "1"},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def fdcore_ready(path: str) -> float:
    from fdcore import LLM
    from fdcore.config import parse_config

    config = parse_config(f'[model]\npath = "{path}"\n[scheduler]\nmax_model_len = 1024\n[workers]\nstandby = false\n')
    t0 = time.perf_counter()
    with LLM(config):
        return time.perf_counter() - t0


def vllm_load(path: str, dtype: str, peer_dir: str) -> dict | None:
    python = os.path.join(peer_dir, "venv", "bin", "python")
    if not os.path.exists(python):
        print(f"(vLLM peer not set up in {peer_dir}: run ../shared/peers/vllm-cpu/setup.sh)", file=sys.stderr)
        return None
    cmd = f"source {peer_dir}/env.sh && exec {python} -c '{VLLM_PROBE}' {path} {dtype}"
    result = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=900)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        print(f"vLLM failed (exit {result.returncode}):\n{result.stderr[-2000:]}", file=sys.stderr)
        return None
    figures = json.loads(lines[-1])
    weights = re.findall(r"Loading weights took ([0-9.]+) seconds", result.stdout + result.stderr)
    figures["weights_s"] = float(weights[-1]) if weights else float("nan")
    return figures


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--peer-dir", default="/tmp/vllm-peer")
    parser.add_argument("--no-peer", action="store_true")
    args = parser.parse_args(argv)
    home = os.environ.get("FDCORE_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "fdcore")
    path = args.model or make_checkpoint(os.path.join(home, "bench", "smollm2-shape-bf16"))
    size = warm_page_cache(path)
    fd = [fdcore_weights(path) for _ in range(args.repeat)]
    ready = [fdcore_ready(path) for _ in range(args.repeat)]
    rows = [
        (
            "fdcore weights (read + build)",
            median([r["read_s"] + r["build_s"] for r in fd]),
            f"read {median([r['read_s'] for r in fd]):.2f} s + build {median([r['build_s'] for r in fd]):.2f} s; "
            f"peak growth {median([r['growth'] / r['weights'] for r in fd]):.2f}x the float32 weights",
        ),
        ("fdcore LLM() to ready", median(ready), "every actor started, model and KV cache in place"),
    ]
    if not args.no_peer:
        for dtype in ("float32", "bfloat16"):
            runs = [r for r in (vllm_load(path, dtype, args.peer_dir) for _ in range(args.repeat)) if r]
            if runs:
                rows.append((f"vLLM {dtype} weights", median([r["weights_s"] for r in runs]), "its own log line"))
                rows.append((f"vLLM {dtype} LLM() to ready", median([r["ready_s"] for r in runs]), ""))
    print(f"\ncheckpoint {path}: {size / 1e6:.0f} MB of files; median of {args.repeat} fresh processes each")
    print(f"{'what':34s} {'seconds':>8s}  note")
    for name, seconds, note in rows:
        print(f"{name:34s} {seconds:8.2f}  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
