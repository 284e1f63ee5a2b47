"""What each compute dtype and weight quantization costs in quality, against float32, on SmolLM2.

Two measures, every setting the CPU accepts (float32, bfloat16, wint8, wint4), one run:

- **perplexity** on a fixed English text shipped with the repository
  (``benchmarks/data/quality_text.txt``: sections of the Python documentation — the execution
  model, exceptions, class definitions, truth values, boolean operations — taken from CPython's
  ``pydoc_data.topics``, PSF License). The text is cut into ``--chunk``-token pieces read in
  parallel, one token per step, teacher-forced: every token after a chunk's first is predicted.
- **greedy agreement**: free-running greedy decoding of the golden chat prompts
  (``tests/data/gguf_reference.json``): how many of the first ``--tokens`` tokens equal float32's,
  per prompt (the issue's bar: every prompt's first 16).

A last row, **float32 on bfloat16-rounded weights** (every matrix of the checkpoint rounded to bfloat16, the
embedding too: SmolLM2 ties it to the LM head; compute and KV cache float32), separates what bfloat16 weights cost
by themselves from what the bfloat16 kernels, activations and cache add: a greedy difference there is one no
bfloat16-weight model can avoid (``--no-rounded-weights`` leaves it out).

Each setting runs with the KV cache the worker gives it (``--cache-dtype auto``: bfloat16 for the bfloat16
model, float32 for the rest; see fdcore.models.llama.LlamaModel.new_cache), shown in the table.

Usage: OMP_NUM_THREADS=1 python benchmarks/bench_quality.py [--chunk 256] [--tokens 16] [--cache-dtype auto]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

os.environ.setdefault("OMP_NUM_THREADS", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

TEXT = os.path.join(HERE, "data", "quality_text.txt")
GOLDEN = os.path.join(HERE, "..", "tests", "data", "gguf_reference.json")
SETTINGS = [("float32", "none"), ("bfloat16", "none"), ("float32", "wint8"), ("float32", "wint4")]
ROUNDED = ("float32", "bfloat16 weights")  # the diagnostic row (round_weights_to_bfloat16)
BLOCK = 16


def usable(dtype: str, quantization: str) -> str | None:
    """None when this CPU and this fdcore accept the setting, else why not."""
    from fdcore.config import ConfigError, parse_config

    try:
        parse_config(f'[model]\ndtype = "{dtype}"\nquantization = "{quantization}"\n')
    except (ConfigError, ValueError) as exc:
        return str(exc).splitlines()[0]
    return None


def round_weights_to_bfloat16(checkpoint) -> None:
    """Every matrix of ``checkpoint`` (its 2-D tensors) rounded to the nearest bfloat16 (ties to even, as Paddle's
    cast that packs fdcore's bfloat16 weights), kept as float32; vectors (norms, biases) left as they are."""
    import paddle

    for name, array in checkpoint.tensors.items():
        if array.ndim == 2:
            checkpoint.tensors[name] = paddle.to_tensor(array).astype("bfloat16").astype("float32").numpy()


def perplexity(model, chunks: list[list[int]], cache_dtype: str = "auto") -> float:
    """exp(mean negative log-likelihood) of every token after each chunk's first, all chunks read
    side by side one token per step (a decode batch), float64 softmax."""
    from fdcore.core.batch import BatchInput

    length = len(chunks[0])
    blocks = -(-length // BLOCK)
    cache = model.new_cache(blocks * len(chunks), BLOCK, cache_dtype)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(len(chunks))]
    nll, count = 0.0, 0
    for pos in range(length - 1):
        batch = BatchInput([[c[pos]] for c in chunks], [pos] * len(chunks), tables, [1] * len(chunks))
        logits = model.forward(batch, cache).astype(np.float64)
        top = logits.max(axis=1, keepdims=True)
        log_z = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
        nll += float(np.sum(log_z - logits[np.arange(len(chunks)), [c[pos + 1] for c in chunks]]))
        count += len(chunks)
    return float(np.exp(nll / count))


def greedy(model, prompt: list[int], tokens: int, cache_dtype: str = "auto") -> tuple[list[int], list[float]]:
    """The first ``tokens`` greedy tokens and, per step, the gap between the two best logits."""
    from fdcore.core.batch import BatchInput

    blocks = -(-(len(prompt) + tokens) // BLOCK)
    cache = model.new_cache(blocks, BLOCK, cache_dtype)
    out, gaps, ids, start = [], [], prompt, 0
    for _ in range(tokens):
        logits = model.forward(BatchInput([ids], [start], [list(range(blocks))], [len(prompt)]), cache)[0]
        best, second = np.sort(logits)[-2:][::-1]
        start, ids = start + len(ids), [int(np.argmax(logits))]
        out += ids
        gaps.append(float(best - second))
    return out, gaps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk", type=int, default=256, help="tokens per teacher-forced piece")
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens compared per golden prompt")
    parser.add_argument(
        "--cache-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="every setting's KV cache (cache.dtype; float32's reference keeps a float32 one)",
    )
    parser.add_argument(
        "--no-rounded-weights", action="store_true", help="leave out the float32 row on bfloat16-rounded weights"
    )
    args = parser.parse_args()

    from fdcore.checkpoint import load_checkpoint
    from fdcore.checkpoint.fetch import fetch_smollm2
    from fdcore.core.tokenizer import ModelTokenizer
    from fdcore.models.llama import LlamaModel

    path = fetch_smollm2()
    ids = ModelTokenizer(path).encode(open(TEXT).read())
    chunks = [ids[i : i + args.chunk] for i in range(0, len(ids) - args.chunk + 1, args.chunk)]
    prompts = [chat["prompt"] for chat in json.load(open(GOLDEN))["chats"]]
    rows, reference = [], None
    settings = SETTINGS + ([] if args.no_rounded_weights else [ROUNDED])
    for dtype, quantization in settings:
        rounded = (dtype, quantization) == ROUNDED
        name = "f32, bf16 weights" if rounded else dtype if quantization == "none" else quantization
        why = None if rounded else usable(dtype, quantization)
        if why:
            rows.append((name, None, None, why))
            continue
        checkpoint = load_checkpoint(path, progress=lambda *_: None)
        if rounded:
            round_weights_to_bfloat16(checkpoint)
        model = LlamaModel(checkpoint, dtype, "none" if rounded else quantization)
        cache_dtype = "float32" if reference is None or rounded else args.cache_dtype
        ppl = perplexity(model, chunks, cache_dtype)
        outputs = [greedy(model, p, args.tokens, cache_dtype) for p in prompts]
        reference = reference or outputs
        agree = [
            next((i for i, (a, b) in enumerate(zip(o[0], r[0], strict=False)) if a != b), args.tokens)
            for o, r in zip(outputs, reference, strict=True)
        ]
        # where one differs: float32's own gap between its two best logits at that step
        agree = [(a, reference[i][1][a] if a < args.tokens else None) for i, a in enumerate(agree)]
        rows.append((name, ppl, agree, model.cache_dtype(cache_dtype)))
        print(f"{name}: perplexity {ppl:.4f}", file=sys.stderr, flush=True)
    base = rows[0][1]
    print(
        f"\nSmolLM2-135M-Instruct (Q4_1 GGUF weights), {len(chunks)} x {args.chunk} tokens of "
        f"{os.path.relpath(TEXT)}; greedy: first {args.tokens} tokens of {len(prompts)} golden chat prompts"
    )
    print(
        f"{'setting':17s} {'KV cache':>9s} {'perplexity':>11s} {'vs float32':>11s}  greedy tokens equal to "
        "float32's, per prompt"
    )
    for name, ppl, agree, cache in rows:
        if ppl is None:
            print(f"{name:17s} {'-':>9s} {'-':>11s} {'-':>11s}  not run: {cache}")
            continue
        full = sum(a == args.tokens for a, _ in agree)
        where = ", ".join(
            f"prompt {i} token {a} (float32's top-two gap {gap:.3f})"
            for i, (a, gap) in enumerate(agree)
            if gap is not None
        )
        print(
            f"{name:17s} {cache:>9s} {ppl:11.4f} {100 * (ppl / base - 1):+10.2f}%  {full}/{len(agree)} prompts all "
            f"{args.tokens}" + (f"; first differences: {where}" if where else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
