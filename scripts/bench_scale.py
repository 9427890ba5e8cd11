#!/usr/bin/env python3
"""Scaling benchmarks, each side by side in one run (docs/scaling.md).

1. Replicas: wrk (scripts/wrk-embed.lua, two texts per request) at
   --connections against one replica directly, one replica behind nginx,
   and two replicas behind nginx (deploy/nginx/nginx.conf), each replica
   with the default two MLX workers and, as a fourth row, two replicas
   with one worker each (the two cores split between them).
2. Bulk: the same JSONL file (--rows rows of wrk's corpus) through
   `mlx-embed embed` (one process) and `mlx-embed bulk` on a local Ray
   cluster (one actor with two MLX workers; two actors with one each).
   Times are whole commands, model loading and Ray start-up included, as a
   user would see them; the bulk job's own time (after Ray is up) is given too.

Writes docs/scaling-results.json and the block between the bench_scale
markers in docs/scaling.md.

    make build && .venv/bin/python scripts/bench_scale.py                  # ~6 min on 2 quiet cores
    .venv/bin/python scripts/bench_scale.py --duration 5s --rows 2000 --no-write  # a quick look
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import replicas as rp  # noqa: E402  (after the sys.path line above)

RESULTS = ROOT / "docs" / "scaling-results.json"
DOC = ROOT / "docs" / "scaling.md"
BEGIN, END = "<!-- bench_scale:begin -->", "<!-- bench_scale:end -->"
REPLICA_ARGS = ["--drain-timeout-secs", "5"]


def _loadtest():
    """scripts/loadtest as a module: its wrk runner and corpus reader."""
    loader = importlib.machinery.SourceFileLoader("loadtest", str(ROOT / "scripts" / "loadtest"))
    spec = importlib.util.spec_from_loader("loadtest", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def seconds_of(duration: str) -> int:
    return int(duration[:-1]) * {"s": 1, "m": 60}[duration[-1]] if duration[-1] in "sm" else int(duration)


# ---------------------------------------------------------------- replicas


def bench_replicas(lt, connections: int, seconds: int, work: Path) -> list[dict]:
    rows = []
    configs = [
        ("1 replica, direct", 1, {}, False),
        ("1 replica behind nginx", 1, {}, True),
        ("2 replicas behind nginx", 2, {}, True),
        ("2 replicas (1 MLX worker each) behind nginx", 2, {"MLX_EMBED_WORKERS": "1"}, True),
    ]
    for label, n, env, through_nginx in configs:
        ports = [rp.free_port() for _ in range(n)]
        replicas = [rp.start_replica(p, work / "logs", REPLICA_ARGS, wait=False, env=env) for p in ports]
        nginx = None
        try:
            for r in replicas:
                rp.wait_healthy(r)
            target = ports[0]
            if through_nginx:
                nginx = rp.start_nginx(rp.free_port(), ports, work / f"nginx-{ports[0]}")
                target = nginx.port
            print(f"{label}: wrk -c {connections} for {seconds}s ...", flush=True)
            result = lt.run_wrk(target, connections, seconds, 60, work / f"wrk-{ports[0]}.log")
            served = [embed_requests(r) for r in replicas]
        finally:
            if nginx:
                nginx.stop()
            for r in replicas:
                r.stop()
        rows.append({"config": label, "replicas": n, "nginx": through_nginx, "env": env,
                     "connections": connections, "seconds": seconds, "served_per_replica": served, **result})
        print(f"  {result.get('texts_per_s', 0):.0f} texts/s, p50 {result.get('p50_ms')} ms, "
              f"p99 {result.get('p99_ms')} ms, non-2xx {result.get('non_2xx')}, per replica {served}", flush=True)
    return rows


def embed_requests(replica: rp.Replica) -> int:
    import re
    import urllib.request

    with urllib.request.urlopen(replica.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return int(sum(float(v) for v in re.findall(
        r'^mlx_embed_http_requests_total\{route="/api/v1/embed",code="\d+"\} (\S+)$', text, re.MULTILINE)))


# ---------------------------------------------------------------- bulk


def bench_bulk(lt, n_rows: int, work: Path) -> list[dict]:
    corpus = lt.lua_corpus()
    path = work / "rows.jsonl"
    with open(path, "w") as f:
        f.writelines(json.dumps({"id": f"doc-{i:07d}", "text": corpus[i % len(corpus)]}) + "\n" for i in range(n_rows))
    cli = [sys.executable, "-m", "mlx_embed"]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    runs = [
        ("mlx-embed embed (one process, 2 MLX workers)",
         [*cli, "embed", "-i", str(path), "-o", str(work / "single.npy"), "--progress", "never"]),
        ("mlx-embed bulk, 1 actor x 2 MLX workers",
         [*cli, "bulk", str(path), "-o", str(work / "bulk1"), "--num-cpus", "2", "--concurrency", "1",
          "--workers-per-actor", "2"]),
        ("mlx-embed bulk, 2 actors x 1 MLX worker",
         [*cli, "bulk", str(path), "-o", str(work / "bulk2"), "--num-cpus", "2", "--concurrency", "2",
          "--cpus-per-actor", "0.5", "--workers-per-actor", "1"]),
    ]
    rows = []
    for label, cmd in runs:
        print(f"{label}: {n_rows} rows ...", flush=True)
        t0 = time.perf_counter()
        r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=1800, cwd=ROOT, env=env)
        wall = time.perf_counter() - t0
        if r.returncode != 0:
            raise RuntimeError(f"{label} failed:\n{r.stderr[-3000:]}")
        row = {"run": label, "command": " ".join(cmd[2:]), "rows": n_rows, "wall_s": round(wall, 2),
               "texts_per_s": round(n_rows / wall, 1)}
        summaries = [line for line in r.stdout.splitlines() if line.startswith('{"input_rows"')]
        if summaries:
            s = json.loads(summaries[-1])
            row["job_s"] = s["seconds"]
            row["job_texts_per_s"] = s["texts_per_s"]
        rows.append(row)
        print(f"  {row['texts_per_s']} texts/s over the whole command"
              + (f", {row['job_texts_per_s']} texts/s in the job" if "job_s" in row else ""), flush=True)
    return rows


# ---------------------------------------------------------------- report


def markdown(results: dict) -> str:
    out = [BEGIN, "", f"Measured {results['date']} on {results['machine']}; `{results['command']}`.", ""]
    reps = results.get("replicas")
    if reps:
        c = reps[0]["connections"]
        out += [f"| wrk, {c} connections, 2 texts/request | texts/s | p50 ms | p99 ms | non-2xx | requests per replica |",
                "| --- | --- | --- | --- | --- | --- |"]
        for r in reps:
            out.append(f"| {r['config']} | {r['texts_per_s']:.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
                       f"{r['non_2xx']} | {' / '.join(map(str, r['served_per_replica']))} |")
        base = reps[0]["texts_per_s"]
        two = next(r for r in reps if r["replicas"] == 2)
        ratio = two["texts_per_s"] / base
        cpus = results["machine"].split()[0]
        out += ["", f"Two replicas behind nginx give **{ratio:.2f}x** the texts/s of one replica direct, on the same {cpus} CPUs.", ""]
    bulk = results.get("bulk")
    if bulk:
        out += ["| bulk, same JSONL file | rows | whole command s | texts/s | texts/s in the job |",
                "| --- | --- | --- | --- | --- |"]
        for b in bulk:
            out.append(f"| {b['run']} | {b['rows']} | {b['wall_s']:.1f} | {b['texts_per_s']:.0f} | "
                       f"{b.get('job_texts_per_s', '')} |")
        out.append("")
    out.append(END)
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", default="20s", help="wrk duration per configuration")
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--rows", type=int, default=20_000, help="rows of the bulk comparison")
    p.add_argument("--skip-replicas", action="store_true")
    p.add_argument("--skip-bulk", action="store_true")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    args = p.parse_args()
    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        print("warning: not running in the project's .venv", file=sys.stderr)
    if not shutil.which("wrk") and not args.skip_replicas:
        sys.exit("wrk is not installed: `make setup` installs it")
    lt = _loadtest()
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}",
        "command": "scripts/bench_scale.py " + " ".join(sys.argv[1:]),
    }
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        work = Path(tmp)
        if not args.skip_replicas:
            results["replicas"] = bench_replicas(lt, args.connections, seconds_of(args.duration), work)
        if not args.skip_bulk:
            results["bulk"] = bench_bulk(lt, args.rows, work)
    text = markdown(results)
    print(text)
    if not args.no_write:
        RESULTS.write_text(json.dumps(results, indent=2) + "\n")
        doc = DOC.read_text()
        if BEGIN in doc and END in doc:
            doc = doc[: doc.index(BEGIN)] + text + doc[doc.index(END) + len(END):]
            DOC.write_text(doc)
        print(f"wrote {RESULTS.relative_to(ROOT)} and {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
