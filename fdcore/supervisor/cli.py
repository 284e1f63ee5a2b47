"""``python -m fdcore.supervisor --config FILE.toml [--check]``: the command line, and ``--check``'s report."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from fdcore import envs
from fdcore.actors import topology
from fdcore.config import Config, ConfigError, load_config, model_path, render_config
from fdcore.ipc.shm import SHM_DIR, free_bytes
from fdcore.supervisor.segments import shared_memory_line
from fdcore.supervisor.tree import Supervisor


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fdcore.supervisor", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="TOML configuration file")
    parser.add_argument("--check", action="store_true", help="validate, print the effective configuration, exit")
    parser.add_argument(
        "--ready-fd",
        type=int,
        default=None,
        help="write the instance id to this file descriptor once ready (used by AsyncLLM)",
    )
    parser.add_argument(
        "--stop-with-parent", action="store_true", help="shut down when the process that started us dies (embedded use)"
    )
    parser.add_argument(
        "--parent-fd",
        type=int,
        default=None,
        help="shut down when this pipe reaches end-of-file: every holder of its write end "
        "(the embedding process) is gone; unlike --stop-with-parent it follows the "
        "process, not the thread that started us (used by AsyncLLM / LLM)",
    )
    args = parser.parse_args(argv)
    return _supervise(args)


def _supervise(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"fdcore: configuration error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        print(render_config(config))
        print(_describe_spares(config))
        print(_describe_shared_weights(config))
        return max(_check_shared_memory(config), _check_model(config))
    import setproctitle

    setproctitle.setproctitle("fdcore:supervisor")
    if args.stop_with_parent:
        _stop_with_parent()
    if args.parent_fd is not None:
        _stop_when_closed(args.parent_fd)
    return Supervisor(config, args.ready_fd).run()


def _check_model(config: Config) -> int:
    """--check's look at the checkpoint: print its chat templates and the sampling defaults the
    engine will give requests that leave them unset; a model the engine could not start with is an
    error (exit code 2)."""
    from fdcore.checkpoint import CheckpointError

    try:
        print(describe_model(config))
    except CheckpointError as exc:
        print(f"fdcore: checkpoint error: {exc}", file=sys.stderr)
        return 2
    return 0


def _describe_spares(config: Config) -> str:
    """--check's line on the warm spares."""
    if not config.workers.standby:
        return "# warm spare workers: off (workers.standby = false): a crashed worker is started afresh"
    return (
        "# warm spare workers: on (workers.standby): the tree says ready once each spare is loaded and warm "
        "(a spare that loads later, after a promotion, loads at idle priority); /health says whether it is warm"
    )


def _describe_shared_weights(config: Config) -> str:
    """--check's line on where the packed weights live."""
    mode = config.workers.shared_weights
    if mode == "off" or config.model.backend == "null":
        return "# shared weights: off: every worker process packs a private copy of its weights"
    return (
        f"# shared weights: {mode}: each rank's packed weights once in a nameless shared file (in "
        f"{envs.fdcore_home()}, or a memfd where that filesystem cannot hold one), mapped read-only by its spare "
        "and its restarts"
        + (" unless its pages measure over 20% slower than private huge pages at load" if mode == "auto" else "")
    )


def _check_shared_memory(config: Config) -> int:
    """--check's look at /dev/shm: what the tree will commit there and what is free (exit code 2 when it
    does not fit; a tensor-parallel group's communicator is not counted here)."""
    need, _ = topology.shared_memory_need(config)
    free = free_bytes()
    print(f"# shared memory: {shared_memory_line(config)}; {SHM_DIR} has {free:,} bytes free")
    if need > free:
        print(f"fdcore: {SHM_DIR} has {free:,} bytes free; this tree needs {need:,}", file=sys.stderr)
        return 2
    return 0


def describe_model(config: Config) -> str:
    """The model as the engine will serve it, as TOML comments (templates compiled, defaults checked)."""
    from fdcore.checkpoint import inspect_checkpoint
    from fdcore.core.generation_config import generation_config_file, sampling_defaults
    from fdcore.core.tokenizer import ModelTokenizer

    path, mode = model_path(config), config.model.generation_config
    args = inspect_checkpoint(path)
    tokenizer = ModelTokenizer(path)
    limits = tokenizer.limits(config.scheduler.max_model_len, config.cache.num_blocks * config.cache.block_size)
    defaults = sampling_defaults(path, mode, limits)
    templates = ", ".join(f"{t.name} ({t.source})" for t in tokenizer.chat_templates.templates.values())
    source = f'model.generation_config = "{mode}"' + (f", {generation_config_file(path)}" if mode == "auto" else "")
    shape = (
        f"# {args.architecture}: {args.num_layers} layers, hidden {args.hidden_size}, {args.num_heads} heads "
        f"({args.num_kv_heads} kv), vocab {args.vocab_size}; config and tensor headers checked"
    )
    keys = args.keys
    lines = [
        f"# model {path}",
        shape,
        f"# config keys read: {', '.join(keys.read) or 'none'}",
        f"# config keys known to change nothing: {', '.join(keys.inert) or 'none'}",
        f"# config keys no transformers model reads (warned, not used): {', '.join(keys.unknown) or 'none'}",
        f"# chat templates: {templates or 'none'}",
        f"# sampling defaults for requests that leave them unset ({source}):" + ("" if defaults else " none"),
    ]
    return "\n".join(lines + [f"#   {name} = {json.dumps(value)}" for name, value in defaults.items()])


def _stop_with_parent() -> None:
    """SIGTERM (a clean stop) when our parent dies: an embedded tree ends with its program."""
    import ctypes

    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGTERM, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def _stop_when_closed(fd: int) -> None:
    """SIGTERM (a clean stop) once ``fd``, a pipe's read end, reads EOF: the kernel closes the write
    end when the embedding process ends, whichever of its threads started us."""
    import threading

    os.set_inheritable(fd, False)  # our own children must not hold it open

    def watch() -> None:
        while os.read(fd, 64):
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="fdcore-parent-watch", daemon=True).start()
