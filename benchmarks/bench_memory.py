"""Memory of a serving tree: the proportional set size (PSS) of every process of ``fdcore serve``, by actor,
after one request, with and without the warm spare, beside llama-server holding the same KV capacity.

PSS counts a page shared by n processes as 1/n in each, so the sum over a tree is what the tree costs the
machine (a spare mapping its worker's shared weights adds only what it holds alone). Each server is
started as a user starts it (``fdcore serve`` with the default configuration but for the model, its
precision, the KV capacity and the spare; llama-server with ``-c`` = the same capacity, ``-np 32``,
``-t`` = the same threads), answers one request (``--input-len`` tokens in, 16 out, over HTTP), is
measured (``/proc/PID/smaps_rollup`` of the supervisor and every descendant; llama-server's one process)
and stopped; they never run at once.

Printed: per configuration, PSS by actor title, the total, and the ratios that matter: worker + spare
against the worker of the run without a spare (a spare should cost little: the weights exist once, its KV
cache is the worker's own shared file) and fdcore's total against llama-server's in the paired precision.

Usage: python benchmarks/bench_memory.py [--model DIR|GGUF] [--settings float32,wint8] [--kv-tokens 8192]
           [--threads T] [--tensor-parallel 1] [--llama-dir /tmp/llama-cpp-peer] [--no-llama-cpp]
"""

from __future__ import annotations

import argparse
import os
import sys

import httpx
import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_batch1 import SETTINGS, llama_cpp_missing
from bench_serving import HOME, Server, llama_ggufs, model_dir, start_llama_server
from bench_serving import start_fdcore as start_serving

BLOCK = 16  # fdcore's default cache.block_size


def pss(pid: int) -> int:
    """Bytes of ``pid``'s proportional set size (0 for a process that ended meanwhile)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
    except (FileNotFoundError, ProcessLookupError, StopIteration):
        return 0


def tree_pss(root: int) -> dict[str, int]:
    """PSS by process title of ``root`` and every descendant (titles repeated: summed)."""
    by_title: dict[str, int] = {}
    try:
        processes = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return by_title
    for p in processes:
        try:
            title = p.cmdline()[0] if p.cmdline() else p.name()
        except (psutil.NoSuchProcess, IndexError):
            continue
        title = title if title.startswith("fdcore:") else os.path.basename(title)
        by_title[title] = by_title.get(title, 0) + pss(p.pid)
    return by_title


def one_request(server: Server, input_len: int) -> None:
    prompt = " ".join(["hello"] * input_len)
    r = httpx.post(
        f"http://127.0.0.1:{server.port}/v1/completions",
        timeout=600,
        json={"model": server.model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True},
    )
    r.raise_for_status()


def start_fdcore(model: str, setting: str, threads: int, kv_tokens: int, standby: bool, tp: int) -> Server:
    return start_serving(
        model,
        setting,
        threads,
        f"standby = {'true' if standby else 'false'}\n"
        f"tensor_parallel_size = {tp}\n[cache]\nnum_blocks = {-(-kv_tokens // BLOCK)}\n",
    )


def measure(server: Server, input_len: int) -> dict[str, int]:
    try:
        server.wait_ready()
        one_request(server, input_len)
        return tree_pss(server.proc.pid)
    finally:
        server.stop()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="an HF directory or a GGUF file (default: SmolLM2's)")
    parser.add_argument("--settings", default="float32,wint8", help=f"a subset of {','.join(SETTINGS)}")
    parser.add_argument("--kv-tokens", type=int, default=8192, help="KV capacity of every server, in tokens")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--tensor-parallel", type=int, default=1, help="fdcore's workers.tensor_parallel_size")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--peer-dir", default="/tmp/vllm-peer", help="its python converts checkpoints for llama.cpp")
    parser.add_argument("--llama-dir", default="/tmp/llama-cpp-peer")
    parser.add_argument("--no-llama-cpp", action="store_true")
    args = parser.parse_args(argv)
    settings = [s for s in args.settings.split(",") if s]
    if unknown := [s for s in settings if s not in SETTINGS]:
        parser.error(f"unknown settings {unknown}; known: {', '.join(SETTINGS)}")
    if not args.no_llama_cpp and (problem := llama_cpp_missing(args.llama_dir)):
        parser.error(problem)
    model = model_dir(args)
    python = os.path.join(args.peer_dir, "venv", "bin", "python")
    ggufs = (
        {} if args.no_llama_cpp else llama_ggufs(model, os.path.join(HOME, "bench"), python, args.llama_dir, settings)
    )
    mib = 1 << 20
    rows = []
    for setting in settings:
        runs = {}
        for standby in (False, True):
            print(f"{setting}: fdcore serve, spare {'on' if standby else 'off'} ...", flush=True)
            runs[standby] = measure(
                start_fdcore(model, setting, args.threads, args.kv_tokens, standby, args.tensor_parallel),
                args.input_len,
            )
        llama = None
        if setting in ggufs:
            print(f"{setting}: llama-server {SETTINGS[setting][2]} ...", flush=True)
            llama = sum(
                measure(
                    start_llama_server(args.llama_dir, ggufs[setting], args.threads, 32, args.kv_tokens // 32),
                    args.input_len,
                ).values()
            )
        rows.append((setting, runs, llama))

    print(
        f"\nPSS after one request ({args.input_len} tokens in, 16 out) in MiB; KV capacity {args.kv_tokens} tokens; "
        f"{args.threads} threads; tensor parallel {args.tensor_parallel}; model {model}"
    )
    for setting, runs, llama in rows:
        print(f"\n{setting}:")
        titles = sorted({t for run in runs.values() for t in run})
        print(f"{'process':28s}{'no spare':>12s}{'spare':>12s}")
        for t in titles:
            print(f"{t:28s}" + "".join(f"{runs[s].get(t, 0) / mib:12.0f}" for s in (False, True)))
        totals = {s: sum(runs[s].values()) for s in (False, True)}
        print(f"{'total':28s}{totals[False] / mib:12.0f}{totals[True] / mib:12.0f}")
        workers = {
            s: sum(v for t, v in runs[s].items() if t.startswith(("fdcore:worker", "fdcore:standby")))
            for s in (False, True)
        }
        print(f"workers + spares / workers without a spare: {workers[True] / workers[False]:.2f}")
        if llama:
            print(
                f"llama-server {SETTINGS[setting][2]}: {llama / mib:.0f} MiB; fdcore / llama-server: "
                f"{totals[False] / llama:.2f} without a spare, {totals[True] / llama:.2f} with it"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
