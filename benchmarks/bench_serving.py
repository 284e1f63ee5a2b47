"""Serving benchmark over the OpenAI API: fdcore's server beside vLLM's, same checkpoint, one run.

Seeded random prompts of ``--input-len`` token ids, ``--output-len`` tokens out
(greedy, ignore_eos), sent to ``/v1/completions`` with streaming, either at a
fixed concurrency or as a Poisson process of ``--rate`` requests/s. Per
request: TTFT (to the first streamed token), ITL (between streamed tokens),
TPOT ((end - first token) / (tokens - 1)) and end-to-end latency; overall:
output tokens/s. Each server is started, measured and stopped in turn, so
they never share the two cores.

Usage: python benchmarks/bench_serving.py [--concurrency 1 64] [--rate R] [--prompts 128]
           [--input-len 32] [--output-len 64] [--peer-dir /tmp/vllm-peer] [--no-peer]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process in its own process group, killed as a group when done."""

    def __init__(self, cmd: list[str], port: int, model: str, env=None):
        self.port, self.model = port, model
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
                                     start_new_session=True, env=env)

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError("server did not become ready")

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
            self.proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()


def start_fdcore(model: str, max_num_seqs: int, omp_threads: int = 1) -> Server:
    port = free_port()
    config = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False, prefix="fdcore-bench-")
    config.write(f'[model]\npath = "{model}"\n[server]\nenabled = true\nport = {port}\nmodel_name = "bench"\n'
                 f'[scheduler]\nmax_num_seqs = {max_num_seqs}\n[workers]\nomp_threads = {omp_threads}\n')
    config.close()
    return Server([sys.executable, "-m", "fdcore.supervisor", "--config", config.name], port, "bench")


def start_vllm(model: str, peer_dir: str, max_num_seqs: int) -> Server:
    port = free_port()
    python = os.path.join(peer_dir, "venv", "bin", "python")
    cli = os.path.join(peer_dir, "vllm_cli.py")
    cmd = (f"source {peer_dir}/env.sh && exec {python} {cli} serve {model} --host 127.0.0.1 --port {port} "
           f"--dtype float32 --max-model-len 1024 --max-num-seqs {max_num_seqs} --served-model-name bench")
    return Server(["bash", "-c", cmd], port, "bench")


async def one_request(http: httpx.AsyncClient, url: str, model: str, prompt: list[int], output_len: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    times, tokens = [], 0
    async with http.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter())
    end = time.perf_counter()
    ttft = times[0] - start if times else end - start
    return {"ttft": ttft, "e2e": end - start, "tokens": tokens,
            "tpot": (end - start - ttft) / (tokens - 1) if tokens > 1 else 0.0,
            "itl": [b - a for a, b in zip(times, times[1:], strict=False)]}


async def run_load(server: Server, prompts, output_len: int, concurrency: int | None, rate: float | None,
                   seed: int) -> dict:
    url = f"http://127.0.0.1:{server.port}/v1/completions"
    limits = httpx.Limits(max_connections=max(concurrency or 256, 1))
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        await one_request(http, url, server.model, prompts[0], 4)  # warm-up
        rng = random.Random(seed)
        gate = asyncio.Semaphore(concurrency) if concurrency else None

        async def go(prompt):
            if gate is None:
                return await one_request(http, url, server.model, prompt, output_len)
            async with gate:
                return await one_request(http, url, server.model, prompt, output_len)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.ensure_future(go(prompt)))
            if rate:
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    return {"results": results, "elapsed": elapsed,
            "throughput": sum(r["tokens"] for r in results) / elapsed}


def summarize(run: dict) -> dict:
    res = run["results"]
    out = {"output tok/s": run["throughput"]}
    for key in ("ttft", "tpot", "e2e"):
        values = sorted(r[key] * 1e3 for r in res)
        out[f"{key} mean ms"] = statistics.mean(values)
        out[f"{key} median ms"] = statistics.median(values)
        out[f"{key} p99 ms"] = values[min(len(values) - 1, int(0.99 * len(values)))]
    itl = sorted(x * 1e3 for r in res for x in r["itl"]) or [0.0]
    out["itl mean ms"], out["itl median ms"] = statistics.mean(itl), statistics.median(itl)
    out["itl p99 ms"] = itl[min(len(itl) - 1, int(0.99 * len(itl)))]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="")
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 64])
    parser.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second instead")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peer-dir", default="/tmp/vllm-peer")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--omp-threads", type=int, default=1, help="fdcore's workers.omp_threads")
    args = parser.parse_args(argv)

    from fdcore.config import default_model_path
    from fdcore.models.tiny import ensure_tiny_model

    model = args.model or ensure_tiny_model(default_model_path())
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.input_len)] for _ in range(args.prompts)]
    loads = [("rate", None, args.rate)] if args.rate else [(f"concurrency {c}", c, None) for c in args.concurrency]
    systems = [("fdcore", lambda: start_fdcore(model, 128, args.omp_threads))]
    if not args.no_peer and os.path.exists(os.path.join(args.peer_dir, "venv", "bin", "python")):
        systems.append(("vLLM CPU fp32", lambda: start_vllm(model, args.peer_dir, 128)))
    table: dict[str, dict[str, dict]] = {}
    for name, start in systems:
        server = start()
        try:
            server.wait_ready()
            for label, concurrency, rate in loads:
                count = args.prompts if concurrency != 1 else min(args.prompts, 16)
                run = asyncio.run(run_load(server, prompts[:count], args.output_len, concurrency, rate, args.seed))
                table.setdefault(label, {})[name] = summarize(run)
        finally:
            server.stop()
    print(f"\n{args.input_len} tokens in, {args.output_len} out (greedy, ignore_eos, streaming); model {model}")
    for label, by_system in table.items():
        names = list(by_system)
        print(f"\n{label}:")
        print(f"{'metric':18s}" + "".join(f"{n:>16s}" for n in names))
        for metric in next(iter(by_system.values())):
            print(f"{metric:18s}" + "".join(f"{by_system[n][metric]:16.2f}" for n in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
