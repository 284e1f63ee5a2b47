"""fdcore's configuration: one TOML file decoded by msgspec into typed Structs.

Every key has a default, so an empty file is valid wherever the defaults can
serve. Unknown keys and wrong types are rejected with a message that names the
file, the key and the expected type (:class:`ConfigError`).

Example (every key shown with its default)::

    [model]
    path = ""                 # HF-format checkpoint directory; "" = the bundled tiny model,
                              # made on first use in $FDCORE_HOME (default ~/.cache/fdcore)
    dtype = "auto"            # auto (= float32) | float32 | bfloat16 (projection weights in bf16, float32
                              # accumulation: CPUs with AVX512-BF16 only; refused elsewhere)
    quantization = "none"     # none | wint8 (weights int8 per row and block of 32, quantized at load; activations
                              # int8 per block of 32; AVX512-VNNI CPUs only) | wint4 (the layers' weights 4-bit per
                              # row and block of 32 with a float16 scale and minimum, llama.cpp's Q4_1; the LM head
                              # int8 as wint8; activations as wint8; AVX512-VNNI CPUs only)
    backend = "paddle"        # paddle | null (answers without computing: measures fdcore's own cost)
    kernels = "compiled"      # compiled: fdcore's C++ operators, built before the tree starts (a failure stops
                              # the start, naming the compiler's complaint) | python: without them (slower)
    generation_config = "auto"  # auto: the checkpoint's generation_config.json sampling values are the
                              # defaults of requests that leave them unset (as vLLM's "auto");
                              # none: fdcore's neutral defaults (temperature 1, max_tokens 16, ...)

    [cache]
    block_size = 16           # tokens per KV-cache block
    num_blocks = 1024         # KV-cache blocks per worker
    enable_prefix_caching = true
    dtype = "auto"            # auto (= the model's: bfloat16 for a bfloat16 model whose head_dim is a multiple
                              # of 32, else float32) | float32 | bfloat16 (half the memory a token, attention's
                              # products in bf16 with float32 sums: AVX512-BF16 CPUs only)
    shared_memory = true      # the KV cache in shared memory the supervisor holds: a crashed worker's successor
                              # finds every computed block, and its streams resume without recomputing them

    [scheduler]
    max_num_seqs = 128
    max_num_batched_tokens = 2048
    max_model_len = 2048
    long_prefill_tokens = 512 # prompt tokens a step computes while other requests wait for their next token

    [engine]
    max_clients = 8           # client slots (each AsyncLLM / LLM / API server takes one)
    max_pending_requests = 4096  # requests in the engine at once; more are refused (429)
    client_stall_timeout = 30.0  # seconds a client may leave its inbox full before it is cut off

    [workers]
    count = 1
    tensor_parallel_size = 1  # ranks of the one worker group (fdcore:worker:0..N-1), each 1/N of the model
    communicator = "shm"      # how the ranks sum: "shm" (one machine) or "paddle" (paddle.distributed: gloo / NCCL)
    omp_threads = 0           # a worker's math threads; 0: $OMP_NUM_THREADS when set, else the cores shared out
    standby = true            # keep a loaded spare per worker: a crashed worker is replaced in ~0.1 s
                              # instead of a fresh start (import + weights); costs its memory
    shared_weights = "auto"   # the packed weights once in shared memory for a rank's worker, spare and restarts:
                              # "on", "off", or "auto": on unless shared pages measure >20% slower here

    [supervisor]
    strategy = "one_for_one"  # one_for_one | one_for_all | rest_for_one
    max_restarts = 5          # more than this many restarts ...
    period = 60.0             # ... within this many seconds stops the whole tree
    start_timeout = 120.0     # seconds a child has to report ready
    shutdown_timeout = 5.0    # seconds a child has to stop after Stop, then SIGTERM, then SIGKILL
    heartbeat_interval = 0.5  # an idle actor still ticks this often
    hang_timeout = 10.0       # no tick (or no progress while busy) this long = hung: killed, restarted
    ring_capacity = 1048576   # bytes per inbox link

    [server]                  # the OpenAI-compatible HTTP server (actor fdcore:api)
    enabled = false           # a [server] section that names a port and leaves this out serves
    host = "127.0.0.1"        # only this machine, unless you say otherwise
    port = 8000
    model_name = ""           # the model id clients send; "" = the model directory's name
    api_key = ""              # "" = no key; else clients send "Authorization: Bearer KEY"
                              # (the environment variable FDCORE_API_KEY overrides it)
    max_request_bytes = 1048576  # larger request bodies get 413
    timeout_keep_alive = 5.0  # seconds an idle keep-alive connection is kept
    header_timeout = 10.0     # seconds a connection has to send a whole request head, else closed
    body_timeout = 30.0       # seconds a connection has, after the head, to send the body it declared
    max_connections = 2048    # connections kept open; past it (or past max_connections_per_peer from one
    max_connections_per_peer = 2048  # address) a new one closes the oldest that is not serving a request
    limit_concurrency = 1024  # requests served at once; more get 503 (0 = no limit)
    max_response_entries = 200000  # tokens a response may list: per choice, each output token with its
                              # top logprobs, and the prompt's with echo / prompt_logprobs; more: 400
    default_max_tokens = 1024  # chat's max_tokens when the request and generation_config.json give none
                              # (0 = up to the context)
    reasoning_parser = ""     # "deepseek_r1" | "qwen3": chat answers' <think>...</think> as reasoning_content
    drain_timeout = 30.0      # on stop: seconds the open requests may run out while new ones get 503; then
                              # what is left ends with finish_reason "abort", an error event and [DONE]
    processes = 1             # HTTP server processes sharing the port (SO_REUSEPORT; fdcore:api:0..N-1 when > 1):
                              # one that dies loses only its own connections, the others keep serving
"""

from __future__ import annotations

import json
import os
from typing import Literal

import msgspec

from fdcore.envs import fdcore_home


class ConfigError(ValueError):
    """A configuration file that cannot be used, with the reason."""


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class ModelConfig(_Section):
    path: str = ""
    backend: Literal["paddle", "null"] = "paddle"
    kernels: Literal["compiled", "python"] = "compiled"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    quantization: Literal["none", "wint8", "wint4"] = "none"
    generation_config: Literal["auto", "none"] = "auto"


class CacheConfig(_Section):
    block_size: int = 16
    num_blocks: int = 1024
    enable_prefix_caching: bool = True
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    shared_memory: bool = True  # the KV cache in a file the supervisor holds: it outlives a crashed worker


class SchedulerConfig(_Section):
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    long_prefill_tokens: int = 512
    max_model_len: int = 2048


class EngineConfig(_Section):
    max_clients: int = 8
    max_pending_requests: int = 4096
    client_stall_timeout: float = 30.0


class WorkersConfig(_Section):
    count: int = 1
    tensor_parallel_size: int = 1  # ranks of the worker group (fdcore.models.tensor_parallel)
    communicator: Literal["shm", "paddle"] = "shm"
    omp_threads: int = 0  # 0: see worker_threads()
    pin_cpus: bool = True  # each rank's main thread alone on a CPU, the control plane beside (fdcore.core.placement)
    standby: bool = True
    shared_weights: Literal["auto", "on", "off"] = "auto"  # fdcore.models.shared_weights


def kv_outlives_workers(config: Config) -> bool:
    """Whether each worker's KV cache lives in shared memory the supervisor holds (``cache.shared_memory``;
    the null backend has none): the supervisor then makes the files, and the scheduler keeps the prefix
    cache across a restart, its blocks' keys and values being still there."""
    return config.cache.shared_memory and config.model.backend != "null"


def worker_threads(workers: WorkersConfig, environ=os.environ) -> int:
    """The math threads each worker runs (its OpenMP / MKL threads): ``workers.omp_threads`` when
    set; else ``OMP_NUM_THREADS`` when the environment sets it (the tests pin 1); else the cores
    this process may run on, shared among the workers (the group's ranks). The other actors need little CPU beside a
    worker's matrix products, and those products are most of the work at every batch size."""
    if workers.omp_threads > 0:
        return workers.omp_threads
    pinned = environ.get("OMP_NUM_THREADS", "")
    if pinned.isdigit() and int(pinned) > 0:
        return int(pinned)
    return max(1, len(os.sched_getaffinity(0)) // worker_ranks(workers))


def worker_ranks(workers: WorkersConfig) -> int:
    """Worker processes of the tree (every rank of every worker group)."""
    return workers.count * workers.tensor_parallel_size


class SupervisorConfig(_Section):
    strategy: Literal["one_for_one", "one_for_all", "rest_for_one"] = "one_for_one"
    max_restarts: int = 5
    period: float = 60.0
    start_timeout: float = 120.0
    shutdown_timeout: float = 5.0
    heartbeat_interval: float = 0.5
    hang_timeout: float = 10.0
    ring_capacity: int = 1 << 20


class ServerConfig(_Section):
    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = ""
    api_key: str = ""
    max_request_bytes: int = 1 << 20
    timeout_keep_alive: float = 5.0
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_connections: int = 2048
    max_connections_per_peer: int = 2048
    limit_concurrency: int = 1024
    max_response_entries: int = 200000
    default_max_tokens: int = 1024
    reasoning_parser: Literal["", "deepseek_r1", "qwen3"] = ""  # chat: <think>...</think> as reasoning_content
    processes: int = 1
    drain_timeout: float = 30.0


class Config(_Section):
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    workers: WorkersConfig = msgspec.field(default_factory=WorkersConfig)
    supervisor: SupervisorConfig = msgspec.field(default_factory=SupervisorConfig)
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)


_SECTIONS = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "engine": EngineConfig,
    "workers": WorkersConfig,
    "supervisor": SupervisorConfig,
    "server": ServerConfig,
}

# (section, key, lowest allowed value) for every number that must be positive
_MINIMA = [
    ("cache", "block_size", 1),
    ("cache", "num_blocks", 1),
    ("scheduler", "max_num_seqs", 1),
    ("scheduler", "max_num_batched_tokens", 1),
    ("scheduler", "long_prefill_tokens", 1),
    ("scheduler", "max_model_len", 1),
    ("engine", "max_clients", 1),
    ("engine", "max_pending_requests", 1),
    ("engine", "client_stall_timeout", 0.001),
    ("workers", "count", 1),
    ("workers", "tensor_parallel_size", 1),
    ("workers", "omp_threads", 0),
    ("supervisor", "max_restarts", 0),
    ("supervisor", "period", 0.001),
    ("supervisor", "start_timeout", 0.001),
    ("supervisor", "shutdown_timeout", 0.0),
    ("supervisor", "heartbeat_interval", 0.001),
    ("supervisor", "hang_timeout", 0.001),
    ("supervisor", "ring_capacity", 4096),
    ("server", "port", 0),
    ("server", "max_request_bytes", 1024),
    ("server", "timeout_keep_alive", 0.001),
    ("server", "header_timeout", 0.001),
    ("server", "body_timeout", 0.001),
    ("server", "max_connections", 1),
    ("server", "max_connections_per_peer", 1),
    ("server", "limit_concurrency", 0),
    ("server", "default_max_tokens", 0),
    ("server", "max_response_entries", 1),
    ("server", "processes", 1),
    ("server", "drain_timeout", 0.0),
]


def load_config(path: str, *, check_model: bool = True) -> Config:
    """Read, decode and validate a configuration file."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the configuration ({exc.strerror})") from None
    return parse_config(raw, source=path, check_model=check_model)


def parse_config(raw: bytes | str, *, source: str = "<config>", check_model: bool = True) -> Config:
    """Decode TOML text into a validated :class:`Config`."""
    try:
        config = msgspec.toml.decode(raw, type=Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {_explain(str(exc))}") from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML ({exc})") from None
    _check_ranges(config, source)
    _serve_when_a_port_is_given(config, raw)
    if check_model:
        check_model_path(config, source)
    return config


def render_config(config: Config) -> str:
    """The effective configuration as TOML (every section and key), which :func:`parse_config`
    reads back: what ``--check`` prints, and the file an embedding client hands the supervisor."""
    return render_sections({name: msgspec.structs.asdict(getattr(config, name)) for name in Config.__struct_fields__})


def render_sections(sections: dict[str, dict]) -> str:
    """``{section: {key: value}}`` as TOML, unchecked (parse_config checks what it reads back)."""
    lines = []
    for section, keys in sections.items():
        lines.append(f"[{section}]")
        for key, value in keys.items():
            text = json.dumps(value) if not isinstance(value, bool) else str(value).lower()
            lines.append(f"{key} = {text}")
        lines.append("")
    return "\n".join(lines)


def config_memfd(config: Config) -> int:
    """The configuration rendered into an anonymous in-memory file (close-on-exec; a child given it in
    ``pass_fds`` reads it as :func:`fd_path`). Nothing is written to disk, so nothing is left there
    however the process ends, and a secret in it (``server.api_key``) never touches a file system."""
    fd = os.memfd_create("fdcore-config", os.MFD_CLOEXEC)
    os.write(fd, render_config(config).encode())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def fd_path(fd: int) -> str:
    """The path under which a process reads its own descriptor ``fd`` from the start (a new open file
    description: each reader its own offset)."""
    return f"/proc/self/fd/{fd}"


def _serve_when_a_port_is_given(config: Config, raw: bytes | str) -> None:
    """A ``[server]`` section with a ``port`` but no ``enabled`` key runs the server: whoever wrote a
    port meant to serve, and a silently absent server is the worst answer. ``enabled = false`` still
    wins (the port may be kept for later)."""
    section = msgspec.toml.decode(raw).get("server", {})
    if "port" in section and "enabled" not in section:
        config.server.enabled = True


def _explain(message: str) -> str:
    """msgspec says '... - at `$.cache.block_sise`'; say it in config terms."""
    text, _, where = message.partition(" - at `$")
    key = where.rstrip("`").lstrip(".")
    if text.startswith("Object contains unknown field"):
        name = text.split("`")[1]
        place = f"section [{key}]" if key else "the top level"
        return f"unknown key {name!r} in {place} (known keys: {_known_keys(key)})"
    return f"key {key!r}: {text}" if key else text


def _known_keys(section: str) -> str:
    return ", ".join((_SECTIONS[section] if section else Config).__struct_fields__)


def _check_ranges(config: Config, source: str) -> None:
    for section, key, lowest in _MINIMA:
        value = getattr(getattr(config, section), key)
        if value < lowest:
            raise ConfigError(f"{source}: key '{section}.{key}' is {value}, must be >= {lowest}")
    if config.workers.count != 1:
        raise ConfigError(
            f"{source}: key 'workers.count' is {config.workers.count}; this version runs exactly 1 "
            "worker group (data-parallel groups are not built yet); for several worker processes "
            "on one model use workers.tensor_parallel_size"
        )
    _check_compute(config.model, config.cache, source)
    w = config.workers
    if w.communicator == "paddle" and w.standby and w.tensor_parallel_size > 1:
        raise ConfigError(
            f"{source}: key 'workers.standby' is true with workers.communicator = \"paddle\": a "
            "paddle.distributed group is joined by all its ranks at once, which warm spares cannot do; "
            'set workers.standby = false (or use the "shm" communicator)'
        )
    if config.server.port > 65535:
        raise ConfigError(f"{source}: key 'server.port' is {config.server.port}, must be <= 65535")
    if config.server.enabled and config.server.processes >= config.engine.max_clients:
        raise ConfigError(
            f"{source}: key 'server.processes' is {config.server.processes}: each takes one of the "
            f"engine.max_clients = {config.engine.max_clients} client slots, and others need some"
        )


def _check_compute(model: ModelConfig, cache: CacheConfig, source: str) -> None:
    """float32 anywhere; bfloat16 (weights or KV cache), wint8 and wint4 where the CPU has the instructions
    their kernels use (bfloat16: AVX512-BF16; wint8 and wint4: AVX2 at least)."""
    from fdcore.models.kernels import missing_cpu_feature, needed_cpu_feature

    if model.dtype == "float16":
        raise ConfigError(
            f"{source}: key 'model.dtype' is 'float16'; the CPU model computes in float32 or "
            "bfloat16 (float16 checkpoints load and are widened)"
        )
    for key, value, instead in (
        ("model.dtype", model.dtype, "float32"),
        ("model.quantization", model.quantization, "none"),
        ("cache.dtype", cache.dtype, "auto"),
    ):
        missing = missing_cpu_feature(value)
        if missing:
            raise ConfigError(
                f"{source}: key '{key}' is {value!r}, which needs a CPU with {missing} "
                f"({needed_cpu_feature(value)[0]} in /proc/cpuinfo); this one has none: use "
                f"{instead!r}"
            )


def default_model_path() -> str:
    """Where the bundled tiny model is made on first use: ``$FDCORE_HOME/models/tiny-llama-v<N>``."""
    from fdcore.checkpoint.tiny import VERSION

    return os.path.join(fdcore_home(), "models", f"tiny-llama-v{VERSION}")


def model_path(config: Config) -> str:
    return config.model.path or default_model_path()


def check_model_path(config: Config, source: str = "<config>") -> None:
    """The model directory (or GGUF file) must exist; the bundled tiny model (empty path) is made
    if missing."""
    if not config.model.path:
        from fdcore.checkpoint.tiny import ensure_tiny_model

        ensure_tiny_model(default_model_path())
        return
    path = config.model.path
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise ConfigError(f"{source}: key 'model.path': GGUF file {path!r} does not exist")
    elif not os.path.isdir(path):
        raise ConfigError(f"{source}: key 'model.path': directory {path!r} does not exist")
