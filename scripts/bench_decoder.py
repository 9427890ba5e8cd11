#!/usr/bin/env python3
"""A decoder's forward pass on the CPU, one source tree against another.

For changes to the decoders' Python path (mlx-lm's blocks as the engine runs
them: attention, feed-forward, norms), where a before/after comparison is the
measurement. Each tree is a ``python`` folder (``--tree NAME=PATH``); every
round starts one process per tree, in turn (interleaved, so both see the
same machine load), which loads the same seeded checkpoint, warms up, and
times each case: ``TEXTSxTOKENS`` texts of exactly that many token ids a
call. Medians over the calls of a round, then over rounds. The first tree's
vectors are the reference for the others' (max |diff| and min cosine).

Shapes (seeded random weights from the engine's own classes, written once
under ``--workdir``; the vocabulary is cut to 32,000 rows, which only the
embedding lookup reads):
  qwen3-0.6b           Qwen3-Embedding-0.6B: 1024 wide, 28 layers, 16 query
                       and 8 key/value heads of 128, SwiGLU 3072
  embeddinggemma-300m  768 wide, 24 layers (5 sliding with a 512 window,
                       then 1 global), 3 query heads and 1 key/value head
                       of 256, GeGLU 1152, bidirectional

A "before" tree is a git worktree of the older revision with this tree's
native extension copied in (the kernels are a superset):

    git worktree add /tmp/before <rev>
    cp python/mlx_embed/_native*.so /tmp/before/python/mlx_embed/
    .venv/bin/python scripts/bench_decoder.py --tree before=/tmp/before/python --tree after=python \\
        --shape qwen3-0.6b --cases 1x64,8x64,1x512 --rounds 3 --json /tmp/decoder.json

``--folder`` times an existing model folder instead (a real checkpoint, or
a test fixture for a quick check of the script itself).

``--attention`` times one layer's attention alone in this tree, for the
shape's heads: MLX's ``mx.fast.scaled_dot_product_attention`` (what mlx-lm
calls) against the native kernel (``ops.decoder_attention``), causal for
Qwen3 and over all keys for Gemma, and for Qwen3 what the engine's passes run
(mlx-lm's attention as ``ops.engine_attention`` wraps it), each
``TEXTSxTOKENS`` case, medians of 20 calls:

    .venv/bin/python scripts/bench_decoder.py --attention --shape qwen3-0.6b --cases 1x64,4x64,8x64,1x512
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "tests" / "fixtures" / "tiny-qwen3" / "tokenizer.json"
VOCAB = 32000

SHAPES = {
    "qwen3-0.6b": {
        "model_type": "qwen3", "vocab_size": VOCAB, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
        "hidden_act": "silu", "attention_bias": False, "hidden_size": 1024, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072,
        "architectures": ["Qwen3Model"],
    },
    "embeddinggemma-300m": {
        "model_type": "gemma3_text", "vocab_size": VOCAB, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "hidden_size": 768, "num_hidden_layers": 24, "num_attention_heads": 3, "num_key_value_heads": 1,
        "head_dim": 256, "intermediate_size": 1152, "query_pre_attn_scalar": 256, "sliding_window": 512,
        "sliding_window_pattern": 6, "use_bidirectional_attention": True,
        "hidden_activation": "gelu_pytorch_tanh", "attn_logit_softcapping": None,
        "final_logit_softcapping": None, "tie_word_embeddings": True, "architectures": ["Gemma3TextModel"],
    },
}


def parse_cases(text: str) -> list[tuple[int, int]]:
    cases = []
    for item in text.split(","):
        texts, tokens = item.lower().split("x")
        cases.append((int(texts), int(tokens)))
    return cases


def make_checkpoint(config: dict, folder: Path) -> None:
    """Seeded random weights from the engine's classes (norm weights
    included, so an ordering bug would show); kept when already there."""
    if (folder / "config.json").exists():
        return
    import mlx_embed  # noqa: F401 - before mlx.core: picks the BLAS
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_embed import loading

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_bytes(TOKENIZER.read_bytes())
    arch = loading.architecture(config["model_type"])
    mx.random.seed(0)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    for name, w in weights.items():
        if name.endswith("norm.weight"):
            weights[name] = mx.random.uniform(-0.5, 0.5, w.shape)
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "config.json").write_text(json.dumps(config))


def worker(args) -> None:
    import mlx_embed
    import numpy as np

    model = mlx_embed.load(args.model)
    rng = np.random.default_rng(0)
    out = {"tree": str(Path(mlx_embed.__file__).parents[1]), "cases": {}}
    vectors = {}
    for texts, tokens in parse_cases(args.cases):
        # Within the tokenizer's range, which the engine checks ids against.
        vocab = min(model.vocab_size, model.tokenizer.vocab_size)
        ids = rng.integers(vocab // 10, vocab, (texts, tokens)).tolist()
        model.embed_ids(ids)  # warm-up: this shape's first graph
        times = []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            vecs = model.embed_ids(ids)
            times.append(time.perf_counter() - t0)
        out["cases"][f"{texts}x{tokens}"] = statistics.median(times) * 1e3
        vectors[f"{texts}x{tokens}"] = np.frombuffer(vecs.vectors, "<f4").reshape(texts, -1).astype(np.float64)
    np.savez(args.vectors, **vectors)
    print(json.dumps(out))


def attention_alone(config: dict, cases: list[tuple[int, int]]) -> dict:
    import mlx_embed  # noqa: F401 - before mlx.core: picks the BLAS
    import mlx.core as mx

    from mlx_embed import _blas, loading, ops

    heads, kv_heads, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    causal = config["model_type"] != "gemma3_text"
    ctx = ops.make_context("native", kernel_threads=_blas.get_num_threads())
    # What the engine's passes call: mlx-lm's attention as ops.engine_attention
    # wraps it.
    module = loading.architecture(config["model_type"]).Model.__module__
    engine_attention = sys.modules[module]._lm.scaled_dot_product_attention

    def median_ms(fn) -> float:
        for _ in range(3):
            mx.eval(fn())
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            mx.eval(fn())
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    out = {}
    for texts, tokens in cases:
        mx.random.seed(0)
        q = mx.random.normal((texts, heads, tokens, hd))
        k, v = (mx.random.normal((texts, kv_heads, tokens, hd)) for _ in range(2))
        mx.eval(q, k, v)
        scale = hd**-0.5
        mlx_ms = median_ms(lambda: mx.fast.scaled_dot_product_attention(
            q, k, v, scale=scale, mask="causal" if causal else None))

        row = {"mlx_ms": mlx_ms}
        with ops.forward_context(ctx):
            row["native_ms"] = median_ms(lambda: ops.decoder_attention(q, k, v, scale, None, causal=causal))
            if causal:
                row["engine_ms"] = median_ms(lambda: engine_attention(q, k, v, scale=scale, mask="causal"))
        out[f"{texts}x{tokens}"] = row
        engine = f", engine {row['engine_ms']:.2f} ms" if causal else ""
        print(f"  {texts}x{tokens}: MLX {mlx_ms:.2f} ms, native {row['native_ms']:.2f} ms "
              f"({mlx_ms / row['native_ms']:.2f}x){engine}", flush=True)
    return out


def compare(reference: Path, other: Path) -> dict:
    import numpy as np

    a, b = np.load(reference), np.load(other)
    out = {}
    for case in a.files:
        x, y = a[case], b[case]
        cos = (x * y).sum(1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1))
        out[case] = {"max_abs_diff": float(np.abs(x - y).max()), "min_cosine": float(cos.min())}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                    help="a python/ folder to import mlx_embed from; the first is the reference")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--folder", type=Path, help="an existing model folder instead of a seeded --shape")
    ap.add_argument("--cases", default="1x64,8x64,1x512", help="TEXTSxTOKENS, comma separated")
    ap.add_argument("--calls", type=int, default=3, help="timed calls per case and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "mlx-embed-bench-decoder")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--attention", action="store_true",
                    help="time one layer's attention alone (MLX against the native kernel), this tree")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--vectors", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return

    if args.attention:
        sys.path.insert(0, str(ROOT / "python"))
        print(f"{args.shape}, one layer's attention (threads as the engine's one caller):")
        result = {"shape": args.shape, "attention": attention_alone(SHAPES[args.shape], parse_cases(args.cases))}
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
        return
    trees = [t.split("=", 1) for t in args.tree]
    if not trees or any(len(t) != 2 for t in trees):
        ap.error("give at least one --tree NAME=PATH")
    args.workdir.mkdir(parents=True, exist_ok=True)
    folder = args.folder
    if folder is None:
        folder = args.workdir / args.shape
        sys.path.insert(0, str(ROOT / "python"))
        make_checkpoint(SHAPES[args.shape], folder)
    label = folder.name

    runs: dict[str, list[dict]] = {name: [] for name, _ in trees}
    for r in range(args.rounds):
        for name, path in trees:
            env = {**os.environ, "PYTHONPATH": str(Path(path).resolve())}
            vectors = args.workdir / f"{name}.npz"
            proc = subprocess.run(
                [sys.executable, __file__, "--worker", "--model", str(folder), "--cases", args.cases,
                 "--calls", str(args.calls), "--vectors", str(vectors)],
                env=env, capture_output=True, text=True,
            )
            if proc.returncode:
                sys.exit(f"{name}: the worker failed:\n{proc.stderr[-3000:]}")
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            runs[name].append(result["cases"])
            cells = ", ".join(f"{c} {ms:,.1f} ms" for c, ms in result["cases"].items())
            print(f"round {r + 1} {name} ({result['tree']}): {cells}", flush=True)

    reference = trees[0][0]
    summary = {"model": label, "cases": args.cases, "calls": args.calls, "rounds": args.rounds,
               "medians_ms": {}, "runs_ms": runs, "vs_" + reference: {}}
    for name, _ in trees:
        summary["medians_ms"][name] = {
            case: statistics.median(run[case] for run in runs[name]) for case in runs[name][0]
        }
    print(f"\n{label}, medians over {args.rounds} rounds (ms a call):")
    for case in runs[reference][0]:
        base = summary["medians_ms"][reference][case]
        row = "  ".join(
            f"{name} {summary['medians_ms'][name][case]:,.1f}"
            + ("" if name == reference else f" ({base / summary['medians_ms'][name][case]:.2f}x)")
            for name, _ in trees
        )
        print(f"  {case:>8}: {row}")
    for name, _ in trees[1:]:
        diff = compare(args.workdir / f"{reference}.npz", args.workdir / f"{name}.npz")
        summary["vs_" + reference][name] = diff
        worst = min(d["min_cosine"] for d in diff.values())
        print(f"  {name} vs {reference}: min cosine {worst:.12f}, "
              f"max |diff| {max(d['max_abs_diff'] for d in diff.values()):.2e}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
