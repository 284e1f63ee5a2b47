"""``LLM.generate`` over a batch far larger than the engine holds: the client's learnt window
against a window fixed at the engine's limit (what a caller who knew the limit would send).

Each mode runs in a fresh process (its own tree, bundled tiny model) so that its peak RSS is its
own: N prompts of 8 token ids, 4 greedy tokens out each. Prints one row per mode: seconds,
requests per second, outputs, errors, requests the engine refused (and the client re-sent), and
the client's peak RSS.

Usage: python benchmarks/bench_client_batch.py [--prompts 100000] [--limit 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def run_mode(mode: str, prompts: int, limit: int) -> dict:
    from fdcore import LLM, SamplingParams
    from fdcore.client import base
    from fdcore.client import llm as client_llm
    from fdcore.config import parse_config

    if mode == "fixed":  # the window the engine's limit allows, never more: nothing is refused
        client_llm.Batch.growth = 0.0
        base.INITIAL_WINDOW = limit
    llm = LLM(parse_config(f"[engine]\nmax_pending_requests = {limit}\n"))
    sent = [0]
    submit = llm._conn.submit
    llm._conn.submit = lambda *a, **kw: (sent.__setitem__(0, sent[0] + 1), submit(*a, **kw))
    batch = [{"prompt_token_ids": [3 + (i * 7919 + j * 31) % 4000 for j in range(8)]} for i in range(prompts)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    try:
        started = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        seconds = time.perf_counter() - started
    finally:
        llm.shutdown()
    in_order = all(o.prompt_token_ids == b["prompt_token_ids"] for o, b in zip(outs, batch, strict=True))
    return {
        "mode": mode,
        "seconds": seconds,
        "outputs": len(outs),
        "in_order": in_order,
        "errors": sum(o.outputs.finish_reason != "length" for o in outs),
        "refused": sent[0] - prompts,
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=100_000)
    parser.add_argument("--limit", type=int, default=1024, help="engine.max_pending_requests")
    parser.add_argument("--mode", choices=["learnt", "fixed"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args.mode, args.prompts, args.limit)))
        return
    rows = []
    for mode in ("fixed", "learnt"):
        out = subprocess.run(
            [sys.executable, __file__, "--mode", mode, "--prompts", str(args.prompts), "--limit", str(args.limit)],
            capture_output=True,
            text=True,
            check=True,
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{args.prompts} prompts of 8 tokens, 4 out; engine.max_pending_requests = {args.limit}")
    print(
        f"{'window':<8}{'seconds':>9}{'req/s':>9}{'outputs':>9}{'errors':>8}{'refused':>9}{'in order':>9}{'RSS MB':>8}"
    )
    for r in rows:
        print(
            f"{r['mode']:<8}{r['seconds']:>9.1f}{r['outputs'] / r['seconds']:>9.0f}{r['outputs']:>9}"
            f"{r['errors']:>8}{r['refused']:>9}{r['in_order']!s:>9}{r['rss_mb']:>8.0f}"
        )
    print(f"learnt / fixed throughput: {rows[0]['seconds'] / rows[1]['seconds']:.3f}")


if __name__ == "__main__":
    main()
