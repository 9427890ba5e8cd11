"""Every command the README shows works.

The README's shell blocks, Python blocks and inline commands (a code span
starting with make, mlx-embed, pip, cargo, curl, ruff or python) are found by
parsing README.md. Each one is run for real, or is in EXCLUDED with the reason
it cannot run inside `make test`. A command that is neither fails this test:
adding a command to the README means making it run here.

Servers: one `mlx-embed serve --rerank-model tests/fixtures/tiny-bert-reranker`
on a free port answers the curl and Python examples (their `localhost:8080`
rewritten to it; with gRPC on, for the gRPC example's `localhost:50051`), one serving tests/fixtures/tiny-splade the `/embed_sparse` one; `mlx-embed serve ...` and `make serve` commands are started
themselves on a free port, checked on /health and stopped.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import mlx_embed
import numpy as np
import pytest
import requests

from harness import ROOT, free_port, start_server

sys.path.insert(0, str(ROOT / "scripts"))
import replicas as rp

README = ROOT / "README.md"
BIN = Path(sys.prefix) / "bin"
COMMAND_WORDS = ("make", "mlx-embed", "pip", "cargo", "curl", "ruff", "python", "python3", ".venv/bin/python")

# Commands that cannot run inside `make test`, with the reason.
EXCLUDED = {
    "make test": "this test runs inside `make test`",
    "make lint": "CI runs it right before `make test` (.ci/run)",
    "make bench": "a minutes-long benchmark for a quiet machine (the coordinator runs it)",
    "make loadtest": "a minutes-long benchmark for a quiet machine (the coordinator runs it)",
    "cargo fmt --check": "part of `make lint`",
    "cargo clippy --workspace --all-targets -- -D warnings": "part of `make lint`",
    "ruff check": "part of `make lint`",
    "cargo doc": "part of `make lint`",
    "make setup": "`make test` runs it first (its prerequisite), on every run",
}
# Prefixes: installs would replace the editable install this very test suite
# imports (`make setup`, which `make test` runs, performs the same installs).
EXCLUDED_PREFIXES = {
    "hf download ": "needs the Hugging Face Hub, which the test machines cannot reach; tests/python/test_hub.py "
    "downloads through huggingface_hub from a fake Hub instead",
    "HF_HUB_OFFLINE=1 mlx-embed serve --model-id BAAI/": "needs that repo in the Hugging Face cache (fetched from the "
    "Hub); tests/e2e/test_hub_models_e2e.py serves a repo id from a cache, offline, through the same flags",
    "pip install": "replaces the editable install the tests run from; `make setup` installs the same",
    ".venv/bin/python scripts/bench_gpu.py": "needs an NVIDIA GPU (its --dry-run runs in make test)",
    ".venv/bin/python scripts/gpu_architectures.py": "needs a GPU (its --dry-run runs in make test)",
    ".venv/bin/python scripts/cold_start.py": "a benchmark (median of repeated cold starts) for a quiet machine",
    "grpcurl ": "a Go binary the test environment lacks; tests/e2e/test_grpc.py makes the same calls (reflection's "
    "list, Embed) through grpcio",
    "grpc_health_probe ": "a Go binary the test environment lacks; tests/e2e/test_grpc.py makes the same health "
    "Check through grpcio-health-checking, and the README's Python block too",
}


def _strip_comment(line: str) -> str:
    # A " #" outside quotes starts a comment.
    out, quote = [], None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            break
        out.append(ch)
    return "".join(out).rstrip()


def readme_commands() -> tuple[list[str], list[str], list[str]]:
    """(shell commands, python blocks, rust blocks) in README order."""
    text = README.read_text(encoding="utf-8")
    shell, python, rust = [], [], []
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S):
        if lang == "sh":
            pending = ""
            for line in body.splitlines():
                line = _strip_comment(line)
                if not line.strip():
                    continue
                if line.endswith("\\"):
                    pending += line[:-1] + " "
                    continue
                shell.append(" ".join((pending + line).split()))
                pending = ""
        elif lang == "python":
            python.append(body)
        elif lang == "rust":
            rust.append(body)
    outside = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    for span in re.findall(r"`([^`\n]+)`", outside):
        first = span.split(" ", 1)[0]
        if first in COMMAND_WORDS and " " in span:
            shell.append(" ".join(span.split()))
    return list(dict.fromkeys(shell)), python, rust


def excluded(cmd: str) -> str | None:
    if cmd in EXCLUDED:
        return EXCLUDED[cmd]
    for prefix, why in EXCLUDED_PREFIXES.items():
        if cmd.startswith(prefix):
            return why
    return None


def _local(cmd: str, port: int) -> str:
    return re.sub(r"(localhost|127\.0\.0\.1):8080", f"127.0.0.1:{port}", cmd)


def _env() -> dict:
    return {**os.environ, "VIRTUAL_ENV": sys.prefix, "PATH": f"{BIN}:{os.environ.get('PATH', '')}"}


def _wait_healthy(port: int, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"exited {proc.returncode} before serving:\n{log.read_text()[-3000:]}")
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.3)
    pytest.fail(f"not healthy after {timeout:.0f}s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> int:
    # make serve runs the server as a child: signal the whole group.
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def run_server_command(cmd: str, tmp_path: Path) -> None:
    port = free_port()
    args = shlex.split(cmd.replace("[flags]", ""))
    if args[0] == "make":
        args += [f"PORT={port}", "HOST=127.0.0.1"]
        timeout = 600.0  # `make serve` runs setup and build first
    else:
        args[0] = str(BIN / args[0])
        args += ["--host", "127.0.0.1", "--port", str(port)]
        timeout = 300.0
    log = tmp_path / f"serve-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT,
                                start_new_session=True)
    try:
        _wait_healthy(port, proc, log, timeout)
    finally:
        code = _stop(proc)
    assert code in (0, -signal.SIGTERM, 2), f"{cmd}: exit {code}\n{log.read_text()[-3000:]}"


def _free_run(n: int) -> int:
    """A free port whose next n-1 ports are free too (`make replicas` puts
    the replicas on the ports after nginx's)."""
    for _ in range(50):
        port = free_port()
        if all(_bindable(port + k) for k in range(1, n)):
            return port
    pytest.fail(f"no {n} consecutive free ports")


def _bindable(port: int) -> bool:
    import socket

    with socket.socket() as s:
        # TIME_WAIT leftovers of closed connections do not count; a listener does.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def run_replicas(cmd: str, tmp_path: Path) -> None:
    """`make replicas`: nginx answers /health and an embedding through the
    replicas behind it; Ctrl-C (SIGINT to the group) stops everything."""
    port = _free_run(3)
    log = tmp_path / f"replicas-{port}.log"
    args = [*shlex.split(cmd), f"PORT={port}"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT,
                                start_new_session=True)
    try:
        _wait_healthy(port, proc, log, 600.0)
        r = requests.post(f"http://127.0.0.1:{port}/embed", json={"inputs": ["hello", "world"]}, timeout=60)
        assert r.status_code == 200 and len(r.json()) == 2, r.text[:500]
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait()
    assert code in (0, 2, -signal.SIGINT), f"{cmd}: exit {code}\n{log.read_text()[-3000:]}"
    for k in range(3):
        # A listener left, not a bind test: another program's connection
        # may have taken the freed port as its source port.
        assert not rp.listening(port + k), f"port {port + k} still listened on after {cmd} stopped"


def run_bulk(cmd: str, tmp_path: Path) -> None:
    """`mlx-embed bulk corpus.parquet -o vectors/` on a small corpus: every
    row comes back once, equal to `mlx-embed embed` on the same texts."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mlx_embed import load

    rows = [{"id": f"doc-{i}", "text": f"readme row {i} about {w}"}
            for i, w in enumerate(["apples", "rivers", "engines", "music"] * 10)]
    args = shlex.split(cmd)
    src, out = tmp_path / args[2], tmp_path / args[args.index("-o") + 1]
    pq.write_table(pa.Table.from_pylist(rows), src)
    args[0] = str(BIN / args[0])
    r = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env={**_env(), "RAY_USAGE_STATS_ENABLED": "0"})
    assert r.returncode == 0, f"{cmd}: exit {r.returncode}\n{r.stderr[-3000:]}"
    table = pa.concat_tables([pq.read_table(f) for f in sorted(out.glob("*.parquet"))])
    got = {row["id"]: row for row in table.to_pylist()}
    assert sorted(got) == sorted(row["id"] for row in rows) and table.num_rows == len(rows)
    want = load().embed([row["text"] for row in rows])
    for row, vec in zip(rows, want):
        assert got[row["id"]]["text"] == row["text"]
        v = np.asarray(got[row["id"]]["embedding"], dtype=np.float32)
        assert float(v @ vec / (np.linalg.norm(v) * np.linalg.norm(vec))) >= 0.99999, row["id"]


def run_curl(cmd: str, port: int) -> None:
    args = shlex.split(_local(cmd, port))
    args[1:1] = ["-w", "\n%{http_code}"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{cmd}: curl exit {r.returncode} {r.stderr}"
    body, _, status = r.stdout.rpartition("\n")
    assert status == "200", f"{cmd}: HTTP {status}: {body[:500]}"
    json.loads(body)


def run_cli(cmd: str, tmp_path: Path) -> None:
    (tmp_path / "texts.txt").write_text("hello\nworld\n")
    (tmp_path / "texts.jsonl").write_text('{"text": "hello"}\n{"text": "world"}\n')
    args = shlex.split(cmd)
    args[0] = str(BIN / args[0])
    r = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=_env())
    assert r.returncode == 0, f"{cmd}: exit {r.returncode}\n{r.stderr[-3000:]}"
    if "-o" in args:
        out = tmp_path / args[args.index("-o") + 1]
        assert out.exists() and out.stat().st_size > 0, cmd


@pytest.fixture(scope="module")
def readme_server(tmp_path_factory):
    """Also serves gRPC (the README's gRPC example; its port 50051 rewritten to this one)."""
    grpc_port = free_port()
    srv = start_server(tmp_path_factory.mktemp("readme"), "--rerank-model",
                       str(ROOT / "tests" / "fixtures" / "tiny-bert-reranker"), "--grpc-port", str(grpc_port))
    srv.grpc_port = grpc_port
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def splade_server(tmp_path_factory):
    """Answers the README's /embed_sparse example, which needs a SPLADE model."""
    srv = start_server(tmp_path_factory.mktemp("readme-splade"), "--model",
                       str(ROOT / "tests" / "fixtures" / "tiny-splade"), "--no-warmup")
    yield srv
    srv.stop()


def test_readme_has_the_cli_fix():
    shell, _, _ = readme_commands()
    assert not any("--file" in c for c in shell), "mlx-embed embed has no --file flag (it is -i/--input)"
    assert any(c.startswith("mlx-embed embed -i ") for c in shell)


def test_every_readme_command_runs(readme_server, splade_server, tmp_path):
    shell, python, rust = readme_commands()
    port = int(readme_server.url.rsplit(":", 1)[1])
    ran, skipped, unknown = [], [], []
    for cmd in shell:
        why = excluded(cmd)
        if why:
            skipped.append((cmd, why))
        elif cmd.startswith("curl ") and "/embed_sparse" in cmd:
            run_curl(cmd, int(splade_server.url.rsplit(":", 1)[1]))
            ran.append(cmd)
        elif cmd.startswith("curl "):
            run_curl(cmd, port)
            ran.append(cmd)
        elif cmd.startswith("mlx-embed serve --help"):
            r = subprocess.run([str(BIN / "mlx-embed"), "serve", "--help"], capture_output=True, text=True,
                               timeout=120, env=_env())
            assert r.returncode == 0 and "--rerank-model" in r.stdout, r.stderr
            ran.append(cmd)
        elif cmd.startswith(("mlx-embed serve", "make serve")):
            run_server_command(cmd, tmp_path)
            ran.append(cmd)
        elif cmd.startswith("mlx-embed embed"):
            run_cli(cmd, tmp_path)
            ran.append(cmd)
        elif cmd == "make replicas":
            run_replicas(cmd, tmp_path)
            ran.append(cmd)
        elif cmd.startswith("mlx-embed bulk "):
            run_bulk(cmd, tmp_path)
            ran.append(cmd)
        elif cmd == "cargo run --release --example semantic_search":
            r = subprocess.run(shlex.split(cmd), capture_output=True, text=True, timeout=900, cwd=ROOT,
                               env=_env())
            assert r.returncode == 0, r.stderr[-3000:]
            ran.append(cmd)
        else:
            unknown.append(cmd)
    assert not unknown, (
        "README commands this test neither runs nor excludes (make them run here, or add them to "
        f"EXCLUDED with the reason): {unknown}"
    )
    # The gRPC example generates its client from proto/tei.proto, a path of the checkout.
    shutil.copytree(ROOT / "proto", tmp_path / "proto")
    for i, block in enumerate(python):
        code = _local(block, port).replace("localhost:50051", f"127.0.0.1:{readme_server.grpc_port}")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           cwd=tmp_path, env=_env())
        assert r.returncode == 0, f"README python block {i}:\n{block}\n{r.stderr[-3000:]}"
    # Rust blocks are library snippets, not commands: they must at least name
    # the crates that exist (examples/semantic_search.rs compiles the real use).
    for block in rust:
        for crate in re.findall(r"use (mlx_embed_\w+)::", block):
            assert (ROOT / "crates" / crate.replace("_", "-")).is_dir(), crate
    assert len(ran) >= 8, ran


def _blocks(lang: str) -> list[str]:
    return [body for tag, body in re.findall(r"^```(\w*)\n(.*?)^```", README.read_text(encoding="utf-8"),
                                              re.M | re.S) if tag == lang]


def test_the_readme_rust_crate_builds_and_embeds(tmp_path):
    """A crate outside the workspace, made only of what the README shows (its
    Cargo.toml dependencies, build.rs and library snippet), builds against
    the venv's Python, finds that libpython at run time and embeds."""
    (manifest,) = _blocks("toml")
    (build_rs,) = [b for b in _blocks("rust") if b.startswith("// build.rs")]
    (snippet,) = [b for b in _blocks("rust") if "Batcher::start" in b and "fn main" not in b]
    crate = tmp_path / "outside"
    (crate / "src").mkdir(parents=True)
    deps = manifest.replace("../mlx-embed/crates/", f"{ROOT}/crates/")
    assert deps != manifest, "the README's Cargo.toml no longer names this checkout's crates"
    # The workspace's release profile, so the build reuses its compiled dependencies.
    (crate / "Cargo.toml").write_text(
        '[package]\nname = "readme-outside-crate"\nversion = "0.1.0"\nedition = "2021"\n\n'
        f"{deps}\n[profile.release]\ndebug = 1\n\n[workspace]\n")
    (crate / "build.rs").write_text(build_rs)
    (crate / "src" / "main.rs").write_text(
        "#[tokio::main]\nasync fn main() -> Result<(), Box<dyn std::error::Error>> {\n"
        f"{snippet}\n"
        '    let v: Vec<String> = out.vectors[0].iter().map(|x| format!("{x:e}")).collect();\n'
        '    println!("[{}]", v.join(","));\n    Ok(())\n}\n')
    (crate / "Cargo.lock").write_bytes((ROOT / "Cargo.lock").read_bytes())
    target = ROOT / "target"
    env = {**_env(), "PYO3_PYTHON": sys.executable, "CARGO_TARGET_DIR": str(target)}
    build = subprocess.run(["cargo", "build", "--release", "--offline", "--quiet"], cwd=crate, env=env,
                           capture_output=True, text=True, timeout=1200)
    assert build.returncode == 0, build.stderr[-4000:]
    binary = target / "release" / "readme-outside-crate"
    # The binary loads the venv interpreter's own libpython (the build.rs rpath), not the system's.
    libdir = sysconfig.get_config_var("LIBDIR")
    ldd = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, timeout=60).stdout
    (line,) = [x for x in ldd.splitlines() if "libpython" in x]
    assert os.path.realpath(line.split("=>")[1].split("(")[0].strip()).startswith(os.path.realpath(libdir)), ldd
    # Run from outside the checkout, so only VIRTUAL_ENV can point it at the venv.
    run = subprocess.run([str(binary)], cwd=tmp_path, env={**env, "VIRTUAL_ENV": sys.prefix},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    want = mlx_embed.load().embed(["hello"])[0]
    assert len(got) == 384
    assert float(np.dot(np.asarray(got, np.float32), want)) >= 0.99999
    # A virtualenv made for another Python holds no packages for this one: the
    # error says so, rather than only to set VIRTUAL_ENV (which is set).
    other = tmp_path / "venv-3.99"
    (other / "lib" / "python3.99" / "site-packages").mkdir(parents=True)
    (other / "pyvenv.cfg").write_text("home = /nowhere\ninclude-system-site-packages = false\nversion = 3.99.1\n")
    # Nor may PATH lead to this venv: an embedded interpreter takes its prefix
    # from the first `python3` there, and a venv's brings its packages along.
    path = os.pathsep.join(p for p in env["PATH"].split(os.pathsep)
                           if not os.path.realpath(p).startswith(os.path.realpath(sys.prefix)))
    wrong = subprocess.run([str(binary)], cwd=tmp_path, env={**env, "VIRTUAL_ENV": str(other), "PATH": path},
                           capture_output=True, text=True, timeout=300)
    assert wrong.returncode != 0
    ours = f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert (f"the virtualenv {other} has no {other}/lib/python{ours}/site-packages: it holds packages for "
            f"Python 3.99.1, and this program embeds Python {ours}.") in wrong.stderr, wrong.stderr[-4000:]
