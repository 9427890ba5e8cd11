#!/usr/bin/env python3
"""One encoder layer's attention: the CPU's native path (the streaming
kernel, ``ops.decoder_attention``'s) against the exact path (MLX's products,
bias or band and softmax, in blocks of query rows past SCORES_BLOCK_BYTES).

Shapes (12 heads of 64, as ModernBERT-base and jina-embeddings-v2-base):
  modernbert-local   keys at most 64 positions away (local_attention 128)
  modernbert-global  every key of the text
  jina-alibi         every key, ALiBi's ``-slope_h * |i - j|`` (12 heads' slopes)

Both are this tree's ``ops.blocked_attention`` in one process, each inside
its forward context with OpenBLAS on the threads the engine's passes give
it (native: one, the kernel on every core; exact: every core); each case
``TEXTSxTOKENS`` random float32 q/k/v, calls interleaved native/exact,
medians of ``--calls``:

    .venv/bin/python scripts/bench_encoder_attention.py --cases 1x128,8x128,1x512,1x2048 --calls 15

``--rss SHAPE TEXTSxTOKENS``: each path in its own process, one call after
the inputs are built; prints the process's peak RSS, how far it rose over
the RSS before the call (what the attention itself adds), and the call's
time:

    .venv/bin/python scripts/bench_encoder_attention.py --rss jina-alibi 1x8192
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATHS = ("native", "exact")
SHAPES = ("modernbert-local", "modernbert-global", "jina-alibi")
HEADS, HEAD_DIM, HALF_WINDOW = 12, 64, 64


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def setup(shape: str, texts: int, tokens: int):
    """Inputs and a call ``run()`` of ``ops.blocked_attention`` on them."""
    import mlx_embed  # noqa: F401 - before mlx.core: picks the BLAS
    import mlx.core as mx
    import numpy as np

    from mlx_embed import ops
    from mlx_embed.models.jina_bert import alibi_slopes

    mx.random.seed(0)
    q, k, v = (mx.random.normal((texts, HEADS, tokens, HEAD_DIM)) for _ in range(3))
    mx.eval(q, k, v)
    scale = HEAD_DIM**-0.5
    slopes = alibi_slopes(HEADS)
    attention_mask = mx.array(np.ones((texts, tokens), dtype=np.int32))

    def run():
        mask = ops.KeyMask(attention_mask, mx.float32)
        L = tokens
        if shape == "modernbert-global":
            return ops.blocked_attention(q, k, v, scale, mask=mask)
        if shape == "modernbert-local":
            def band(start, end):
                near = mx.abs(mx.arange(start, end)[:, None] - mx.arange(L)[None, :]) <= HALF_WINDOW
                return mask.additive + mx.where(near, 0.0, mask.masked_value)
            return ops.blocked_attention(q, k, v, scale, mask=mask, additive=band, window=HALF_WINDOW)
        table = -mx.array(slopes)[:, None, None]

        def alibi(start, end):
            dist = mx.abs(mx.arange(start, end)[:, None] - mx.arange(L)[None, :]).astype(mx.float32)
            return table * dist + mask.additive
        return ops.blocked_attention(q, k, v, scale, mask=mask, additive=alibi, alibi=slopes)

    return run


def contexts() -> dict:
    """Each path's forward context and OpenBLAS threads, as the engine's
    passes run it (scheduler._pass_blas_threads)."""
    from mlx_embed import ops

    threads = os.cpu_count() or 1
    return {
        "native": (ops.make_context("native", kernel_threads=threads), 1),
        "exact": (ops.make_context("exact", kernel_threads=threads), threads),
    }


def call(run, ctx, blas_threads: int):
    """``run()`` evaluated inside ``ctx`` with OpenBLAS on ``blas_threads``."""
    import mlx.core as mx

    from mlx_embed import _blas, ops

    _blas.set_num_threads(blas_threads)
    with ops.forward_context(ctx):
        out = run()
        mx.eval(out)
    return out


def timed(args) -> dict:
    import mlx_embed  # noqa: F401 - before mlx.core: picks the BLAS
    import numpy as np

    variants = contexts()
    results = {}
    for shape in args.shapes.split(","):
        for case in args.cases.split(","):
            texts, tokens = (int(x) for x in case.lower().split("x"))
            run = setup(shape, texts, tokens)
            # Warm-up, and the outputs compared.
            outs = {path: np.array(call(run, *variants[path])) for path in PATHS}
            times = {path: [] for path in PATHS}
            for _ in range(args.calls):
                for path in PATHS:
                    t0 = time.perf_counter()
                    call(run, *variants[path])
                    times[path].append(time.perf_counter() - t0)
            row = {path: statistics.median(t) * 1e3 for path, t in times.items()}
            row["max_abs_diff"] = float(np.abs(outs["native"] - outs["exact"]).max())
            results[f"{shape} {case}"] = row
            print(f"{shape:18} {case:7} native {row['native']:9.2f} ms  exact {row['exact']:9.2f} ms  "
                  f"{row['exact'] / row['native']:5.2f}x  max|diff| {row['max_abs_diff']:.1e}", flush=True)
    return results


def one_rss(args) -> None:
    import mlx_embed  # noqa: F401 - before mlx.core: picks the BLAS

    texts, tokens = (int(x) for x in args.rss[1].lower().split("x"))
    run = setup(args.rss[0], texts, tokens)
    start = rss_bytes()
    t0 = time.perf_counter()
    call(run, *contexts()[args.path])
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"path": args.path, "rss_before_call": start, "peak_rss": peak, "seconds": seconds}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--cases", default="1x128,8x128,1x512,1x2048")
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--rss", nargs=2, metavar=("SHAPE", "TEXTSxTOKENS"))
    ap.add_argument("--path", choices=PATHS, help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.rss and args.path:
        one_rss(args)
        return
    if args.rss:
        out = {}
        for path in PATHS:
            line = subprocess.run(
                [sys.executable, __file__, "--rss", *args.rss, "--path", path],
                check=True, capture_output=True, text=True,
            ).stdout.strip().splitlines()[-1]
            out[path] = row = json.loads(line)
            print(f"{path:6} {' '.join(args.rss)}: peak RSS {row['peak_rss'] / 1e9:.2f} GB, "
                  f"{(row['peak_rss'] - row['rss_before_call']) / 1e9:.2f} GB over the inputs', "
                  f"one call {row['seconds']:.2f} s", flush=True)
    else:
        out = timed(args)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
