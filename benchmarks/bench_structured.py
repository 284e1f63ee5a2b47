"""What structured outputs cost: N concurrent JSON-schema-constrained requests beside the same batch
unconstrained, in fdcore and in vLLM's CPU build (its ``structured_outputs``), on the same checkpoint.

The schema asks for an array of at least 500 records (integers with a range, bounded strings,
booleans, an enum), so no request can finish before ``--output-len`` tokens: both runs generate
exactly the same number of tokens and the ratio is the per-token cost of the constraint (the mask of
every row at every step, and applying it). Sampled at temperature 1, seeded.

Usage: python benchmarks/bench_structured.py [--model DIR] [--prompts 64] [--input-len 32]
           [--output-len 64] [--repeat 3] [--peer-dir /tmp/vllm-peer] [--no-peer]
Prints a table: tokens/s unconstrained and constrained, and the cost (unconstrained / constrained).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.bench_throughput import fdcore_config, has_avx512_bf16, make_prompts, run_in_peer
from fdcore import LLM, SamplingParams, StructuredOutputs
from fdcore.checkpoint.tiny import ensure_tiny_model
from fdcore.config import default_model_path

HERE = os.path.dirname(os.path.abspath(__file__))
RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
        "name": {"type": "string", "maxLength": 12},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
    },
    "required": ["id", "name", "ok", "kind"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {"records": {"type": "array", "items": RECORD, "minItems": 500}},
    "required": ["records"],
    "additionalProperties": False,
}


def run_fdcore(model: str, args) -> dict:
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    prompts = make_prompts(args.prompts, args.input_len, vocab)
    free = SamplingParams(temperature=1.0, seed=0, max_tokens=args.output_len, ignore_eos=True)
    held = SamplingParams(
        temperature=1.0, seed=0, max_tokens=args.output_len, structured_outputs=StructuredOutputs(json=SCHEMA)
    )
    rates: dict[str, list[float]] = {"unconstrained": [], "constrained": []}
    with LLM(fdcore_config(model, args, "paddle")) as llm:
        llm.generate(prompts[:4], held, use_tqdm=False)  # warm-up: the tokenizer, the grammar, the kernels
        for _ in range(args.repeat):
            for name, params in (("unconstrained", free), ("constrained", held)):
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                elapsed = time.perf_counter() - t0
                produced = sum(len(o.outputs.token_ids) for o in outs)
                assert produced == args.prompts * args.output_len, f"{name}: {produced} tokens"
                rates[name].append(produced / elapsed)
        sample = outs[0].outputs.text
    assert sample.startswith('{"records": [{"id": '), sample[:80]
    return {name: statistics.median(values) for name, values in rates.items()}


def run_vllm(model: str, args) -> dict | None:
    dtype = "bfloat16" if has_avx512_bf16() else "float32"  # vLLM's best CPU dtype here
    result = run_in_peer(
        args.peer_dir,
        [
            os.path.join(HERE, "vllm_structured.py"),
            model,
            "--prompts",
            args.prompts,
            "--input-len",
            args.input_len,
            "--output-len",
            args.output_len,
            "--repeat",
            args.repeat,
            "--dtype",
            dtype,
            "--schema",
            json.dumps(SCHEMA),
        ],
    )
    return None if result is None else {**result, "dtype": dtype}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="an HF checkpoint directory (default: the tiny model)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--peer-dir", default="/tmp/vllm-peer")
    parser.add_argument("--no-peer", action="store_true")
    args = parser.parse_args(argv)
    model = args.model or ensure_tiny_model(default_model_path())
    rows = [("fdcore (llguidance)", run_fdcore(model, args))]
    if not args.no_peer:
        peer = run_vllm(model, args)
        if peer is not None:
            rows.append((f"vLLM {peer['dtype']} ({peer['backend']})", peer))
    print(f"\n{args.prompts} requests x {args.input_len} in / {args.output_len} out, {os.path.basename(model)}")
    print(f"{'engine':<32} {'unconstrained tok/s':>20} {'constrained tok/s':>18} {'cost':>6}")
    for name, r in rows:
        print(
            f"{name:<32} {r['unconstrained']:>20.1f} {r['constrained']:>18.1f} "
            f"{r['unconstrained'] / r['constrained']:>5.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
