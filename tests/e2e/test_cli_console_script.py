"""The installed `mlx-embed` console script (python/mlx_embed/cli.py) around
the server: Ctrl-C drains and exits 0 as SIGTERM does, Ctrl-C while the model
loads still stops it at once, and a top-level --version."""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import free_port, start_server
from test_overload import HOST, port_of, send_until_all_accepted

CONSOLE_SCRIPT = Path(sys.prefix) / "bin" / "mlx-embed"
DRAIN_S = 30


@pytest.fixture(scope="module", autouse=True)
def _console_script():
    if not CONSOLE_SCRIPT.exists():
        pytest.fail(f"{CONSOLE_SCRIPT} is missing: install the package (make build)")


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_signal_under_load_answers_in_flight_requests_then_exits_0(tmp_path, signame):
    """A SIGINT (Ctrl-C) once left Python a pending KeyboardInterrupt under
    the server's own handler: the drain went well, then the script printed a
    traceback and killed itself with SIGINT (exit -2, 130 in a shell) where
    the Rust binary, and SIGTERM, exit 0."""
    server = start_server(tmp_path, "--no-warmup", "--drain-timeout-secs", str(DRAIN_S),
                          command=[str(CONSOLE_SCRIPT), "serve"])
    port = port_of(server)
    n = 32

    async def scenario():
        tasks, answered = await send_until_all_accepted(server, port, n)
        assert answered < n, f"all answered before {signame}; make the load heavier"
        signalled = time.monotonic()
        server.proc.send_signal(getattr(signal, signame))
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=DRAIN_S + 10)
        return signalled, results

    try:
        signalled, results = asyncio.run(scenario())
        code = server.proc.wait(timeout=DRAIN_S + 10)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(timeout=30)
    exited = time.monotonic() - signalled
    log = re.sub(r"\x1b\[[0-9;]*m", "", server.log())
    for resp in results:
        assert resp.status == 200, resp.body
        assert len(resp.json()["embeddings"]) == 2
    assert code == 0, f"{signame}: exit {code}\n{log[-3000:]}"
    assert exited < DRAIN_S
    assert f"received {signame}" in log and "shut down" in log
    assert "KeyboardInterrupt" not in log and "Traceback" not in log, log[-3000:]
    # The console script runs in the venv's python, whose packages are on the
    # path already: that once logged a warning that the venv "added no packages".
    assert "added no packages" not in log, log[:3000]


# `mlx-embed serve` as the console script runs it (cli.main), with a model
# load that takes a minute and says when it began.
SLOW_LOAD = """
import os, sys, time
import mlx_embed
from mlx_embed.cli import main
_load = mlx_embed.load
def slow_load(*args, **kwargs):
    open(os.environ["LOADING_MARK"], "w").close()
    time.sleep(60)
    return _load(*args, **kwargs)
mlx_embed.load = slow_load
sys.exit(main(["serve", *sys.argv[1:]]))
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_while_the_model_loads_stops_at_once(tmp_path, signum):
    """A signal while the model loads ends the process right away with 128
    plus its number, as a shell reports a process a signal ended. The
    handlers go in before the load: a container's PID 1 has no default
    action, so until then a SIGTERM was lost and the load went on (and
    Python's own SIGINT handler, left in place, only noted a Ctrl-C)."""
    mark = tmp_path / "loading"
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", SLOW_LOAD, "--host", HOST, "--port", str(free_port()), "--no-warmup"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "LOADING_MARK": str(mark)},
            # A shell's background job (CI run with `&`) starts with SIGINT
            # ignored, which the CLI rightly keeps: give the child a terminal's.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    try:
        deadline = time.monotonic() + 60
        while not mark.exists():
            assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the model load never began"
            time.sleep(0.05)
        proc.send_signal(signum)
        signalled = time.monotonic()
        code = proc.wait(timeout=20)
        stopped = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    log = log_path.read_text(errors="replace")
    assert code == 128 + signum and stopped < 5, (code, stopped, log[-3000:])
    assert "stopping before serving: a signal came while the models loaded" in log, log[-3000:]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=60)


def test_top_level_version_is_the_servers():
    serve = _run(str(CONSOLE_SCRIPT), "serve", "--version")
    assert serve.returncode == 0, serve.stderr
    match = re.fullmatch(r"mlx-embed serve (\d+\.\d+\.\d+\S*)\n", serve.stdout)
    assert match, serve.stdout
    version = match.group(1)
    assert version == importlib.metadata.version("mlx-embed")
    for cmd in ([str(CONSOLE_SCRIPT)], [sys.executable, "-m", "mlx_embed"]):
        top = _run(*cmd, "--version")
        assert top.returncode == 0, top.stderr
        assert top.stdout == f"mlx-embed {version}\n" and top.stderr == "", (top.stdout, top.stderr)


def test_port_0_prints_the_port_it_picked_whatever_the_log_filter(tmp_path):
    """`--port 0` picks a free port; with `--log warn` the start-up line
    that names it is filtered out, so the address also goes to stdout."""
    from harness import SERVER_BINARY

    proc = subprocess.Popen(
        [str(SERVER_BINARY), "--host", HOST, "--port", "0", "--log", "warn", "--no-warmup"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "VIRTUAL_ENV": sys.prefix},
    )
    try:
        line = proc.stdout.readline()
        match = re.fullmatch(rf"listening on http://{re.escape(HOST)}:(\d+)\n", line)
        assert match, repr(line)
        port = int(match.group(1))
        assert port != 0
        import urllib.request
        with urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=10) as health:
            assert health.status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
