"""The model worker's step time beside its floor: the same step's weight matrix products alone.

For each decode batch size, B sequences with a 128-token context each decode
one token per step; the step's time (median of several, alternating with the floor) is shown next to the
time of the step's matrix products run alone on contiguous inputs of the same
shapes and dtypes (gemm_floor): per layer qkv, o, gate_up, down and the two attention products
(scores, weighted values), then the LM head. Prefill is measured in tokens/s
for one 512-token prompt, beside its GEMM floor too (the LM head on its last
token only, as the model computes it; the prompt's attention is not in this
floor, so it counts against the step).

Usage: OMP_NUM_THREADS=1 python benchmarks/bench_model.py [--model DIR|smollm2] [--dtype float32|bfloat16]
           [--quantization none|wint8|wint4] [--steps N] [--batches 1,8,32]

``--model smollm2`` is the real SmolLM2-135M-Instruct (fetched once; see
fdcore.checkpoint.fetch); the floor uses the model's own matrix dtype, the step the KV cache the worker
gives the model (``cache.dtype = "auto"``: bfloat16 for ``--dtype bfloat16``, float32 otherwise).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fdcore.models import cpu_env  # noqa: F401  (math-library settings before paddle)

# isort: split
import paddle

from fdcore.checkpoint import load_checkpoint
from fdcore.core.batch import BatchInput
from fdcore.models import kernels, tiny
from fdcore.models.llama import LlamaModel
from fdcore.models.matrices import Bf16Matrix, linear, swiglu

BLOCK = 16
CONTEXT = 128


def timed_pair(fn, floor, repeat: int) -> tuple[float, float]:
    """Median seconds of ``fn()`` and of ``floor()``, run alternately (after a warm-up) so that
    both see the same machine: on a shared 2-core VM, conditions drift within seconds."""
    fn(), floor()
    a, b = [], []
    for _ in range(repeat):
        for f, out in ((fn, a), (floor, b)):
            t0 = time.perf_counter()
            f()
            out.append(time.perf_counter() - t0)
    return statistics.median(a), statistics.median(b)


def gemm_floor(model: LlamaModel, rows: int, decode_context: int = 0):
    """One step's matrix products alone, on contiguous inputs of the same shapes: the weight
    GEMMs of ``rows`` tokens and, for a decode step, the attention products (scores and
    weighted values) over ``decode_context`` tokens. Returns the function that runs them.

    Each product is the kernel call the step makes, on inputs of the step's dtype: a bfloat16 model's norms
    and SwiGLU hand the qkv, gate_up and down products their rows already rounded to bfloat16
    (kernels/decoder.cc), so here those three take bfloat16 inputs, and its gate_up is the gated product with
    its SwiGLU epilogue, bfloat16 activations out (what the down product takes); o rounds its float32 input
    (the attention's output) as in the step, or takes it rounded where the step's attention hands it so
    (``kernels.attention_rounds_rows``: on AMX tiles). The step's o and down also add their rows to the residual
    stream in their epilogue (kernels/decoder.cc's FoldsResidual); that add is not a product, so here they are
    plain products and it counts against the step."""
    a = model.args
    x_h = paddle.randn([rows, a.hidden_size])
    x_q = paddle.randn([rows, a.num_heads * a.head_dim])
    x_i = paddle.randn([rows, a.intermediate_size])
    groups = a.num_heads // a.num_kv_heads
    gated = isinstance(model.layers[0]["gate_up"], Bf16Matrix) and model.layers[0]["gate_up"].gated
    if gated:
        x_h, x_i = x_h.astype("bfloat16"), x_i.astype("bfloat16")
        if all(kernels.attention_rounds_rows(groups, a.head_dim, BLOCK, layer["window"]) for layer in model.layers):
            x_q = x_q.astype("bfloat16")
    q = paddle.randn([a.num_kv_heads, rows, groups, a.head_dim])
    kv = paddle.randn([a.num_kv_heads, rows, decode_context, a.head_dim])
    probs = paddle.randn([a.num_kv_heads, rows, groups, decode_context])
    head_rows = paddle.randn([rows if decode_context else 1, a.hidden_size])  # (the final norm's: float32)

    def step():
        for layer in model.layers:
            linear(x_h, layer["qkv"])
            linear(x_q, layer["o"])
            if gated:
                swiglu(x_h, layer["gate_up"], None, None)
            else:
                linear(x_h, layer["gate_up"])
            linear(x_i, layer["down"])
            if decode_context:
                paddle.matmul(q, kv, transpose_y=True)
                paddle.matmul(probs, kv)
        linear(head_rows, model.lm_head)

    return step


def decode_step(model: LlamaModel, batch: int, repeat: int):
    """B sequences with a CONTEXT-token context; returns the function that decodes one token."""
    blocks_per_seq = -(-(CONTEXT + 2 * repeat + 4) // BLOCK)
    cache = model.new_cache(blocks_per_seq * batch, BLOCK)  # the dtype the worker takes
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
    prompt = [(7 * i) % model.args.vocab_size for i in range(CONTEXT)]
    for i in range(batch):  # fill each context (not timed)
        model.forward(BatchInput([prompt], [0], [tables[i]]), cache)
    position = [CONTEXT]

    def step():
        model.forward(BatchInput([[5]] * batch, [position[0]] * batch, tables), cache)
        position[0] += 1

    return step


def prefill(model: LlamaModel, tokens: int):
    blocks = -(-tokens // BLOCK)
    cache = model.new_cache(blocks, BLOCK)
    prompt = [(3 * i) % model.args.vocab_size for i in range(tokens)]
    return lambda: model.forward(BatchInput([prompt], [0], [list(range(blocks))]), cache)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory, GGUF file or smollm2 (default: the tiny model)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--quantization", default="none", choices=["none", "wint8", "wint4"])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per figure")
    parser.add_argument("--batches", default="1,8,32,64,128")
    opts = parser.parse_args(argv)
    if opts.model == "smollm2":
        from fdcore.checkpoint.fetch import fetch_smollm2

        opts.model = fetch_smollm2()
    path = opts.model or tiny.make_tiny_model(os.path.join(tempfile.mkdtemp(), "tiny"))
    model = LlamaModel(load_checkpoint(path, progress=lambda *_: None), opts.dtype, opts.quantization)
    print(
        f"model {path} ({model.matrix_dtype} weights): {model.args.num_layers} layers, "
        f"hidden {model.args.hidden_size}, "
        f"vocab {model.args.vocab_size}; OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, "
        f"context {CONTEXT}, median of {opts.steps} steps"
    )
    print(f"{'decode batch':>12s} {'step ms':>9s} {'GEMM floor ms':>14s} {'step/floor':>11s} {'tok/s':>9s}")
    for batch in (int(b) for b in opts.batches.split(",")):
        padded = -(-(CONTEXT + 2 * opts.steps + 2) // BLOCK) * BLOCK
        step, floor = timed_pair(
            decode_step(model, batch, opts.steps), gemm_floor(model, batch, decode_context=padded), opts.steps
        )
        print(f"{batch:12d} {step * 1e3:9.2f} {floor * 1e3:14.2f} {step / floor:10.2f}x {batch / step:9.0f}")
    tokens = 512
    step, floor = timed_pair(prefill(model, tokens), gemm_floor(model, tokens), max(3, opts.steps // 4))
    print(
        f"{'prefill':>12s} {step * 1e3:9.2f} {floor * 1e3:14.2f} {step / floor:10.2f}x "
        f"{tokens / step:9.0f}  ({tokens}-token prompt)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
