#!/usr/bin/env python3
"""Peak memory of a server flooded with texts to tokenize.

For ``--seconds``, ``--large`` clients send one 2,000,000-character text of
``!`` each (a token per character, the tokenizer's worst case) and
``--small`` clients one 60,000-character text, all to ``/embed`` (truncated),
back to back. Prints the requests each kind got answered and the server's
peak and final resident memory (``VmHWM``, ``VmRSS``, Linux). Each binary
given runs in turn.

    .venv/bin/python scripts/bench_tokenize_memory.py --binary /tmp/old/mlx-embed-server \\
        --binary target/release/mlx-embed-server
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from bench_route_ab import start  # noqa: E402



def memory_gb(pid: int) -> dict[str, float]:
    out = {}
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(("VmHWM", "VmRSS")):
            out[line.split(":")[0]] = int(line.split()[1]) / 1e6
    return out


def flood(binary: str, args: argparse.Namespace) -> str:
    proc = start(binary, args.port)
    try:
        bodies = {
            "large": json.dumps({"inputs": "!" * 2_000_000, "truncate": True}).encode(),
            "small": json.dumps({"inputs": "!" * 60_000, "truncate": True}).encode(),
        }
        answered = {"large": 0, "small": 0}
        stop = time.monotonic() + args.seconds

        def client(kind: str) -> None:
            while time.monotonic() < stop:
                req = urllib.request.Request(f"http://127.0.0.1:{args.port}/embed", data=bodies[kind],
                                             headers={"Content-Type": "application/json"})
                urllib.request.urlopen(req, timeout=120).read()
                answered[kind] += 1

        threads = [threading.Thread(target=client, args=("large",)) for _ in range(args.large)]
        threads += [threading.Thread(target=client, args=("small",)) for _ in range(args.small)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        mem = memory_gb(proc.pid)
        return (f"{binary}: answered {answered['large']} large, {answered['small']} small; "
                f"peak {mem['VmHWM']:.2f} GB, after {mem['VmRSS']:.2f} GB")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--binary", action="append",
                   help="a server binary (repeat; default target/release/mlx-embed-server)")
    p.add_argument("--large", type=int, default=4, help="clients sending 2 MB texts")
    p.add_argument("--small", type=int, default=11, help="clients sending 60 KB texts")
    p.add_argument("--seconds", type=int, default=30)
    p.add_argument("--port", type=int, default=18792)
    args = p.parse_args()
    for binary in args.binary or [str(ROOT / "target" / "release" / "mlx-embed-server")]:
        print(flood(binary, args), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
