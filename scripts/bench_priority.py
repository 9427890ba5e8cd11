#!/usr/bin/env python3
"""Issue 16's benchmark: priority lanes under a saturating bulk load, and the
embedding cache on a Graphiti-like replay. Starts the real server binary on
loopback for each configuration and drives it over HTTP.

1. Priority. A bulk client keeps the server saturated: --bulk-conns
   connections (64) each posting --bulk-texts (64) distinct short texts per
   request, back to back, at normal priority. Queries (one short text) arrive
   at --query-rate per second (5) for --seconds. Two phases in the same
   server run: queries sent with `X-Priority: high`, then the same queries
   with no priority. Reported against the time of one full batch: the
   model's mean seconds per batch for --bulk-texts-sized batches, measured
   on the idle server before the load (from /metrics `model_seconds`).
   Target (issue 16): high-priority p50 <= 1.5x and p99 <= 3x that time.
   The server runs with --no-cache so every bulk text is computed, and with
   --max-priority-batch-size a quarter of --bulk-texts (the defaults' 16 of 64).

2. Cache. A Graphiti-like ingestion replay: --episodes episodes, each one
   request of entity names (--entities-per-episode, drawn with a Zipf
   distribution of exponent --zipf-s over a --vocab-size vocabulary of
   entity names: a few names recur in most episodes, most are rare), one
   fact per pair of consecutive entities ("A works with B", relation drawn
   uniformly from a short list) and one summary sentence unique to the
   episode. --replay-conns clients replay the same episode stream against a
   server with the default cache and one with --no-cache; reported: texts/s
   and the cache's hit rate (from /metrics).

    .venv/bin/python scripts/bench_priority.py                 # full run (3 to 4 minutes)
    .venv/bin/python scripts/bench_priority.py --quick         # smoke run (well under a minute)
    .venv/bin/python scripts/bench_priority.py --write-docs    # also update docs/benchmarks.md

Numbers depend on the machine and what else runs on it; run on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
# The server gets this interpreter's venv; run by a python outside any venv, it is left to find ./.venv itself.
VENV_ENV = {"VIRTUAL_ENV": sys.prefix} if sys.prefix != sys.base_prefix else {}
SERVER = ROOT / "target" / "release" / "mlx-embed-server"
DOCS = ROOT / "docs" / "benchmarks.md"
DOC_BEGIN = "<!-- bench_priority:begin -->"
DOC_END = "<!-- bench_priority:end -->"

WORDS = (
    "the of and to in is was for on that with as by at from an were are which this "
    "embedding vector model server request latency throughput token batch search "
    "retrieval document query similarity cosine index cluster memory kernel thread "
    "history science river mountain library museum village festival election weather"
).split()
FIRST = "Ada Alan Grace Linus Ken Dennis Barbara Edsger Donald Margaret Tim Guido Bjarne John".split()
LAST = "Lovelace Turing Hopper Torvalds Thompson Ritchie Liskov Dijkstra Knuth Hamilton Berners-Lee".split()
ORGS = "Acme Globex Initech Umbrella Hooli Stark Wayne Wonka Tyrell Cyberdyne Soylent Vandelay".split()
RELATIONS = ["works with", "founded", "acquired", "met", "wrote about", "invested in", "moved to", "sued"]


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def entity_vocabulary(size: int, rng: random.Random) -> list[str]:
    names: set[str] = set()
    while len(names) < size:
        kind = rng.random()
        if kind < 0.6:
            names.add(f"{rng.choice(FIRST)} {rng.choice(LAST)} {rng.randrange(1000)}")
        else:
            names.add(f"{rng.choice(ORGS)} {rng.choice(['Labs', 'Inc', 'Group', 'Systems'])} {rng.randrange(1000)}")
    out = sorted(names)
    rng.shuffle(out)
    return out


def episodes(n: int, per_episode: int, vocab_size: int, s: float, seed: int) -> list[list[str]]:
    """Each episode: entity names (Zipf over the vocabulary), facts between
    consecutive entities, one unique summary."""
    rng = random.Random(seed)
    vocab = entity_vocabulary(vocab_size, rng)
    weights = [1.0 / (k ** s) for k in range(1, vocab_size + 1)]
    out = []
    for e in range(n):
        names = rng.choices(vocab, weights=weights, k=per_episode)
        facts = [f"{a} {rng.choice(RELATIONS)} {b}" for a, b in zip(names, names[1:])]
        summary = f"Episode {e}: " + sentence(rng, 24)
        out.append(names + facts + [summary])
    return out


# --- the server -----------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    def __init__(self, args: list[str], log_dir: Path, name: str, binary: Path = SERVER):
        if not binary.exists():
            sys.exit(f"{binary} is missing: run `make build` first")
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"bench-priority-{name}.log"
        env = {**os.environ, **VENV_ENV, "MLX_EMBED_LOG": "warn"}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([str(binary), "--host", "127.0.0.1", "--port", str(port), *args],
                                         stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"server exited during startup:\n{self.log_path.read_text()[-3000:]}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        self.stop()
        sys.exit("server not healthy after 180 s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics as {"name{labels}": value}."""
        text = requests.get(self.url + "/metrics", timeout=30).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out


def embed(session: requests.Session, url: str, texts: list[str], headers=None, timeout=300) -> requests.Response:
    return session.post(url + "/api/v1/embed", json={"texts": texts}, headers=headers or {}, timeout=timeout)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


# --- 1. priority ----------------------------------------------------------

class Bulk:
    """Connections posting distinct bulk requests back to back until stopped."""

    def __init__(self, url: str, conns: int, texts: int, seed: int):
        self.url, self.texts, self.seed = url, texts, seed
        self.stop_flag = threading.Event()
        self.lock = threading.Lock()
        self.done_texts = 0
        self.errors = 0
        self.threads = [threading.Thread(target=self.run, args=(c,), daemon=True) for c in range(conns)]

    def run(self, conn: int) -> None:
        rng = random.Random(self.seed * 1000 + conn)
        session = requests.Session()
        i = 0
        while not self.stop_flag.is_set():
            texts = [f"bulk {self.seed} {conn} {i} {j} " + sentence(rng, 12) for j in range(self.texts)]
            i += 1
            try:
                r = embed(session, self.url, texts)
                ok = r.status_code == 200
            except requests.RequestException:
                ok = False
            with self.lock:
                if ok:
                    self.done_texts += self.texts
                else:
                    self.errors += 1

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop_flag.set()
        for t in self.threads:
            t.join(timeout=600)


def run_queries(url: str, rate: float, seconds: float, headers: dict, seed: int) -> tuple[list[float], int]:
    """Single-text queries on a fixed schedule, each in its own thread so a
    slow one does not delay the next; returns latencies (s) and failures."""
    rng = random.Random(seed)
    latencies: list[float] = []
    failures = [0]
    lock = threading.Lock()

    def one(text: str) -> None:
        start = time.perf_counter()
        try:
            r = requests.post(url + "/api/v1/embed", json={"texts": [text]}, headers=headers, timeout=600)
            ok = r.status_code == 200
        except requests.RequestException:
            ok = False
        with lock:
            if ok:
                latencies.append(time.perf_counter() - start)
            else:
                failures[0] += 1

    threads = []
    start = time.perf_counter()
    n = int(rate * seconds)
    for k in range(n):
        delay = start + k / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        t = threading.Thread(target=one, args=(f"query {seed} {k}: " + sentence(rng, 6),), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join(timeout=600)
    return latencies, failures[0]


def full_batch_seconds(server: Server, texts: int, rounds: int) -> float:
    """Mean model seconds of one batch of `texts` distinct bulk texts on the idle server."""
    session = requests.Session()
    rng = random.Random(99)
    embed(session, server.url, [sentence(rng, 12) for _ in range(texts)])  # warm
    before = server.metrics()
    for r in range(rounds):
        embed(session, server.url, [f"calibrate {r} {j} " + sentence(rng, 12) for j in range(texts)])
    after = server.metrics()
    count = after["mlx_embed_model_seconds_count"] - before["mlx_embed_model_seconds_count"]
    total = after["mlx_embed_model_seconds_sum"] - before["mlx_embed_model_seconds_sum"]
    return total / count


def bench_priority(a, log_dir: Path) -> dict:
    args = ["--no-cache", "--max-batch-size", str(a.bulk_texts), "--max-priority-batch-size", str(a.priority_batch_size)]
    with Server(args, log_dir, "priority") as server:
        batch_s = full_batch_seconds(server, a.bulk_texts, rounds=3 if a.quick else 5)
        phases = {}
        for label, headers in [("X-Priority: high", {"X-Priority": "high"}), ("no priority (normal)", {})]:
            with Bulk(server.url, a.bulk_conns, a.bulk_texts, seed=len(phases)) as bulk:
                time.sleep(a.warmup)  # let the bulk load fill the queue
                t0, texts0 = time.perf_counter(), bulk.done_texts
                lat, failed = run_queries(server.url, a.query_rate, a.seconds, headers, seed=len(phases))
                bulk_rate = (bulk.done_texts - texts0) / (time.perf_counter() - t0)
            phases[label] = {"latencies": lat, "failed": failed, "bulk_texts_per_s": bulk_rate,
                             "bulk_errors": bulk.errors}
        lanes = {k: v for k, v in server.metrics().items() if k.startswith("mlx_embed_lane_queue_wait_seconds_count")}
    return {"batch_s": batch_s, "phases": phases, "lanes": lanes}


# --- 2. cache ------------------------------------------------------------

def replay(server: Server, stream: list[list[str]], conns: int) -> dict:
    next_episode = [0]
    lock = threading.Lock()
    errors = [0]

    def worker() -> None:
        session = requests.Session()
        while True:
            with lock:
                i = next_episode[0]
                next_episode[0] += 1
            if i >= len(stream):
                return
            r = embed(session, server.url, stream[i])
            if r.status_code != 200:
                with lock:
                    errors[0] += 1

    before = server.metrics()
    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    after = server.metrics()
    texts = sum(len(e) for e in stream)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    hits, misses = delta("mlx_embed_cache_hits_total"), delta("mlx_embed_cache_misses_total")
    return {"texts": texts, "seconds": elapsed, "texts_per_s": texts / elapsed, "errors": errors[0],
            "hits": hits, "misses": misses, "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
            "computed": delta("mlx_embed_batch_size_sum"),
            "cache_bytes": after.get("mlx_embed_cache_bytes", 0.0)}


def bench_cache(a, log_dir: Path) -> dict:
    stream = episodes(a.episodes, a.entities_per_episode, a.vocab_size, a.zipf_s, seed=7)
    out = {}
    for label, args in [("cache on (default)", []), ("--no-cache", ["--no-cache"])]:
        with Server(args, log_dir, "cache-on" if not args else "cache-off") as server:
            requests.post(server.url + "/api/v1/embed", json={"texts": ["warm up"]}, timeout=60)
            out[label] = replay(server, stream, a.replay_conns)
    return out


# --- report --------------------------------------------------------------

def report(a, prio: dict, cache: dict) -> str:
    b = prio["batch_s"]
    lines = [
        f"One full batch ({a.bulk_texts} short texts) takes {b * 1e3:.0f} ms of model time on the idle server.",
        f"Bulk: {a.bulk_conns} connections x {a.bulk_texts} texts, normal priority; queries: one short text at "
        f"{a.query_rate:g}/s for {a.seconds:g} s. Server flags: `--no-cache --max-batch-size {a.bulk_texts} "
        f"--max-priority-batch-size {a.priority_batch_size}`.",
        "",
        "| queries sent with | answered | p50 | p99 | p50 / batch | p99 / batch | bulk texts/s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, p in prio["phases"].items():
        lat = p["latencies"]
        p50, p99 = pct(lat, 0.5), pct(lat, 0.99)
        lines.append(f"| {label} | {len(lat)}/{len(lat) + p['failed']} | {p50 * 1e3:.0f} ms | {p99 * 1e3:.0f} ms "
                     f"| {p50 / b:.2f}x | {p99 / b:.2f}x | {p['bulk_texts_per_s']:.0f} |")
    lines += [
        "",
        f"Graphiti-like replay: {a.episodes} episodes of {a.entities_per_episode} entity names (Zipf s={a.zipf_s:g} "
        f"over {a.vocab_size} names), {a.entities_per_episode - 1} facts and one unique summary each "
        f"({2 * a.entities_per_episode} texts per request), {a.replay_conns} concurrent clients.",
        "",
        "| server | texts/s | cache hit rate | texts computed | cache bytes |",
        "| --- | --- | --- | --- | --- |",
    ]
    for label, c in cache.items():
        lines.append(f"| {label} | {c['texts_per_s']:.0f} | {c['hit_rate'] * 100:.1f} % | {c['computed']:.0f} of "
                     f"{c['texts']} | {c['cache_bytes'] / 2**20:.1f} MiB |")
    on, off = cache.get("cache on (default)"), cache.get("--no-cache")
    if on and off:
        lines += ["", f"Cache speed-up on the replay: {on['texts_per_s'] / off['texts_per_s']:.2f}x."]
    return "\n".join(lines)


def write_docs(text: str, command: str) -> None:
    body = f"{DOC_BEGIN}\n`{command}` on {time.strftime('%Y-%m-%d')}:\n\n{text}\n{DOC_END}"
    doc = DOCS.read_text()
    if DOC_BEGIN in doc:
        doc = re.sub(re.escape(DOC_BEGIN) + ".*?" + re.escape(DOC_END), lambda _: body, doc, flags=re.S)
    else:
        doc += f"\n## Priority lanes and the embedding cache (issue 16)\n\n{body}\n"
    DOCS.write_text(doc)


FULL = {"bulk_conns": 64, "bulk_texts": 64, "seconds": 60.0, "warmup": 5.0, "episodes": 400, "vocab_size": 2000}
QUICK = {"bulk_conns": 8, "bulk_texts": 16, "seconds": 4.0, "warmup": 1.0, "episodes": 40, "vocab_size": 300}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small, short smoke run")
    # Defaults of None are filled from FULL or QUICK, so explicit values win in both modes.
    p.add_argument("--bulk-conns", type=int)
    p.add_argument("--bulk-texts", type=int, help="texts per bulk request, also the server's --max-batch-size")
    p.add_argument("--priority-batch-size", type=int,
                   help="the server's --max-priority-batch-size (default: a quarter of --bulk-texts, "
                        "the server defaults' proportion)")
    p.add_argument("--query-rate", type=float, default=5.0)
    p.add_argument("--seconds", type=float, help="query phase length")
    p.add_argument("--warmup", type=float, help="seconds of bulk load before queries start")
    p.add_argument("--episodes", type=int)
    p.add_argument("--entities-per-episode", type=int, default=12)
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--zipf-s", type=float, default=1.1)
    p.add_argument("--replay-conns", type=int, default=8)
    p.add_argument("--skip", choices=["priority", "cache"], action="append", default=[])
    p.add_argument("--write-docs", action="store_true", help="put the tables in docs/benchmarks.md")
    p.add_argument("--json", type=Path, help="also write the raw results here")
    p.add_argument("--log-dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")))
    a = p.parse_args()
    for name, value in (QUICK if a.quick else FULL).items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    if a.priority_batch_size is None:
        a.priority_batch_size = max(1, a.bulk_texts // 4)
    prio = bench_priority(a, a.log_dir) if "priority" not in a.skip else {"batch_s": float("nan"), "phases": {}}
    cache = bench_cache(a, a.log_dir) if "cache" not in a.skip else {}
    text = report(a, prio, cache)
    print(text)
    if a.json:
        a.json.write_text(json.dumps({"priority": prio, "cache": cache}, indent=1))
    if a.write_docs:
        write_docs(text, ".venv/bin/python scripts/bench_priority.py " + " ".join(sys.argv[1:]).replace("--write-docs", "").strip())
    failed = sum(ph["failed"] for ph in prio["phases"].values()) + sum(c["errors"] for c in cache.values())
    if failed:
        sys.exit(f"{failed} requests failed")


if __name__ == "__main__":
    main()
