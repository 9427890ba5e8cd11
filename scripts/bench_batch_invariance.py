#!/usr/bin/env python3
"""The CPU's native path before and after batch-invariant passes: speed and memory.

One source tree against another (``--tree NAME=PATH``, each a ``python``
folder; the first is the reference), on seeded random checkpoints of real
models' shapes written once under ``--workdir`` (the vocabulary cut to
32,000 rows, which only the embedding lookup reads):

  qwen3-0.6b       Qwen3-Embedding-0.6B (scripts/bench_decoder.py's shape)
  minilm           the bundled all-MiniLM-L6-v2 (the native encoder)
  modernbert-base  ModernBERT-base: 768 wide, 22 layers (global attention
                   every third, a 128-token window otherwise), 12 heads,
                   GeGLU 1152

Every round starts one process per tree, in turn (interleaved: both see the
same machine load), which loads the model (its resident memory after load is
``rss_mb``; after the cases ``rss_after_mb``, its peak ``peak_mb``), warms up, and times two cases: ``one``, one short text (12
token ids; the latency of a lone request) and ``mixed``, 64 texts of 8 to
``--mixed-max`` (256) token ids in one call (texts per second). Medians of ``--calls`` calls,
then of the rounds. It also reports whether the tree's vectors are the same
bits for each text alone and in the 64-text call.

    git worktree add /tmp/before <rev>
    cp python/mlx_embed/_native*.so /tmp/before/python/mlx_embed/
    .venv/bin/python scripts/bench_batch_invariance.py --tree before=/tmp/before/python --tree after=python
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
sys.path.insert(0, str(ROOT / "scripts"))

MODERNBERT_BASE = {
    "model_type": "modernbert",
    "architectures": ["ModernBertModel"],
    "vocab_size": 32000,
    "hidden_size": 768,
    "num_hidden_layers": 22,
    "num_attention_heads": 12,
    "intermediate_size": 1152,
    "global_attn_every_n_layers": 3,
    "local_attention": 128,
    "global_rope_theta": 160000.0,
    "local_rope_theta": 10000.0,
    "max_position_embeddings": 8192,
    "hidden_activation": "gelu",
    "norm_eps": 1e-5,
    "norm_bias": False,
    "attention_bias": False,
    "mlp_bias": False,
    "classifier_pooling": "cls",
    "pad_token_id": 703,
    "cls_token_id": 701,
    "sep_token_id": 702,
    "bos_token_id": 701,
    "eos_token_id": 702,
    "tie_word_embeddings": True,
}
# The tokenizer files each shape's folder takes (only the special ids matter:
# the cases send token ids).
TOKENIZERS = {"qwen3-0.6b": "tiny-qwen3", "modernbert-base": "tiny-modernbert"}


def shapes() -> dict:
    from bench_decoder import SHAPES

    return {"qwen3-0.6b": SHAPES["qwen3-0.6b"], "modernbert-base": MODERNBERT_BASE}


def make_checkpoint(shape: str, folder: Path, layers: int = 0) -> None:
    if (folder / "config.json").exists():
        return
    from bench_decoder import make_checkpoint as seeded

    config = dict(shapes()[shape])
    if layers:
        config["num_hidden_layers"] = layers
    seeded(config, folder)
    source = ROOT / "tests" / "fixtures" / TOKENIZERS[shape]
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).exists():
            shutil.copy(source / name, folder / name)


def rss_mb(field: str = "VmRSS") -> float:
    """This process's resident memory (``VmHWM``: its peak so far), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def worker(args) -> None:
    import mlx_embed
    import numpy as np

    long_cases = parse_cases(args.cases)
    # The fixtures' tokenizer files say 128 tokens.
    longest = max([512] + [n for _, n in long_cases])
    model = mlx_embed.load() if str(args.model) == "default" else mlx_embed.load(str(args.model), max_length=longest)
    out = {"tree": str(Path(mlx_embed.__file__).parents[1]), "rss_mb": rss_mb(), "ms": {}, "rows_differing_alone": None}
    rng = np.random.default_rng(0)
    vocab = min(model.vocab_size, model.tokenizer.vocab_size)
    one = [rng.integers(vocab // 10, vocab, 12).tolist()]
    mixed = [rng.integers(vocab // 10, vocab, int(n)).tolist() for n in rng.integers(8, args.mixed_max + 1, 64)]

    def vectors(ids):
        return np.frombuffer(model.embed_ids(ids).vectors, "<f4").reshape(len(ids), -1)

    cases = [("one", one), ("mixed", mixed)] if not long_cases else []
    for texts, tokens in long_cases:
        cases.append((f"{texts}x{tokens}", [rng.integers(vocab // 10, vocab, tokens).tolist() for _ in range(texts)]))
    for name, ids in cases:
        vectors(ids)  # warm-up: this case's shapes
        times = []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            vectors(ids)
            times.append(time.perf_counter() - t0)
        out["ms"][name] = statistics.median(times) * 1e3
    if args.check:
        batch = vectors(mixed)
        out["rows_differing_alone"] = int(
            sum(not np.array_equal(vectors([t])[0], batch[i]) for i, t in enumerate(mixed))
        )
    out["rss_after_mb"] = rss_mb()
    out["peak_mb"] = rss_mb("VmHWM")
    print(json.dumps(out))


def parse_cases(text: str) -> list[tuple[int, int]]:
    """``TEXTSxTOKENS,...`` (``8x2048``: eight texts of 2,048 token ids in one call)."""
    return [tuple(int(n) for n in case.split("x")) for case in text.split(",") if case]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=PATH")
    ap.add_argument(
        "--shape", action="append", choices=sorted(TOKENIZERS) + ["minilm"], help="minilm: the bundled default model"
    )
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--mixed-max", type=int, default=256, help="the longest text of the mixed case, in tokens")
    ap.add_argument(
        "--no-check",
        dest="check",
        action="store_false",
        help="skip embedding each mixed text alone (64 calls) to count the rows that differ",
    )
    ap.add_argument(
        "--cases",
        default="",
        help="TEXTSxTOKENS,... (e.g. 1x512,8x512,1x2048) instead of the one and mixed cases",
    )
    ap.add_argument("--layers", type=int, default=0, help="cut the shape to this many layers (0: all)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "mlx-embed-bench-invariance")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    trees = [t.split("=", 1) for t in args.tree]
    if not trees or any(len(t) != 2 for t in trees):
        ap.error("give at least one --tree NAME=PATH")
    sys.path.insert(0, str(ROOT / "python"))
    summary = {}
    for shape in args.shape or sorted(TOKENIZERS):
        if shape == "minilm":
            folder = Path("default")
        else:
            folder = args.workdir / (f"{shape}-{args.layers}l" if args.layers else shape)
            make_checkpoint(shape, folder, args.layers)
        runs = {name: [] for name, _ in trees}
        for r in range(args.rounds):
            for name, path in trees:
                env = {**os.environ, "PYTHONPATH": str(Path(path).resolve())}
                proc = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--worker",
                        "--model",
                        str(folder),
                        "--calls",
                        str(args.calls),
                        "--mixed-max",
                        str(args.mixed_max),
                        "--cases",
                        args.cases,
                        *([] if args.check else ["--no-check"]),
                    ],
                    env=env,
                    capture_output=True,
                    text=True,
                )
                if proc.returncode:
                    sys.exit(f"{name}: the worker failed:\n{proc.stderr[-3000:]}")
                result = json.loads(proc.stdout.strip().splitlines()[-1])
                runs[name].append(result)
                times = ", ".join(f"{case} {ms:.0f} ms" for case, ms in result["ms"].items())
                print(
                    f"{shape} round {r + 1} {name}: {times}, RSS {result['rss_mb']:.0f} MB after load "
                    f"({result['rss_after_mb']:.0f} after the cases, peak {result['peak_mb']:.0f}), "
                    f"rows differing alone: {result['rows_differing_alone']} of 64",
                    flush=True,
                )
        summary[shape] = {}
        for name, _ in trees:
            rows = runs[name]
            s = summary[shape][name] = {
                "ms": {case: statistics.median(x["ms"][case] for x in rows) for case in rows[0]["ms"]},
                "rss_mb": statistics.median(x["rss_mb"] for x in rows),
                "rss_after_mb": statistics.median(x["rss_after_mb"] for x in rows),
                "peak_mb": statistics.median(x["peak_mb"] for x in rows),
                "rows_differing_alone": rows[-1]["rows_differing_alone"],
            }
            if "mixed" in s["ms"]:
                s["mixed_texts_per_s"] = 64e3 / s["ms"]["mixed"]
            times = ", ".join(f"{case} {ms:.0f} ms" for case, ms in s["ms"].items())
            print(
                f"{shape} {name}: {times}, RSS {s['rss_mb']:.0f} MB "
                f"(after the cases {s['rss_after_mb']:.0f}, peak {s['peak_mb']:.0f}), rows differing alone: {s['rows_differing_alone']}/64"
            )
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
