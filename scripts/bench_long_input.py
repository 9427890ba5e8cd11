#!/usr/bin/env python3
"""Memory and time of one long input, attention in query-row blocks or not.

jina-embeddings-v2 takes 8192 tokens, and its attention (ALiBi) runs through
MLX with the score matrix materialized: [heads, L, L] float32 per sequence,
3.2 GB at 8192 tokens with 12 heads, several of them alive at once.
``ops.blocked_attention`` computes long inputs a block of query rows at a
time (``ops.SCORES_BLOCK_BYTES`` of scores per block). This script measures
what that changes on a jina-embeddings-v2-base-shaped model (12 layers, 768
wide, 12 heads, GEGLU, ALiBi; seeded random weights, tiny-jina-v2's
tokenizer): one input of each length, each configuration in its own process
(so each peak is its own), interleaved rounds, medians.

``--model qwen3-0.6b``: the decoders (Qwen3-Embedding takes 32,768 tokens),
whose mlx-lm attention ``ops.engine_attention`` cuts the same way on MLX's
path (``fast_ops="exact"``, what a GPU runs; on the CPU's native path the
decoders' attention runs in the native kernel, which holds no score matrix
at any length: scripts/bench_batch_invariance.py measures that):
Qwen3-0.6B's layer shape (1024 wide, 16 query and 8 key heads of 128, MLP
3072) with ``--layers`` of its 28 layers (4 by default: the attention's
memory is per layer, its time per layer), seeded random weights, tiny-qwen3's
tokenizer.

    .venv/bin/python scripts/bench_long_input.py --lengths 1024,2048,4096 --rounds 3 --json docs/long-input-results.json
    .venv/bin/python scripts/bench_long_input.py --model qwen3-0.6b --lengths 2048,4096,8192 --rounds 1

Configurations: ``blocked`` (the default) and ``whole`` (one block whatever
the size, ``SCORES_BLOCK_BYTES`` set past any
input: the memory of the code before blocks).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny-jina-v2"
SHAPE = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072}
QWEN3_FIXTURE = ROOT / "tests" / "fixtures" / "tiny-qwen3"
QWEN3_SHAPE = {"hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
               "intermediate_size": 3072}
WORDS = ("the of and to in is was for on that with as by at from his her an were are model data search "
         "query document vector").split()


def make_model(folder: Path) -> None:
    """tiny-jina-v2's folder at jina-embeddings-v2-base's shape, seeded
    random weights (N(0, 0.02), norms 1 and 0)."""
    import mlx.core as mx
    import numpy as np

    shutil.copytree(FIXTURE, folder)
    for f in folder.glob("reference_*.npy"):
        f.unlink()
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(SHAPE)
    (folder / "config.json").write_text(json.dumps(cfg))
    st = json.loads((folder / "sentence_bert_config.json").read_text())
    st["max_seq_length"] = 8192
    (folder / "sentence_bert_config.json").write_text(json.dumps(st))
    pooling = json.loads((folder / "1_Pooling" / "config.json").read_text())
    pooling["word_embedding_dimension"] = SHAPE["hidden_size"]
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    rng = np.random.default_rng(0)
    h, inter = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    w = {}

    def rand(name, *shape):
        w[name] = mx.array((0.02 * rng.standard_normal(shape)).astype(np.float32))

    def norm(name):
        w[name + ".weight"], w[name + ".bias"] = mx.ones((h,)), mx.zeros((h,))

    rand("embeddings.word_embeddings.weight", cfg["vocab_size"], h)
    rand("embeddings.token_type_embeddings.weight", 2, h)
    norm("embeddings.LayerNorm")
    for i in range(SHAPE["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        for n in ("query", "key", "value"):
            rand(p + f"attention.self.{n}.weight", h, h)
            rand(p + f"attention.self.{n}.bias", h)
        rand(p + "attention.output.dense.weight", h, h)
        rand(p + "attention.output.dense.bias", h)
        norm(p + "attention.output.LayerNorm")
        rand(p + "mlp.gated_layers.weight", 2 * inter, h)
        rand(p + "mlp.wo.weight", h, inter)
        rand(p + "mlp.wo.bias", h)
        norm(p + "mlp.layernorm")
    mx.save_safetensors(str(folder / "model.safetensors"), w)


def make_qwen3(folder: Path, layers: int) -> dict:
    """tiny-qwen3's folder at Qwen3-0.6B's layer shape with ``layers``
    layers, seeded random weights (mlx-lm's initialization, norms 1)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3

    shutil.copytree(QWEN3_FIXTURE, folder)
    for f in folder.glob("reference_*.npy"):
        f.unlink()
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(QWEN3_SHAPE, num_hidden_layers=layers)
    (folder / "config.json").write_text(json.dumps(cfg))
    mx.random.seed(0)
    model = qwen3.Qwen3Model(qwen3.ModelArgs.from_dict(cfg))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return {**QWEN3_SHAPE, "num_hidden_layers": layers}


def text_of(tokens: int) -> str:
    # ~1.2 tokens a word with this vocabulary; run() reports the exact count.
    rnd = random.Random(tokens)
    return " ".join(rnd.choice(WORDS) for _ in range(int(tokens / 1.2)))


def run(folder: str, config: str, tokens: int, block_bytes: int) -> dict:
    """One process, one configuration, one input: load, warm up on a short
    text, embed the long one."""
    import mlx_embed  # first: it sets up the BLAS before MLX loads
    import mlx.core as mx
    from mlx_embed import ops

    if config == "whole":
        ops.SCORES_BLOCK_BYTES = 1 << 62
    elif block_bytes:
        ops.SCORES_BLOCK_BYTES = block_bytes
    model = mlx_embed.load(folder, max_length=max(8192, tokens + 64), fast_ops="exact")
    model.embed(["warm up"])
    text = text_of(tokens)
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    model.embed([text])
    seconds = time.perf_counter() - t0
    return {
        "config": config,
        "tokens": model.count_tokens([text])[0],
        "seconds": seconds,
        "mlx_peak_bytes": mx.get_peak_memory(),
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("jina-v2-base", "qwen3-0.6b"), default="jina-v2-base")
    ap.add_argument("--layers", type=int, default=4, help="layers of the qwen3-0.6b shape")
    ap.add_argument("--lengths", default="1024,2048,4096", help="input lengths (approximate tokens)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", default="blocked,whole")
    ap.add_argument("--json", help="write the raw results here")
    ap.add_argument("--timeout", type=float, default=900, help="seconds one process may take")
    ap.add_argument("--block-bytes", type=int, default=0,
                    help="scores per block for `blocked` (default: ops.SCORES_BLOCK_BYTES)")
    ap.add_argument("--one", nargs=3, metavar=("FOLDER", "CONFIG", "TOKENS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run(args.one[0], args.one[1], int(args.one[2]), args.block_bytes)))
        return 0
    lengths = [int(x) for x in args.lengths.split(",")]
    configs = args.configs.split(",")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / f"{args.model}-shape"
        if args.model == "qwen3-0.6b":
            shape = make_qwen3(folder, args.layers)
        else:
            make_model(folder)
            shape = SHAPE
        for r in range(args.rounds):
            for tokens in lengths:
                for config in configs:
                    out = subprocess.run(
                        [sys.executable, __file__, "--one", str(folder), config, str(tokens),
                         "--block-bytes", str(args.block_bytes)],
                        capture_output=True, text=True, timeout=args.timeout, env=dict(os.environ),
                    )
                    if out.returncode != 0:
                        raise SystemExit(f"{config} at {tokens} tokens failed:\n{out.stderr[-3000:]}")
                    row = json.loads(out.stdout.strip().splitlines()[-1]) | {"round": r}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    print("\n| tokens | config | seconds (median) | MLX peak GB | max RSS GB |")
    print("|---:|---|---:|---:|---:|")
    summary = []
    for tokens in lengths:
        for config in configs:
            mine = [x for x in rows if x["config"] == config and abs(x["tokens"] - tokens) < tokens * 0.3]
            if not mine:
                continue
            s = {
                "tokens": mine[0]["tokens"], "config": config,
                "seconds": statistics.median(x["seconds"] for x in mine),
                "mlx_peak_gb": max(x["mlx_peak_bytes"] for x in mine) / 1e9,
                "max_rss_gb": max(x["max_rss_bytes"] for x in mine) / 1e9,
            }
            summary.append(s)
            print(f"| {s['tokens']} | {config} | {s['seconds']:.2f} | {s['mlx_peak_gb']:.2f} | {s['max_rss_gb']:.2f} |")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"model": args.model, "shape": shape, "rows": rows, "summary": summary}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
