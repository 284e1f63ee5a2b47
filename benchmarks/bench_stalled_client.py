"""A client that stops reading with 1,000 requests open: do the other clients notice?

One tree (bundled tiny model). A *neighbour* (this process, ``AsyncLLM``) streams 8 long requests;
once they run, a *crowd* client (another process, its own client slot) submits 1,000 long requests
and then, in each mode:

- ``reading``: keeps draining its inbox (the baseline: a healthy client with the same requests,
  so that the neighbour's share of every batch is the same in both modes);
- ``stalled``: is frozen (SIGSTOP) right after submitting: its ring fills, the engine holds its
  updates back and, after ``engine.client_stall_timeout``, disconnects it.

The neighbour's tokens/s are counted over the same window in both modes, from 1 s after the crowd
submitted until ``--window`` s later (well before the stall timeout, while the crowd's requests
still take their share of each step). For the stalled crowd the table also shows when the engine
cut it off (seconds after the freeze, from the engine's disconnected-clients count) and, once it is
thawed, how many of its 1,000 requests ended with the engine's "client disconnected" error.
Modes alternate for ``--rounds`` rounds; the ratio is stalled / reading, medians over rounds.

Usage: python benchmarks/bench_stalled_client.py [--requests 1000] [--window 4] [--stall-timeout 8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

NEIGHBOUR_STREAMS = 8
MAX_TOKENS = 1500
PROMPT = 16


def prompt(i: int) -> list[int]:
    return [5 + (i * 131 + j * 17) % 4000 for j in range(PROMPT)]


# ------------------------------------------------------------------ the crowd
def crowd(instance: str, requests: int) -> int:
    """Submit ``requests`` long requests, say so on stdout, then drain the inbox without decoding
    (cheap: a reading client must not cost the neighbour more CPU than a frozen one saves it).
    SIGUSR1 switches to decoding: count the requests that ended with the engine's disconnect error
    and print that count once every request has ended. SIGTERM aborts every request and exits."""
    from fdcore import SamplingParams
    from fdcore.client import Tree
    from fdcore.client.connection import Connection
    from fdcore.ipc import RingEmpty
    from fdcore.protocol import AbortRequest, Update

    conn = Connection(Tree.find(instance))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = [f"crowd-{i}" for i in range(requests)]
    for i, request_id in enumerate(ids):
        conn.submit(request_id, prompt(1000 + i), params)
    asked: list[int] = []  # signals received (a handler only records: see runtime.StopRequested)
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: asked.append(signum))
    print("submitted", flush=True)
    try:
        while not asked:
            try:
                conn.inbox.get_many(timeout=0.2)
            except RingEmpty:
                pass
        if signal.SIGTERM in asked:
            for request_id in ids:
                conn.send(AbortRequest(conn.slot, request_id))
            return 0
        ended = {}
        while len(ended) < requests:
            for message in conn.receiver.recv_many(timeout=30):
                if isinstance(message, Update) and message.finish_reason:
                    ended[message.request_id] = "disconnected" in (message.error_msg or "")
        print(f"{sum(ended.values())} of {requests}", flush=True)
    finally:
        conn.close()
    return 0


# --------------------------------------------------------------- the neighbour
async def one_round(llm, mode: str, args) -> dict:
    from fdcore import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    marks: list[float] = []  # one timestamp per token the neighbour received
    first = [asyncio.Event() for _ in range(NEIGHBOUR_STREAMS)]
    stop = asyncio.Event()

    async def stream(i: int) -> None:
        async for out in llm.generate(prompt(i), params, request_id=f"{mode}-{i}-{time.monotonic_ns()}"):
            now = time.monotonic()
            marks.extend([now] * len(out.outputs.token_ids))
            first[i].set()
            if stop.is_set():
                break

    streams = [asyncio.ensure_future(stream(i)) for i in range(NEIGHBOUR_STREAMS)]
    await asyncio.gather(*(e.wait() for e in first))  # running before the crowd queues behind them
    before = (await llm.stats()).disconnected_clients
    proc = subprocess.Popen(
        [sys.executable, __file__, "--crowd", llm.instance, "--requests", str(args.requests)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = await asyncio.to_thread(proc.stdout.readline)
        assert line.strip() == "submitted", f"the crowd did not start: {line!r}"
        frozen = time.monotonic()
        if mode == "stalled":
            os.kill(proc.pid, signal.SIGSTOP)
        start, end = frozen + 1.0, frozen + 1.0 + args.window
        await asyncio.sleep(end - time.monotonic())  # the window passes: no event to wait on
        rate = sum(start <= t < end for t in marks) / args.window
        row = {"mode": mode, "rate": rate, "cut_after": None, "errors": None}
        if mode == "stalled":
            row["cut_after"] = await wait_for_disconnect(llm, before, frozen, args.stall_timeout + 30)
            os.kill(proc.pid, signal.SIGUSR1)
            os.kill(proc.pid, signal.SIGCONT)
            row["errors"] = await asyncio.to_thread(proc.stdout.readline)
        else:
            proc.terminate()
        await asyncio.to_thread(proc.wait, 60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stop.set()
        await asyncio.gather(*streams)
    await wait_idle(llm)
    return row


async def wait_for_disconnect(llm, before: int, since: float, timeout: float) -> float:
    """Seconds from ``since`` until the engine counted one more disconnected client (its stats are
    the only place that says so: polled)."""
    deadline = time.monotonic() + timeout
    while (await llm.stats()).disconnected_clients == before:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the stalled client was not disconnected within {timeout:g} s")
        await asyncio.sleep(0.05)
    return time.monotonic() - since


async def wait_idle(llm, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while (stats := await llm.stats()).running or stats.waiting:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the engine did not go idle: {stats}")
        await asyncio.sleep(0.05)


async def main(args) -> None:
    from fdcore import AsyncLLM
    from fdcore.config import parse_config

    config = parse_config(
        f"[engine]\nclient_stall_timeout = {args.stall_timeout}\nmax_clients = 4\n"
        f"max_pending_requests = {args.requests + 100}\n"
    )
    rows = []
    async with AsyncLLM(config) as llm:
        for _ in range(args.rounds):
            for mode in ("reading", "stalled"):
                rows.append(await one_round(llm, mode, args))
    print(f"{'mode':<10} {'neighbour tok/s':>16} {'cut off after s':>16}  crowd requests ended 'disconnected'")
    for row in rows:
        cut = f"{row['cut_after']:.2f}" if row["cut_after"] is not None else "-"
        print(f"{row['mode']:<10} {row['rate']:>16.0f} {cut:>16}  {(row['errors'] or '-').strip()}")
    median = {m: statistics.median(r["rate"] for r in rows if r["mode"] == m) for m in ("reading", "stalled")}
    print(
        f"neighbour throughput, stalled / reading crowd (medians over {args.rounds} rounds): "
        f"{median['stalled'] / median['reading']:.3f}   (stall timeout {args.stall_timeout:g} s, "
        f"window {args.window:g} s, {args.requests} crowd requests)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--window", type=float, default=4.0)
    parser.add_argument("--stall-timeout", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--crowd", metavar="INSTANCE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.crowd:
        sys.exit(crowd(args.crowd, args.requests))
    if args.window + 1.0 >= args.stall_timeout:
        parser.error("--window + 1 s must end before --stall-timeout (the crowd must still be connected)")
    asyncio.run(main(args))
