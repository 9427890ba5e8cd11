"""Every architecture the engine serves, on this machine's GPU against its CPU.

The GPU figures of docs/benchmarks.md cover two BERT shapes and Qwen3. The
other architectures (DistilBERT, MPNet, XLM-RoBERTa, CamemBERT, DeBERTa,
ModernBERT, NomicBERT, GTE, JinaBERT in both layouts, EuroBERT, Mistral, Llama, Qwen2,
Gemma3, SPLADE, static tables, and the cross-encoder heads) have only run on
the CPU. This loads each test fixture (``tests/fixtures/tiny-*``: random
weights in each architecture's real layout) and the bundled
all-MiniLM-L6-v2 on the default device with the engine's defaults there
(pipelined passes, shape buckets, fused attention in half precision), and
in a child process on the CPU (``mx.set_default_device(mx.cpu)``: the CPU's
defaults, whose outputs the unit tests check against each fixture's
sentence-transformers or transformers references), and compares them:

* embedding models: ``embed`` on the golden texts plus two long ones, the
  lowest cosine between the two devices' vectors;
* rerankers: raw ``score`` of (text, next text) pairs; classifiers: raw
  ``predict`` of the texts; the largest difference, beside the largest score.

Each model runs in float32, in bfloat16, in float32 with attention cut
into query blocks (``ops.SCORES_BLOCK_BYTES`` lowered to 64 KiB, so the tiny
models take the path an 8,192-token input takes), and in float32 and
bfloat16 with the encoders' layers on each pass's real tokens
(``packed_rows``; a model that does not pack runs as in the plain run), and in float32 and
bfloat16 evaluated in pieces, one after every layer (``eval_chunk_mb``, the
chunk lowered to a byte so the tiny models' layers each reach it; what a big
pass takes with CUDA graphs off). A row passes at cosine
>= 0.9999 (float32; 0.9999999 on an H200 since the package keeps float32
matmuls out of TF32, 0.9999961 with TF32) or
>= 0.99 (bfloat16), and at score differences within 1e-3 (float32) or 1e-1
(bfloat16) of 1 + the largest score.

    .venv/bin/python scripts/gpu_architectures.py --out results/          # on a GPU
    .venv/bin/python scripts/gpu_architectures.py --fixtures /tmp/fixtures --out results/
    .venv/bin/python scripts/gpu_architectures.py --dry-run               # CPU only (make test)

``--dry-run`` runs on a machine without a GPU: the "device" side is the CPU
with the GPU's settings forced (pipelined passes, shape buckets, MLX's own
element-wise ops, fused attention), so every architecture's GPU code path is
checked against the CPU path it is tested by (float32, blocked attention and
packed rows; bfloat16 has no fast path on a CPU). The exit status is 1 when a row fails
or a model fails to load on one side only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
# --fixtures: on a device machine the fixtures come in a call of their own
# (scripts/gpu-relay-tree hide takes them out of the working tree).
FIXTURES = ROOT / "tests" / "fixtures"
DEFAULT = "all-MiniLM-L6-v2"
# What the GPU defaults switch on, forced on the CPU for --dry-run.
GPU_LIKE = {"pipeline": True, "shape_buckets": True, "fast_ops": "exact", "fused_attention": True}
RUNS = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "float32_blocked": {"dtype": "float32", "blocked": True},
    # Encoders' layers on each pass's real tokens (load(packed_rows=True)):
    # the same outputs as the CPU's padded path.
    "float32_packed": {"dtype": "float32", "packed_rows": True},
    "bfloat16_packed": {"dtype": "bfloat16", "packed_rows": True},
    # A pass evaluated after every layer, at most two pieces queued
    # (ops.EvaluationPoints): the same outputs as a whole pass.
    "float32_points": {"dtype": "float32", "points": True},
    "bfloat16_points": {"dtype": "bfloat16", "points": True},
}
TINY_BLOCK_BYTES = 64 << 10
MIN_COSINE = {"float32": 0.9999, "bfloat16": 0.99}
# bfloat16 keeps 8 bits of mantissa: on the CPU, the GPU's settings and the
# CPU's own moved random-weight logits of ~3-14 by up to 0.25 (--dry-run).
SCORE_TOLERANCE = {"float32": 1e-3, "bfloat16": 1e-1}
# bfloat16 has no fast path on the CPU and its GPU-settings path is float32's
# with another dtype, so the dry run leaves it out.
DRY_RUNS = ("float32", "float32_blocked", "float32_packed", "float32_points")


def texts() -> list[str]:
    golden = [t for t in json.loads((FIXTURES / "golden" / "minilm_texts.json").read_text()) if t.strip()]
    long = " ".join(golden[:12])
    return golden + [long, " ".join([long] * 4)]


def models() -> list[tuple[str, str | None]]:
    found = [(p.name, str(p)) for p in sorted(FIXTURES.glob("tiny-*")) if (p / "README.md").is_file()]
    return [(DEFAULT, None), *found]


def run_model(path: str | None, run: str, extra: dict) -> dict:
    """One model's outputs on the current default device."""
    import mlx_embed
    from mlx_embed import ops

    spec = RUNS[run]
    before, points = ops.SCORES_BLOCK_BYTES, ops.EvaluationPoints.__init__
    if spec.get("blocked"):
        ops.SCORES_BLOCK_BYTES = TINY_BLOCK_BYTES
    if spec.get("points"):
        extra = {**extra, "eval_chunk_mb": 1}
        ops.EvaluationPoints.__init__ = lambda self, chunk_bytes, depth=2: points(self, 1, depth)
    try:
        m = mlx_embed.load(path, dtype=spec["dtype"], packed_rows=spec.get("packed_rows", False), **extra)
        spec_ = m.spec()
        kind = spec_.kind
        some = texts()
        if spec_.multi_vector:
            # A ColBERT model has no pooled vector: every kept token row of
            # the texts as queries (expansion rows included) and as documents.
            out = np.concatenate([*m.embed_multi_vector(some, is_query=True), *m.embed_multi_vector(some)])
        elif kind == "reranker":
            out = m.score(list(zip(some[:-1], some[1:])), raw_scores=True)
        elif kind == "classifier":
            out = m.predict(some, raw_scores=True)
        elif spec_.tasks:
            # Task adapters (jina-embeddings-v3): the base weights, then a
            # task's low-rank path.
            out = np.concatenate([m.embed(some), m.embed(some, task=spec_.tasks[-1])])
        else:
            out = m.embed(some)
        return {"kind": kind, "device": m.device, "output": np.asarray(out, dtype=np.float32)}
    finally:
        ops.SCORES_BLOCK_BYTES, ops.EvaluationPoints.__init__ = before, points


def compare(run: str, kind: str, device: np.ndarray, cpu: np.ndarray) -> dict:
    if device.shape != cpu.shape:
        return {"ok": False, "error": f"shapes differ: {device.shape} vs {cpu.shape}"}
    if kind == "embedding":
        norms = np.linalg.norm(device, axis=1) * np.linalg.norm(cpu, axis=1)
        live = norms > 0
        cos = (device * cpu).sum(axis=1)[live] / norms[live]
        zeros_agree = bool(np.all(np.linalg.norm(device[~live], axis=1) == np.linalg.norm(cpu[~live], axis=1)))
        low = float(cos.min()) if cos.size else 1.0
        return {"ok": low >= MIN_COSINE[run.split("_")[0]] and zeros_agree, "min_cosine": low,
                "max_abs_diff": float(np.abs(device - cpu).max())}
    diff = float(np.abs(device - cpu).max())
    scale = float(np.abs(cpu).max())
    return {"ok": diff <= SCORE_TOLERANCE[run.split("_")[0]] * (1 + scale), "max_abs_diff": diff,
            "max_abs_score": scale}


def side(out_path: Path, cpu: bool, dry_run: bool, only: list[str]) -> None:
    """Every model and run on one side, into an .npz (outputs) and a .json
    (kinds, devices, errors)."""
    if cpu:
        import mlx_embed  # noqa: F401 - before mlx.core, so that its BLAS takes effect

        import mlx.core as mx

        mx.set_default_device(mx.cpu)
    extra = GPU_LIKE if (dry_run and not cpu) else {}
    arrays, meta = {}, {}
    for name, path in models():
        if only and name not in only:
            continue
        for run in DRY_RUNS if dry_run else RUNS:
            key = f"{name}:{run}"
            t0 = time.perf_counter()
            try:
                r = run_model(path, run, extra)
                arrays[key] = r["output"]
                meta[key] = {"kind": r["kind"], "device": r["device"], "seconds": time.perf_counter() - t0}
            except Exception as e:  # noqa: BLE001 - recorded; the other side decides
                meta[key] = {"error": f"{type(e).__name__}: {e}"}
                traceback.print_exc()
    np.savez(out_path.with_suffix(".npz"), **{k.replace(":", "__"): v for k, v in arrays.items()})
    out_path.with_suffix(".json").write_text(json.dumps(meta, indent=1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="no GPU: the CPU with the GPU's settings forced")
    p.add_argument("--only", default="", help="comma list of model names (fixture folder names)")
    p.add_argument("--out", help="folder for architectures.json")
    p.add_argument("--fixtures", help="the fixtures folder, if not tests/fixtures")
    p.add_argument("--side", choices=("device", "cpu"), help=argparse.SUPPRESS)
    p.add_argument("--side-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    only = [x for x in args.only.split(",") if x]
    if args.fixtures:
        global FIXTURES
        FIXTURES = Path(args.fixtures).resolve()
    known = [name for name, _ in models()]
    unknown = [x for x in only if x not in known]
    if unknown:
        # A typo would drop its rows without a word ("0 of 0 rows pass").
        p.error(f"--only: unknown model name(s) {', '.join(unknown)} (known, from {FIXTURES}: {', '.join(known)})")
    if args.side:
        side(Path(args.side_out), args.side == "cpu", args.dry_run, only)
        return 0

    import mlx.core as mx

    if mx.default_device() == mx.cpu and not args.dry_run:
        print("no GPU here: MLX's default device is the CPU (use --dry-run)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        sides = {}
        for which in ("device", "cpu"):
            # A process each: the device side must not see the CPU default,
            # and MLX's buffer cache limit is process-wide.
            stem = Path(tmp) / which
            cmd = [sys.executable, __file__, "--side", which, "--side-out", str(stem), "--only", args.only,
                   "--fixtures", str(FIXTURES)]
            if args.dry_run:
                cmd.append("--dry-run")
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                [str(ROOT / "python"), os.environ.get("PYTHONPATH", "")])}
            r = subprocess.run(cmd, env=env, timeout=1800)
            if r.returncode != 0:
                print(f"the {which} side exited with {r.returncode}", file=sys.stderr)
                return 1
            data = np.load(stem.with_suffix(".npz"))
            sides[which] = ({k.replace("__", ":"): data[k] for k in data.files},
                            json.loads(stem.with_suffix(".json").read_text()))
    (dev_out, dev_meta), (cpu_out, cpu_meta) = sides["device"], sides["cpu"]
    rows, failed = {}, []
    for key in dev_meta:
        d, c = dev_meta[key], cpu_meta.get(key, {"error": "not run"})
        if "error" in d or "error" in c:
            # A model neither side can load is not this script's finding.
            ok = "error" in d and "error" in c
            rows[key] = {"ok": ok, "device_error": d.get("error"), "cpu_error": c.get("error")}
        else:
            rows[key] = {"kind": d["kind"], "device": d["device"], "cpu": c["device"],
                         **compare(key.split(":")[1], d["kind"], dev_out[key], cpu_out[key])}
        if not rows[key]["ok"]:
            failed.append(key)
    meta = {"mlx": mx.__version__, "device": str(mx.default_device()), "dry_run": args.dry_run,
            "seconds": time.perf_counter() - t0, "argv": sys.argv[1:]}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "architectures.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"# {meta}")
    print("| model | run | kind | min cosine or max diff (max score) | ok |")
    print("|---|---|---|---|---|")
    for key, r in rows.items():
        name, run = key.split(":")
        if "min_cosine" in r:
            figure = f"{r['min_cosine']:.7f}"
        elif "max_abs_diff" in r:
            figure = f"{r['max_abs_diff']:.2e} ({r['max_abs_score']:.2f})"
        else:
            figure = f"device: {r.get('device_error')}; cpu: {r.get('cpu_error')}"[:160]
        print(f"| {name} | {run} | {r.get('kind', '-')} | {figure} | {'yes' if r['ok'] else 'NO'} |")
    print(f"{len(rows) - len(failed)} of {len(rows)} rows pass" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
