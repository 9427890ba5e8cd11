#!/usr/bin/env python3
"""One encoder layer's attention on the CPU's native path, before and after
it ran in the streaming kernel (``ops.decoder_attention``'s).

Shapes (12 heads of 64, as ModernBERT-base and jina-embeddings-v2-base):
  modernbert-local   keys at most 64 positions away (local_attention 128)
  modernbert-global  every key of the text
  jina-alibi         every key, ALiBi's ``-slope_h * |i - j|`` (12 heads' slopes)

"before" is ``ops.blocked_attention`` of the revision ``--before`` (default:
the one before the change), its ``ops.py`` read by ``git show`` and run as a
module of this package, on this tree's extension (which still exports the
kernels it calls); "after" is this tree's. Both in one process, inside a
native forward context as the engine's passes run them (OpenBLAS pinned to
one thread, the kernels on every core), each case ``TEXTSxTOKENS`` random
float32 q/k/v, calls interleaved before/after, medians of ``--calls``:

    .venv/bin/python scripts/bench_encoder_attention.py --cases 1x128,8x128,1x512,1x2048,1x8192 --calls 15

``--rss SHAPE TEXTSxTOKENS``: each variant in its own process, one call
after the inputs are built; prints the process's peak RSS, how far it rose
over the RSS before the call (what the attention itself adds), and the
call's time:

    .venv/bin/python scripts/bench_encoder_attention.py --rss jina-alibi 1x8192
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "f6c2f69"
SHAPES = ("modernbert-local", "modernbert-global", "jina-alibi")
HEADS, HEAD_DIM, HALF_WINDOW = 12, 64, 64


def load_before(rev: str):
    """``ops.py`` as of ``rev``, a module of this tree's package."""
    import mlx_embed

    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:python/mlx_embed/ops.py"],
        check=True, capture_output=True, text=True,
    ).stdout
    name = "mlx_embed._ops_before"
    spec = importlib.util.spec_from_loader(name, loader=None, origin=f"{rev}:ops.py")
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "mlx_embed"
    sys.modules[name] = module
    exec(compile(source, f"{rev}:python/mlx_embed/ops.py", "exec"), module.__dict__)
    mlx_embed._ops_before = module
    return module


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def setup(shape: str, texts: int, tokens: int):
    """Inputs and a call ``run(ops)`` of that module's blocked_attention."""
    import mlx_embed  # noqa: F401 - before mlx.core: picks the BLAS
    import mlx.core as mx
    import numpy as np

    from mlx_embed.models.jina_bert import alibi_slopes

    mx.random.seed(0)
    q, k, v = (mx.random.normal((texts, HEADS, tokens, HEAD_DIM)) for _ in range(3))
    mx.eval(q, k, v)
    scale = HEAD_DIM**-0.5
    slopes = alibi_slopes(HEADS)
    attention_mask = mx.array(np.ones((texts, tokens), dtype=np.int32))

    def run(ops):
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


def contexts(before):
    from mlx_embed import _blas, ops

    _blas.set_num_threads(1)
    threads = os.cpu_count() or 1
    return {
        "before": (before, before.make_context("native", kernel_threads=threads)),
        "after": (ops, ops.make_context("native", kernel_threads=threads)),
    }


def timed(args) -> dict:
    import mlx_embed  # noqa: F401 - before mlx.core: picks the BLAS
    import mlx.core as mx
    import numpy as np

    variants = contexts(load_before(args.before))
    results = {}
    for shape in args.shapes.split(","):
        for case in args.cases.split(","):
            texts, tokens = (int(x) for x in case.lower().split("x"))
            run = setup(shape, texts, tokens)
            outs, times = {}, {name: [] for name in variants}
            for name, (module, ctx) in variants.items():
                with module.forward_context(ctx):
                    outs[name] = np.array(run(module))  # warm-up, and the output compared
            for _ in range(args.calls):
                for name, (module, ctx) in variants.items():
                    with module.forward_context(ctx):
                        t0 = time.perf_counter()
                        mx.eval(run(module))
                        times[name].append(time.perf_counter() - t0)
            row = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            row["max_abs_diff"] = float(np.abs(outs["before"] - outs["after"]).max())
            results[f"{shape} {case}"] = row
            print(f"{shape:18} {case:7} before {row['before']:9.2f} ms  after {row['after']:9.2f} ms  "
                  f"{row['before'] / row['after']:5.2f}x  max|diff| {row['max_abs_diff']:.1e}", flush=True)
    return results


def one_rss(args) -> None:
    import mlx_embed  # noqa: F401 - before mlx.core: picks the BLAS
    import mlx.core as mx

    variants = contexts(load_before(args.before))
    module, ctx = variants[args.variant]
    texts, tokens = (int(x) for x in args.rss[1].lower().split("x"))
    run = setup(args.rss[0], texts, tokens)
    start = rss_bytes()
    t0 = time.perf_counter()
    with module.forward_context(ctx):
        mx.eval(run(module))
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"variant": args.variant, "rss_before_call": start, "peak_rss": peak, "seconds": seconds}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default=BEFORE, help="the git revision whose ops.py is 'before'")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--cases", default="1x128,8x128,1x512,1x2048")
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--rss", nargs=2, metavar=("SHAPE", "TEXTSxTOKENS"))
    ap.add_argument("--variant", choices=("before", "after"), help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.rss and args.variant:
        one_rss(args)
        return
    if args.rss:
        out = {}
        for variant in ("before", "after"):
            line = subprocess.run(
                [sys.executable, __file__, "--before", args.before, "--rss", *args.rss, "--variant", variant],
                check=True, capture_output=True, text=True,
            ).stdout.strip().splitlines()[-1]
            out[variant] = row = json.loads(line)
            print(f"{variant:6} {' '.join(args.rss)}: peak RSS {row['peak_rss'] / 1e9:.2f} GB, "
                  f"{(row['peak_rss'] - row['rss_before_call']) / 1e9:.2f} GB over the inputs', "
                  f"one call {row['seconds']:.2f} s", flush=True)
    else:
        out = timed(args)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
