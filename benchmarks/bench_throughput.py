"""Offline throughput: fdcore's actor tree beside vLLM's CPU build, on the same checkpoint, in one run.

N prompts of random token ids (seeded), fixed input and output lengths,
``ignore_eos``, sampled at temperature 1 with seed 0 (what the vLLM peer's
``offline_bench.py`` does). Generated tokens per second, median of
``--repeat`` runs after a warm-up, for:

- fdcore: ``LLM`` over the whole actor tree (engine, scheduler, cache manager,
  worker), in each ``--settings`` entry (float32, bfloat16, wint8, wint4: model.dtype or
  model.quantization; default float32), the worker on every core (fdcore's default; no warm
  spares: none loads beside the measured runs); with
  ``--tp 1,2`` each setting once per tensor-parallel size (TP=N: N worker ranks, the cores
  shared out among them: on 2 cores, TP=2 is one thread per rank beside TP=1's two threads);
- fdcore with the null model (``--null``): the worker answers without
  computing, so what is left is fdcore's own cost per step (scheduling, IPC,
  detokenizing, streaming); reported per step at the given batch;
- vLLM CPU (``../shared/peers/vllm-cpu``, set up with its ``setup.sh``), float32
  and bfloat16 (its best CPU setting where the CPU has AVX512-BF16; ``--bf16`` forces it elsewhere).

Ratios are against vLLM's best dtype in the same run.

Usage: python benchmarks/bench_throughput.py [--prompts 64] [--input-len 32] [--output-len 64]
           [--null] [--peer-dir /tmp/vllm-peer] [--no-peer] [--bf16] [--model DIR]
           [--settings float32,bfloat16,wint8,wint4] [--tp 1,2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fdcore import LLM, SamplingParams
from fdcore.checkpoint.tiny import ensure_tiny_model
from fdcore.config import Config, default_model_path, parse_config

HERE = os.path.dirname(os.path.abspath(__file__))
PEER_SCRIPT = os.path.join(HERE, "..", "..", "shared", "peers", "vllm-cpu", "offline_bench.py")


def make_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def fdcore_config(model: str, args, backend: str, setting: str = "float32", tp: int = 1) -> Config:
    dtype, quantization = (setting, "none") if setting in ("float32", "bfloat16") else ("float32", setting)
    return parse_config(f"""
[workers]
tensor_parallel_size = {tp}
standby = false
[model]
path = "{model}"
backend = "{backend}"
dtype = "{dtype}"
quantization = "{quantization}"
[scheduler]
max_num_seqs = {max(args.prompts, 1)}
max_num_batched_tokens = {max(2048, args.input_len)}
max_model_len = 1024
[cache]
num_blocks = {max(1024, args.prompts * (-(-(args.input_len + args.output_len) // 16)) + 64)}
""")


def run_fdcore(model: str, args, backend: str = "paddle", setting: str = "float32", tp: int = 1) -> dict:
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    prompts = make_prompts(args.prompts, args.input_len, vocab)
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=args.output_len, ignore_eos=True)
    t0 = time.perf_counter()
    with LLM(fdcore_config(model, args, backend, setting, tp)) as llm:
        init_s = time.perf_counter() - t0
        llm.generate(prompts[:4], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
        rates, per_step = [], []
        for _ in range(args.repeat):
            steps_before = llm.stats().steps
            t1 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - t1
            steps = llm.stats().steps - steps_before
            produced = sum(len(o.outputs.token_ids) for o in outs)
            assert produced == args.prompts * args.output_len, f"{produced} tokens, expected more"
            rates.append(produced / elapsed)
            per_step.append(elapsed / steps * 1e3)
    return {
        "gen_tok_per_s": statistics.median(rates),
        "all": rates,
        "ms_per_step": statistics.median(per_step),
        "init_s": init_s,
    }


def has_avx512_bf16() -> bool:
    from fdcore.models.kernels import cpu_flags

    return "avx512_bf16" in cpu_flags().split()


def run_vllm(model: str, args, dtype: str) -> dict | None:
    script = os.path.join(args.peer_dir, "offline_bench.py")
    if not os.path.exists(script):
        script = PEER_SCRIPT
    return run_in_peer(
        args.peer_dir,
        [
            script,
            model,
            "--prompts",
            args.prompts,
            "--input-len",
            args.input_len,
            "--output-len",
            args.output_len,
            "--dtype",
            dtype,
            "--max-num-seqs",
            args.prompts,
            "--repeat",
            args.repeat,
        ],
    )


def run_in_peer(peer_dir: str, argv: list) -> dict | None:
    """A script run by the vLLM peer's python (its env.sh sourced); the last JSON line it prints."""
    python = os.path.join(peer_dir, "venv", "bin", "python")
    if not os.path.exists(python):
        print(f"(vLLM peer not set up in {peer_dir}: run ../shared/peers/vllm-cpu/setup.sh)", file=sys.stderr)
        return None
    cmd = f"source {shlex.quote(peer_dir)}/env.sh && exec {python} " + " ".join(shlex.quote(str(a)) for a in argv)
    result = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=3600)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        print(f"vLLM run failed (exit {result.returncode}):\n{result.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="checkpoint directory (default: the bundled tiny model)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--null", action="store_true", help="also run fdcore with the null model")
    parser.add_argument(
        "--null-output-len",
        type=int,
        default=256,
        help="output length of the null-model run (more steps at full batch)",
    )
    parser.add_argument("--no-peer", action="store_true", help="skip vLLM")
    parser.add_argument("--bf16", action="store_true", help="also run vLLM in bfloat16 (the stretch goal)")
    parser.add_argument("--peer-dir", default="/tmp/vllm-peer")
    parser.add_argument("--settings", default="float32", help="fdcore settings, comma-separated")
    parser.add_argument("--tp", default="1", help="tensor-parallel sizes, comma-separated (e.g. 1,2)")
    args = parser.parse_args(argv)
    model = args.model or ensure_tiny_model(default_model_path())
    rows = []
    for setting in args.settings.split(","):
        for tp in (int(n) for n in args.tp.split(",")):
            fd = run_fdcore(model, args, setting=setting, tp=tp)
            label = setting if tp == 1 and args.tp == "1" else f"{setting}, TP={tp}"
            rows.append((f"fdcore ({label})", fd["gen_tok_per_s"], f"{fd['ms_per_step']:.2f} ms/step"))
    if args.null:
        null_args = argparse.Namespace(**{**vars(args), "output_len": args.null_output_len})
        null = run_fdcore(model, null_args, backend="null")
        rows.append(
            (
                f"fdcore (null model, {args.prompts} running)",
                null["gen_tok_per_s"],
                f"{null['ms_per_step']:.3f} ms/step engine overhead",
            )
        )
    peers = {}
    if not args.no_peer:
        for dtype in ["float32"] + (["bfloat16"] if args.bf16 or has_avx512_bf16() else []):
            result = run_vllm(model, args, dtype)
            if result:
                peers[dtype] = result["gen_tok_per_s"]
                rows.append((f"vLLM CPU ({dtype})", result["gen_tok_per_s"], ""))
    print(
        f"\n{args.prompts} prompts x {args.input_len} tokens in, {args.output_len} out (ignore_eos, "
        f"temperature 1, seed 0), median of {args.repeat}; model {model}"
    )
    best = max(peers, key=peers.get) if peers else None
    print(f"{'system':42s} {'gen tok/s':>10s}  {'vs vLLM ' + (best or '-'):>16s}  note")
    for name, rate, note in rows:
        ratio = f"{rate / peers[best]:.2f}x" if best and not name.startswith("fdcore (null") else ""
        print(f"{name:42s} {rate:10.0f}  {ratio:>16s}  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
