#!/usr/bin/env python3
"""The native linear kernel against MLX's matmul (OpenBLAS) by row count, and
OpenBLAS's threads on one long text's attention scores: where a long input's
time goes on the CPU's native path (docs/benchmarks.md, "Long inputs").

    .venv/bin/python scripts/bench_linear_rows.py
"""

from __future__ import annotations

import statistics
import time

import mlx_embed  # noqa: F401 - before mlx.core: picks the BLAS
import mlx.core as mx
import mlx.nn as nn

from mlx_embed import _blas, ops


def timed(fn, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    threads = _blas.own_num_threads() or 1
    ctx = ops.ForwardContext(path="native", kernel_threads=threads)
    print(f"OpenBLAS threads {threads}, native kernel threads {threads}")
    for rows, inputs, outputs in ((16, 1024, 3072), (512, 1024, 3072), (2048, 1024, 3072), (2048, 3072, 1024)):
        layer = nn.Linear(inputs, outputs)
        weight = layer.weight
        x = mx.random.normal((1, rows, inputs))
        mx.eval(layer.parameters(), x)
        ops.prepare(layer, ctx)
        with ops.forward_context(ctx):
            native = timed(lambda: ops.linear(layer, x))
        blas = timed(lambda: x @ weight.T)
        print(f"[{rows}, {inputs}] x [{inputs}, {outputs}]: native {native:.1f} ms, OpenBLAS {blas:.1f} ms")
    q, k = (mx.random.normal((1, 16, 2048, 128), key=mx.random.key(i)) for i in (1, 2))
    mx.eval(q, k)
    for n in sorted({1, threads}):
        _blas.set_num_threads(n)
        print(
            f"q @ k^T, 16 heads x 2048 x 128, OpenBLAS on {n} thread(s): {timed(lambda: q @ k.swapaxes(-1, -2)):.1f} ms"
        )


if __name__ == "__main__":
    main()
