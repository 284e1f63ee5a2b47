"""Serving benchmark over the OpenAI API: fdcore's server beside its peers' (llama-server, vLLM), same
weights, one run, every server driven by vLLM's own load generator, ``vllm bench serve``.

Using the peer's own client (what its users run) means no server is measured through a client that
handicaps it: an earlier hand-written httpx client reported vLLM at 672 output tok/s at concurrency 64
where ``vllm bench serve`` measured 4,450 against the same server. A setting's servers are all started,
then measured one at a time (an idle server takes no CPU from the measured one), then stopped.

Precision pairs (``--settings``): fdcore float32 / wint8 / wint4 beside llama-server F32 / Q8_0 / Q4_1
(``-t`` = fdcore's math threads, ``-np`` = the largest concurrency, continuous batching: its defaults
otherwise), and vLLM at float32 beside fdcore's float32 (``--vllm``; bfloat16 too where the CPU has
AVX512-BF16). The GGUFs hold the same weights: llama.cpp's ``convert_hf_to_gguf.py`` writes F32 and Q8_0
from the model directory fdcore serves, ``llama-quantize`` Q4_1 from the F32 file. A GGUF ``--model``
(SmolLM2's Q4_1 file by default) is first exported to a float32 directory (tools/export_hf.py), which
every server then loads. Concurrency 1 runs in ``--rounds`` interleaved rounds (see ``alternate_c1``:
this machine's speed drifts), each also measuring fdcore's own offline decode (``AsyncLLM.connect`` to the
tree the server runs, no HTTP: 1 request at a time, TPOT from the first streamed token to the last), the
yardstick for its HTTP path.

The load: ``vllm bench serve --dataset-name random`` (seeded) with ``--input-len`` tokens in,
``--output-len`` out, ``--ignore-eos``, temperature 0, at each ``--concurrency`` (or ``--rate``
requests/s): ``--prompts`` requests (``--prompts-c1`` a round at concurrency 1). Its JSON result gives TTFT,
TPOT, ITL, end-to-end latency (mean, median, p99) and output tokens/s.

Usage: python benchmarks/bench_serving.py [--model DIR|GGUF] [--settings float32,wint8,wint4] [--threads T]
           [--concurrency 1 32] [--rate R] [--prompts 128] [--prompts-c1 16] [--rounds 3] [--input-len 32]
           [--output-len 64]
           [--peer-dir /tmp/vllm-peer] [--llama-dir /tmp/llama-cpp-peer] [--vllm] [--no-llama-cpp]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tools"))

from bench_batch1 import SETTINGS, llama_cpp_missing

HOME = os.environ.get("FDCORE_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "fdcore")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process in its own process group, killed as a group when done."""

    def __init__(self, cmd: list[str], port: int, model: str, env=None, config: str | None = None):
        self.port, self.model, self.config = port, model, config  # (config: a file to delete at stop)
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, start_new_session=True, env=env
        )

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
        if self.config:
            os.unlink(self.config)


def fdcore_toml(model: str, setting: str, threads: int, max_num_seqs: int = 128) -> str:
    dtype, quantization = SETTINGS[setting][:2]
    return (
        f'[model]\npath = "{model}"\ndtype = "{dtype}"\nquantization = "{quantization}"\n'
        f"[scheduler]\nmax_num_seqs = {max_num_seqs}\n[workers]\nomp_threads = {threads}\n"
    )


def start_fdcore(model: str, setting: str, threads: int, extra: str = "") -> Server:
    """``fdcore serve`` as a user starts it: the default configuration but for the model, its precision
    and the math threads (the spare worker included); ``extra``: TOML lines that follow ``[workers]``."""
    port = free_port()
    config = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False, prefix="fdcore-bench-")
    config.write(
        fdcore_toml(model, setting, threads)
        + extra
        + f'[server]\nenabled = true\nport = {port}\nmodel_name = "bench"\n'
    )
    config.close()
    return Server(
        [sys.executable, "-m", "fdcore.supervisor", "--config", config.name], port, "bench", config=config.name
    )


def start_llama_server(llama_dir: str, gguf: str, threads: int, slots: int, context: int) -> Server:
    port = free_port()
    return Server(
        [
            os.path.join(llama_dir, "bin", "llama-server"),
            "-m",
            gguf,
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "-np",
            str(slots),
            "-c",
            str(slots * context),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--alias",
            "bench",
        ],
        port,
        "bench",
    )


def offline_tpot(model: str, args) -> float:
    """fdcore's decode without HTTP, on the running fdcore tree (``AsyncLLM.connect``: the same processes,
    the same memory): median ms per output token over ``--prompts-c1`` requests, one at a time, after a
    warm-up one (bench_batch1.decode_rate: first streamed token to the last). The same tree, because a
    tree's speed can differ start to start (seen on a Zen 4 VM: SmolLM2 float32 at ~12 or ~18 ms a token,
    whichever the path), which a yardstick from another start would read as the HTTP path's cost."""
    import asyncio
    import random

    from bench_batch1 import decode_rate

    from fdcore import AsyncLLM
    from fdcore.checkpoint import read_config

    vocab = read_config(model)["vocab_size"]
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.input_len)] for _ in range(args.prompts_c1 + 1)]

    async def main() -> list[float]:
        async with AsyncLLM.connect() as llm:
            return [await decode_rate(llm, prompt, args.output_len) for prompt in prompts]

    rates = asyncio.run(main())[1:]
    return 1000.0 / statistics.median(rates)


def alternate_c1(servers: dict[str, Server], model: str, args) -> tuple[dict[str, dict], list[tuple[float, float]]]:
    """Concurrency 1, ``--rounds`` rounds, each: fdcore's offline decode on its tree, then every server's
    ``vllm bench serve`` run of ``--prompts-c1`` requests. Interleaved, because a machine's speed can drift
    for tens of seconds at a time (a Zen 4 VM: SmolLM2 float32 at ~12 then ~18 ms a token in one tree,
    offline and over HTTP alike), which runs minutes apart would read as one system's edge. Each metric is
    the median over the rounds; the pairs are fdcore's (offline, HTTP) median TPOT per round."""
    runs: dict[str, list[dict]] = {name: [] for name in servers}
    pairs = []
    fdcore = next(name for name in servers if name.startswith("fdcore"))
    for round_ in range(args.rounds):
        print(f"concurrency 1, round {round_ + 1}/{args.rounds} ...", flush=True)
        off = offline_tpot(model, args)
        for name, server in servers.items():
            runs[name].append(bench_serve(server, args.peer_dir, model, args, 1, args.prompts_c1))
        pairs.append((off, runs[fdcore][-1]["tpot median ms"]))
    return {
        name: {metric: statistics.median(r[metric] for r in results) for metric in results[0]}
        for name, results in runs.items()
    }, pairs


def llama_ggufs(hf_dir: str, cache: str, python: str, llama_dir: str, settings: list[str]) -> dict[str, str]:
    """setting -> GGUF of ``hf_dir``'s weights in llama.cpp's paired type (each made once, kept in ``cache``):
    F32 and Q8_0 by convert_hf_to_gguf.py, Q4_1 by llama-quantize from the F32 file."""
    os.makedirs(cache, exist_ok=True)
    stem = os.path.basename(os.path.normpath(hf_dir))
    out = {}
    for setting in settings:
        kind = SETTINGS[setting][2]
        path = os.path.join(cache, f"{stem}.{kind}.gguf")
        if not os.path.isfile(path):
            tmp = path + ".part"
            if kind == "Q4_1":
                f32 = llama_ggufs(hf_dir, cache, python, llama_dir, ["float32"])["float32"]
                cmd = [os.path.join(llama_dir, "bin", "llama-quantize"), f32, tmp, "Q4_1"]
            else:
                cmd = [
                    python,
                    os.path.join(llama_dir, "src", "convert_hf_to_gguf.py"),
                    hf_dir,
                    "--outtype",
                    kind.lower(),
                    "--outfile",
                    tmp,
                ]
            print(f"making {path}: {' '.join(cmd[:2])} ...", flush=True)
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
            os.replace(tmp, path)
        out[setting] = path
    return out


def start_vllm(model: str, peer_dir: str, max_num_seqs: int, dtype: str) -> Server:
    port = free_port()
    python = os.path.join(peer_dir, "venv", "bin", "python")
    cli = os.path.join(peer_dir, "vllm_cli.py")
    cmd = (
        f"source {peer_dir}/env.sh && exec {python} {cli} serve {model} --host 127.0.0.1 --port {port} "
        f"--dtype {dtype} --max-model-len 1024 --max-num-seqs {max_num_seqs} --served-model-name bench"
    )
    return Server(["bash", "-c", cmd], port, "bench")


METRICS = [("output tok/s", "output_throughput")] + [
    (f"{name} {stat} ms", f"{stat}_{key}_ms")
    for name, key in (("ttft", "ttft"), ("tpot", "tpot"), ("itl", "itl"), ("e2e", "e2el"))
    for stat in ("mean", "median", "p99")
]


def bench_serve(server: Server, peer_dir: str, tokenizer: str, args, concurrency: int | None, prompts: int) -> dict:
    """One ``vllm bench serve`` run against ``server``; its saved JSON result."""
    with tempfile.TemporaryDirectory(prefix="fdcore-bench-serve-") as out:
        return _bench_serve_into(out, server, peer_dir, tokenizer, args, concurrency, prompts)


def _bench_serve_into(
    out: str, server: Server, peer_dir: str, tokenizer: str, args, concurrency: int | None, prompts: int
) -> dict:
    python = os.path.join(peer_dir, "venv", "bin", "python")
    cli = os.path.join(peer_dir, "vllm_cli.py")
    load = f"--max-concurrency {concurrency} --request-rate inf" if concurrency else f"--request-rate {args.rate}"
    cmd = (
        f"source {peer_dir}/env.sh && exec {python} {cli} bench serve --backend openai "
        f"--base-url http://127.0.0.1:{server.port} --endpoint /v1/completions --model {server.model} "
        f"--tokenizer {tokenizer} --dataset-name random --random-input-len {args.input_len} "
        f"--random-output-len {args.output_len} --random-range-ratio 0 --num-prompts {prompts} "
        f"--ignore-eos --temperature 0 --seed {args.seed} {load} --num-warmups 2 --disable-tqdm "
        f"--percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 99 "
        f"--save-result --result-dir {out} --result-filename result.json"
    )
    done = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, cwd=ROOT)
    path = os.path.join(out, "result.json")
    if done.returncode != 0 or not os.path.exists(path):
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    with open(path) as f:
        result = json.load(f)
    metrics = {label: result[key] for label, key in METRICS}
    # shown: llama-server fails a few requests under `vllm bench serve` (seen: 1 of 16 at concurrency 1, up to
    # 21 of 128 at 32, no error text recorded); its throughput then counts only the others' tokens, so a
    # figure as if every request had completed at the same rate is printed beside it (an upper bound)
    completed = result.get("completed", 0)
    metrics["failed requests"] = prompts - completed
    metrics["tok/s if all done"] = result["output_throughput"] * prompts / completed if completed else 0.0
    return metrics


def has_avx512_bf16() -> bool:
    from fdcore.models.kernels import cpu_flags

    return "avx512_bf16" in cpu_flags().split()


def model_dir(args) -> str:
    """The HF directory every server loads: ``--model`` itself, or a GGUF's float32 export."""
    from fdcore.checkpoint.fetch import fetch_smollm2

    source = args.model or fetch_smollm2()
    if os.path.isdir(source):
        return source
    from export_hf import export_hf

    out = os.path.join(HOME, "bench", os.path.basename(source).removesuffix(".gguf") + ".hf-float32")
    if not os.path.isfile(os.path.join(out, "model.safetensors")):
        print(f"exporting {source} -> {out} (fdcore's GGUF reader, float32)", flush=True)
        export_hf(source, out, "float32")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="an HF directory or a GGUF file (default: SmolLM2's)")
    parser.add_argument("--settings", default="float32,wint8,wint4", help=f"a subset of {','.join(SETTINGS)}")
    parser.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="fdcore's workers.omp_threads and llama-server's -t (default: every core)",
    )
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 32])
    parser.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second instead")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--prompts-c1", type=int, default=16, help="requests at concurrency 1 (and offline), a round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds at concurrency 1")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--peer-dir",
        default="/tmp/vllm-peer",
        help="the vLLM peer: its `vllm bench serve` drives every server, its python converts checkpoints for llama.cpp",
    )
    parser.add_argument("--llama-dir", default="/tmp/llama-cpp-peer")
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--vllm", action="store_true", help="vLLM's server too, beside fdcore's float32")
    args = parser.parse_args(argv)
    settings = [s for s in args.settings.split(",") if s]
    if unknown := [s for s in settings if s not in SETTINGS]:
        parser.error(f"unknown settings {unknown}; known: {', '.join(SETTINGS)}")
    python = os.path.join(args.peer_dir, "venv", "bin", "python")
    if not os.path.exists(python):
        parser.error(
            f"the vLLM peer (its `vllm bench serve` drives every server) is not in {args.peer_dir}: "
            "run ../shared/peers/vllm-cpu/setup.sh first"
        )
    if not args.no_llama_cpp and (problem := llama_cpp_missing(args.llama_dir)):
        parser.error(problem)
    model = model_dir(args)
    ggufs = (
        {} if args.no_llama_cpp else llama_ggufs(model, os.path.join(HOME, "bench"), python, args.llama_dir, settings)
    )
    loads = [("rate", None)] if args.rate else [(f"concurrency {c}", c) for c in args.concurrency]
    slots = max(args.concurrency) if not args.rate else 64
    # a slot's context: the random prompt's text re-tokenized by the server can be longer than it was
    context = 4 * args.input_len + args.output_len + 64

    table: dict[tuple[str, str], dict[str, dict]] = {}  # (setting, load) -> system -> metrics
    offline: dict[str, float] = {}
    load_before = os.getloadavg()[0]
    for setting in settings:
        systems = [(f"fdcore {setting}", lambda setting=setting: start_fdcore(model, setting, args.threads))]
        if setting in ggufs:
            systems.append(
                (
                    f"llama-server {SETTINGS[setting][2]}",
                    lambda setting=setting: start_llama_server(
                        args.llama_dir, ggufs[setting], args.threads, slots, context
                    ),
                )
            )
        if args.vllm and setting == "float32":
            systems.append(("vLLM fp32", lambda: start_vllm(model, args.peer_dir, 128, "float32")))
            if has_avx512_bf16():
                systems.append(("vLLM bf16", lambda: start_vllm(model, args.peer_dir, 128, "bfloat16")))
        servers: dict[str, Server] = {}
        try:
            for name, start in systems:  # (all up at once: an idle server takes no CPU from the one measured)
                print(f"{setting}: starting {name} ...", flush=True)
                servers[name] = start()
                servers[name].wait_ready()
            for label, concurrency in loads:
                if concurrency == 1:
                    table[(setting, label)], offline[setting] = alternate_c1(servers, model, args)
                    continue
                for name, server in servers.items():
                    print(f"{setting}: {name}, {label} ...", flush=True)
                    table.setdefault((setting, label), {})[name] = bench_serve(
                        server, args.peer_dir, model, args, concurrency, args.prompts
                    )
        finally:
            for server in servers.values():
                server.stop()

    print(
        f"\n{args.input_len} tokens in, {args.output_len} out (greedy, ignore_eos, streaming), load from "
        f"`vllm bench serve`; {args.threads} threads each; model {model}; load average {load_before:.2f} "
        f"before, {os.getloadavg()[0]:.2f} after ({len(os.sched_getaffinity(0))} cores)"
    )
    for (setting, label), by_system in table.items():
        names = list(by_system)
        print(f"\n{setting}, {label}:")
        print(
            f"{'metric':18s}"
            + "".join(f"{n:>20s}" for n in names)
            + "".join(f"{'fdcore/' + n.split()[0]:>20s}" for n in names[1:])
        )
        for metric, _key in [*METRICS, ("failed requests", None), ("tok/s if all done", None)]:
            values = [by_system[n][metric] for n in names]
            ratios = [values[0] / v if v else float("nan") for v in values[1:]]
            print(f"{metric:18s}" + "".join(f"{v:20.2f}" for v in values) + "".join(f"{r:20.2f}" for r in ratios))
        if label == "concurrency 1" and setting in offline:
            pairs = offline[setting]
            ratios = [http / off for off, http in pairs]
            print(
                f"{'offline tpot ms':18s}{statistics.median(off for off, _ in pairs):20.2f}   (HTTP / offline, "
                f"round by round: {' '.join(f'{r:.2f}' for r in ratios)}; median {statistics.median(ratios):.2f})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
