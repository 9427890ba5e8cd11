#!/usr/bin/env python3
"""Peak memory of a server whose clients ask for large answers and never read them.

``--clients`` raw connections, each with a 4 KiB receive buffer, send one
``/embed_all`` request of 170 texts of 256 tokens (about 195 MB of JSON answer
on all-MiniLM-L6-v2) and read nothing. For ``--hold`` seconds (under the
``--client-timeout-secs`` of 60 the servers run with, so no answer is
dropped meanwhile) a query client sends one short ``/embed`` every half
second. Then every connection closes. Printed per ``--max-unsent-answers-mb``
setting: the server's peak resident memory (``VmHWM``), the large answers
made during the hold, the unsent bytes and waiting requests ``/metrics``
showed at its end, and the queries' median and worst latency.

    .venv/bin/python scripts/bench_unread_answers.py --room-mb 256 --room-mb 1048576
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from bench_route_ab import start  # noqa: E402

# 256 tokens each once cut (all-MiniLM-L6-v2 keeps 256), 170 of them:
# 170 * 256 * 384 floats, just under the 2^24 one answer may hold.
TEXTS = 170
WORDS = "embedding " * 600


def peak_gb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 1e6
    raise RuntimeError("no VmHWM")


def metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(("mlx_embed_http_unsent_answer_bytes", "mlx_embed_http_requests_waiting_for_answer_room",
                            'mlx_embed_http_requests_total{route="/embed_all",code="200"}')):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def ask_and_never_read(port: int) -> socket.socket:
    body = json.dumps({"inputs": [f"{i} {WORDS}" for i in range(TEXTS)], "truncate": True}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(b"POST /embed_all HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return s


def run(binary: str, room_mb: int, args: argparse.Namespace) -> str:
    proc = start(binary, args.port, "--max-unsent-answers-mb", str(room_mb), "--client-timeout-secs", "60",
                 "--no-cache")
    sockets = []
    try:
        sockets = [ask_and_never_read(args.port) for _ in range(args.clients)]
        latencies: list[float] = []
        stop = time.monotonic() + args.hold

        def queries() -> None:
            body = json.dumps({"inputs": "what is a vector database?"}).encode()
            while time.monotonic() < stop:
                t = time.monotonic()
                req = urllib.request.Request(f"http://127.0.0.1:{args.port}/embed", data=body,
                                             headers={"Content-Type": "application/json"})
                urllib.request.urlopen(req, timeout=120).read()
                latencies.append(time.monotonic() - t)
                time.sleep(max(0.0, 0.5 - (time.monotonic() - t)))

        q = threading.Thread(target=queries)
        q.start()
        q.join()
        seen = metrics(args.port)
        peak = peak_gb(proc.pid)
        made = seen.get('mlx_embed_http_requests_total{route="/embed_all",code="200"}', 0)
        return (f"--max-unsent-answers-mb {room_mb}: peak {peak:.2f} GB; {made:.0f} of {args.clients} large answers "
                f"made in {args.hold} s; unsent {seen['mlx_embed_http_unsent_answer_bytes'] / 1e6:.0f} MB, "
                f"{seen['mlx_embed_http_requests_waiting_for_answer_room']:.0f} waiting; queries: "
                f"{len(latencies)}, median {statistics.median(latencies) * 1e3:.0f} ms, "
                f"max {max(latencies) * 1e3:.0f} ms")
    finally:
        for s in sockets:
            s.close()
        proc.terminate()
        proc.wait(timeout=60)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--binary", default=str(ROOT / "target" / "release" / "mlx-embed-server"))
    p.add_argument("--room-mb", type=int, action="append",
                   help="a --max-unsent-answers-mb setting to run (repeat; default 256 and 1048576)")
    p.add_argument("--clients", type=int, default=6, help="connections that never read")
    p.add_argument("--hold", type=int, default=40, help="seconds they hold their answers (under 60)")
    p.add_argument("--port", type=int, default=18793)
    args = p.parse_args()
    if not 1 <= args.hold < 60:
        p.error("--hold must be 1 to 59 s: the servers drop unread answers after 60 s")
    for room_mb in args.room_mb or [256, 1 << 20]:
        print(run(args.binary, room_mb, args), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
