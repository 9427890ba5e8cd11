#!/usr/bin/env python3
"""The request path of two server binaries, side by side: wrk against each in
turn, the embedding cache on. wrk cycles the 672 sentences of
scripts/wrk-common.lua, so once a warm-up pass has filled the cache every
input is a hit, and what is timed is the route: HTTP, the JSON body, the
priority header, tokenizing, the cache. Rounds alternate which binary goes
first, and the routes take turns going first after a
start; medians.

    .venv/bin/python scripts/bench_route_ab.py --before /path/to/old/mlx-embed-server \\
        [--after target/release/mlx-embed-server] [--rounds 4]

Build an older tree's binary into this checkout's target/ab (what --before
target/ab/release/mlx-embed-server then names) from the repository root,
after ``make build``; R is expanded before the cd, and the build links
this checkout's .venv, as the Makefile's builds do:

    R=$PWD && git worktree add /tmp/old <rev> && (cd /tmp/old &&
        CARGO_TARGET_DIR=$R/target/ab PYO3_PYTHON=$R/.venv/bin/python VIRTUAL_ENV=$R/.venv \\
        cargo build --release -p mlx-embed --bin mlx-embed-server)
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The server gets this interpreter's venv; run by a python outside any venv, it is left to find ./.venv itself.
VENV_ENV = {"VIRTUAL_ENV": sys.prefix} if sys.prefix != sys.base_prefix else {}
COMMON = ROOT / "scripts" / "wrk-common.lua"
# Route -> (path, Lua body of two corpus texts).
ROUTES = {
    "native": ("/api/v1/embed", """'{"texts": ["' .. a .. '", "' .. b .. '"]}'"""),
    "tei": ("/embed", """'{"inputs": ["' .. a .. '", "' .. b .. '"]}'"""),
    "openai": ("/v1/embeddings", """'{"input": ["' .. a .. '", "' .. b .. '"]}'"""),
}


def lua_script(folder: Path, path: str, body: str) -> Path:
    out = folder / f"{path.strip('/').replace('/', '_')}.lua"
    out.write_text(f'dofile("{COMMON}").install("{path}", function(next_text)\n'
                   f"  local a, b = next_text(), next_text()\n  return {body}\nend)\n")
    return out


def wrk(port: int, lua: Path, seconds: int, connections: int) -> float:
    cmd = ["wrk", "-t", "2", "-c", str(connections), "-d", f"{seconds}s", "-s", str(lua),
           f"http://127.0.0.1:{port}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60).stdout
    bad = int(re.search(r"non_2xx: (\d+)", out).group(1))  # wrk-common.lua's summary
    if bad:
        raise RuntimeError(f"{lua.name}: {bad} answers were not 2xx:\n{out}")
    return float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))


def start(binary: str, port: int, *flags: str) -> subprocess.Popen:
    """`binary` serving on `port` (with `flags`), once its /health answers."""
    env = {**os.environ, **VENV_ENV, "MLX_EMBED_LOG": "warn"}
    proc = subprocess.Popen([binary, "--port", str(port), *flags], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"{binary} exited with {proc.returncode}")
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{binary} not healthy after 120 s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, help="the older server binary")
    p.add_argument("--after", default=str(ROOT / "target" / "release" / "mlx-embed-server"))
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--seconds", type=int, default=8, help="timed wrk run per route and round")
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--port", type=int, default=18401)
    args = p.parse_args()
    binaries = {"before": args.before, "after": args.after}
    rates: dict = {(b, r): [] for b in binaries for r in ROUTES}
    with tempfile.TemporaryDirectory() as tmp:
        scripts = {r: lua_script(Path(tmp), path, body) for r, (path, body) in ROUTES.items()}
        for k in range(args.rounds):
            for name in list(binaries)[:: 1 if k % 2 == 0 else -1]:
                proc = start(binaries[name], args.port)
                try:
                    # The routes take turns going first after a start too.
                    order = list(scripts)[k % len(scripts):] + list(scripts)[: k % len(scripts)]
                    for route in order:
                        lua = scripts[route]
                        wrk(args.port, lua, 4, args.connections)  # fills the cache
                        rates[(name, route)].append(wrk(args.port, lua, args.seconds, args.connections))
                        print(f"round {k} {name} {route}: {rates[(name, route)][-1]:.0f} req/s", flush=True)
                finally:
                    proc.terminate()
                    proc.wait(30)
    print("| route | before req/s | after req/s | after / before |\n|---|---:|---:|---:|")
    for route in ROUTES:
        before, after = (statistics.median(rates[(b, route)]) for b in binaries)
        print(f"| {ROUTES[route][0]} | {before:.0f} | {after:.0f} | {after / before:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
