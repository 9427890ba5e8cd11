#!/usr/bin/env python3
"""One short query, whole model: the time of ``model.embed([text])`` for a
single text of ~8, ~16, ~32 and ~128 tokens, the latency an interactive
search waits on, on the CPU's native path and the exact (MLX) path, for one
or more source trees side by side.

Models (``--models``), seeded random float32 weights at the real shapes, the
tokenizer of the matching test fixture (so the token counts are the
fixture tokenizer's, the shapes the real model's):
  modernbert  ModernBERT-base: hidden 768, 22 layers, 12 heads, local
              attention 128, a global layer every 3rd
  jina-v2     jina-embeddings-v2-base: BERT-base (12 layers, 768, 12 heads,
              GEGLU 3072) with ALiBi
  minilm      the bundled all-MiniLM-L6-v2 (real weights; its encoder runs
              the older ``post_ln_encoder`` kernel)

Each (tree, path) is a long-lived worker process, the tree's ``python``
folder first on its PYTHONPATH, that loads the model once, builds its texts
(words added until the text is that many tokens, specials included) and
warms up; the parent then asks the workers in turn for ``--calls`` timed
calls of one text (interleaved A, B, A, B ..., the order reversed every
other round, so all see the same machine load; fresh workers every round,
so no process's own luck follows one tree). Medians over every round's
calls; ratios against the first tree's first path. ``--attention``: also
the time spent in the layers' attention per call (``ops.blocked_attention``,
its inputs evaluated first: one more sync per layer, so run it apart from
the timed totals).

    # main against the tree before the encoders' attention moved (a worktree
    # at f6c2f69 with its extension built there):
    .venv/bin/python scripts/bench_short_query.py --trees before=/tmp/wt-before,after=. \\
        --tokens 8,16,32,128 --calls 10 --rounds 4

``--tiny``: the fixtures' own small shapes, a quick check that it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
PATHS = ("native", "exact")

# Real shapes over the fixture's config (its vocabulary: its tokenizer's).
MODELS = {
    "modernbert": ("tiny-modernbert", {
        "hidden_size": 768, "intermediate_size": 1152, "num_hidden_layers": 22,
        "num_attention_heads": 12, "local_attention": 128, "global_attn_every_n_layers": 3,
        "max_position_embeddings": 8192,
    }),
    "jina-v2": ("tiny-jina-v2", {
        "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
        "num_attention_heads": 12, "max_position_embeddings": 8192,
    }),
    "minilm": (None, {}),
}

WORDS = (
    "search query latency vector index retrieval document graph memory episode "
    "entity relation summary node edge fact time user assistant message context "
    "history river mountain library museum village festival science weather"
).split()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_checkpoint(name: str, folder: Path, seed: int, tiny: bool) -> Path:
    """The model's folder: the fixture's files (tokenizer, pooling) with the
    real shapes' config and seeded random weights made by the engine's own
    model class. ``minilm``: the bundled model's folder."""
    fixture, shape = MODELS[name]
    if fixture is None:
        from mlx_embed import loading

        return Path(loading.default_model_path())
    src = FIXTURES / fixture
    if tiny:
        return src
    if (folder / "model.safetensors").exists():
        return folder
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_embed import loading

    folder.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name == "model.safetensors" or f.suffix == ".npy":
            continue
        (shutil.copytree if f.is_dir() else shutil.copy)(f, folder / f.name)
    config = {**json.loads((src / "config.json").read_text()), **shape}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    arch = loading.architecture(config["model_type"], config)
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return folder


def text_of(model, tokens: int) -> tuple[str, int]:
    """A text of ``tokens`` tokens (specials included), or the shortest past it."""
    words: list[str] = []
    while True:
        words.append(WORDS[(len(words) * 7) % len(WORDS)])
        text = " ".join(words)
        n = model.count_tokens([text])[0]
        if n >= tokens:
            return text, n


def worker(args) -> None:
    """Load, warm up, then answer ``TOKENS CALLS`` lines from stdin with one
    JSON line: the calls' times (ms) and the text's vector."""
    import mlx_embed

    model = mlx_embed.load(None if args.folder == "-" else args.folder, fast_ops=args.path)
    attention = [0.0]
    if args.attention:
        attention_share(attention)
    texts = {t: text_of(model, t) for t in (int(x) for x in args.tokens.split(","))}
    for text, _ in texts.values():
        for _ in range(args.warmup):
            model.embed([text])
    print(json.dumps({"ready": True, "file": mlx_embed.__file__}), flush=True)
    for line in sys.stdin:
        target, calls = (int(x) for x in line.split())
        text, n = texts[target]
        times, attn = [], []
        for _ in range(calls):
            attention[0] = 0.0
            t0 = time.perf_counter()
            vec = model.embed([text])
            times.append((time.perf_counter() - t0) * 1e3)
            attn.append(attention[0] * 1e3)
        print(json.dumps({"tokens": n, "ms": times, "attention_ms": attn, "vector": vec[0].tolist()}), flush=True)


def attention_share(total: list) -> None:
    """Add the time of every encoder layer's attention (``ops.blocked_attention``,
    its inputs evaluated first, its output evaluated) to ``total[0]``: its
    share of a forward. MiniLM's attention is ``post_ln_encoder``'s and
    counts nothing here."""
    import mlx.core as mx

    from mlx_embed import ops

    inner = ops.blocked_attention
    depth = [0]

    def timed(q, k, v, *a, **kw):
        if depth[0]:  # the per-text path calls itself once per text
            return inner(q, k, v, *a, **kw)
        depth[0] += 1
        try:
            mx.eval(q, k, v)
            t0 = time.perf_counter()
            out = inner(q, k, v, *a, **kw)
            mx.eval(out)
            total[0] += time.perf_counter() - t0
        finally:
            depth[0] -= 1
        return out

    ops.blocked_attention = timed


def start(tree: Path, path: str, folder: str, args) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(tree / "python")}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--path", path, "--folder", folder,
           "--tokens", args.tokens, "--warmup", str(args.warmup)] + (["--attention"] if args.attention else [])
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def ask(proc: subprocess.Popen, line: str) -> dict:
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    out = proc.stdout.readline()
    if not out:
        raise RuntimeError(f"worker {proc.args} ended")
    return json.loads(out)


def bench_model(name: str, folder: str, trees: dict[str, Path], args) -> dict:
    import numpy as np

    keys = [(t, p) for t in trees for p in args.paths]
    got: dict = {}
    for r in range(args.rounds):
        # Fresh processes every round: a process's own luck (where its
        # weights landed in memory) would otherwise follow its tree all run.
        workers = {key: start(trees[key[0]], key[1], folder, args) for key in keys}
        try:
            for key, proc in workers.items():
                hello = json.loads(proc.stdout.readline() or "{}")
                if not hello.get("ready"):
                    raise RuntimeError(f"worker {key} did not start")
                if r == 0:
                    log(f"{name} {key}: {hello['file']}")
            for target in (int(x) for x in args.tokens.split(",")):
                for key in keys if r % 2 == 0 else keys[::-1]:
                    ans = ask(workers[key], f"{target} {args.calls}")
                    row = got.setdefault(target, {}).setdefault(
                        key, {"ms": [], "attention_ms": [], "tokens": ans["tokens"]})
                    row["ms"] += ans["ms"]
                    row["attention_ms"] += ans["attention_ms"]
                    row["vector"] = ans["vector"]
        finally:
            for proc in workers.values():
                proc.stdin.close()
                proc.wait(timeout=60)
    base = keys[0]
    res = {}
    for target, rows in got.items():
        ref = np.asarray(rows[base]["vector"])
        out = {"tokens": rows[base]["tokens"]}
        for key, row in rows.items():
            med = statistics.median(row["ms"])
            vec = np.asarray(row["vector"])
            out[f"{key[0]}/{key[1]}"] = col = {
                "median_ms": round(med, 3),
                "calls": len(row["ms"]),
                "vs_base": round(statistics.median(rows[base]["ms"]) / med, 3),
                "max_abs_diff": float(np.abs(vec - ref).max()),
                "tokens": row["tokens"],
            }
            if args.attention:
                col["attention_ms"] = round(statistics.median(row["attention_ms"]), 3)
        res[f"{name} {target}"] = out
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", default=f"this={ROOT}",
                    help="label=repo root, comma-separated; the first is the ratios' base")
    ap.add_argument("--models", default="modernbert,jina-v2,minilm")
    ap.add_argument("--tokens", default="8,16,32,128")
    ap.add_argument("--paths", default="native,exact")
    ap.add_argument("--calls", type=int, default=10, help="timed calls per worker, case and round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=5, help="untimed calls per text at start")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", help="where the checkpoints go (kept; default a temporary folder)")
    ap.add_argument("--tiny", action="store_true", help="the fixtures' own small models")
    ap.add_argument("--attention", action="store_true",
                    help="also the time in the layers' attention per call (adds a sync per layer)")
    ap.add_argument("--json", help="write the results here")
    # The worker's.
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    args.paths = [p for p in args.paths.split(",") if p]
    if not set(args.paths) <= set(PATHS):
        ap.error(f"--paths: {', '.join(PATHS)}")
    trees = {}
    for item in args.trees.split(","):
        label, _, root = item.partition("=")
        trees[label] = Path(root).resolve()
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_short_query-") as tmp:
        work = Path(args.workdir or tmp)
        for name in args.models.split(","):
            folder = make_checkpoint(name, work / name, args.seed, args.tiny)
            results.update(bench_model(name, "-" if MODELS[name][0] is None else str(folder), trees, args))
    for case, out in results.items():
        cols = "  ".join(f"{k} {v['median_ms']:.2f} ms ({v['vs_base']:.2f}x)"
                         + (f" attn {v['attention_ms']:.2f}" if "attention_ms" in v else "")
                         for k, v in out.items() if k != "tokens")
        print(f"{case:>16} ({out['tokens']} tok): {cols}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
