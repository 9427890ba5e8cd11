#!/usr/bin/env python3
"""A bounded HTTP/1.1 load generator for JSON POSTs, in the standard library only.

Where wrk is missing, or to keep the answers: each line of ``--bodies`` is one
request body, sent once, in order, over ``--connections`` keep-alive
connections spread across ``--procs`` processes (one asyncio loop each), so
the client keeps up with tens of thousands of small requests a second (what
it still spends of each round, ``send_wrk``'s rows show). It stops when every body is sent or at ``--deadline`` seconds, and
prints one JSON object: requests sent and answered, status counts, seconds
from the first request to the last answer, latency percentiles, and the
bodies of the first ``--keep`` answers (for a correctness check).

    python3 scripts/http_load.py --url http://127.0.0.1:8080/v1/embeddings \\
        --bodies bodies.jsonl --connections 64 --procs 8 --deadline 60

``send_all`` wraps it with the server's own figures (``/metrics``: how it
grouped the requests, where a round's time went); ``send_wrk`` does the
same with wrk as the client (``scripts/wrk-bodies.lua``), where wrk is
installed, to tell what the Python client costs a round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import rawhttp


async def _one_connection(host, port, path, bodies, state, deadline, out):
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while time.perf_counter() < deadline:
            i = state["next"]
            if i >= len(bodies):
                return
            state["next"] = i + 1
            t0 = time.perf_counter()
            writer.write(rawhttp.encode_request(host, port, path, bodies[i], keep_alive=True))
            answer = await rawhttp.read_response(reader)
            out["latencies"].append(time.perf_counter() - t0)
            out["statuses"][answer.status] = out["statuses"].get(answer.status, 0) + 1
            if i < out["keep"]:
                out["answers"][i] = answer.body.decode()
    except (ConnectionError, asyncio.IncompleteReadError):
        out["errors"] += 1
    finally:
        writer.close()


def _worker(index, url, bodies, connections, start_at, deadline, keep, queue):
    parts = urlsplit(url)
    host, port = parts.hostname, parts.port or 80
    out = {"latencies": [], "statuses": {}, "errors": 0, "answers": {}, "keep": keep}
    state = {"next": 0}

    async def main():
        await asyncio.sleep(max(0.0, start_at - time.time()))
        t0 = time.perf_counter()
        stop = t0 + deadline
        await asyncio.gather(*(
            _one_connection(host, port, parts.path or "/", bodies, state, stop, out)
            for _ in range(connections)
        ))
        return time.perf_counter() - t0

    seconds = asyncio.run(main())
    queue.put({"index": index, "sent": state["next"], "latencies": out["latencies"],
               "statuses": out["statuses"], "errors": out["errors"], "answers": out["answers"],
               "seconds": seconds})


def run(url: str, bodies: list[bytes], connections: int, procs: int, deadline: float, keep: int = 0) -> dict:
    """Sends every body once (bounded by ``deadline`` seconds) and returns the
    figures; ``answers`` maps the index of each of the first ``keep`` bodies
    to its answer's text."""
    procs = max(1, min(procs, connections, len(bodies)))
    # fork: this process holds no device or threads (run it as its own process).
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    start_at = time.time() + 0.5  # every process starts together
    workers = []
    for p in range(procs):
        conns = connections // procs + (1 if p < connections % procs else 0)
        # Process p sends bodies p, p + procs, ...: its k-th is body p + k * procs.
        keep_here = len(range(p, min(keep, len(bodies)), procs))
        w = ctx.Process(target=_worker, args=(p, url, bodies[p::procs], conns, start_at, deadline,
                                              keep_here, queue))
        w.start()
        workers.append(w)
    results = [queue.get(timeout=deadline + 60) for _ in workers]
    for w in workers:
        w.join(timeout=10)
    latencies = sorted(x for r in results for x in r["latencies"])
    statuses: dict[str, int] = {}
    answers: dict[int, str] = {}
    for r in results:
        for k, v in r["statuses"].items():
            statuses[str(k)] = statuses.get(str(k), 0) + v
        for k, text in r["answers"].items():
            answers[r["index"] + k * procs] = text

    def pct(q):
        return 1e3 * latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else None

    return {
        "requests": len(bodies),
        "sent": sum(r["sent"] for r in results),
        "answered": len(latencies),
        "errors": sum(r["errors"] for r in results),
        "statuses": statuses,
        # Every process starts at one agreed moment; the slowest one's span is the run's.
        "seconds": max(r["seconds"] for r in results),
        "latency_ms": {"p50": pct(0.5), "p99": pct(0.99),
                       "mean": 1e3 * statistics.fmean(latencies) if latencies else None},
        "answers": answers,
    }


def run_in_child(url: str, bodies_path, connections: int, procs: int, deadline: float, keep: int = 0) -> dict:
    """``run`` in a process of its own (the load generator then shares no
    interpreter with the caller); raises RuntimeError if it fails."""
    import subprocess

    cmd = [sys.executable, __file__, "--url", url, "--bodies", str(bodies_path), "--connections",
           str(connections), "--procs", str(procs), "--deadline", str(deadline), "--keep", str(keep)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=deadline + 120)
    if r.returncode != 0:
        raise RuntimeError(f"http_load failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout)


# The server's running totals that send_all reads before and after a load
# (every model's; the HTTP ones for the route loaded only).
_TOTALS = ("batches_total", "batch_size_sum", "model_seconds_sum", "gil_wait_seconds_sum",
           "queue_wait_seconds_sum", "queue_wait_seconds_count")
_ROUTE_TOTALS = ("http_request_duration_seconds_sum", "http_request_duration_seconds_count")


def _server_totals(base: str, route: str) -> dict[str, float]:
    """The server's totals so far, from its /metrics."""
    import re
    import urllib.request

    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()

    def value(name, labels=r"(?:\{[^}]*\})?"):
        return sum(float(v) for v in re.findall(rf"^mlx_embed_{name}{labels} ([0-9.e+-]+)$", text, re.M))

    out = {name: value(name) for name in _TOTALS}
    for name in _ROUTE_TOTALS:
        out[name] = value(name, r"\{" + re.escape(f'route="{route}"') + r"\}")
    return out


def _round_breakdown(before: dict, after: dict, out: dict, connections: int) -> dict:
    """Where a closed-loop round went, in ms: each connection's round
    (``round``: the run's seconds over its requests), the client's latency
    (send to answer) and its gap (answer to the next send), the server's
    own time on a request (the HTTP handler), the part of it queued (from
    arrival to the start of its model call: the regroup window, a running
    pass), and a model call's time (``model_call``, from its submission to
    its vectors) with its wait for the interpreter (``gil_wait``)."""
    d = {k: after[k] - before[k] for k in after}
    calls = max(1.0, d["batches_total"])
    rounds = max(1.0, out["answered"] / max(1, connections))
    round_ms = 1e3 * out["seconds"] / rounds
    mean = out["latency_ms"]["mean"] or 0.0
    return {
        "round": round_ms,
        "client_latency": mean,
        "client_gap": max(0.0, round_ms - mean),
        "server": 1e3 * d["http_request_duration_seconds_sum"] / max(1.0, d["http_request_duration_seconds_count"]),
        "queued": 1e3 * d["queue_wait_seconds_sum"] / max(1.0, d["queue_wait_seconds_count"]),
        "model_call": 1e3 * d["model_seconds_sum"] / calls,
        "gil_wait": 1e3 * d["gil_wait_seconds_sum"] / calls,
    }


# The breakdown's columns as bench_gpu.py and bench_regroup.py print them.
ROUND_COLUMNS = ("round", "client_latency", "client_gap", "server", "queued", "model_call")
ROUND_TITLE = ("where a round went (ms; round = client latency + client gap; the server's time holds "
               "the queued part and the model call)")


def round_cells(breakdown: dict) -> str:
    """One table row's cells for a ``_round_breakdown``, in ROUND_COLUMNS order."""
    return " | ".join(f"{breakdown[k]:.2f}" for k in ROUND_COLUMNS)


def round_header(*leading: str) -> list[str]:
    """A markdown table's head: ``leading`` columns, then ROUND_COLUMNS."""
    names = [*leading, *(k.replace("_", " ") for k in ROUND_COLUMNS)]
    return ["| " + " | ".join(names) + " |", "|" + "---|" * len(leading) + "---:|" * len(ROUND_COLUMNS)]


def send_all(base: str, path: str, bodies: list[str], bodies_file, connections: int, procs: int,
             deadline: float, keep: int = 0) -> dict:
    """Every body once through ``base + path`` (``run_in_child``; the bodies
    are written to ``bodies_file``); raises RuntimeError unless every request
    was answered 200. Adds how the server grouped them (``_measured``)."""
    out = _measured(base, path, bodies, bodies_file, connections,
                    lambda: run_in_child(base + path, bodies_file, connections, procs, deadline, keep))
    if out["statuses"] != {"200": len(bodies)} or out["errors"]:
        raise RuntimeError(f"not every request answered 200: {out['statuses']}, errors {out['errors']}")
    return out


def _measured(base: str, path: str, bodies: list[str], bodies_file, connections: int, load) -> dict:
    """``load()``'s figures (a client sending the bodies, written to
    ``bodies_file`` first), with how the server grouped its requests, from
    /metrics before and after: ``model_calls``, ``inputs_per_call``, and
    where a round's time went (``round_ms``, see ``_round_breakdown``)."""
    Path(bodies_file).write_text("\n".join(bodies) + "\n")
    before = _server_totals(base, path)
    out = load()
    after = _server_totals(base, path)
    out["model_calls"] = after["batches_total"] - before["batches_total"]
    out["inputs_per_call"] = (after["batch_size_sum"] - before["batch_size_sum"]) / max(1.0, out["model_calls"])
    out["round_ms"] = _round_breakdown(before, after, out, connections)
    return out


WRK_SCRIPT = Path(__file__).resolve().parent / "wrk-bodies.lua"


def run_wrk(url: str, bodies_file, connections: int, threads: int, seconds: float) -> dict:
    """wrk (C, one event loop per thread) sending the lines of ``bodies_file``
    to ``url`` for ``seconds``, each connection its next request when the last
    is answered, as ``run`` does; the same figures as ``run`` (no answers
    kept). Raises RuntimeError if wrk fails or any request did."""
    import shutil
    import subprocess

    wrk = shutil.which("wrk")
    if wrk is None:
        raise RuntimeError("wrk is not on PATH")
    # wrk gives each thread connections // threads: keep them all.
    threads = max(t for t in range(1, max(1, min(threads, connections)) + 1) if connections % t == 0)
    cmd = [wrk, "-t", str(threads), "-c", str(connections), "-d", f"{max(1, round(seconds))}s",
           "--timeout", "30s", "-s", str(WRK_SCRIPT), url, "--", str(bodies_file)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120)
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    try:
        got = json.loads(lines[-1]) if r.returncode == 0 and lines else None
        errors = sum(got[k] for k in ("connect_errors", "read_errors", "write_errors", "timeouts"))
    except (ValueError, KeyError, TypeError):
        got = None
    if got is None:
        raise RuntimeError(f"wrk failed ({r.returncode}): {(r.stderr or r.stdout)[-2000:]}")
    if errors or got["status_errors"] or not got["requests"]:
        raise RuntimeError(f"wrk: {got['requests']} requests, {errors} socket errors, "
                           f"{got['status_errors']} answers of 400 or over")
    lat = got["latency_us"]
    # wrk counts answers of 400 and over, not each status: the rest are
    # "under 400" (this server answers a POST 200 or an error).
    return {"requests": got["requests"], "sent": got["requests"], "answered": got["requests"],
            "errors": 0, "statuses": {"under_400": got["requests"]},
            "seconds": got["duration_us"] / 1e6,
            "latency_ms": {"p50": lat["p50"] / 1e3, "p99": lat["p99"] / 1e3, "mean": lat["mean"] / 1e3},
            "answers": {}}


def send_wrk(base: str, path: str, bodies: list[str], bodies_file, connections: int, threads: int,
             seconds: float) -> dict:
    """``send_all`` with wrk as the client (``run_wrk``): the bodies for
    ``seconds`` (over and over) rather than each once, and no answers kept;
    the same figures, so the two clients' rows compare. A Python client
    spends some of each round itself; wrk's rows say how much."""
    return _measured(base, path, bodies, bodies_file, connections,
                     lambda: run_wrk(base + path, bodies_file, connections, threads, seconds))


def answered_vectors(answers: dict, per_request: int, n: int):
    """The first ``n`` texts' float32 vectors from kept ``/v1/embeddings``
    answers in base64 (body k holds texts k * per_request ...)."""
    import base64

    import numpy as np

    rows = [None] * n
    for k, text in answers.items():
        for item in json.loads(text)["data"]:
            i = int(k) * per_request + item["index"]
            if i < n:
                rows[i] = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
    missing = [i for i, r in enumerate(rows) if r is None]
    if missing:
        raise RuntimeError(f"no answer kept for texts {missing[:8]}")
    return np.stack(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--bodies", required=True, help="one JSON request body per line")
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--deadline", type=float, default=60.0, help="seconds; the run stops then")
    p.add_argument("--keep", type=int, default=0, help="answers of the first N bodies to print")
    args = p.parse_args(argv)
    with open(args.bodies, "rb") as f:
        bodies = [line.rstrip(b"\n") for line in f if line.strip()]
    json.dump(run(args.url, bodies, args.connections, args.procs, args.deadline, args.keep), sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
