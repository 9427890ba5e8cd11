"""scripts/replicas.py as a user runs it (`make replicas`): real replicas and
real nginx on loopback, the script stopped by SIGTERM or Ctrl-C at start-up
and while serving, a port taken before or at nginx's start, and server flags
that nginx's config must follow.

Each test starts at most two replicas and one nginx, waits with deadlines,
and kills whatever the script left behind.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from harness import ROOT, TEST_SERVER_BINARY

sys.path.insert(0, str(ROOT / "scripts"))
import replicas as rp

SCRIPT = ROOT / "scripts" / "replicas.py"
# Kept apart from the ports other suites take (free_port's ephemeral range).
PORT_RANGE = range(19200, 19300)
STOP_SECONDS = 60
# With the test server, every batch (the start-up warm-up too) pays this: the
# replicas take seconds to come up, as with a real model, so a signal lands
# at start-up for sure. Their signal handlers are installed before the warm-up.
SLOW_START = {"MLX_EMBED_TEST_PASS_MS": "4000"}


def free_run(n: int) -> int:
    """The first port of n consecutive free ones in PORT_RANGE."""
    for first in range(PORT_RANGE.start, PORT_RANGE.stop - n + 1):
        if all(rp.port_free(first + k) for k in range(n)):
            return first
    pytest.fail(f"no {n} consecutive free ports in {PORT_RANGE}")


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Script:
    """scripts/replicas.py in its own process group, as a terminal runs it."""

    def __init__(self, tmp_path: Path, port: int, *args: str, env: dict | None = None):
        self.dir, self.port = tmp_path / "run", port
        self.out, self.err = tmp_path / "stdout", tmp_path / "stderr"
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(SCRIPT), "--port", str(port), "--dir", str(self.dir), *args],
                stdout=out, stderr=err, cwd=ROOT, env={**os.environ, **(env or {})}, start_new_session=True)
        self.seen: set[int] = set()  # every child seen, to check and clean up after

    def kids(self) -> list[int]:
        found = children(self.proc.pid) if self.proc.poll() is None else []
        self.seen.update(found)
        return found

    def replica_logs(self) -> list[str]:
        return [p.read_text(errors="replace") for p in sorted(self.dir.glob("replica-*.log"))]

    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def wait_for(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.kids()
            if condition():
                return
            if self.proc.poll() is not None:
                pytest.fail(f"replicas.py exited {self.proc.returncode} before {what}:\n{self.stderr()[-3000:]}")
            time.sleep(0.01)
        pytest.fail(f"timed out after {timeout}s waiting for {what}:\n{self.stderr()[-3000:]}")

    def wait_serving(self, timeout: float = 120) -> None:
        self.wait_for(lambda: "nginx on http://" in self.stdout(), timeout, "nginx")

    def wait(self, timeout: float = STOP_SECONDS) -> int:
        """The script's exit code; notes its children until then."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                pytest.fail(f"replicas.py still running after {timeout}s:\n{self.stderr()[-3000:]}")
            self.kids()
            time.sleep(0.01)
        return self.proc.returncode

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for pid in self.seen:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def script(tmp_path):
    started: list[Script] = []

    def start(*args: str, port: int | None = None, env: dict | None = None) -> Script:
        s = Script(tmp_path, port or free_run(3), *args, env=env)
        started.append(s)
        return s

    yield start
    for s in started:
        s.cleanup()


def assert_all_stopped(s: Script) -> None:
    left = [pid for pid in s.seen if alive(pid)]
    assert not left, f"left running: {left}\n{s.stderr()[-3000:]}"
    for k in range(3):
        assert not rp.listening(s.port + k), f"port {s.port + k} still listened on"


STOPS = {
    "SIGTERM to the script": lambda s: s.proc.send_signal(signal.SIGTERM),
    # A terminal's Ctrl-C reaches the whole foreground group.
    "Ctrl-C": lambda s: os.killpg(s.proc.pid, signal.SIGINT),
}


@pytest.mark.parametrize("how", STOPS)
@pytest.mark.parametrize("when", ["start-up", "serving"])
def test_stop_at_any_moment_drains_every_replica(script, how, when):
    """A stop during start-up (replicas still warming up, nginx not started)
    or while serving stops every child; each replica gets exactly one signal,
    so it drains and shuts down as on a normal stop."""
    s = script("--replicas", "2", "--server-binary", str(TEST_SERVER_BINARY), env=SLOW_START)
    if when == "start-up":
        # Past "batcher started" the replica has its signal handlers (or will
        # within microseconds) and is inside its multi-second warm-up.
        s.wait_for(lambda: len(s.replica_logs()) == 2 and all("batcher started" in log for log in s.replica_logs()),
                   60, "both replicas loading")
        time.sleep(0.3)
        assert len(s.kids()) == 2, "the replicas should be the only children yet"
        assert not (s.dir / "nginx.conf").exists(), "nginx started already: not a start-up stop"
    else:
        s.wait_serving()
        assert requests.get(f"http://127.0.0.1:{s.port}/health", timeout=10).status_code == 200
    STOPS[how](s)
    code = s.wait()
    assert code == 0, s.stderr()[-3000:]
    # Start-up: the two replicas; serving: nginx too (and `nginx -t` before it).
    assert len(s.seen) == 2 if when == "start-up" else len(s.seen) >= 3
    assert_all_stopped(s)
    for log in s.replica_logs():
        assert len(re.findall(r"received SIG(TERM|INT)", log)) == 1, log[-3000:]
        assert "second signal" not in log and "shut down" in log, log[-3000:]
    assert ("nginx on" in s.stdout()) == (when == "serving")


@pytest.mark.parametrize("when", ["start-up", "serving"])
def test_killed_script_leaves_no_child_running(script, when):
    """SIGKILL to the script alone (an OOM killer, `kill -9`): it can stop
    nothing itself, so its children must go by themselves. Linux signals
    them when it dies: each replica gets SIGTERM and drains, nginx gets SIGQUIT."""
    s = script("--replicas", "1", "--server-binary", str(TEST_SERVER_BINARY), env=SLOW_START)
    if when == "start-up":
        s.wait_for(lambda: s.replica_logs() and "batcher started" in s.replica_logs()[0], 60, "the replica loading")
    else:
        s.wait_serving()
    s.kids()
    expected = 1 if when == "start-up" else 2
    assert len([pid for pid in s.seen if alive(pid)]) == expected, s.seen
    os.kill(s.proc.pid, signal.SIGKILL)
    s.proc.wait(10)
    deadline = time.monotonic() + STOP_SECONDS
    while any(alive(pid) for pid in s.seen) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert_all_stopped(s)
    log = s.replica_logs()[0]
    assert len(re.findall(r"received SIGTERM", log)) == 1, log[-3000:]


def test_port_taken_before_start_fails_at_once(script):
    """nginx's port held by another listener: reported before anything starts, exit 1."""
    port = free_run(3)
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))
        other.listen()
        s = script("--replicas", "1", port=port)
        code = s.wait(30)
    assert code == 1
    assert f"{port} already in use" in s.stderr(), s.stderr()
    assert "nginx on" not in s.stdout()
    assert s.replica_logs() == [], "no replica should have started"


def test_port_taken_at_nginx_start_fails_and_stops_the_replicas(script):
    """The port is taken after the script's check, while the replicas start:
    nginx cannot bind it, and the script must not take the other listener for
    its nginx. It says so, stops the replicas and exits 1."""
    port = free_run(3)
    s = script("--replicas", "1", "--server-binary", str(TEST_SERVER_BINARY), port=port, env=SLOW_START)
    s.wait_for(lambda: len(s.kids()) == 1, 30, "the replica")
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))
        other.listen()
        code = s.wait(120)
    assert code == 1, s.stderr()[-3000:]
    assert "nginx on" not in s.stdout(), s.stdout()
    assert "nginx exited with 1" in s.stderr() and "Address already in use" in s.stderr(), s.stderr()[-3000:]
    assert len(s.seen) >= 2, "the replica and then nginx"
    assert_all_stopped(s)
    assert "shut down" in s.replica_logs()[0]


def test_start_nginx_is_not_fooled_by_another_listener(tmp_path):
    """start_nginx returns only for its own nginx, not for whoever accepts on the port."""
    port = free_run(1)
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))
        other.listen()
        try:
            fooled = rp.start_nginx(port, [port + 1], tmp_path / "nginx", timeout=30)
        except RuntimeError as e:
            assert "nginx exited with 1" in str(e)
        else:
            fooled.stop()
            pytest.fail("start_nginx returned with the port held by another listener")


def body(size: int) -> bytes:
    head, tail = b'{"texts": ["hello"], "padding": "', b'"}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_body_limit_follows_the_replicas(script, how):
    """`-- --max-body-bytes N` (or MLX_EMBED_MAX_BODY_BYTES): nginx passes a
    body the replicas take, and refuses one byte more with the replicas' own
    wording of their limit."""
    limit = 8 * 1024 * 1024
    if how == "flag":
        s = script("--replicas", "1", "--", "--no-warmup", "--max-body-bytes", str(limit))
    else:
        s = script("--replicas", "1", "--", "--no-warmup", env={"MLX_EMBED_MAX_BODY_BYTES": str(limit)})
    s.wait_serving()
    url = f"http://127.0.0.1:{s.port}"
    headers = {"content-type": "application/json"}
    for size in (2_400_000, limit):
        r = requests.post(url + "/api/v1/embed", data=body(size), headers=headers, timeout=120)
        assert r.status_code in (200, 422), (size, r.text[:300])  # the replica's answer
    r = requests.post(url + "/api/v1/embed", data=body(limit + 1), headers=headers, timeout=120)
    assert r.status_code == 413, r.text[:300]
    assert r.json()["error"]["message"] == (
        f"request body is larger than the limit of {limit} bytes (--max-body-bytes)")
    replica = requests.get(f"http://127.0.0.1:{s.port + 1}/metrics", timeout=10).text
    assert 'code="413"' not in replica, "nginx should refuse it before a replica sees it"
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait() == 0
    assert_all_stopped(s)


def directive(conf: str, name: str) -> str:
    values = re.findall(rf"^\s*{name}\s+([^;]+);", conf, re.MULTILINE)
    assert len(values) == 1, (name, values)
    return values[0]


def test_render_follows_the_server_settings(tmp_path, monkeypatch):
    monkeypatch.delenv("MLX_EMBED_MAX_BODY_BYTES", raising=False)
    monkeypatch.delenv("MLX_EMBED_MAX_QUEUE_WAIT_MS", raising=False)
    shipped = rp.NGINX_CONF.read_text()
    plain = rp.render_nginx_conf(9000, [9001])
    for name in ("client_max_body_size", "client_body_buffer_size", "proxy_read_timeout",
                 "proxy_next_upstream_timeout", "proxy_send_timeout"):
        assert directive(plain, name) == directive(shipped, name)

    # The queue wait past nginx's read timeout: nginx would give up on a
    # request the replica still answers, and resend it (non_idempotent).
    # It may wait that long twice (for answer room, then in the queue).
    conf = rp.render_nginx_conf(9000, [9001], server_args=["--max-queue-wait-ms=120000"])
    assert directive(conf, "proxy_read_timeout") == directive(conf, "proxy_send_timeout") == "255s"
    assert directive(conf, "proxy_next_upstream_timeout") == "510s"
    assert "non_idempotent" in directive(conf, "proxy_next_upstream")
    # A shorter one never lowers the shipped margin.
    conf = rp.render_nginx_conf(9000, [9001], env={"MLX_EMBED_MAX_QUEUE_WAIT_MS": "1000"})
    assert directive(conf, "proxy_read_timeout") == directive(shipped, "proxy_read_timeout")

    # A client timeout under nginx's idle upstream timeout: a replica would
    # close idle connections nginx still sends requests into.
    monkeypatch.delenv("MLX_EMBED_CLIENT_TIMEOUT_SECS", raising=False)
    assert directive(plain, "keepalive_timeout") == directive(shipped, "keepalive_timeout") == "60s"
    conf = rp.render_nginx_conf(9000, [9001], server_args=["--client-timeout-secs", "30"])
    assert directive(conf, "keepalive_timeout") == "25s"
    conf = rp.render_nginx_conf(9000, [9001], server_args=["--client-timeout-secs", "300"])
    assert directive(conf, "keepalive_timeout") == "60s"

    # The flag wins over the environment, as in the server.
    conf = rp.render_nginx_conf(9000, [9001], server_args=["--max-body-bytes", "3000000"],
                                env={"MLX_EMBED_MAX_BODY_BYTES": "5"})
    assert directive(conf, "client_max_body_size") == "3000000"
    assert directive(conf, "client_body_buffer_size") == "3000000"
    assert conf.count("limit of 3000000 bytes (--max-body-bytes)") == 5
    assert "2097152" not in conf
    with pytest.raises(ValueError, match="--max-body-bytes"):
        rp.render_nginx_conf(9000, [9001], server_args=["--max-body-bytes", "2m"])

    path = tmp_path / "nginx.conf"
    path.write_text(rp.render_nginx_conf(9000, [9001], server_args=["--max-body-bytes", "3000000",
                                                                   "--max-queue-wait-ms", "600000"]))
    r = subprocess.run([rp.find_nginx(), "-t", "-p", str(tmp_path), "-c", str(path), "-e", "stderr"],
                       check=False, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
