"""float32 projections: fdcore's kernel (F32Matrix) against Paddle's MKL matmul, by rows of x.

One "step" is every weight product of a SmolLM2-135M token: 30 layers of qkv [960, 576], o [576, 576],
gate_up [3072, 576], down [576, 1536], then the tied LM head [49152, 576]: 538 MB of float32 weights
(random here, the shapes are what matters). Each figure is the median of several steps, the two
paths alternating so that both see the same machine; GB/s is the weights' bytes over the step.

Usage: OMP_NUM_THREADS=T python benchmarks/bench_linear_f32.py [--rows 1,4,8,16,32,64] [--steps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fdcore.models import cpu_env  # noqa: F401  (math-library settings before paddle)

# isort: split
import numpy as np
import paddle

from fdcore.models.matrices import F32Matrix, f32_kernel, linear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS, VOCAB = 30, 49152


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,8,16,32,64")
    parser.add_argument("--steps", type=int, default=5)
    opts = parser.parse_args(argv)
    if not f32_kernel():
        print("no float32 kernel here (needs AVX-512F or AVX2 and fdcore's C++ operators)")
        return 1
    rng = np.random.default_rng(0)
    plain, packed = [], []
    for n, k in SHAPES * LAYERS + [(VOCAB, 576)]:
        w = rng.standard_normal((n, k), dtype=np.float32) * np.float32(0.02)
        plain.append(paddle.to_tensor(w))
        packed.append(F32Matrix.pack(w))
    total = sum(int(w.numel()) * 4 for w in plain)
    print(
        f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, {total / 1e6:.0f} MB of weights per step, "
        f"median of {opts.steps}"
    )
    print(f"{'rows':>5s} {'MKL ms':>9s} {'kernel ms':>10s} {'MKL GB/s':>9s} {'kernel GB/s':>12s} {'MKL/kernel':>11s}")
    for rows in (int(r) for r in opts.rows.split(",")):
        xs = {k: paddle.randn([rows, k]) for k in (576, 1536)}

        def mkl(xs=xs):
            for w in plain:
                linear(xs[w.shape[1]], w)

        def kernel(xs=xs):
            for w in packed:
                linear(xs[w.array.shape[1]], w)

        times = {mkl: [], kernel: []}
        mkl(), kernel()
        for _ in range(opts.steps):
            for fn, out in times.items():
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
        a, b = statistics.median(times[mkl]), statistics.median(times[kernel])
        print(
            f"{rows:5d} {a * 1e3:9.2f} {b * 1e3:10.2f} {total / a / 1e9:9.1f} {total / b / 1e9:12.1f} {a / b:10.2f}x",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
