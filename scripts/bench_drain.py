#!/usr/bin/env python3
"""How many accepted calls a drain cut short by its timeout still answers.

Each run starts a server binary, sends `--calls` concurrent calls of
`--texts` long texts to /embed, sends SIGTERM `--signal-after` seconds later
and counts the answers: 200 (finished in the drain) or 503 (still unfinished
when `--drain-timeout-secs` ran out). Binaries given with several
`--binary` run alternately, in the same conditions, and each line reports
the median over `--runs`.

    .venv/bin/python scripts/bench_drain.py --binary /tmp/before/mlx-embed-server \\
        --binary target/release/mlx-embed-server --runs 3

Every run is bounded: its calls time out after 60 s and the server is
killed if it has not exited 30 s after the signal.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
WORDS = "the of river mountain quantum cache embed vector server system network".split()


def wait_healthy(url: str, proc: subprocess.Popen, limit: float = 120) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} before it was healthy")
        try:
            if requests.get(url + "/health", timeout=1).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise SystemExit("server not healthy in time")


def one_run(binary: str, port: int, args, log: Path) -> dict:
    env = dict(os.environ, VIRTUAL_ENV=str(ROOT / ".venv"))
    cmd = [binary, "--port", str(port), "--no-cache", "--drain-timeout-secs", str(args.drain_timeout_secs)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        codes: list[object] = []
        lock = threading.Lock()

        def call(i: int) -> None:
            rng = random.Random(i)
            texts = [" ".join(rng.choice(WORDS) for _ in range(args.words)) + f" {i}.{k}"
                     for k in range(args.texts)]
            try:
                code: object = requests.post(url + "/embed", json={"inputs": texts}, timeout=60).status_code
            except requests.RequestException as err:
                code = type(err).__name__
            with lock:
                codes.append(code)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(args.calls)]
        for t in threads:
            t.start()
        time.sleep(args.signal_after)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
        exited = time.monotonic() - signalled
        for t in threads:
            t.join(timeout=70)
        counts = Counter(str(c) for c in codes)
        return {"answered": counts.get("200", 0), "refused_503": counts.get("503", 0),
                "other": {k: v for k, v in counts.items() if k not in ("200", "503")},
                "exit_code": rc, "exit_s": round(exited, 2)}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", action="append", required=True, help="a server binary (repeat to compare)")
    ap.add_argument("--calls", type=int, default=48)
    ap.add_argument("--texts", type=int, default=16)
    ap.add_argument("--words", type=int, default=80)
    ap.add_argument("--signal-after", type=float, default=1.0)
    ap.add_argument("--drain-timeout-secs", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--port", type=int, default=19180)
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/bench-drain"))
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {b: [] for b in args.binary}
    for r in range(args.runs):
        for k, binary in enumerate(args.binary):
            result = one_run(binary, args.port + k, args, args.log_dir / f"run{r}-{k}.log")
            runs[binary].append(result)
            print(f"run {r} {binary}: {result}", file=sys.stderr)
    summary = {}
    for binary, results in runs.items():
        summary[binary] = {
            "answered_median": statistics.median(r["answered"] for r in results),
            "refused_503_median": statistics.median(r["refused_503"] for r in results),
            "runs": results,
        }
        print(f"{binary}: {summary[binary]['answered_median']:g} of {args.calls} answered, "
              f"{summary[binary]['refused_503_median']:g} refused 503 (median of {args.runs})")
    if args.json:
        args.json.write_text(json.dumps({"settings": {k: v for k, v in vars(args).items()
                                                      if k not in ("json", "log_dir")}, "results": summary},
                                        indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
