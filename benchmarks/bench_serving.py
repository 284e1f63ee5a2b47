"""Serving benchmark over the OpenAI API: fdcore's server beside vLLM's, same checkpoint, one run,
every server driven by vLLM's own load generator, ``vllm bench serve``.

Using the peer's own client (what its users run) means neither server is measured through a
client that handicaps it: an earlier hand-written httpx client reported vLLM at 672 output tok/s at
concurrency 64 where ``vllm bench serve`` measured 4,450 against the same server. Each server is
started, measured and stopped in turn, so they never share the two cores; vLLM runs at float32 and,
where the CPU has AVX512-BF16 (its best CPU setting), at bfloat16 too.

The load: ``vllm bench serve --dataset-name random`` (seeded) with ``--input-len`` tokens in,
``--output-len`` out, ``--ignore-eos``, temperature 0, at each ``--concurrency`` (or ``--rate``
requests/s). Its JSON result gives TTFT, TPOT, ITL, end-to-end latency (mean, median, p99) and
output tokens/s, printed side by side.

Usage: python benchmarks/bench_serving.py [--concurrency 1 64] [--rate R] [--prompts 128]
           [--input-len 32] [--output-len 64] [--peer-dir /tmp/vllm-peer] [--no-peer] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
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


def start_fdcore(model: str, max_num_seqs: int, omp_threads: int = 0) -> Server:
    port = free_port()
    config = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False, prefix="fdcore-bench-")
    config.write(f'[model]\npath = "{model}"\n[server]\nenabled = true\nport = {port}\nmodel_name = "bench"\n'
                 f'[scheduler]\nmax_num_seqs = {max_num_seqs}\n[workers]\nomp_threads = {omp_threads}\n')
    config.close()
    # (the supervisor deletes the file as it stops)
    return Server([sys.executable, "-m", "fdcore.supervisor", "--config", config.name, "--remove-config"], port,
                  "bench")


def start_vllm(model: str, peer_dir: str, max_num_seqs: int, dtype: str) -> Server:
    port = free_port()
    python = os.path.join(peer_dir, "venv", "bin", "python")
    cli = os.path.join(peer_dir, "vllm_cli.py")
    cmd = (f"source {peer_dir}/env.sh && exec {python} {cli} serve {model} --host 127.0.0.1 --port {port} "
           f"--dtype {dtype} --max-model-len 1024 --max-num-seqs {max_num_seqs} --served-model-name bench")
    return Server(["bash", "-c", cmd], port, "bench")


METRICS = [("output tok/s", "output_throughput")] + [
    (f"{name} {stat} ms", f"{stat}_{key}_ms") for name, key in (("ttft", "ttft"), ("tpot", "tpot"), ("itl", "itl"),
                                                                  ("e2e", "e2el"))
    for stat in ("mean", "median", "p99")]


def bench_serve(server: Server, peer_dir: str, tokenizer: str, args, concurrency: int | None,
                prompts: int) -> dict:
    """One ``vllm bench serve`` run against ``server``; its saved JSON result."""
    with tempfile.TemporaryDirectory(prefix="fdcore-bench-serve-") as out:
        return _bench_serve_into(out, server, peer_dir, tokenizer, args, concurrency, prompts)


def _bench_serve_into(out: str, server: Server, peer_dir: str, tokenizer: str, args, concurrency: int | None,
                      prompts: int) -> dict:
    python = os.path.join(peer_dir, "venv", "bin", "python")
    cli = os.path.join(peer_dir, "vllm_cli.py")
    load = f"--max-concurrency {concurrency} --request-rate inf" if concurrency else f"--request-rate {args.rate}"
    cmd = (f"source {peer_dir}/env.sh && exec {python} {cli} bench serve --backend openai "
           f"--base-url http://127.0.0.1:{server.port} --endpoint /v1/completions --model {server.model} "
           f"--tokenizer {tokenizer} --dataset-name random --random-input-len {args.input_len} "
           f"--random-output-len {args.output_len} --random-range-ratio 0 --num-prompts {prompts} "
           f"--ignore-eos --temperature 0 --seed {args.seed} {load} --num-warmups 2 --disable-tqdm "
           f"--percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 99 "
           f"--save-result --result-dir {out} --result-filename result.json")
    done = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, cwd=ROOT)
    path = os.path.join(out, "result.json")
    if done.returncode != 0 or not os.path.exists(path):
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    with open(path) as f:
        result = json.load(f)
    if result.get("completed") != prompts:
        raise RuntimeError(f"vllm bench serve completed {result.get('completed')} of {prompts} requests")
    return {label: result[key] for label, key in METRICS}


def has_avx512_bf16() -> bool:
    from fdcore.models.kernels import cpu_flags

    return "avx512_bf16" in cpu_flags().split()


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
    parser.add_argument("--omp-threads", type=int, default=0, help="fdcore's workers.omp_threads (0: its default, every core)")
    args = parser.parse_args(argv)

    from fdcore.config import default_model_path
    from fdcore.models.tiny import ensure_tiny_model

    model = args.model or ensure_tiny_model(default_model_path())
    if not os.path.exists(os.path.join(args.peer_dir, "venv", "bin", "python")):
        parser.error(f"the vLLM peer (its `vllm bench serve` drives every server) is not in {args.peer_dir}: "
                     "run ../shared/peers/vllm-cpu/setup.sh first")
    loads = [("rate", None)] if args.rate else [(f"concurrency {c}", c) for c in args.concurrency]
    systems = [("fdcore", lambda: start_fdcore(model, 128, args.omp_threads))]
    if not args.no_peer:
        systems.append(("vLLM fp32", lambda: start_vllm(model, args.peer_dir, 128, "float32")))
        if has_avx512_bf16():
            systems.append(("vLLM bf16", lambda: start_vllm(model, args.peer_dir, 128, "bfloat16")))
    table: dict[str, dict[str, dict]] = {}
    for name, start in systems:
        server = start()
        try:
            server.wait_ready()
            for label, concurrency in loads:
                count = args.prompts if concurrency != 1 else min(args.prompts, 16)
                table.setdefault(label, {})[name] = bench_serve(server, args.peer_dir, model, args, concurrency, count)
        finally:
            server.stop()
    print(f"\n{args.input_len} tokens in, {args.output_len} out (greedy, ignore_eos, streaming), "
          f"load from `vllm bench serve`; model {model}")
    for label, by_system in table.items():
        names = list(by_system)
        print(f"\n{label}:")
        print(f"{'metric':18s}" + "".join(f"{n:>14s}" for n in names) + "".join(
            f"{'fdcore/' + n.split()[-1]:>14s}" for n in names[1:]))
        for metric, _key in METRICS:
            values = [by_system[n][metric] for n in names]
            ratios = [values[0] / v if v else float("nan") for v in values[1:]]
            print(f"{metric:18s}" + "".join(f"{v:14.2f}" for v in values) + "".join(f"{r:14.2f}" for r in ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
