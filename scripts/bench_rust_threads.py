#!/usr/bin/env python3
"""What a Rust program keeps after loading a model on threads that come and
go: OS threads and resident memory before and after N loads (each with one
embed call) on N fresh threads one after another, and the same N inside
``Batcher::start`` (a model thread each), from the bridge crate's example
``thread_probe`` (all-MiniLM-L6-v2, float32, on the CPU).

Each mode runs ``--runs`` times, each in a fresh process (the counts are the
process's); the table gives the median of each figure. ``--venv`` names the
virtualenv whose ``mlx_embed`` the probe imports (``VIRTUAL_ENV``): another
checkout's venv gives that checkout's Python side with this binary (an A/B of
the Python side alone).

    cargo build --release -p mlx-embed-python --example thread_probe
    python scripts/bench_rust_threads.py [--n 20] [--runs 3] [--venv .venv]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def probe(binary: Path, mode: str, n: int, venv: str) -> dict:
    env = {**os.environ, "VIRTUAL_ENV": venv}
    out = subprocess.run(
        [str(binary), mode, str(n)], capture_output=True, text=True, timeout=600, env=env, check=False
    )
    if out.returncode != 0:
        raise SystemExit(f"{mode}: exit {out.returncode}\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=20, help="loads per run (default 20)")
    parser.add_argument("--runs", type=int, default=3, help="processes per mode (default 3)")
    parser.add_argument("--venv", default=str(ROOT / ".venv"), help="VIRTUAL_ENV for the probe")
    parser.add_argument("--binary", default=str(ROOT / "target/release/examples/thread_probe"))
    args = parser.parse_args()
    binary = Path(args.binary)
    if not binary.exists():
        raise SystemExit(f"{binary} is missing: cargo build --release -p mlx-embed-python --example thread_probe")
    print(f"{args.n} loads, median of {args.runs} processes, VIRTUAL_ENV={args.venv}")
    print(f"{'mode':<8} {'threads before':>14} {'after':>6} {'RSS MB before':>14} {'after':>6} {'lent streams':>13}")
    for mode in ("fresh", "batcher"):
        runs = [probe(binary, mode, args.n, args.venv) for _ in range(args.runs)]
        med = lambda f: statistics.median(f(r) for r in runs)  # noqa: E731
        print(
            f"{mode:<8} {med(lambda r: r['threads'][0]):>14g} {med(lambda r: r['threads'][1]):>6g} "
            f"{med(lambda r: r['rss_mb'][0]):>14g} {med(lambda r: r['rss_mb'][1]):>6g} "
            f"{med(lambda r: r['lent_streams']):>13g}",
            flush=True,
        )


if __name__ == "__main__":
    main()
