#!/usr/bin/env python3
"""A short call behind a bulk call in the same priority lane.

Graphiti-style clients send their ingestion and their users' searches with no
priority, so both share the normal lane. This starts the real server binary
(--no-cache, so every text is computed) and, per round:

1. sends one bulk request of --bulk-texts texts of --words words each;
2. --delay seconds later, sends one short text in the same lane, and times it;
3. does the same with the short text sent `X-Priority: high`, for reference.

Reported, medians over --rounds: the short call's time, the bulk call's time,
and the short call's time as a fraction of the bulk call's (same run, so the
machine's speed cancels out). A lane that lets the short call in only after
the bulk call is done gives a fraction near 1.

    python scripts/bench_lane_turns.py                  # 2048 x 90 words, 3 rounds
    python scripts/bench_lane_turns.py --bulk-texts 512 --words 40 --rounds 2
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
from bench_priority import WORDS, Server  # noqa: E402


def texts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


def one_round(url: str, bulk: list[str], delay: float, headers: dict) -> tuple[float, float]:
    """(short call seconds, bulk call seconds)."""
    done = {}

    def send_bulk():
        t = time.perf_counter()
        r = requests.post(url + "/api/v1/embed", json={"texts": bulk}, timeout=600)
        r.raise_for_status()
        done["bulk"] = time.perf_counter() - t

    thread = threading.Thread(target=send_bulk)
    thread.start()
    time.sleep(delay)
    t = time.perf_counter()
    r = requests.post(url + "/api/v1/embed", json={"texts": ["where is the harbor?"]}, headers=headers,
                      timeout=600)
    r.raise_for_status()
    short = time.perf_counter() - t
    thread.join()
    return short, done["bulk"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bulk-texts", type=int, default=2048)
    p.add_argument("--words", type=int, default=90)
    p.add_argument("--delay", type=float, default=0.5, help="seconds between the bulk and the short call")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--log-dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")))
    a = p.parse_args()
    rows = {}
    flags = ["--no-cache", "--max-inputs-per-request", str(max(a.bulk_texts, 2048)),
             "--max-body-bytes", str(64 << 20)]
    with Server(flags, a.log_dir, "lane-turns") as server:
        for name, headers in (("same lane (normal)", {}), ("X-Priority: high", {"X-Priority": "high"})):
            runs = [one_round(server.url, texts(a.bulk_texts, a.words, seed), a.delay, headers)
                    for seed in range(a.rounds)]
            rows[name] = runs
    print(f"# {a.bulk_texts} bulk texts of {a.words} words, short call {a.delay} s later; "
          f"medians of {a.rounds} rounds")
    print("| short call | short call s | bulk call s | short / bulk |")
    print("|---|---:|---:|---:|")
    for name, runs in rows.items():
        short = statistics.median(s for s, _ in runs)
        bulk = statistics.median(b for _, b in runs)
        frac = statistics.median(s / b for s, b in runs)
        print(f"| {name} | {short:.2f} | {bulk:.2f} | {frac:.2f} |")


if __name__ == "__main__":
    main()
