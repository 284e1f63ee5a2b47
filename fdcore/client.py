"""The thin client: embed fdcore in any Python program (``AsyncLLM``, and the sync ``LLM``).

::

    from fdcore import AsyncLLM, SamplingParams

    async with AsyncLLM("fdcore.toml") as llm:          # starts the actor tree ...
        async for out in llm.generate("Hello", SamplingParams(max_tokens=32)):
            print(out.outputs[0].text, end="")          # ... and streams deltas

``AsyncLLM(config)`` starts ``python -m fdcore.supervisor --config`` as a child
(it stops when the program ends, however it ends); ``AsyncLLM.connect()``
attaches to a tree that is already running. Any number of processes, up to
``engine.max_clients``, can use one tree at once: each claims a *client slot*
(an inbox the engine answers on) by locking it, so a slot is freed by the
kernel the moment its owner dies, and the engine then aborts what that owner
left running.

Streaming: each ``RequestOutput`` from ``generate`` carries the *new* tokens
and text since the previous one (FastDeploy's convention); ``LLM.generate``
returns whole outputs. A request the engine refuses ends with one output with
``finish_reason == "error"``, ``error_code`` (400, 429, ...) and ``error_msg``
naming the field and the limit; nothing is raised for it.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field

import msgspec

from fdcore.actors import health, topology
from fdcore.actors.health import HealthBoard, State
from fdcore.config import Config
from fdcore.ipc import Inbox, Receiver, Ring, RingEmpty, Sender, names
from fdcore.protocol import (AbortRequest, AddRequest, ClientMessage, Hello, Metrics, SamplingParams,
                             ServingStats, StatsQuery, Update, Welcome)

__all__ = ["AsyncLLM", "LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineError"]

_ENCODE = msgspec.msgpack.Encoder().encode


class EngineError(RuntimeError):
    """The tree could not be started or reached, or it went away."""

    def __init__(self, message: str, error_code: int = 500):
        super().__init__(message)
        self.error_code = error_code


@dataclass
class CompletionOutput:
    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[list[tuple[int, float]]] | None = None  # per token: (chosen id, lp), then top-N
    finish_reason: str | None = None  # stop | length | abort | error


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | list | None = None
    prompt_token_ids: list[int] | None = None
    outputs: CompletionOutput = field(default_factory=CompletionOutput)
    finished: bool = False
    metrics: Metrics | None = None
    error_code: int = 0
    error_msg: str = ""


# --------------------------------------------------------------------- tree
class _Tree:
    """The supervisor we started (if any) and the instance id we talk to."""

    def __init__(self, instance: str, proc: subprocess.Popen | None = None, config_file: str | None = None):
        self.instance = instance
        self.proc = proc
        self.config_file = config_file

    @classmethod
    def start(cls, config, timeout: float) -> "_Tree":
        path, temporary = _config_file(config)
        read_fd, write_fd = os.pipe()
        cmd = [sys.executable, "-m", "fdcore.supervisor", "--config", path, "--ready-fd", str(write_fd),
               "--stop-with-parent"]
        proc = subprocess.Popen(cmd, pass_fds=(write_fd,), process_group=0, stdin=subprocess.DEVNULL)
        os.close(write_fd)
        try:
            instance = _read_ready(read_fd, proc, timeout)
        except BaseException:
            _terminate(proc, 5.0)
            if temporary:
                os.unlink(path)
            raise
        finally:
            os.close(read_fd)
        return cls(instance, proc, path if temporary else None)

    @classmethod
    def find(cls, instance: str | None) -> "_Tree":
        running = sorted({e.instance_id for e in names.list_entries()
                          if e.filename.endswith("-engine") and names.pid_alive(e.owner_pid)})
        if instance is None:
            if len(running) != 1:
                raise EngineError(f"connect(): {len(running)} running fdcore instances ({', '.join(running)}); "
                                  "name one with instance=...")
            instance = running[0]
        elif instance not in running:
            raise EngineError(f"connect(): no running fdcore instance {instance!r} (running: {running})")
        return cls(instance)

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return names.pid_alive(int(self.instance.rsplit(".", 1)[1]))

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is not None:
            _terminate(self.proc, timeout)
            self.proc = None
        if self.config_file:
            os.unlink(self.config_file)
            self.config_file = None


def _config_file(config) -> tuple[str, bool]:
    if isinstance(config, (str, os.PathLike)):
        return os.fspath(config), False
    from fdcore.supervisor import render_config

    if config is None:
        config = Config()
    if not isinstance(config, Config):
        raise TypeError(f"config must be a TOML file path or a fdcore.config.Config, got {type(config).__name__}")
    fd, path = tempfile.mkstemp(prefix="fdcore-config-", suffix=".toml")
    with os.fdopen(fd, "w") as f:
        f.write(render_config(config))
    return path, True


def _read_ready(fd: int, proc: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    data = b""
    while not data.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise EngineError(f"the fdcore tree did not become ready within {timeout:g} s")
        if select.select([fd], [], [], remaining)[0]:
            chunk = os.read(fd, 256)
            if not chunk:
                code = proc.wait()
                raise EngineError(f"the fdcore tree failed to start (supervisor exit code {code}); "
                                  "its log above says why")
            data += chunk
    return data.decode().strip()


def _terminate(proc: subprocess.Popen, timeout: float) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# --------------------------------------------------------------- connection
class Connection:
    """One claimed client slot: sends requests to the engine, receives its answers."""

    def __init__(self, tree: _Tree, timeout: float = 30.0):
        self.tree = tree
        self.slot, self.lock_fd = self._claim(tree.instance)
        try:
            client = f"client{self.slot}"
            self.inbox = Inbox.attach(topology.inbox_name(tree.instance, client), ["engine"])
            self.receiver = Receiver(self.inbox, ClientMessage)
            engine = topology.inbox_name(tree.instance, "engine")
            self.sender = Sender(Ring.attach(f"{engine}.{client}"))
            self._send_lock = threading.Lock()
            self.welcome = self.handshake(timeout)
        except BaseException:
            os.close(self.lock_fd)
            raise

    @staticmethod
    def _claim(instance: str) -> tuple[int, int]:
        slot = 0
        while True:
            path = os.path.join(names.SHM_DIR, topology.inbox_name(instance, f"client{slot}").lstrip("/"))
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                raise EngineError(f"all {slot} client slots of instance {instance} are taken "
                                  "(engine.max_clients)", 503) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return slot, fd
            except BlockingIOError:
                os.close(fd)
                slot += 1

    def engine_alive(self) -> bool:
        return names.pid_alive(self.welcome.engine_pid)

    def handshake(self, timeout: float) -> Welcome:
        """Hello / Welcome with the engine (a restarted one too: our links outlive it). The
        engine aborts whatever this slot had running; what it had sent is dropped here."""
        session = secrets.randbits(62)
        self.send(Hello(self.slot, session))
        deadline = time.monotonic() + timeout
        while True:  # whatever a previous owner of the slot left in the ring is dropped
            try:
                message = self.receiver.recv(timeout=max(0.0, deadline - time.monotonic()))
            except RingEmpty:
                raise EngineError(f"the engine of {self.tree.instance} did not answer within {timeout:g} s") from None
            if isinstance(message, Welcome) and message.session == session:
                self.welcome = message
                return message

    def send(self, message) -> None:
        with self._send_lock:
            self.sender.send(message, timeout=30.0)

    def submit(self, request_id: str, prompt, params: SamplingParams, resume_token_ids=(),
               resume_text_chars: int = 0) -> None:
        body: dict = {"sampling_params": params}
        if isinstance(prompt, str):
            body["prompt"] = prompt
        elif isinstance(prompt, dict):
            body.update(prompt)  # {"prompt_token_ids": [...]} or {"messages": [...]}
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            body["messages"] = prompt
        else:
            body["prompt_token_ids"] = prompt
        self.send(AddRequest(self.slot, request_id, msgspec.Raw(_ENCODE(body)), time.time(),
                             list(resume_token_ids), resume_text_chars))

    def resubmit(self, flights: dict) -> None:
        """Hand a restarted engine these requests again ({request id: _InFlight}), each with the
        tokens and text already received, so their streams resume where they were."""
        for request_id, flight in flights.items():
            self.submit(request_id, flight.prompt, flight.params, flight.token_ids, flight.text_chars)

    def abort(self, request_id: str) -> None:
        self.send(AbortRequest(self.slot, request_id))

    def close(self) -> None:
        self.sender.close()
        self.inbox.close()
        os.close(self.lock_fd)  # releases the slot


def chat_prompt(messages: list[dict], *, tools: list[dict] | None = None, documents: list[dict] | None = None,
                add_generation_prompt: bool | None = None, continue_final_message: bool | None = None,
                chat_template_kwargs: dict | None = None, chat_template: str | None = None) -> dict:
    """A chat prompt for ``generate``: the messages and the template options given (transformers'
    ``apply_chat_template`` names; None leaves an option to the engine: no tools or documents, a
    generation prompt unless the final message is continued, the model's default template)."""
    options = {"tools": tools, "documents": documents, "add_generation_prompt": add_generation_prompt,
               "continue_final_message": continue_final_message, "chat_template_kwargs": chat_template_kwargs,
               "chat_template": chat_template}
    return {"messages": messages, **{name: value for name, value in options.items() if value is not None}}


def _output(request_id: str, prompt, update: Update, prompt_token_ids) -> RequestOutput:
    return RequestOutput(request_id, prompt, prompt_token_ids,
                         CompletionOutput(0, update.text, list(update.token_ids), update.logprobs,
                                          update.finish_reason),
                         update.finish_reason is not None, update.metrics, update.error_code, update.error_msg)


def check_health(tree: _Tree, stale_after: float = 10.0) -> tuple[bool, str]:
    """(True, "") while the supervisor lives and every actor is READY with a fresh heartbeat."""
    if not tree.alive():
        return False, f"the supervisor of {tree.instance} is gone"
    try:
        board = HealthBoard.attach(topology.health_name(tree.instance))
    except Exception as exc:
        return False, f"no health board ({exc})"
    try:
        now = time.monotonic_ns()
        for slot in range(board.slots):
            state = board.read(slot, health.STATE)
            if state != State.READY:
                return False, f"actor in slot {slot} is {State(state).name}"
            age = (now - board.read(slot, health.HEARTBEAT)) / 1e9
            if age > stale_after:
                return False, f"actor in slot {slot} has not ticked for {age:.1f} s"
        return True, ""
    finally:
        board.close()


class _Client:
    """What both clients are: a tree (started here, or found running) and a claimed slot in it."""

    def __init__(self, config=None, *, start_timeout: float = 300.0, _tree: _Tree | None = None):
        self._tree = _tree or _Tree.start(config, start_timeout)
        try:
            self._conn = Connection(self._tree)
        except BaseException:
            if _tree is None:
                self._tree.stop()
            raise

    @classmethod
    def connect(cls, instance: str | None = None):
        """Attach to a tree started with ``python -m fdcore.supervisor --config``."""
        return cls(_tree=_Tree.find(instance))

    @property
    def instance(self) -> str:
        return self._tree.instance


# -------------------------------------------------------------------- async
class AsyncLLM(_Client):
    """Asynchronous client: many concurrent streaming requests from one event loop."""

    def __init__(self, config=None, *, start_timeout: float = 300.0, _tree: _Tree | None = None):
        super().__init__(config, start_timeout=start_timeout, _tree=_tree)
        self._queues: dict[str, asyncio.Queue] = {}
        self._inflight: dict[str, _InFlight] = {}  # what a restarted engine must be given again
        self._stats: dict[int, asyncio.Future] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._closing = threading.Event()

    # ---------------------------------------------------------------- public
    async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None):
        """Stream ``RequestOutput`` deltas of one request until it finishes."""
        self._ensure_reader()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already streaming in this client")
        queue = self._queues[request_id] = asyncio.Queue()
        params = sampling_params or SamplingParams()
        self._inflight[request_id] = _InFlight(prompt, params)
        finished = False
        prompt_ids = None
        try:
            self._conn.submit(request_id, prompt, params)
            while not finished:
                update = await queue.get()
                prompt_ids = update.prompt_token_ids or prompt_ids
                out = _output(request_id, prompt, update, prompt_ids)
                finished = out.finished
                yield out
        finally:
            self._queues.pop(request_id, None)
            self._inflight.pop(request_id, None)
            if not finished and not self._closing.is_set():
                self._conn.abort(request_id)  # the caller stopped listening: stop computing

    async def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None,
                   request_id: str | None = None, **options):
        """Stream the answer to one conversation; ``options`` as :func:`chat_prompt` (tools, ...)."""
        async for out in self.generate(chat_prompt(messages, **options), sampling_params, request_id):
            yield out

    async def abort(self, request_id: str) -> None:
        self._conn.abort(request_id)

    async def check_health(self) -> tuple[bool, str]:
        return check_health(self._tree)

    async def stats(self, timeout: float = 10.0) -> ServingStats:
        """Running / waiting requests, steps, preemptions, KV-cache usage and prefix hit rate."""
        self._ensure_reader()
        nonce = secrets.randbits(62)
        future = self._stats[nonce] = self._loop.create_future()
        self._conn.send(StatsQuery(nonce, self._conn.slot))
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self._stats.pop(nonce, None)

    async def shutdown(self) -> None:
        self._closing.set()
        if self._reader is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._reader.join)
        self._conn.close()
        self._tree.stop()

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    # ---------------------------------------------------------------- reader
    def _ensure_reader(self) -> None:
        if self._reader is None:
            self._loop = asyncio.get_running_loop()
            self._reader = threading.Thread(target=self._read, name="fdcore-client-reader", daemon=True)
            self._reader.start()

    def _read(self) -> None:
        """Reader thread: wait on the inbox, hand batches to the event loop; notice a dead engine."""
        next_check = time.monotonic() + ENGINE_CHECK_INTERVAL
        while not self._closing.is_set():
            try:
                messages = self._conn.receiver.recv_many(timeout=ENGINE_CHECK_INTERVAL)
            except RingEmpty:
                messages = []
            if messages:
                self._loop.call_soon_threadsafe(self._dispatch, messages)
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + ENGINE_CHECK_INTERVAL
                if not self._tree.alive():
                    self._loop.call_soon_threadsafe(self._fail_all, _tree_gone(self._tree))
                    return
                if not self._conn.engine_alive():
                    self._recover()

    def _recover(self) -> None:
        """The engine died: greet its successor, then hand it every stream again, each with the
        tokens and text already received, so the streams resume where they were."""
        try:
            self._conn.handshake(RECOVERY_TIMEOUT)
        except EngineError:
            self._loop.call_soon_threadsafe(self._fail_all, _tree_gone(self._tree))
            return
        self._loop.call_soon_threadsafe(self._conn.resubmit, self._inflight)

    def _dispatch(self, messages: list) -> None:
        for message in messages:
            if isinstance(message, Update):
                queue = self._queues.get(message.request_id)
                if queue is not None:
                    self._inflight[message.request_id].received(message)
                    queue.put_nowait(message)
            elif isinstance(message, ServingStats):
                future = self._stats.get(message.nonce)
                if future is not None and not future.done():
                    future.set_result(message)

    def _fail_all(self, reason: str) -> None:
        """The tree is gone: every open stream ends with an error output saying why."""
        for request_id, queue in self._queues.items():
            queue.put_nowait(Update(request_id, [], "", "error", error_code=503, error_msg=reason))


ENGINE_CHECK_INTERVAL = 0.2  # seconds between looks at whether the engine (and the tree) still live
RECOVERY_TIMEOUT = 300.0     # how long a restarted engine may take to answer


@dataclass
class _InFlight:
    """A request as its client knows it: enough to submit it again to a restarted engine."""

    prompt: object
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    text_chars: int = 0

    def received(self, update: Update) -> None:
        self.token_ids += update.token_ids
        self.text_chars += len(update.text)


def _tree_gone(tree: _Tree) -> str:
    if tree.proc is not None and tree.proc.poll() is not None:
        return f"the fdcore tree stopped (supervisor exit code {tree.proc.returncode}; its log says why)"
    return f"the fdcore tree {tree.instance} stopped"


# --------------------------------------------------------------------- sync
class LLM(_Client):
    """Synchronous helper: ``LLM(config).generate(prompts, params) -> list[RequestOutput]``."""

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion (concurrently); outputs in the order of ``prompts``."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts")
        batch = uuid.uuid4().hex[:8]
        results = {f"{batch}-{i}": RequestOutput(f"{batch}-{i}", p) for i, p in enumerate(prompts)}
        for (request_id, out), p in zip(results.items(), params, strict=True):
            self._conn.submit(request_id, out.prompt, p or SamplingParams())
        flights = {rid: _InFlight(out.prompt, p or SamplingParams())
                   for (rid, out), p in zip(results.items(), params, strict=True)}
        bar = _Progress(len(prompts), enabled=use_tqdm)
        pending = len(results)
        next_check = time.monotonic() + ENGINE_CHECK_INTERVAL
        while pending:
            try:
                messages = self._conn.receiver.recv_many(timeout=ENGINE_CHECK_INTERVAL)
            except RingEmpty:
                messages = []
            for message in messages:
                out = results.get(getattr(message, "request_id", None))
                if out is None or out.finished:
                    continue
                flights[out.request_id].received(message)
                _accumulate(out, message)
                if out.finished:
                    pending -= 1
                    bar.advance()
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + ENGINE_CHECK_INTERVAL
                if not self._tree.alive():
                    _fail(results, _tree_gone(self._tree))
                    break
                if not self._conn.engine_alive():  # resume every unfinished request on the new engine
                    self._conn.handshake(RECOVERY_TIMEOUT)
                    self._conn.resubmit({rid: f for rid, f in flights.items() if not results[rid].finished})
        bar.close()
        return list(results.values())

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, **options) -> list[RequestOutput]:
        """Answer one conversation, or each of a list of them; ``options`` as :func:`chat_prompt`."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([chat_prompt(c, **options) for c in conversations], sampling_params, use_tqdm)

    def check_health(self) -> tuple[bool, str]:
        return check_health(self._tree)

    def stats(self, timeout: float = 10.0) -> ServingStats:
        nonce = secrets.randbits(62)
        self._conn.send(StatsQuery(nonce, self._conn.slot))
        deadline = time.monotonic() + timeout
        while True:
            for message in self._conn.receiver.recv_many(timeout=max(0.0, deadline - time.monotonic())):
                if isinstance(message, ServingStats) and message.nonce == nonce:
                    return message

    def shutdown(self) -> None:
        self._conn.close()
        self._tree.stop()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _accumulate(out: RequestOutput, update: Update) -> None:
    c = out.outputs
    c.text += update.text
    c.token_ids += update.token_ids
    if update.logprobs:
        c.logprobs = (c.logprobs or []) + update.logprobs
    if update.prompt_token_ids is not None:
        out.prompt_token_ids = list(update.prompt_token_ids)
    if update.finish_reason is not None:
        c.finish_reason = update.finish_reason
        out.finished = True
        out.metrics = update.metrics
        out.error_code, out.error_msg = update.error_code, update.error_msg


def _fail(results: dict[str, RequestOutput], reason: str) -> None:
    for out in results.values():
        if not out.finished:
            _accumulate(out, Update(out.request_id, [], "", "error", error_code=503, error_msg=reason))


class _Progress:
    """A one-line progress bar on stderr (only when it is a terminal, or forced)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done = total, 0
        self.enabled = enabled and sys.stderr.isatty()
        self.started = time.monotonic()

    def advance(self) -> None:
        self.done += 1
        if self.enabled:
            filled = 30 * self.done // self.total
            rate = self.done / max(1e-9, time.monotonic() - self.started)
            sys.stderr.write(f"\rgenerating [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} "
                             f"({rate:.1f} req/s)")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
