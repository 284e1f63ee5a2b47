"""fdcore's shared-memory ring against the transports a user could pick instead.

Every figure comes from two processes (a sender and a receiver) started fresh
for each cell, measured in this one run:

- small:    N msgspec messages of ~60 bytes, encoded by the sender and decoded
            by the receiver, one send call per message (msg/s);
- batch64:  the same messages, 64 per call, each transport through its best
            batch path: fdcore's typed channel (Sender.send_many /
            Receiver.recv_many: the batch is one ring record), and for every
            peer the whole batch encoded by one msgspec call and sent as one
            message (faster than pickled lists or zmq multipart) (msg/s);
- 4KiB, 1MiB: raw byte payloads (GB/s);
- rtt:      ping-pong round trip of a small message, p50 and p99 (us);
- idle:     CPU used by a receiver blocked on an empty transport for 2 s (% of a core).

Usage: python benchmarks/bench_ipc.py [--small N] [--quick]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import resource
import statistics
import sys
import time
from dataclasses import dataclass

import msgspec

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fdcore.ipc import Receiver, Ring, Sender
from fdcore.ipc import names as ipc_names

BATCH = 64
CELL_TIMEOUT = 180  # a peer that wedges costs a NaN cell, never the whole run


class TokenMsg(msgspec.Struct, array_like=True, gc=False):
    """A typical engine -> client delta: request id, position, token, logprob, finished."""

    request_id: str
    position: int
    token_id: int
    logprob: float
    finished: bool


SAMPLE = TokenMsg("chatcmpl-7f3a9c2d81b0e4f1", 1234, 31337, -0.6931, False)
ENCODED = msgspec.msgpack.encode(SAMPLE)


# ------------------------------------------------------------------ transports
class Transport:
    """One-way link factory: ``setup`` in the parent, ``sender``/``receiver`` in children."""

    name = "?"
    big_ok = True

    def setup(self, max_bytes: int):
        return None

    def teardown(self, cfg) -> None:
        pass


class FdcoreRing(Transport):
    name = "fdcore"

    def setup(self, max_bytes):
        ring = Ring.create(max(1 << 22, 16 * max_bytes))
        self._ring = ring
        return ring.name

    def teardown(self, cfg):
        self._ring.close()
        self._ring.unlink()

    def sender(self, cfg):
        ring = Ring.attach(cfg)
        return ring.put, Sender(ring).send_many, ring.close

    def receiver(self, cfg):
        ring = Ring.attach(cfg)
        return ring.get, Receiver(ring, TokenMsg).recv_many, ring.close, lambda t: _swallow(ring.get, t)


class MpQueue(Transport):
    name = "mp.Queue"

    def setup(self, max_bytes):
        return mp.get_context("fork").Queue(maxsize=10000)

    def sender(self, q):
        return q.put, _blob_sender(q.put), q.close

    def receiver(self, q):
        return q.get, _blob_receiver(q.get), q.close, lambda t: _swallow(q.get, t)


class MpPipe(Transport):
    name = "mp.Pipe"

    def setup(self, max_bytes):
        return mp.get_context("fork").Pipe(duplex=False)

    def sender(self, pipe):
        conn = pipe[1]
        return conn.send_bytes, _blob_sender(conn.send_bytes), conn.close

    def receiver(self, pipe):
        conn = pipe[0]
        return conn.recv_bytes, _blob_receiver(conn.recv_bytes), conn.close, lambda t: conn.poll(t)


class Zmq(Transport):
    name = "pyzmq"

    def setup(self, max_bytes):
        return f"ipc:///tmp/bench-ipc-{os.getpid()}-{time.monotonic_ns()}"

    def teardown(self, addr):
        path = addr[len("ipc://") :]
        if os.path.exists(path):
            os.unlink(path)

    def sender(self, addr):
        import zmq

        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 100000)
        sock.connect(addr)
        big = 1 << 16

        def close():  # only term() waits for queued messages to leave
            sock.close(linger=-1)
            ctx.term()

        send = lambda b: sock.send(b, copy=len(b) < big)
        return send, _blob_sender(send), close

    def receiver(self, addr):
        import zmq

        sock = zmq.Context().socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, 100000)
        sock.bind(addr)
        return sock.recv, _blob_receiver(sock.recv), sock.close, lambda t: sock.poll(int(t * 1000))


class FasterFifo(Transport):
    name = "faster-fifo"

    def setup(self, max_bytes):
        from faster_fifo import Queue

        return Queue(max_size_bytes=max(1 << 22, 16 * max_bytes))

    def sender(self, q):
        return q.put, _blob_sender(q.put), lambda: None

    def receiver(self, q):
        return q.get, _blob_receiver(q.get), lambda: None, lambda t: _swallow(q.get, t)


def _blob_sender(put):
    encode = msgspec.msgpack.Encoder().encode
    return lambda messages: put(encode(messages))


def _blob_receiver(get):
    decode = msgspec.msgpack.Decoder(list[TokenMsg]).decode
    return lambda: decode(get())


def _swallow(get, timeout):
    try:
        get(timeout=timeout)
    except Exception:
        pass


TRANSPORTS = [FdcoreRing(), MpQueue(), MpPipe(), Zmq(), FasterFifo()]


# ------------------------------------------------------------------- workloads
@dataclass
class Cell:
    value: float
    extra: float | None = None


def _run_pair(transport, cfg, send_fn, recv_fn, *args) -> float:
    """Fork a receiver and a sender; returns what the receiver reports."""
    ctx = mp.get_context("fork")
    start = ctx.Barrier(2)
    result = ctx.Queue()
    recv = ctx.Process(target=_child, args=(recv_fn, transport, cfg, start, result, args))
    send = ctx.Process(target=_child, args=(send_fn, transport, cfg, start, None, args))
    recv.start()
    send.start()
    try:
        return result.get(timeout=CELL_TIMEOUT)
    except queue.Empty:
        return float("nan")
    finally:
        _reap(send, recv)


def _reap(*procs):
    for proc in procs:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def _child(fn, transport, cfg, start, result, args):
    value = fn(transport, cfg, start, *args)
    if result is not None:
        result.put(value)


def send_small(transport, cfg, start, n):
    put, _, close = transport.sender(cfg)
    encode = msgspec.msgpack.Encoder().encode
    msg = SAMPLE
    start.wait()
    for _ in range(n):
        put(encode(msg))
    close()


def recv_small(transport, cfg, start, n):
    get, _, close, _ = transport.receiver(cfg)
    decode = msgspec.msgpack.Decoder(TokenMsg).decode
    start.wait()
    t0 = time.perf_counter()
    for _ in range(n):
        decode(get())
    elapsed = time.perf_counter() - t0
    close()
    return n / elapsed


def send_batch(transport, cfg, start, n):
    _, put_batch, close = transport.sender(cfg)
    batch = [SAMPLE] * BATCH
    start.wait()
    for _ in range(n // BATCH):
        put_batch(batch)
    close()


def recv_batch(transport, cfg, start, n):
    _, get_batch, close, _ = transport.receiver(cfg)
    total = (n // BATCH) * BATCH
    start.wait()
    t0 = time.perf_counter()
    got = 0
    while got < total:
        got += len(get_batch())
    elapsed = time.perf_counter() - t0
    close()
    return total / elapsed


def send_bytes(transport, cfg, start, n, size):
    put, _, close = transport.sender(cfg)
    payload = os.urandom(size)
    start.wait()
    for _ in range(n):
        put(payload)
    close()


def recv_bytes(transport, cfg, start, n, size):
    get, _, close, _ = transport.receiver(cfg)
    start.wait()
    t0 = time.perf_counter()
    for _ in range(n):
        data = get()
    elapsed = time.perf_counter() - t0
    assert len(data) == size
    close()
    return n * size / elapsed / 1e9


def bench_rtt(transport, n):
    """Ping-pong over two one-way links; returns (p50, p99) in microseconds."""
    ping, pong = transport.setup(1 << 12), None
    other = type(transport)()
    pong = other.setup(1 << 12)
    try:
        ctx = mp.get_context("fork")
        result = ctx.Queue()
        server = ctx.Process(target=_echo, args=(transport, ping, other, pong, n))
        server.start()
        client = ctx.Process(target=_pinger, args=(transport, ping, other, pong, n, result))
        client.start()
        try:
            samples = result.get(timeout=CELL_TIMEOUT)
        except queue.Empty:
            samples = [float("nan")]
        _reap(client, server)
    finally:
        transport.teardown(ping)
        other.teardown(pong)
    samples.sort()
    return samples[len(samples) // 2], samples[int(len(samples) * 0.99)]


def _echo(transport, ping, other, pong, n):
    get, _, close_in, _ = transport.receiver(ping)
    put, _, close_out = other.sender(pong)
    for _ in range(n + 100):
        put(get())
    close_in()
    close_out()


def _pinger(transport, ping, other, pong, n, result):
    put, _, close_out = transport.sender(ping)
    get, _, close_in, _ = other.receiver(pong)
    samples = []
    clock = time.perf_counter
    for i in range(n + 100):
        t0 = clock()
        put(ENCODED)
        get()
        if i >= 100:
            samples.append((clock() - t0) * 1e6)
    close_out()
    close_in()
    result.put(samples)


def idle_cpu(transport, seconds=2.0):
    """CPU used by a receiver blocked for ``seconds`` on an empty link (% of one core)."""
    cfg = transport.setup(1 << 12)
    try:
        ctx = mp.get_context("fork")
        result = ctx.Queue()
        proc = ctx.Process(target=_idler, args=(transport, cfg, seconds, result))
        proc.start()
        value = result.get(timeout=60)
        _reap(proc)
    finally:
        transport.teardown(cfg)
    return value


def _idler(transport, cfg, seconds, result):
    _, _, close, wait = transport.receiver(cfg)
    wait(0.05)  # settle: first call may allocate
    before = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.monotonic()
    deadline = t0 + seconds
    while (left := deadline - time.monotonic()) > 0:
        wait(left)
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    close()
    result.put(100.0 * cpu / (time.monotonic() - t0))


def run_cell(transport, kind, args):
    if kind == "rtt":
        return bench_rtt(transport, args["rtt_n"])
    if kind == "idle":
        return idle_cpu(transport)
    size = {"small": 1 << 10, "batch64": 1 << 14, "4KiB": 4096, "1MiB": 1 << 20}[kind]
    cfg = transport.setup(size)
    try:
        if kind == "small":
            return _run_pair(transport, cfg, send_small, recv_small, args["small_n"])
        if kind == "batch64":
            return _run_pair(transport, cfg, send_batch, recv_batch, args["small_n"])
        n = args["4k_n"] if kind == "4KiB" else args["1m_n"]
        return _run_pair(transport, cfg, send_bytes, recv_bytes, n, size)
    finally:
        transport.teardown(cfg)


WORKLOADS = [  # (kind, unit, higher_is_better)
    ("small", "M msg/s", True),
    ("batch64", "M msg/s", True),
    ("4KiB", "GB/s", True),
    ("1MiB", "GB/s", True),
    ("rtt p50", "us", False),
    ("rtt p99", "us", False),
    ("idle", "% core", False),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=200_000, help="small messages per run")
    parser.add_argument("--repeat", type=int, default=3, help="runs per cell; the best is kept")
    parser.add_argument("--quick", action="store_true", help="short runs (smoke test)")
    parser.add_argument("--only", nargs="*", help="transport names to run")
    opts = parser.parse_args(argv)
    args = {"small_n": opts.small, "4k_n": 100_000, "1m_n": 2_000, "rtt_n": 20_000}
    if opts.quick:
        args = {"small_n": 20_000, "4k_n": 5_000, "1m_n": 100, "rtt_n": 1_000}
        opts.repeat = 1
    transports = [t for t in TRANSPORTS if not opts.only or t.name in opts.only]
    table = {t.name: {} for t in transports}
    for transport in transports:
        for kind in ("small", "batch64", "4KiB", "1MiB", "rtt", "idle"):
            runs = [run_cell(transport, kind, args) for _ in range(opts.repeat)]
            _store(table[transport.name], kind, runs)
            print(f"  {transport.name:12s} {kind:8s} {_fmt_runs(kind, runs)}", file=sys.stderr)
    ipc_names.sweep()
    print(render(table, args))
    return 0


def _store(row, kind, runs):
    if kind == "rtt":
        best = min(runs)
        row["rtt p50"], row["rtt p99"] = best
    elif kind == "idle":
        row["idle"] = statistics.median(runs)
    else:
        value = _best(runs, higher=True)
        row[kind] = value / 1e6 if kind in ("small", "batch64") else value


def _best(values, higher: bool) -> float:
    """The best of the values that are numbers (a failed cell is NaN, and max() over a list with
    a NaN depends on where the NaN stands); NaN only when none is."""
    numbers = [v for v in values if v == v]
    return (max if higher else min)(numbers) if numbers else float("nan")


def _fmt_runs(kind, runs):
    return " ".join(f"{r[0]:.1f}/{r[1]:.1f}" if isinstance(r, tuple) else f"{r:,.3f}" for r in runs)


def render(table, args) -> str:
    names = list(table)
    peers = [n for n in names if n != "fdcore"]
    head = f"{'workload':10s} {'unit':8s} " + " ".join(f"{n:>12s}" for n in names)
    if "fdcore" in table and peers:
        head += f" {'vs best peer':>13s}"
    lines = [
        f"small={args['small_n']:,} msgs, 4KiB x {args['4k_n']:,}, 1MiB x {args['1m_n']:,}, rtt x {args['rtt_n']:,}",
        head,
        "-" * len(head),
    ]
    for kind, unit, higher in WORKLOADS:
        cells = [table[n].get(kind) for n in names]
        line = f"{kind:10s} {unit:8s} " + " ".join(_fmt(v, kind) for v in cells)
        if "fdcore" in table and peers:
            best = _best([table[p][kind] for p in peers], higher)
            ours = table["fdcore"][kind]
            ratio = ours / best if higher else best / max(ours, 1e-9)
            line += f" {ratio:12.2f}x" if ratio == ratio else f" {'n/a':>13s}"
        lines.append(line)
    lines.append("vs best peer: fdcore's figure over the best peer's (>1 is better, lower-is-better rows inverted)")
    return "\n".join(lines)


def _fmt(v, kind):
    if v is None:
        return f"{'-':>12s}"
    return f"{v:12.4f}" if kind == "idle" else f"{v:12.3f}"


if __name__ == "__main__":
    sys.exit(main())
