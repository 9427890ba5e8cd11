#!/usr/bin/env python3
"""How long a small request waits while other clients send the largest texts.

Requests are tokenized before they are admitted, in a room that bounds how
much text is tokenized at once (``mlx_embed_core::reading_room``). This
bench keeps ``--bulk`` clients sending one 2,000,000-byte text each
(``/embed``, truncated), back to back, and times a client that sends one
10 KB text at a time beside them; then the same small client alone. Each
binary given runs in turn (rounds alternate which goes first); medians and
p95 of the small client's latency.

    .venv/bin/python scripts/bench_tokenize_room.py --before /path/to/old/mlx-embed-server \\
        [--after target/release/mlx-embed-server] [--bulk 2 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from bench_route_ab import start  # noqa: E402

LARGE = json.dumps({"inputs": "!" * 2_000_000, "truncate": True}).encode()
SMALL = json.dumps({"inputs": ("a small request " * 640)[:10_000], "truncate": True}).encode()


def post(port: int, body: bytes, timeout: float = 120) -> None:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/embed", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        r.read()


def small_latencies(port: int, count: int) -> list[float]:
    out = []
    for _ in range(count):
        t = time.perf_counter()
        post(port, SMALL)
        out.append(time.perf_counter() - t)
    return out


def beside_bulk(port: int, bulk: int, count: int) -> list[float]:
    stop = threading.Event()
    sent = [0] * bulk

    def bulk_client(i: int) -> None:
        deadline = time.monotonic() + 300
        while not stop.is_set() and time.monotonic() < deadline:
            post(port, LARGE)
            sent[i] += 1

    threads = [threading.Thread(target=bulk_client, args=(i,), daemon=True) for i in range(bulk)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # the bulk clients' first texts are in the room
    try:
        return small_latencies(port, count)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)


def p95(xs: list[float]) -> float:
    return sorted(xs)[max(0, int(len(xs) * 0.95) - 1)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", help="the older server binary")
    p.add_argument("--after", default=str(ROOT / "target" / "release" / "mlx-embed-server"))
    p.add_argument("--bulk", type=int, nargs="+", default=[2, 4], help="bulk clients, one run each")
    p.add_argument("--count", type=int, default=30, help="small requests timed per run")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--port", type=int, default=18791)
    args = p.parse_args()
    binaries = {"after": args.after} | ({"before": args.before} if args.before else {})
    results: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        order = list(binaries.items())
        if r % 2:
            order.reverse()
        for name, binary in order:
            proc = start(binary, args.port, "--no-cache")  # every large text tokenized and run
            try:
                small_latencies(args.port, 3)  # warm
                results.setdefault((name, 0), []).extend(small_latencies(args.port, args.count))
                for bulk in args.bulk:
                    results.setdefault((name, bulk), []).extend(beside_bulk(args.port, bulk, args.count))
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    print("binary  bulk clients  small request median (s)  p95 (s)  n")
    for (name, bulk), xs in sorted(results.items()):
        print(f"{name:7} {bulk:12}  {statistics.median(xs):24.3f}  {p95(xs):7.3f}  {len(xs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
