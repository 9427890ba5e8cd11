#!/usr/bin/env python3
"""The query thread (``--query-threads``): one-text queries beside a bulk load
of long texts, with and without it, runs interleaved in one process.

Per run: start the server (``--no-cache`` plus the variant's flags), warm it,
then --bulk-conns connections post requests of --bulk-texts texts of --words
words (cut to the model's maximum, 256 tokens on MiniLM: a full batch is
8192 padded tokens) back to back at normal priority. Phase 1, bulk alone for
--seconds: the bulk inputs computed per second (from /metrics batch sizes).
Phase 2, the same load for --seconds plus one-text queries, one at a time
with a random pause of 0-0.3 s, alternately normal and ``X-Priority: high``:
their latencies, and the bulk inputs per second again (queries taken off;
each rate from the first to the last batch answered in its phase).
Then ten queries on the idle server. Variants alternate run by run; medians
over runs of each figure, and B/A ratios.

    .venv/bin/python scripts/bench_query_thread.py                  # 0 vs 1 query thread, 3 runs each
    .venv/bin/python scripts/bench_query_thread.py --quick          # smoke run
    .venv/bin/python scripts/bench_query_thread.py --variant "workers1=--query-threads 1 --workers 1"

Numbers depend on the machine and what else runs on it; run on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_priority import WORDS, Server, pct  # noqa: E402

LOGS = Path("/tmp/mlx-embed-bench-query-thread")


class Bulk:
    """Connections posting distinct requests of long texts back to back until stopped."""

    def __init__(self, url: str, conns: int, texts: int, words: int, seed: int):
        self.url, self.texts, self.words, self.seed = url, texts, words, seed
        self.stop = threading.Event()
        self.errors = 0
        self.threads = [threading.Thread(target=self.run, args=(c,), daemon=True) for c in range(conns)]

    def run(self, conn: int) -> None:
        rng = random.Random(self.seed * 1000 + conn)
        session = requests.Session()
        i = 0
        while not self.stop.is_set():
            texts = [f"bulk {self.seed} {conn} {i} {j} " + " ".join(rng.choice(WORDS) for _ in range(self.words))
                     for j in range(self.texts)]
            i += 1
            try:
                ok = session.post(self.url + "/api/v1/embed", json={"texts": texts}, timeout=900).status_code == 200
            except requests.RequestException:
                ok = False
            self.errors += not ok

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=900)


class Throughput(threading.Thread):
    """Bulk inputs per second over a phase, between the first and the last
    batch answered in it (a bulk batch takes seconds: counting whole
    seconds would round it away). Polls /metrics; the queries answered
    (`queries`, one input each) are taken off."""

    def __init__(self, server: Server):
        super().__init__(daemon=True)
        self.server, self.queries, self.stop = server, 0, threading.Event()
        self.samples: list[tuple[float, float]] = []

    def run(self) -> None:
        last = None
        while not self.stop.is_set():
            value = self.server.metrics()["mlx_embed_batch_size_sum"] - self.queries
            if value != last:
                self.samples.append((time.perf_counter(), value))
                last = value
            time.sleep(0.02)

    def rate(self) -> float:
        self.stop.set()
        self.join(timeout=30)
        # The first sample is where the phase found the count, not a batch's end.
        (t0, v0), (t1, v1) = self.samples[1], self.samples[-1]
        return (v1 - v0) / (t1 - t0) if t1 > t0 else float("nan")


def run(flags: list[str], name: str, a: argparse.Namespace, seed: int) -> dict:
    rng = random.Random(seed)
    server = Server(["--no-cache", *flags], LOGS, name)
    try:
        session = requests.Session()
        for _ in range(3):
            session.post(server.url + "/api/v1/embed", json={"texts": ["warm up"]}, timeout=60).raise_for_status()
        out: dict = {}
        with Bulk(server.url, a.bulk_conns, a.bulk_texts, a.words, seed) as bulk:
            time.sleep(a.warmup)
            meter = Throughput(server)
            meter.start()
            time.sleep(a.seconds)
            out["bulk_alone_inputs_per_s"] = meter.rate()
            lat: dict[str, list[float]] = {"normal": [], "high": []}
            meter = Throughput(server)
            meter.start()
            t0 = time.perf_counter()
            k = 0
            while time.perf_counter() - t0 < a.seconds and k < 10_000:
                prio = "high" if k % 2 else "normal"
                headers = {"X-Priority": "high"} if prio == "high" else {}
                text = f"query {seed} {k}: " + " ".join(rng.choice(WORDS) for _ in range(6))
                t = time.perf_counter()
                r = session.post(server.url + "/api/v1/embed", json={"texts": [text]}, headers=headers, timeout=600)
                r.raise_for_status()
                lat[prio].append(time.perf_counter() - t)
                k += 1
                meter.queries = k
                time.sleep(rng.uniform(0, 0.3))
            out["bulk_with_queries_inputs_per_s"] = meter.rate()
            out["bulk_errors"] = bulk.errors
        for prio, values in lat.items():
            out[f"{prio}_p50_ms"] = 1e3 * pct(values, 0.5)
            out[f"{prio}_p90_ms"] = 1e3 * pct(values, 0.9)
            out[f"{prio}_n"] = len(values)
        idle = []
        for k in range(10):
            t = time.perf_counter()
            session.post(server.url + "/api/v1/embed", json={"texts": [f"idle {seed} {k}"]}, timeout=60).raise_for_status()
            idle.append(time.perf_counter() - t)
        out["idle_p50_ms"] = 1e3 * pct(idle, 0.5)
        m = server.metrics()
        out["query_thread_batches"] = m.get("mlx_embed_query_thread_batches_total", 0.0)
        return out
    finally:
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one short run of each variant")
    p.add_argument("--runs", type=int, default=3, help="runs of each variant, interleaved")
    p.add_argument("--bulk-conns", type=int, default=2)
    p.add_argument("--bulk-texts", type=int, default=64)
    p.add_argument("--words", type=int, default=300, help="words per bulk text (MiniLM cuts at 256 tokens)")
    p.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of bulk load before phase 1")
    p.add_argument("--variant", action="append", metavar="NAME=FLAGS",
                   help="server flags of one variant (default: off=--query-threads 0, on=--query-threads 1)")
    p.add_argument("--json", type=Path, help="write every run's figures here")
    a = p.parse_args()
    if a.quick:
        a.runs, a.seconds, a.warmup = 1, 6.0, 2.0
    variants = [v.split("=", 1) for v in (a.variant or ["off=--query-threads 0", "on=--query-threads 1"])]
    results: dict[str, list[dict]] = {name: [] for name, _ in variants}
    for r in range(a.runs):
        for name, flags in variants:
            figures = run(flags.split(), name, a, seed=r)
            results[name].append(figures)
            print(f"run {r} {name}: " + json.dumps({k: round(v, 1) for k, v in figures.items()}), flush=True)
    keys = list(next(iter(results.values()))[0])
    medians = {name: {k: statistics.median(f[k] for f in runs) for k in keys} for name, runs in results.items()}
    base = variants[0][0]
    print(f"\nmedians over {a.runs} run(s); ratios to {base}")
    print(f"| figure | {' | '.join(n for n, _ in variants)} |")
    print(f"|---|{'---:|' * len(variants)}")
    for k in keys:
        cells = []
        for name, _ in variants:
            v = medians[name][k]
            b = medians[base][k]
            cells.append(f"{v:.1f}" + (f" ({v / b:.2f}x)" if name != base and b else ""))
        print(f"| {k} | {' | '.join(cells)} |")
    if a.json:
        a.json.write_text(json.dumps({"args": vars(a) | {"json": str(a.json)}, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
