#!/usr/bin/env python3
"""One-text ``X-Priority: high`` queries beside one low-priority bulk request
of long texts, for one or more server binaries (an A/B of the batch a query
waits for).

Per run: start the binary (``--no-cache``), warm it, post one bulk request
(``--bulk-texts`` texts of ``--words`` words, ``X-Priority: low``) and, from
``--delay`` s after it until it is answered, high queries: one at a time with a
random pause of 0-0.3 s (closed loop), or with ``--open-loop`` at Poisson
arrival times of ``--rate`` per second, each in its own thread. Then ten
queries alone. Runs alternate the binaries; p50/p95/max of the queries beside
the bulk request, per binary.

    .venv/bin/python scripts/bench_query_topup.py --binary target/ab/release/mlx-embed-server \\
        --binary target/release/mlx-embed-server --runs 2 --open-loop --rate 1
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_priority import WORDS, Server, pct  # noqa: E402

LOGS = Path("/tmp/mlx-embed-bench-query-topup")


def run(binary: Path, args: argparse.Namespace, seed: int) -> dict:
    rng = random.Random(seed)
    bulk = [f"bulk {seed} {i} " + " ".join(rng.choice(WORDS) for _ in range(args.words))
            for i in range(args.bulk_texts)]
    server = Server(["--no-cache"], LOGS, binary.parent.parent.name + "-" + binary.name, binary=binary)
    try:
        session = requests.Session()
        session.post(server.url + "/api/v1/embed", json={"texts": ["warm up"]}, timeout=60).raise_for_status()
        done: dict[str, float] = {}

        def send_bulk() -> None:
            t = time.perf_counter()
            r = requests.post(server.url + "/api/v1/embed", json={"texts": bulk},
                              headers={"X-Priority": "low"}, timeout=900)
            r.raise_for_status()
            done["s"] = time.perf_counter() - t

        lock = threading.Lock()
        latencies: list[float] = []

        def query(k: int) -> None:
            text = f"query {seed} {k}: " + " ".join(rng.choice(WORDS) for _ in range(6))
            t = time.perf_counter()
            r = requests.post(server.url + "/api/v1/embed", json={"texts": [text]},
                              headers={"X-Priority": "high"}, timeout=600)
            r.raise_for_status()
            with lock:
                latencies.append(time.perf_counter() - t)

        bulk_thread = threading.Thread(target=send_bulk)
        bulk_thread.start()
        time.sleep(args.delay)
        queries: list[threading.Thread] = []
        k = 0
        deadline = time.monotonic() + 900
        while bulk_thread.is_alive() and time.monotonic() < deadline:
            if args.open_loop:
                q = threading.Thread(target=query, args=(k,))
                q.start()
                queries.append(q)
                time.sleep(rng.expovariate(args.rate))
            else:
                query(k)
                time.sleep(rng.uniform(0, 0.3))
            k += 1
        for q in queries:
            q.join()
        bulk_thread.join()
        alone = []
        for j in range(10):
            t = time.perf_counter()
            session.post(server.url + "/api/v1/embed", json={"texts": [f"alone {seed} {j} x"]},
                         headers={"X-Priority": "high"}, timeout=60).raise_for_status()
            alone.append(time.perf_counter() - t)
        metrics = server.metrics()
    finally:
        server.stop()
    return {"lat": latencies, "bulk_s": done["s"], "alone": statistics.median(alone),
            "batches": metrics.get("mlx_embed_model_seconds_count", float("nan"))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--binary", type=Path, action="append", required=True, help="a server binary (repeat)")
    p.add_argument("--bulk-texts", type=int, default=512)
    p.add_argument("--words", type=int, default=250)
    p.add_argument("--delay", type=float, default=1.0)
    p.add_argument("--open-loop", action="store_true",
                   help="Poisson arrivals at --rate per second, each query in its own thread")
    p.add_argument("--rate", type=float, default=1.0)
    p.add_argument("--runs", type=int, default=1, help="runs per binary, alternated")
    args = p.parse_args()
    results: dict[Path, list[dict]] = {b: [] for b in args.binary}
    for r in range(args.runs):
        for binary in args.binary:
            out = run(binary, args, seed=r)
            results[binary].append(out)
            lat = out["lat"]
            print(f"{binary} run {r}: n={len(lat)} p50={pct(lat, .5) * 1e3:.0f} ms "
                  f"p95={pct(lat, .95) * 1e3:.0f} ms max={max(lat) * 1e3:.0f} ms "
                  f"bulk={out['bulk_s']:.1f} s batches={out['batches']:.0f} alone={out['alone'] * 1e3:.0f} ms",
                  flush=True)
    print("\n| build | queries | p50 | p95 | max | bulk call | alone |\n|---|---:|---:|---:|---:|---:|---:|")
    for binary, outs in results.items():
        lat = [x for o in outs for x in o["lat"]]
        print(f"| {binary} | {len(lat)} | {pct(lat, .5):.2f} s | {pct(lat, .95):.2f} s | {max(lat):.2f} s | "
              f"{statistics.median(o['bulk_s'] for o in outs):.1f} s | "
              f"{statistics.median(o['alone'] for o in outs) * 1e3:.0f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
