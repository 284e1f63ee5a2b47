"""Batch-1 decoding on SmolLM2-135M: fdcore in each precision beside llama.cpp on the same weights.

One request at a time, 32 prompt tokens in (seeded random ids), 64 out (greedy, ignore_eos);
generation tokens/s, for:

- fdcore, through its real serving path: ``AsyncLLM`` over the whole actor tree, the worker with
  ``workers.omp_threads = T`` (``workers.standby = false``: no spare worker loading beside it). A
  request's figure is its decode alone, as llama-bench's tg64 is: (tokens - first) / (time of the
  last streamed token - time of the first), the first token being the prefill's. One warm-up
  request, then ``--repeat`` requests (each its own prompt); mean and standard deviation, as
  llama-bench reports them. Settings: float32, bfloat16, wint8 and wint4, each only when this
  fdcore's configuration accepts it on this CPU (asked of ``parse_config``; a refused one is shown
  with the reason).
- llama.cpp: ``llama-bench -m GGUF -p 32 -n 64 -t T -r 1``, REPEAT times (``-r REPEAT`` once where
  fdcore does not run beside it) (tg64: 64 single-token decodes from an empty context, after a
  warm-up; pp32: one 32-token prompt). The GGUFs hold fdcore's own
  weights: fdcore's GGUF reader exports SmolLM2's Q4_1 file (what fdcore runs) to a float32 HF
  directory (tools/export_hf.py), which llama.cpp's ``convert_hf_to_gguf.py`` writes as F32, BF16
  and Q8_0; Q4_1 is the original file. Rows pair float32/F32, bfloat16/BF16, wint8/Q8_0,
  wint4/Q4_1. Converted files are cached in ``$FDCORE_HOME/bench/`` (default ~/.cache/fdcore).

Both use the same thread count T (``--threads``, default: all cores). A pair alternates: each
timed fdcore request is followed by one llama-bench run (``-r 1``) while the tree idles, so both
sides see the same minutes of the machine (its speed drifts by 10-25 % within minutes here). Needs the llama.cpp peer
(``/tmp/llama-cpp-peer``, made by ``../shared/peers/llama-cpp/setup.sh``) and a python with
torch + transformers for the converter (``--convert-python``; /tmp/refvenv or the vLLM peer's
venv are found by themselves).

Usage: python benchmarks/bench_batch1.py [--threads T] [--repeat 5] [--settings float32,wint8]
           [--llama-dir /tmp/llama-cpp-peer] [--convert-python PY] [--no-llama-cpp] [--no-fdcore]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

from fdcore import AsyncLLM, SamplingParams
from fdcore.config import Config, ConfigError, parse_config

INPUT_LEN, OUTPUT_LEN = 32, 64
SETUP_SCRIPT = os.path.normpath(os.path.join(ROOT, "..", "shared", "peers", "llama-cpp", "setup.sh"))
CONVERT_PYTHONS = ["/tmp/refvenv/bin/python", "/tmp/vllm-peer/venv/bin/python"]
THREAD_ENV = ("KMP_BLOCKTIME", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_DEBUG_CPU_TYPE")

# fdcore setting -> (model.dtype, model.quantization, llama.cpp type, converter --outtype or None:
# the original file)
SETTINGS = {
    "float32": ("float32", "none", "F32", "f32"),
    "bfloat16": ("bfloat16", "none", "BF16", "bf16"),
    "wint8": ("float32", "wint8", "Q8_0", "q8_0"),
    "wint4": ("float32", "wint4", "Q4_1", None),
}


# ---------------------------------------------------------------------- fdcore
def fdcore_config(model: str, setting: str, threads: int) -> Config:
    """The setting's configuration; ConfigError when this fdcore or this CPU does not take it."""
    dtype, quantization = SETTINGS[setting][:2]
    return parse_config(f"""
[model]
path = "{model}"
dtype = "{dtype}"
quantization = "{quantization}"
[scheduler]
max_num_seqs = 8
[workers]
omp_threads = {threads}
standby = false
""")


def prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(INPUT_LEN)] for _ in range(count)]


async def decode_rate(llm: AsyncLLM, prompt: list[int], output_len: int = OUTPUT_LEN) -> float:
    """Tokens/s between the first streamed token (the prefill's) and the last."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    first = last = None
    before = total = 0
    async for out in llm.generate(prompt, params):
        if out.outputs.finish_reason == "error":
            raise RuntimeError(f"request failed: {out.error_code} {out.error_msg}")
        count = len(out.outputs.token_ids)
        if not count:
            continue
        now = time.perf_counter()
        if first is None:
            first, before = now, count
        last, total = now, total + count
    if total != output_len or last == first:
        raise RuntimeError(f"{total} tokens streamed, expected {output_len}")
    return (total - before) / (last - first)


def run_fdcore(config: Config, vocab: int, repeat: int, between=None) -> list[float]:
    """fdcore's timed requests; ``between()`` (if given) runs after each, in a thread, while the tree
    idles: how llama-bench's repetitions alternate with fdcore's requests."""

    async def main() -> list[float]:
        async with AsyncLLM(config) as llm:
            warm, *timed = prompts(repeat + 1, vocab)
            await decode_rate(llm, warm)
            rates = []
            for prompt in timed:
                rates.append(await decode_rate(llm, prompt))
                if between is not None:
                    await asyncio.to_thread(between)
            return rates

    return asyncio.run(main())


class LlamaRuns:
    """llama-bench repetitions gathered one call at a time (``-r 1`` each), so that they can alternate
    with fdcore's requests: this host's speed drifts by 10-25 % within minutes, and a pair measured in
    alternation sees the same drift on both sides."""

    def __init__(self, llama_dir: str, gguf: str, threads: int):
        self.args = (llama_dir, gguf, threads)
        self.samples: dict[str, list[float]] = {}
        self.notes: set[str] = set()

    def __call__(self, repeat: int = 1) -> None:
        out, note = run_llama_bench(*self.args, repeat)
        for test, values in out.items():
            self.samples.setdefault(test, []).extend(values)
        if note:
            self.notes.add(note)


# ---------------------------------------------------------------------- llama.cpp
def converted_ggufs(source: str, cache: str, python: str, llama_dir: str, outtypes: list[str]) -> dict[str, str]:
    """outtype -> GGUF made by convert_hf_to_gguf.py from fdcore's float32 export of ``source``
    (each made once; kept in ``cache``)."""
    from export_hf import export_hf

    stem = os.path.basename(source).removesuffix(".gguf")
    hf_dir = os.path.join(cache, f"{stem}.hf-float32")
    files = {t: os.path.join(cache, f"{stem}.{t}.gguf") for t in outtypes}
    missing = [t for t, f in files.items() if not os.path.isfile(f)]
    if missing and not os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
        print(f"exporting {source} -> {hf_dir} (fdcore's GGUF reader, float32)", flush=True)
        export_hf(source, hf_dir, "float32")
    for outtype in missing:
        print(f"converting {hf_dir} -> {files[outtype]} (convert_hf_to_gguf.py --outtype {outtype})", flush=True)
        tmp = files[outtype] + ".part"
        result = subprocess.run(
            [
                python,
                os.path.join(llama_dir, "src", "convert_hf_to_gguf.py"),
                hf_dir,
                "--outtype",
                outtype,
                "--outfile",
                tmp,
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"convert_hf_to_gguf.py --outtype {outtype} failed:\n{result.stderr[-3000:]}")
        os.replace(tmp, files[outtype])
    return files


def run_llama_bench(llama_dir: str, gguf: str, threads: int, repeat: int) -> tuple[dict[str, list[float]], str]:
    """({"pp32": [tok/s per repetition], "tg64": [...]} from llama-bench's JSON, a note).

    llama-bench's default (``--repack 1``) lets ggml's extra buffer types take the weights: AMX's where
    the CPU flags have amx_*. On a CPU whose flags say AMX but whose kernel or hypervisor does not run it
    (seen: an AMD EPYC with amx_bf16 in /proc/cpuinfo), llama.cpp dies in ggml_backend_amx_mul_mat
    (SIGSEGV) for Q8_0 and Q4_1. Then it runs again with ``--repack 0`` (its own weights, its own
    AVX-512 kernels: for these types on x86 that turns off only the AMX buffer, so it is llama.cpp's best
    setting that runs), and the note says so."""
    cmd = [
        os.path.join(llama_dir, "bin", "llama-bench"),
        "-m",
        gguf,
        "-p",
        str(INPUT_LEN),
        "-n",
        str(OUTPUT_LEN),
        "-t",
        str(threads),
        "-r",
        str(repeat),
        "-o",
        "json",
    ]
    result, note = subprocess.run(cmd, capture_output=True, text=True, check=False), ""
    if result.returncode < 0:
        note = f"llama.cpp: --repack 0 (its default died of signal {-result.returncode})"
        cmd += ["--repack", "0"]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    out = {}
    for test in json.loads(result.stdout):
        name = f"pp{test['n_prompt']}" if test["n_gen"] == 0 else f"tg{test['n_gen']}"
        out[name] = [float(x) for x in test["samples_ts"]]
    return out, note


def llama_cpp_missing(llama_dir: str) -> str:
    for part in ("bin/llama-bench", "src/convert_hf_to_gguf.py"):
        if not os.path.exists(os.path.join(llama_dir, part)):
            return (
                f"llama.cpp peer not found ({os.path.join(llama_dir, part)} is missing). Build it "
                f"(about 10-15 minutes on 2 cores):\n    bash {SETUP_SCRIPT} {llama_dir}\n"
                "or run with --no-llama-cpp for fdcore alone."
            )
    return ""


# ---------------------------------------------------------------------- report
def mean_sd(values: list[float] | None) -> str:
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.1f} ± {sd:.1f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="fdcore's workers.omp_threads and llama-bench's -t (default: every core this process may run on)",
    )
    parser.add_argument("--repeat", type=int, default=5, help="timed requests / llama-bench repetitions")
    parser.add_argument(
        "--settings", default=",".join(SETTINGS), help=f"comma-separated subset of {','.join(SETTINGS)}"
    )
    parser.add_argument("--llama-dir", default="/tmp/llama-cpp-peer")
    parser.add_argument(
        "--convert-python",
        help="a python with torch + transformers for convert_hf_to_gguf.py "
        f"(default: the first of {', '.join(CONVERT_PYTHONS)})",
    )
    parser.add_argument("--no-llama-cpp", action="store_true", help="fdcore alone")
    parser.add_argument("--no-fdcore", action="store_true", help="llama.cpp alone")
    args = parser.parse_args(argv)
    settings = [s for s in args.settings.split(",") if s]
    if unknown := [s for s in settings if s not in SETTINGS]:
        parser.error(f"unknown settings {unknown}; known: {', '.join(SETTINGS)}")

    from fdcore.checkpoint import read_config
    from fdcore.checkpoint.fetch import fetch_smollm2

    source = fetch_smollm2()
    vocab = read_config(source)["vocab_size"]
    home = os.environ.get("FDCORE_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "fdcore")
    ggufs: dict[str, str] = {}
    if not args.no_llama_cpp:
        if problem := llama_cpp_missing(args.llama_dir):
            print(problem, file=sys.stderr)
            return 2
        python = args.convert_python or next((p for p in CONVERT_PYTHONS if os.path.exists(p)), None)
        if python is None:
            print(
                "no python with torch + transformers for convert_hf_to_gguf.py: pass --convert-python", file=sys.stderr
            )
            return 2
        outtypes = [SETTINGS[s][3] for s in settings if SETTINGS[s][3]]
        converted = converted_ggufs(source, os.path.join(home, "bench"), python, args.llama_dir, outtypes)
        ggufs = {s: converted[SETTINGS[s][3]] if SETTINGS[s][3] else source for s in settings}

    load = os.getloadavg()[0]
    rows = []
    for setting in settings:
        fd, fd_note = None, ""
        llama = LlamaRuns(args.llama_dir, ggufs[setting], args.threads) if setting in ggufs else None
        if not args.no_fdcore:
            try:
                config = fdcore_config(source, setting, args.threads)
            except ConfigError as exc:
                fd_note = f"not run: {str(exc).split(': ', 1)[-1]}"
            else:
                print(
                    f"fdcore {setting}: {args.repeat} requests"
                    + (f", each followed by one llama-bench {SETTINGS[setting][2]} run" if llama else "")
                    + " ...",
                    flush=True,
                )
                try:
                    fd = run_fdcore(config, vocab, args.repeat, llama)
                except Exception as exc:
                    fd_note = f"failed: {exc}"
        if llama is not None and len(llama.samples.get(f"tg{OUTPUT_LEN}", [])) < args.repeat:
            print(f"llama-bench {SETTINGS[setting][2]}: {os.path.basename(ggufs[setting])} ...", flush=True)
            llama.samples.clear()
            llama(args.repeat)  # alone: fdcore did not run (or failed) beside it
        if llama is not None:
            fd_note = "; ".join(n for n in (fd_note, *sorted(llama.notes)) if n)
        rows.append((setting, fd, fd_note, llama.samples if llama else {}))

    print(
        f"\nSmolLM2-135M-Instruct, batch 1, {INPUT_LEN} tokens in / {OUTPUT_LEN} out, {args.threads} threads "
        f"each, mean ± sd of {args.repeat}; load average {load:.2f} before, {os.getloadavg()[0]:.2f} after "
        f"({len(os.sched_getaffinity(0))} cores)"
    )
    if runtime := " ".join(f"{k}={os.environ[k]}" for k in THREAD_ENV if k in os.environ):
        print(f"threading environment (fdcore's worker inherits it): {runtime}")
    header = (
        f"{'setting':10s} {'fdcore tok/s':>15s} {'llama.cpp tg64 tok/s':>22s} {'ratio':>6s} "
        f"{'llama.cpp pp32 tok/s':>21s}  note"
    )
    print(header)
    print("-" * len(header))
    for setting, fd, note, llama in rows:
        tg = llama.get(f"tg{OUTPUT_LEN}")
        ratio = f"{statistics.mean(fd) / statistics.mean(tg):.2f}" if fd and tg else "-"
        kind = f"({SETTINGS[setting][2]})" if tg else ""
        print(
            f"{setting:10s} {mean_sd(fd):>15s} {mean_sd(tg) + ' ' + kind:>22s} {ratio:>6s} "
            f"{mean_sd(llama.get(f'pp{INPUT_LEN}')):>21s}  {note}"
        )
    print(
        "\nratio = fdcore / llama.cpp generation tok/s. fdcore: decode only (first streamed token to last) "
        "through AsyncLLM and the actor tree; llama.cpp: llama-bench tg64 (decodes from an empty context)."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
