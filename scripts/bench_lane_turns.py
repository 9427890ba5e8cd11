#!/usr/bin/env python3
"""A short call behind a bulk call in the same priority lane.

Graphiti-style clients send their ingestion and their users' searches with no
priority, so both share the normal lane. This starts the real server binary
(--no-cache, so every text is computed) and, per round:

1. sends --bulk-calls bulk requests (one by default, 50 ms apart, each on its own
   connection) of --bulk-texts texts of --words words each;
2. --delay seconds after the first, sends one short text in the same lane, and times it;
3. does the same with the short text sent `X-Priority: high`, for reference.

Reported, medians over --rounds: the short call's time, the first bulk call's
time, and the short call's time as a fraction of it (same run, so the
machine's speed cancels out). A lane that lets the short call in only after
the bulk call is done gives a fraction near 1; behind several bulk calls that
let it in only after some of them, more than 1.

    .venv/bin/python scripts/bench_lane_turns.py                  # 2048 x 90 words, 3 rounds
    .venv/bin/python scripts/bench_lane_turns.py --bulk-texts 512 --words 40 --rounds 2
    .venv/bin/python scripts/bench_lane_turns.py --bulk-calls 4 --words 12   # four bulk calls ahead
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_priority import SERVER, WORDS, Server  # noqa: E402


def texts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


def one_round(url: str, bulks: list[list[str]], delay: float, headers: dict) -> tuple[float, float, float]:
    """(short call seconds, first bulk call seconds, seconds until every bulk call was answered)."""
    done = {}

    def send_bulk(k: int, bulk: list[str]):
        t = time.perf_counter()
        r = requests.post(url + "/api/v1/embed", json={"texts": bulk}, timeout=600)
        r.raise_for_status()
        done[k] = time.perf_counter() - t

    threads = []
    start = time.perf_counter()
    for k, bulk in enumerate(bulks):
        threads.append(threading.Thread(target=send_bulk, args=(k, bulk)))
        threads[-1].start()
        time.sleep(0.05)  # so they reach the server in order
    time.sleep(max(0.0, delay - (time.perf_counter() - start)))
    t = time.perf_counter()
    r = requests.post(url + "/api/v1/embed", json={"texts": ["where is the harbor?"]}, headers=headers,
                      timeout=600)
    r.raise_for_status()
    short = time.perf_counter() - t
    for thread in threads:
        thread.join()
    every_bulk = time.perf_counter() - start
    assert len(done) == len(bulks), done
    return short, done[0], every_bulk


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bulk-texts", type=int, default=2048)
    p.add_argument("--bulk-calls", type=int, default=1, help="bulk requests ahead of the short call")
    p.add_argument("--words", type=int, default=90)
    p.add_argument("--delay", type=float, default=0.5, help="seconds between the bulk and the short call")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--log-dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")))
    p.add_argument("--server", type=Path, default=SERVER,
                   help="server binary (another build, to compare two in one session)")
    a = p.parse_args()
    rows = {}
    flags = ["--no-cache", "--max-inputs-per-request", str(max(a.bulk_texts, 2048)),
             "--max-body-bytes", str(64 << 20)]
    with Server(flags, a.log_dir, "lane-turns", binary=a.server) as server:
        for name, headers in (("same lane (normal)", {}), ("X-Priority: high", {"X-Priority": "high"})):
            runs = [one_round(server.url, [texts(a.bulk_texts, a.words, seed * 100 + k) for k in range(a.bulk_calls)],
                              a.delay, headers)
                    for seed in range(a.rounds)]
            rows[name] = runs
    print(f"# {a.bulk_calls} bulk call(s) of {a.bulk_texts} texts of {a.words} words, short call {a.delay} s "
          f"after the first; medians of {a.rounds} rounds")
    print("| short call | short call s | first bulk call s | short / first bulk | every bulk call answered s |")
    print("|---|---:|---:|---:|---:|")
    for name, runs in rows.items():
        short = statistics.median(s for s, _, _ in runs)
        bulk = statistics.median(b for _, b, _ in runs)
        frac = statistics.median(s / b for s, b, _ in runs)
        every = statistics.median(e for _, _, e in runs)
        print(f"| {name} | {short:.2f} | {bulk:.2f} | {frac:.2f} | {every:.2f} |")


if __name__ == "__main__":
    main()
