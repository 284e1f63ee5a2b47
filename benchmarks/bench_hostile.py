"""Hostile clients against ``fdcore serve``: does anyone honest notice?

One server, in its default configuration (the bundled tiny model unless ``--model``). A quiet round of
32 honest streams first gives every stream's reference text. Then, for ``--minutes``, everything at
once:

- honest: 32 greedy streams, round after round, each compared with its reference;
- a probe: a one-token completion every half second (its latency);
- a light client: a short streamed request every second, from an address of its own (time to first token);
- heavy requests: issue 43's (64 choices of a 2,040-token prompt, echo, 20 logprobs, 20 prompt logprobs;
  64 chat choices of 2,000 tokens with 20 top logprobs), one after another;
- 1,100 slow sockets: half of them send half a request head, half a whole head and one byte of a
  100 KB body; each reconnects when the server closes it;
- a client that corrupts its own link: it claims a client slot and, in turn, publishes a record with a
  wrong check word, one with an impossible length, a tail out of bounds, a record nested 100,000 deep
  and random bytes over its ring's header, greeting the engine again after each;
- a /metrics flood: 30 scrapers as fast as they can;
- four greedy clients, each from its own address: a request for 16 choices of a 1,500-token prompt for
  500 tokens, streamed and never read (``--greedy-every S``: another every S seconds, every connection
  kept open).

Attackers speak from other loopback addresses (127.0.0.2 and up) than the honest clients
(127.0.0.1), as they would from other hosts. It prints a table: honest streams complete and identical,
probe latency and light TTFT percentiles, requests each attacker got through, restarts of any actor (from
the supervisor's log), and whether the tree is up at the end. Pass: 100 % identical, probe p99 < 1 s,
light TTFT p99 < 2 s, 0 restarts, up.

Usage: python benchmarks/bench_hostile.py [--minutes 10] [--model DIR] [--port 8431] [--greedy-every S]
                                         [--without greedy,...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

HONEST = "127.0.0.1"
SLOW, RINGS, HEAVY, METRICS, LIGHT = "127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5", "127.0.0.6"
GREEDY = ["127.0.0.7", "127.0.0.8", "127.0.0.9", "127.0.0.10"]
STREAMS, STREAM_TOKENS = 32, 64


# ------------------------------------------------------------------ HTTP by hand
async def request(
    port: int,
    body: dict | None,
    path: str = "/v1/completions",
    source: str = HONEST,
    read_all: bool = True,
    timeout: float = 120.0,
) -> tuple[int, bytes, float]:
    """(status, body, seconds to the first body byte) of one request on a connection of its own."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    try:
        payload = b"" if body is None else json.dumps(body).encode()
        method = "GET" if body is None else "POST"
        writer.write(
            f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
            + payload
        )
        started = time.monotonic()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        status = int(head.split(b" ", 2)[1])
        first = await asyncio.wait_for(reader.read(1), timeout)
        ttfb = time.monotonic() - started
        rest = await asyncio.wait_for(reader.read(), timeout) if read_all else b""
        return status, first + rest, ttfb
    finally:
        writer.close()


def stream_text(raw: bytes) -> tuple[str, bool]:
    """The text of an SSE completion stream (chunked transfer framing ignored) and whether [DONE] came."""
    text = "".join(
        json.loads(m)["choices"][0]["text"]
        for m in re.findall(rb"data: (\{.*?\})\r?\n", raw)
        if json.loads(m)["choices"]
    )
    return text, b"data: [DONE]" in raw


def honest_body(i: int) -> dict:
    return {
        "model": "tiny",
        "prompt": [5 + i, 17, 29, 41 + i],
        "max_tokens": STREAM_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


async def honest_round(port: int) -> list[tuple[str, bool]]:
    replies = await asyncio.gather(*(request(port, honest_body(i)) for i in range(STREAMS)), return_exceptions=True)
    return [("", False) if isinstance(r, BaseException) else stream_text(r[1]) for r in replies]


# ------------------------------------------------------------------ the attackers
async def forever(stop: asyncio.Event, work, counter: dict, key: str) -> None:
    while not stop.is_set():
        try:
            await work()
            counter[key] = counter.get(key, 0) + 1
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError):
            counter[key + " failed"] = counter.get(key + " failed", 0) + 1
            await asyncio.sleep(0.05)


async def slow_socket(port: int, body_variant: bool, stop: asyncio.Event, counter: dict) -> None:
    head = (
        (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\n\r\n{"
        )
        if body_variant
        else b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nCont"
    )
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(SLOW, 0))
            writer.write(head)
            counter["slow sockets opened"] = counter.get("slow sockets opened", 0) + 1
            stopped = asyncio.ensure_future(stop.wait())
            closed = asyncio.ensure_future(reader.read())
            await asyncio.wait({stopped, closed}, return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            closed.cancel()
            writer.close()
        except OSError:
            await asyncio.sleep(0.1)


async def greedy_client(port: int, source: str, stop: asyncio.Event, counter: dict, every: float) -> None:
    """Sends a huge streamed request (another every ``every`` s; 0: just one), each on a connection it never
    reads from (all kept open)."""
    writers = []
    for k in range(1 << 30):
        body = {
            "model": "tiny",
            "prompt": [5 + (j * 7 + k) % 4000 for j in range(1500)],
            "n": 16,
            "max_tokens": 500,
            "ignore_eos": True,
            "temperature": 1.0,
            "stream": True,
        }
        payload = json.dumps(body).encode()
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
            writer.write(
                f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
            writers.append(writer)
            counter["greedy requests"] = counter.get("greedy requests", 0) + 1
        except OSError:
            counter["greedy requests failed"] = counter.get("greedy requests failed", 0) + 1
        try:
            await asyncio.wait_for(stop.wait(), every or None)
            break
        except TimeoutError:
            continue
    for writer in writers:
        writer.close()


def ring_attacker(instance: str, stop: threading.Event, counter: dict) -> None:
    """A client of the engine (its own slot) that breaks its own link, again and again."""
    import struct

    from fdcore import SamplingParams
    from fdcore.client import Tree
    from fdcore.client.connection import Connection
    from fdcore.ipc.ring_layout import HEADER_SIZE, TAIL

    conn = Connection(Tree.find(instance))
    rng = random.Random(43)
    kinds = ["check_word", "length", "tail", "deep", "header_bytes"]
    try:
        while not stop.is_set():
            ring, kind = conn.sender.ring, kinds[counter.get("ring attacks", 0) % len(kinds)]
            conn.submit(f"x{rng.random()}", [5, 6, 7], SamplingParams(max_tokens=50))
            tail, mask = ring._tail, ring._mask
            if kind in ("check_word", "length"):
                header = (4, 0xDEADBEEF) if kind == "check_word" else (0xFFFFFFF0, (tail >> 3) & 0xFFFFFFFF)
                struct.pack_into("II", ring._mm, HEADER_SIZE + (tail & mask), *header)
                ring._words[TAIL] = tail + 16
            elif kind == "tail":
                ring._words[TAIL] = tail + 3
            elif kind == "deep":
                ring.put(b"\x91" * 100_000 + b"\xc0")
            else:
                start = rng.randrange(0, HEADER_SIZE + 64)
                garbage = os.urandom(rng.randrange(1, HEADER_SIZE + 64 - start + 1))
                ring._mm[start : start + len(garbage)] = garbage
            ring._bell.semaphore.release()
            counter["ring attacks"] = counter.get("ring attacks", 0) + 1
            try:
                conn.handshake(10.0)
            except Exception:
                counter["ring re-greetings failed"] = counter.get("ring re-greetings failed", 0) + 1
            stop.wait(0.2)
    finally:
        conn.close()


# ------------------------------------------------------------------ the run
def start_server(port: int, model: str | None) -> tuple[subprocess.Popen, str, list[str]]:
    cmd = [sys.executable, "-m", "fdcore.cli", "serve", "--port", str(port), "--served-model-name", "tiny"]
    cmd += [model] if model else []
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, start_new_session=True)
    log: list[str] = []
    ready = threading.Event()
    found: list[str] = []

    def read() -> None:
        for line in proc.stderr:
            log.append(line.rstrip())
            if "event=ready" in line:
                found.append(line.split("instance=")[1].split()[0])
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(300) or not found:
        proc.kill()
        raise SystemExit("the server did not start:\n" + "\n".join(log[-30:]))
    return proc, found[0], log


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def run(port: int, minutes: float, instance: str, without: set[str], greedy_every: float) -> dict:
    reference = await honest_round(port)
    assert all(done for _, done in reference), "the quiet round did not complete"
    stop, thread_stop, counter = asyncio.Event(), threading.Event(), {}
    probes, ttfts, honest = [], [], {"streams": 0, "complete": 0, "identical": 0}
    slowest: list[tuple[float, float]] = []  # (probe latency, seconds into the attack)
    began = time.monotonic()
    heavy = [
        (
            {
                "model": "tiny",
                "prompt": [5 + (i * 37) % 4000 for i in range(2040)],
                "n": 64,
                "echo": True,
                "logprobs": 20,
                "prompt_logprobs": 20,
            },
            "/v1/completions",
        ),
        (
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "n": 64,
                "logprobs": True,
                "top_logprobs": 20,
                "max_tokens": 2000,
            },
            "/v1/chat/completions",
        ),
    ]

    async def probe():
        started = time.monotonic()
        await request(port, {"model": "tiny", "prompt": "hi", "max_tokens": 1}, timeout=30)
        probes.append(time.monotonic() - started)
        slowest.append((probes[-1], started - began))
        await asyncio.sleep(0.5)

    async def light():
        _, _, ttfb = await request(
            port, {"model": "tiny", "prompt": [9, 8, 7], "max_tokens": 8, "stream": True}, source=LIGHT, timeout=60
        )
        ttfts.append(ttfb)
        await asyncio.sleep(1.0)

    async def heavy_one():
        body, path = heavy[counter.get("heavy", 0) % 2]
        status, _, _ = await request(port, body, path, source=HEAVY, timeout=60)
        counter[f"heavy answered {status}"] = counter.get(f"heavy answered {status}", 0) + 1

    async def scrape():
        await request(port, None, "/metrics", source=METRICS, timeout=30)

    tasks = [
        asyncio.ensure_future(forever(stop, probe, counter, "probes")),
        asyncio.ensure_future(forever(stop, light, counter, "light requests")),
    ]
    if "heavy" not in without:
        tasks.append(asyncio.ensure_future(forever(stop, heavy_one, counter, "heavy")))
    if "metrics" not in without:
        tasks += [asyncio.ensure_future(forever(stop, scrape, counter, "metrics scrapes")) for _ in range(30)]
    if "slow" not in without:
        tasks += [asyncio.ensure_future(slow_socket(port, i % 2 == 1, stop, counter)) for i in range(1100)]
    if "greedy" not in without:
        tasks += [asyncio.ensure_future(greedy_client(port, source, stop, counter, greedy_every)) for source in GREEDY]
    ring = threading.Thread(target=ring_attacker, args=(instance, thread_stop, counter), daemon=True)
    if "rings" not in without:
        ring.start()
    deadline = time.monotonic() + minutes * 60
    while time.monotonic() < deadline:
        for (text, done), (want, _) in zip(await honest_round(port), reference, strict=True):
            honest["streams"] += 1
            honest["complete"] += done
            honest["identical"] += done and text == want
    stop.set()
    thread_stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    if ring.is_alive():
        ring.join(30)
    _, text, _ = await request(port, None, "/metrics")
    counter["preemptions (engine)"] = int(float(re.search(rb"^fdcore_preemptions (\S+)", text, re.M).group(1)))
    return {
        "honest": honest,
        "probes": probes,
        "ttfts": ttfts,
        "counter": counter,
        "slowest": sorted(slowest, reverse=True)[:5],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--model", default=None, help="what fdcore serve serves (default: the bundled tiny model)")
    parser.add_argument("--port", type=int, default=8431)
    parser.add_argument(
        "--greedy-every",
        type=float,
        default=0.0,
        help="seconds between each greedy client's requests (default 0: one request each)",
    )
    parser.add_argument(
        "--without",
        default="",
        help="attackers to leave out, comma-separated: heavy, slow, rings, metrics, greedy (to see what each costs)",
    )
    args = parser.parse_args()
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    proc, instance, log = start_server(args.port, args.model)
    try:
        without = set(filter(None, args.without.split(",")))
        result = asyncio.run(run(args.port, args.minutes, instance, without, args.greedy_every))
        up = proc.poll() is None
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    restarts = [line for line in log if re.search(r"event=(exited|hung|restarted|intensity_exceeded)", line)]
    honest, counter = result["honest"], result["counter"]
    probe99, light99 = percentile(result["probes"], 0.99), percentile(result["ttfts"], 0.99)
    identical = honest["identical"] / max(1, honest["streams"])
    rows = [
        ("honest streams (all rounds)", honest["streams"]),
        ("  complete", f"{honest['complete']} ({honest['complete'] / max(1, honest['streams']):.1%})"),
        ("  identical to the quiet run", f"{honest['identical']} ({identical:.1%})"),
        ("probe latency p50 / p99 (s)", f"{statistics.median(result['probes']):.3f} / {probe99:.3f}"),
        ("light client TTFT p50 / p99 (s)", f"{statistics.median(result['ttfts']):.3f} / {light99:.3f}"),
        *((name, count) for name, count in sorted(counter.items())),
        ("actor restarts (supervisor log)", len(restarts)),
        ("tree up at the end", up),
    ]
    width = max(len(name) for name, _ in rows)
    print(f"\nbench_hostile: {args.minutes:g} min against fdcore serve ({args.model or 'tiny model'})")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    print("  slowest probes (s, at s): " + ", ".join(f"{lat:.2f} at {at:.0f}" for lat, at in result["slowest"]))
    for line in restarts[:10]:
        print("  " + line)
    passed = (
        identical == 1.0
        and honest["complete"] == honest["streams"]
        and probe99 < 1.0
        and light99 < 2.0
        and not restarts
        and up
    )
    print(f"  {'verdict':<{width}}  {'pass' if passed else 'FAIL'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
