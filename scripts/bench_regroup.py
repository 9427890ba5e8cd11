#!/usr/bin/env python3
"""The regroup window against real HTTP clients, on a device with a fixed cost per pass.

On a GPU every pass of the model costs about the same few milliseconds
whatever its size (docs/benchmarks.md, third lease), so how the collector
groups callers who wait for their answers decides the throughput. This
machine has no GPU, so the device is simulated inside the real server: the
test build (`mlx-embed-server-test`, `make build`) with
``MLX_EMBED_TEST_PASS_MS`` makes every batch also hold a simulated device for
that long, one batch after another, while the real model (a tiny fixture,
whose own cost is small beside it) computes the vectors. The server runs as on
a GPU: pipelined, with the GPU's batch caps (256 inputs, 32768 tokens).

For each ``--regroup-window-ms`` value, interleaved over ``--rounds``, it
starts the server, sends every text of the corpus once with
``scripts/http_load.py`` under each load (texts per request x connections, each
connection sending its next request when the last is answered), and reports
texts/s, the server's model calls and inputs per call (from /metrics), and
latency percentiles; medians over the rounds. Every answer must be 200. The
lone connection (``1x1``) shows what the window costs a caller with nobody to
wait for. ``--client wrk`` drives the same loads with wrk instead (the same
bodies over and over for ``--wrk-seconds``), which spends less of each round
in the client than Python does.

    .venv/bin/python scripts/bench_regroup.py                    # defaults: 3 ms a pass, windows 0,2,4
    .venv/bin/python scripts/bench_regroup.py --json docs/regroup-results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import http_load  # this script's neighbours in scripts/
import replicas

ROOT = Path(__file__).resolve().parents[1]
TEST_SERVER = ROOT / "target" / "release" / "mlx-embed-server-test"
MODEL = ROOT / "tests" / "fixtures" / "tiny-distilbert"
GPU_CAPS = ["--max-batch-size", "256", "--max-batch-tokens", "32768"]


def corpus(n: int) -> list[str]:
    words = "vector index graph episode query answer model batch device token".split()
    return [" ".join(words[(i * 7 + k) % len(words)] for k in range(4 + i % 9)) + f" {i}" for i in range(n)]


def one_load(base: str, texts: list[str], per_request: int, connections: int, procs: int,
             workdir: Path, deadline: float, wrk_seconds: float = 0.0) -> dict:
    """Every text once with the Python client; with ``wrk_seconds``, wrk
    sending the same bodies over and over for that long instead."""
    bodies = [json.dumps({"input": texts[i : i + per_request]}) for i in range(0, len(texts), per_request)]
    bodies_file = workdir / f"bodies-{per_request}.jsonl"
    if wrk_seconds > 0:
        out = http_load.send_wrk(base, "/v1/embeddings", bodies, bodies_file, connections,
                                 min(procs, connections), wrk_seconds)
        sent = out["answered"] * len(texts) / len(bodies)
    else:
        out = http_load.send_all(base, "/v1/embeddings", bodies, bodies_file, connections,
                                 min(procs, connections), deadline)
        sent = len(texts)
    return {"texts_per_s": sent / out["seconds"], "model_calls": out["model_calls"],
            "inputs_per_call": out["inputs_per_call"],
            "p50_ms": out["latency_ms"]["p50"], "p99_ms": out["latency_ms"]["p99"],
            # Where a round went (http_load._round_breakdown), flat for the medians.
            **{f"{k}_ms": v for k, v in out["round_ms"].items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pass-ms", type=float, default=3.0, help="the simulated device's cost per pass")
    p.add_argument("--windows", default="0,2,4", help="--regroup-window-ms values, comma-separated")
    p.add_argument("--loads", default="1x64,32x4,1x1", help="texts per request x connections, comma-separated")
    p.add_argument("--texts", type=int, default=3072, help="texts sent once per load")
    p.add_argument("--lone-texts", type=int, default=200, help="texts a load of one connection sends")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--procs", type=int, default=2, help="client processes (wrk: threads)")
    p.add_argument("--client", choices=("python", "wrk"), default="python",
                   help="python: scripts/http_load.py sends every text once; wrk: the same bodies "
                        "for --wrk-seconds")
    p.add_argument("--wrk-seconds", type=float, default=5.0)
    p.add_argument("--model", default=str(MODEL))
    p.add_argument("--deadline", type=float, default=120, help="seconds per load at most")
    p.add_argument("--json", help="write the raw figures here")
    args = p.parse_args(argv)
    if not TEST_SERVER.exists():
        p.error(f"{TEST_SERVER} is missing: run `make build`")
    windows = [int(w) for w in args.windows.split(",") if w.strip()]
    loads = [tuple(int(x) for x in spec.split("x")) for spec in args.loads.split(",") if spec.strip()]
    texts = corpus(args.texts)
    wrk_seconds = args.wrk_seconds if args.client == "wrk" else 0.0
    if args.client == "wrk" and wrk_seconds <= 0:
        p.error("--client wrk needs --wrk-seconds > 0")
    env = {"MLX_EMBED_TEST_PASS_MS": str(args.pass_ms), "MLX_EMBED_LOG": "warn"}
    raw: dict = {f"{w}": {f"{n}x{c}": [] for n, c in loads} for w in windows}
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="bench_regroup-") as tmp:
        work = Path(tmp)
        for r in range(args.rounds):
            for w in windows:
                flags = ["--model", args.model, "--pipeline", "true", "--no-cache", "--no-warmup",
                         *GPU_CAPS, "--regroup-window-ms", str(w)]
                server = replicas.start_replica(replicas.free_port(), work / "logs", flags, env=env,
                                                binary=TEST_SERVER)
                try:
                    for n, c in loads:
                        # One connection waits a whole pass per request: fewer texts.
                        sent = texts[: args.lone_texts] if c == 1 else texts
                        one_load(server.url, texts[:256], n, c, args.procs, work, args.deadline)  # warm up
                        got = one_load(server.url, sent, n, c, args.procs, work, args.deadline, wrk_seconds)
                        raw[f"{w}"][f"{n}x{c}"].append(got)
                        print(f"round {r + 1}, window {w} ms, {n}x{c}: {got['texts_per_s']:.0f} texts/s, "
                              f"{got['inputs_per_call']:.1f} inputs a call", file=sys.stderr, flush=True)
                finally:
                    code = server.stop()
                if code != 0:
                    raise RuntimeError(f"server exited {code}:\n{server.log()[-3000:]}")
    print(f"simulated device: {args.pass_ms} ms a pass; {args.texts} texts per load; medians of {args.rounds} "
          f"rounds; {args.procs} client {'threads (wrk' if wrk_seconds else 'processes (Python'}); "
          f"{time.time() - started:.0f} s")
    print("| load (texts x connections) | --regroup-window-ms | texts/s | vs 0 | inputs per call | p50 ms | p99 ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    med = {}
    for n, c in loads:
        for w in windows:
            rows = raw[f"{w}"][f"{n}x{c}"]
            med[(w, n, c)] = {k: statistics.median(x[k] for x in rows) for k in rows[0]}
        for w in windows:
            m, base = med[(w, n, c)], med[(windows[0], n, c)]
            print(f"| {n} x {c} | {w} | {m['texts_per_s']:.0f} | {m['texts_per_s'] / base['texts_per_s']:.2f}x | "
                  f"{m['inputs_per_call']:.1f} | {m['p50_ms']:.2f} | {m['p99_ms']:.2f} |")
    print(f"\n{http_load.ROUND_TITLE}:")
    print("\n".join(http_load.round_header("load", "--regroup-window-ms")))
    for n, c in loads:
        for w in windows:
            m = med[(w, n, c)]
            cells = http_load.round_cells({k: m[f"{k}_ms"] for k in http_load.ROUND_COLUMNS})
            print(f"| {n} x {c} | {w} | {cells} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": sys.argv[1:], "pass_ms": args.pass_ms,
                                               "client": args.client, "raw": raw},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
