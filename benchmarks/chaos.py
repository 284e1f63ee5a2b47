"""Chaos: SIGKILL random actors while streams run; every stream must equal its fault-free run.

N concurrent streaming requests (half greedy, half seeded sampling) run once
without faults, then again while K SIGKILLs hit random actors (worker,
scheduler, cache manager, engine) at random moments, all drawn from one seed.
Each kill waits until tokens flow again, then a random pause, then the next.

Reported: requests identical to the fault-free run / total, kills (= restarts)
per actor, and the pause each crash caused: the longest silence any stream open
at the kill saw, from the kill through its next AFTER_KILL tokens (tokens already
in flight arrive right after a kill; the stall comes after them), p50 and max per
actor kind and overall. A worker killed while its warm spare stood ready and one
killed while the spare was still loading (the previous kill's replacement: kills
come faster than a spare loads) are different recoveries, a promotion against a
load, and are reported apart; ``--wait-warm`` waits for the spare before each
kill. ``--from-decode`` holds the first kill until every stream has its first
token: the pause of a kill in the first prefill is that prefill's recompute. After every
restart the tree must run exactly one process per actor title (checked: a
restart that leaves a second engine, or none, fails the run).

Usage: python benchmarks/chaos.py [--streams 32] [--kills 10] [--seed 0] [--max-tokens 300]
                                  [--strategy one_for_one|one_for_all|rest_for_one]
                                  [--model tiny|smollm2|PATH] [--dtype float32|bfloat16]
                                  [--quantization none|wint8|wint4]
                                  [--shared-weights auto|on|off] [--shared-kv on|off] [--wait-warm] [--from-decode]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fdcore import AsyncLLM, SamplingParams
from fdcore.actors import health, topology
from fdcore.actors.health import HealthBoard
from fdcore.checkpoint.fetch import fetch_smollm2
from fdcore.checkpoint.tiny import ensure_tiny_model
from fdcore.config import default_model_path, parse_config
from fdcore.supervisor import actor_census
from fdcore.supervisor import actor_pid as find_actor

CHILDREN = {"worker": "worker0", "scheduler": "scheduler", "cache": "cache", "engine": "engine"}  # kind: child


def actor_pid(client: AsyncLLM, kind: str) -> int | None:
    return find_actor(client._tree.proc.pid, CHILDREN[kind])


def workload(streams: int, max_tokens: int, rng: random.Random):
    prompts = [[rng.randrange(5, 4000) for _ in range(rng.randrange(16, 64))] for _ in range(streams)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        if i % 2
        else SamplingParams(temperature=0.9, top_p=0.95, seed=i, max_tokens=max_tokens, ignore_eos=True)
        for i in range(streams)
    ]
    return prompts, params


AFTER_KILL = 3  # tokens per stream the pause is measured over: more than the two steps in flight


class Clock:
    """When each stream's tokens arrived, which streams ended, and an event per token so the chaos
    task can wait on them."""

    def __init__(self):
        self.arrivals: dict[str, list[float]] = {}
        self.done: set[str] = set()
        self.tick = asyncio.Event()

    def token(self, request_id: str) -> None:
        self.arrivals.setdefault(request_id, []).append(time.monotonic())
        self.tick.set()

    def end(self, request_id: str) -> None:
        self.done.add(request_id)
        self.tick.set()

    def open_streams(self) -> set[str]:
        return set(self.arrivals) - self.done

    def after(self, request_id: str, moment: float) -> list[float]:
        return [t for t in self.arrivals[request_id] if t > moment][:AFTER_KILL]

    def waiting(self, moment: float, streams: set[str]) -> set[str]:
        """Of ``streams``, those that have not ended and have fewer than AFTER_KILL tokens since ``moment``."""
        return {r for r in streams if r not in self.done and len(self.after(r, moment)) < AFTER_KILL}

    def longest_silence(self, moment: float, streams: set[str]) -> float | None:
        gaps = [
            max(b - a for a, b in zip([moment, *times], times, strict=False))
            for r in streams
            if (times := self.after(r, moment))
        ]
        return max(gaps, default=None)


async def stream(client, prompt, params, request_id, clock: Clock | None):
    tokens, text, error = [], "", ""
    async for out in client.generate(prompt, params, request_id=request_id):
        tokens += out.outputs.token_ids
        text += out.outputs.text
        error = out.error_msg
        if clock is not None and out.outputs.token_ids:
            clock.token(request_id)
    if clock is not None:
        clock.end(request_id)
    return tokens, text, error


async def census_after_restart(client, child_ids: list[str], timeout: float = 30.0) -> str:
    """'' once every actor runs as exactly one process; else what was still wrong at the timeout
    (a token can arrive while siblings are still being restarted, so this waits, bounded)."""
    deadline = time.monotonic() + timeout
    while (wrong := actor_census(client._tree.proc.pid, child_ids)) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return wrong


async def wait_for_warm_spare(board: HealthBoard, slot: int, timeout: float = 120.0) -> bool:
    """Until the worker's spare is warm (the health board is where a spare says so; no event says when:
    polled), or the timeout."""
    deadline = time.monotonic() + timeout
    while board.spare(slot) != health.SPARE_WARM and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return board.spare(slot) == health.SPARE_WARM


async def chaos(
    client,
    clock: Clock,
    kills: int,
    rng: random.Random,
    kinds: list[str],
    log: list,
    child_ids: list[str],
    census: list,
    board: HealthBoard,
    wait_warm: bool,
    decoding: int = 0,
):
    await clock.tick.wait()
    while len(clock.arrivals) < decoding:  # (--from-decode: until that many streams have their first token)
        clock.tick.clear()
        await clock.tick.wait()
    for _ in range(kills):
        kind = rng.choice(kinds)
        pause = rng.uniform(0.05, 0.4)
        slot = child_ids.index(CHILDREN[kind])
        if kind == "worker" and wait_warm:
            await wait_for_warm_spare(board, slot)
        await asyncio.sleep(pause)
        pid = actor_pid(client, kind)
        if pid is None:
            log.append((kind, None))  # not running at that moment: reported, not silently skipped
            continue
        if kind == "worker" and board.spare(slot) != health.SPARE_WARM:
            kind = "worker*"  # its replacement loads: the kill comes before the last one's spare warmed
        streams = clock.open_streams()
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        clock.tick.clear()
        while clock.waiting(killed_at, streams):  # until every open stream is flowing again (or ended)
            clock.tick.clear()
            await clock.tick.wait()
        silence = clock.longest_silence(killed_at, streams)
        log.append((kind, "idle" if silence is None else silence))  # idle: no stream had more to get
        census.append(await census_after_restart(client, child_ids))


async def main_async(args) -> int:
    rng = random.Random(args.seed)
    prompts, params = workload(args.streams, args.max_tokens, rng)
    model = (
        ensure_tiny_model(default_model_path())
        if args.model == "tiny"
        else fetch_smollm2()
        if args.model == "smollm2"
        else args.model
    )
    config = parse_config(
        f'[model]\npath = "{model}"\ndtype = "{args.dtype}"\nquantization = "{args.quantization}"\n'
        f'[supervisor]\nmax_restarts = {args.kills + 5}\nperiod = 600.0\nstrategy = "{args.strategy}"\n'
        f'[workers]\nshared_weights = "{args.shared_weights}"\n'
        f"[cache]\nshared_memory = {'true' if args.shared_kv == 'on' else 'false'}\n"
    )
    async with AsyncLLM(config) as client:
        clean_started = time.monotonic()
        clean = await asyncio.gather(
            *(stream(client, p, s, f"clean-{i}", None) for i, (p, s) in enumerate(zip(prompts, params, strict=True)))
        )
        clean_elapsed = time.monotonic() - clean_started
        clock, log, census = Clock(), [], []
        started = time.monotonic()
        board = HealthBoard.attach(topology.health_name(client._tree.instance))
        chaos_task = asyncio.ensure_future(
            chaos(
                client,
                clock,
                args.kills,
                rng,
                args.actors.split(","),
                log,
                topology.child_ids(config),
                census,
                board,
                args.wait_warm,
                args.streams if args.from_decode else 0,
            )
        )
        crashed = await asyncio.gather(
            *(stream(client, p, s, f"chaos-{i}", clock) for i, (p, s) in enumerate(zip(prompts, params, strict=True)))
        )
        elapsed = time.monotonic() - started
        chaos_task.cancel()
        healthy = await client.check_health()
        board.close()
    identical = sum(1 for a, b in zip(clean, crashed, strict=True) if a[:2] == b[:2] and not b[2])
    for i, (a, b) in enumerate(zip(clean, crashed, strict=True)):
        if a[:2] != b[:2] or b[2]:
            at = next(
                (j for j, (x, y) in enumerate(zip(a[0], b[0], strict=False)) if x != y), min(len(a[0]), len(b[0]))
            )
            print(
                f"stream {i} differs ({'greedy' if i % 2 else 'seeded'}): {len(a[0])} vs {len(b[0])} tokens, "
                f"first difference at token {at}: {a[0][at : at + 4]} vs {b[0][at : at + 4]}; "
                f"text equal: {a[1] == b[1]}; error: {b[2]!r}"
            )
    skipped = [k for k, p in log if p is None]
    idle = [k for k, p in log if p == "idle"]
    log = [(k, p) for k, p in log if p is not None]
    print(
        f"\nchaos ({args.strategy}; {os.path.basename(model)} {args.dtype}, quantization {args.quantization}): "
        f"{args.streams} streams x {args.max_tokens} tokens, {len(log)} of "
        f"{args.kills} kills done in {elapsed:.1f} s (fault-free run: {clean_elapsed:.1f} s; seed {args.seed}); "
        f"health after: {healthy}"
        + (f"\nkills skipped (no such process then): {skipped}" if skipped else "")
        + (f"\nkills after every stream had its last token (no pause to measure): {idle}" if idle else "")
    )
    print(f"identical to the fault-free run: {identical}/{args.streams}")
    wrong = [f"after kill {i + 1}: {w}" for i, w in enumerate(census) if w]
    print(
        f"one process per actor after each restart: {len(census) - len(wrong)}/{len(census)}"
        + "".join(f"\n  {w}" for w in wrong)
    )
    print(f"{'actor':10s} {'kills':>5s} {'pause p50 s':>12s} {'pause max s':>12s}")
    for kind in [*CHILDREN, "worker*", "all"]:
        pauses = [p for k, p in log if kind in (k, "all") and p != "idle"]
        if pauses:
            print(f"{kind:10s} {len(pauses):5d} {statistics.median(pauses):12.3f} {max(pauses):12.3f}")
    if any(k == "worker*" for k, _ in log):
        print(
            "worker*: a worker killed while its spare was still loading (the replacement loads; "
            "--wait-warm spaces the kills)"
        )
    if len(log) < args.kills and not skipped:
        print("the streams ended before every kill was done (restarts outlasted the workload)")
    return 0 if identical == args.streams and len(log) == args.kills and not wrong else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--actors", default="worker,scheduler,cache,engine")
    parser.add_argument("--strategy", default="one_for_one", choices=["one_for_one", "one_for_all", "rest_for_one"])
    parser.add_argument("--model", default="tiny", help="tiny (the bundled model), smollm2 (fetched once) or a path")
    parser.add_argument("--dtype", default="float32", help="model.dtype")
    parser.add_argument("--quantization", default="none", help="model.quantization")
    parser.add_argument(
        "--shared-weights", default="auto", choices=["auto", "on", "off"], help="workers.shared_weights"
    )
    parser.add_argument("--shared-kv", default="on", choices=["on", "off"], help="cache.shared_memory")
    parser.add_argument("--wait-warm", action="store_true", help="before each worker kill, wait for its warm spare")
    parser.add_argument("--from-decode", action="store_true", help="the first kill once every stream has a token")
    return asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
