#!/usr/bin/env python3
"""Cold start: seconds from launching the server to its first 200 on /health.

Starts the server N times (``mlx-embed serve``, the README's command, or the
Rust binary with ``--binary``), polls ``/health`` every 5 ms, records the
time to the first 200, stops the server, and prints the median with each
run's startup stages as the server logged them ("startup stage" lines).

    .venv/bin/python scripts/cold_start.py                 # 5 runs of `mlx-embed serve`
    .venv/bin/python scripts/cold_start.py --runs 9 --binary -- --model /path/to/folder
    .venv/bin/python scripts/cold_start.py --json out.json

Everything after ``--`` goes to the server.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("VIRTUAL_ENV") or ROOT / ".venv")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=0.5) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


_ENGINE_STAGES = re.compile(r"\b([a-z_]+)=(\d+)ms\b")
_SERVER_STAGES = re.compile(r"\b(load_ms|warmup_ms)=(\d+)\b")


def stages_from_log(text: str) -> dict[str, float]:
    """Stage -> ms from the server log: the engine's stages (the ``startup``
    entry of the model details in the serving summary: process start,
    imports, weights, build) and the server's load and warm-up."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if "startup=" in line:
            for k, v in _ENGINE_STAGES.findall(line.split("startup=", 1)[1]):
                out.setdefault(k, float(v))
        for k, v in _SERVER_STAGES.findall(line):
            out.setdefault(k.removesuffix("_ms"), float(v))
    return out


def one_run(command: list[str], timeout_s: float) -> dict:
    port = _free_port()
    env = {**os.environ, "VIRTUAL_ENV": str(VENV), "MLX_EMBED_LOG": "info"}
    with tempfile.TemporaryFile() as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen([*command, "--host", "127.0.0.1", "--port", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        url = f"http://127.0.0.1:{port}/health"
        seconds = None
        try:
            while time.perf_counter() - t0 < timeout_s:
                if proc.poll() is not None:
                    break
                if _healthy(url):
                    seconds = time.perf_counter() - t0
                    break
                time.sleep(0.005)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        log.seek(0)
        text = log.read().decode("utf-8", "replace")
    if seconds is None:
        raise SystemExit(f"server did not become healthy (exit {proc.returncode}):\n{text[-3000:]}")
    return {"seconds": seconds, "stages_ms": stages_from_log(text)}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--binary", action="store_true", help="run target/release/mlx-embed-server")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait per run")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if args.binary:
        command = [str(ROOT / "target" / "release" / "mlx-embed-server")]
    else:
        command = [str(VENV / "bin" / "mlx-embed"), "serve"]
    command += extra
    runs = [one_run(command, args.timeout) for _ in range(max(1, args.runs))]
    secs = [r["seconds"] for r in runs]
    for i, r in enumerate(runs):
        stages = ", ".join(f"{k} {v:.0f}" for k, v in r["stages_ms"].items())
        print(f"run {i + 1}: {r['seconds']:.3f} s   [{stages}]")
    median = statistics.median(secs)
    print(f"cold start (launch to first 200 on /health), median of {len(secs)}: {median:.3f} s "
          f"(min {min(secs):.3f}, max {max(secs):.3f})  command: {' '.join(command)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "median_s": median, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
