"""Two real replicas behind real nginx (deploy/nginx/nginx.conf), under load.

A replica drained by SIGTERM, killed with SIGKILL, or whose model died (503)
mid-load costs the clients nothing: nginx resends to the other replica, every
answer is the right vector, and a replica brought back gets traffic again.
Each test is bounded: a fixed number of clients, a request cap and deadlines.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests
from harness import ROOT, TEST_SERVER_BINARY, cosine_rows

sys.path.insert(0, str(ROOT / "scripts"))
import replicas as rp

CLIENTS = 8
MAX_REQUESTS = 20_000  # per load run; the phases below stop it long before
MAX_LOAD_SECONDS = 240
DRAIN_SECONDS = 30
# No embedding cache: the load repeats PAIRS, and a replica answering from a
# warm cache would be far faster than one brought back cold, so least_conn
# would rightly send it nearly everything; the test is about real compute.
REPLICA_ARGS = ["--no-warmup", "--no-cache", "--drain-timeout-secs", str(DRAIN_SECONDS)]
# Distinct two-text requests; each answer is checked against its own texts' vectors.
PAIRS = [[f"request {i}: how do replicas share the load", f"second text {i} about nginx and retries"]
         for i in range(24)]


def embed_count(replica: rp.Replica) -> int:
    """Embed requests this replica answered 200, from its /metrics."""
    text = requests.get(replica.url + "/metrics", timeout=10).text
    return int(sum(float(v) for v in re.findall(
        r'^mlx_embed_http_requests_total\{route="/api/v1/embed",code="200"\} (\S+)$', text, re.MULTILINE)))


def wait_for(condition, timeout: float, what: str, poll: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll)
    pytest.fail(f"timed out after {timeout}s waiting for {what}")


class Load:
    """CLIENTS threads posting PAIRS through nginx on keep-alive sessions until
    stopped, MAX_REQUESTS are sent or MAX_LOAD_SECONDS pass. Any answer other
    than a 200 carrying the request's own vectors is recorded as an error."""

    def __init__(self, url: str, reference: dict[str, np.ndarray]):
        self.url, self.reference = url, reference
        self.ok = 0
        self.errors: list[str] = []
        self.sent = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._deadline = time.monotonic() + MAX_LOAD_SECONDS
        self._threads = [threading.Thread(target=self._client, args=(c,), daemon=True) for c in range(CLIENTS)]

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=90)
        assert not any(t.is_alive() for t in self._threads), "a load client did not stop"

    def _next(self) -> int | None:
        with self._lock:
            if self._stop.is_set() or self.sent >= MAX_REQUESTS or time.monotonic() > self._deadline:
                return None
            self.sent += 1
            return self.sent

    def _client(self, c: int) -> None:
        session = requests.Session()
        while (n := self._next()) is not None:
            pair = PAIRS[(n * 7 + c) % len(PAIRS)]
            try:
                r = session.post(self.url + "/api/v1/embed", json={"texts": pair}, timeout=90)
            except requests.RequestException as e:
                self._error(f"request {n}: {e!r}")
                continue
            if r.status_code != 200:
                self._error(f"request {n}: HTTP {r.status_code}: {r.text[:200]}")
                continue
            got = np.asarray(r.json()["embeddings"], dtype=np.float32)
            want = np.stack([self.reference[t] for t in pair])
            if got.shape != want.shape or cosine_rows(got, want).min() < 0.99999:
                self._error(f"request {n}: wrong vectors for {pair}")
                continue
            with self._lock:
                self.ok += 1

    def _error(self, message: str) -> None:
        with self._lock:
            self.errors.append(message)

    def wait_ok(self, n: int, timeout: float, what: str) -> None:
        """Waits for `n` more correct answers than now."""
        target = self.ok + n
        wait_for(lambda: self.ok >= target or self.errors, timeout, what)
        assert not self.errors, self.errors[:5]


@pytest.fixture
def cluster(tmp_path):
    """Two replicas and nginx on free loopback ports; everything stopped after."""
    ports = [rp.free_port(), rp.free_port()]
    started = [rp.start_replica(p, tmp_path, REPLICA_ARGS, wait=False) for p in ports]
    procs = {"replicas": list(started), "nginx": None}
    try:
        for r in started:
            rp.wait_healthy(r)
        procs["nginx"] = rp.start_nginx(rp.free_port(), ports, tmp_path / "nginx")
        yield procs
    finally:
        if procs["nginx"]:
            procs["nginx"].stop()
        for r in procs["replicas"]:
            r.stop(timeout=DRAIN_SECONDS + 10)


def reference_vectors(replica: rp.Replica) -> dict[str, np.ndarray]:
    texts = sorted({t for pair in PAIRS for t in pair})
    r = requests.post(replica.url + "/api/v1/embed", json={"texts": texts}, timeout=60)
    assert r.status_code == 200, r.text
    return dict(zip(texts, np.asarray(r.json()["embeddings"], dtype=np.float32)))


def retried_from(nginx: rp.Nginx, replica: rp.Replica) -> int:
    """Requests that `replica` failed and another replica then answered, from
    nginx's access log (upstream addresses "a, b" with statuses "502, 200")."""
    lines = wait_for(lambda: nginx.access_log() or None, 5, "the access log")
    return sum(1 for line in lines if f"upstream=127.0.0.1:{replica.port}, " in line)


def upstream_failures(nginx: rp.Nginx, replica: rp.Replica) -> dict[str, int]:
    """What nginx's error log says went wrong with `replica`, by kind."""
    kinds = {"refused": "Connection refused", "closed before answering": "prematurely closed",
             "reset": "reset by peer", "timed out": "timed out"}
    lines = [line for line in nginx.error_log().splitlines()
             if f'upstream: "http://127.0.0.1:{replica.port}/' in line]
    return {kind: sum(text in line for line in lines) for kind, text in kinds.items()}


def test_sigterm_one_replica_mid_load_drains_with_no_client_errors(cluster):
    a, b = cluster["replicas"]
    nginx = cluster["nginx"]
    reference = reference_vectors(a)
    with Load(nginx.url, reference) as load:
        wait_for(lambda: embed_count(a) >= 20 and embed_count(b) >= 20, 120, "both replicas serving")
        served_by_a = embed_count(a)
        signalled = time.monotonic()
        a.proc.send_signal(signal.SIGTERM)
        code = a.proc.wait(timeout=DRAIN_SECONDS + 10)
        exited = time.monotonic() - signalled
        # The other replica carries the load alone from here.
        load.wait_ok(60, 120, "answers after the drained replica left")
    assert load.errors == [], load.errors[:5]
    assert code == 0, a.log()[-3000:]
    assert exited < DRAIN_SECONDS
    log = a.log()
    assert "received SIGTERM" in log and "shut down" in log
    assert "drain timeout" not in log, "the replica exited before answering what it accepted"
    # A request the draining replica had accepted and then sat on would show as a timeout.
    failures = upstream_failures(nginx, a)
    assert failures["timed out"] == 0, failures
    print(f"\nSIGTERM: {load.ok} answers, 0 errors; the drained replica had answered {served_by_a}, "
          f"exited 0 after {exited:.2f}s; {retried_from(nginx, a)} requests resent by nginx "
          f"({failures})")


def test_kill_9_one_replica_mid_load_then_bring_it_back(cluster, tmp_path):
    a, b = cluster["replicas"]
    nginx = cluster["nginx"]
    reference = reference_vectors(a)
    with Load(nginx.url, reference) as load:
        wait_for(lambda: embed_count(a) >= 20 and embed_count(b) >= 20, 120, "both replicas serving")
        a.proc.kill()
        a.proc.wait(timeout=10)
        load.wait_ok(60, 120, "answers after the kill")
        resent = retried_from(nginx, a)

        # Bring it back on the same port: no replica is marked down, so nginx sends it traffic at once.
        back = rp.start_replica(a.port, tmp_path / "back", REPLICA_ARGS)
        cluster["replicas"].append(back)
        returned = time.monotonic()
        wait_for(lambda: embed_count(back) >= 30, 60, "traffic on the replica brought back")
        seconds_to_return = time.monotonic() - returned
        before_back, before_b = embed_count(back), embed_count(b)
        load.wait_ok(120, 120, "answers with both replicas up")
        share = (embed_count(back) - before_back) / max(
            embed_count(back) - before_back + embed_count(b) - before_b, 1)
    assert load.errors == [], load.errors[:5]
    # least_conn over two equal replicas: each takes a real part of the load.
    assert share >= 0.2, f"the replica brought back took only {share:.0%} of the requests"
    print(f"\nkill -9: {load.ok} answers, 0 errors, {resent} requests resent to the survivor; "
          f"the replica brought back served again after {seconds_to_return:.1f}s, "
          f"then {share:.0%} of the requests")


def test_rolling_restart_under_load_has_no_client_errors(cluster, tmp_path):
    """Restart one replica, wait for its /health, then stop the other at
    once: a rolling restart. With a failed replica marked down for 2 s
    (max_fails=1 fail_timeout=2s) nginx still skipped the restarted one and
    had none left: a probe saw 3,156 502s in 2 s. Now no replica is marked
    down and the clients see only right answers."""
    a, b = cluster["replicas"]
    nginx = cluster["nginx"]
    reference = reference_vectors(a)
    with Load(nginx.url, reference) as load:
        wait_for(lambda: embed_count(a) >= 20 and embed_count(b) >= 20, 120, "both replicas serving")
        a.proc.send_signal(signal.SIGTERM)
        assert a.proc.wait(timeout=DRAIN_SECONDS + 10) == 0
        load.wait_ok(20, 120, "answers from the other replica")
        back = rp.start_replica(a.port, tmp_path / "back", REPLICA_ARGS)
        cluster["replicas"].append(back)
        b.proc.send_signal(signal.SIGTERM)
        assert b.proc.wait(timeout=DRAIN_SECONDS + 10) == 0
        load.wait_ok(60, 120, "answers from the restarted replica alone")
    assert load.errors == [], load.errors[:5]
    assert embed_count(back) >= 60


def test_no_replica_left_is_a_json_502(tmp_path):
    """Every replica gone: nginx's own 502, in the JSON shape of the API
    called (it was nginx's HTML page)."""
    nginx = rp.start_nginx(rp.free_port(), [rp.free_port(), rp.free_port()], tmp_path / "nginx")
    try:
        r = requests.post(nginx.url + "/v1/embeddings", json={"input": "x", "model": "m"}, timeout=30)
        assert r.status_code == 502
        assert r.headers["content-type"].startswith("application/json")
        message = "no replica answered: every one nginx tried refused, failed or timed out"
        assert r.json()["error"]["message"] == message
        r = requests.post(nginx.url + "/embed", json={"inputs": "x"}, timeout=30)
        assert (r.status_code, r.json()) == (502, {"error": message, "error_type": "Backend"})
    finally:
        nginx.stop()


def test_replica_answering_503_is_skipped(tmp_path):
    """A replica whose model thread died answers 503 to everything: nginx
    resends to the healthy one (proxy_next_upstream http_503)."""
    marker = "@@die@@"
    sick = rp.start_replica(rp.free_port(), tmp_path, REPLICA_ARGS, wait=False,
                            env={"MLX_EMBED_TEST_KILL": marker}, binary=TEST_SERVER_BINARY)
    well = rp.start_replica(rp.free_port(), tmp_path, REPLICA_ARGS, wait=False)
    nginx = None
    try:
        rp.wait_healthy(sick)
        rp.wait_healthy(well)
        nginx = rp.start_nginx(rp.free_port(), [sick.port, well.port], tmp_path / "nginx")
        r = requests.post(sick.url + "/api/v1/embed", json={"texts": [f"x {marker} y"]}, timeout=60)
        assert r.status_code == 503
        wait_for(lambda: not sick.healthy(), 10, "the sick replica to report unhealthy")
        reference = reference_vectors(well)
        session = requests.Session()
        for i in range(40):
            pair = PAIRS[i % len(PAIRS)]
            r = session.post(nginx.url + "/api/v1/embed", json={"texts": pair}, timeout=60)
            assert r.status_code == 200, r.text
            got = np.asarray(r.json()["embeddings"], dtype=np.float32)
            assert cosine_rows(got, np.stack([reference[t] for t in pair])).min() >= 0.99999
        assert requests.get(sick.url + "/metrics", timeout=10).text.count('code="503"') >= 1
        assert retried_from(nginx, sick) >= 1, "nginx never tried the sick replica"
    finally:
        if nginx:
            nginx.stop()
        sick.stop()
        well.stop()


def test_body_limit_is_the_servers(cluster):
    """nginx's client_max_body_size is the server's --max-body-bytes (2 MiB):
    a body of exactly the limit reaches a replica, one byte more gets nginx's
    413, in the called API's JSON shape as the server words it."""
    nginx = cluster["nginx"]
    limit = 2 * 1024 * 1024

    def body(size: int) -> bytes:
        head, tail = b'{"texts": ["hello"], "padding": "', b'"}'
        return head + b"x" * (size - len(head) - len(tail)) + tail

    headers = {"content-type": "application/json"}
    r = requests.post(nginx.url + "/api/v1/embed", data=body(limit), headers=headers, timeout=60)
    assert r.headers.get("content-type", "").startswith("application/json"), r.text[:300]
    assert r.status_code in (200, 422), r.text[:300]  # the replica's answer, whatever it makes of "padding"
    message = "request body is larger than the limit of 2097152 bytes (--max-body-bytes)"
    shapes = {
        "/api/v1/embed": {"error": {"message": message, "type": "invalid_request_error", "code": 413}},
        "/v1/embeddings": {"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": None}, "detail": message},
        "/v2/embed": {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None},
                      "detail": message},
        "/pooling": {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None},
                     "detail": message},
        "/invocations": {"error": message, "error_type": "Validation"},
        "/embed": {"error": message, "error_type": "Validation"},
        "/": {"error": message, "error_type": "Validation"},
        "/api/embed": {"error": message},
        "/vectors": {"error": message},
    }
    for path, shape in shapes.items():
        r = requests.post(nginx.url + path, data=body(limit + 1), headers=headers, timeout=60)
        assert r.status_code == 413, (path, r.text[:300])
        assert r.headers.get("content-type", "").startswith("application/json"), (path, r.headers)
        assert r.json() == shape, (path, r.text[:300])
    # Refused by nginx before any replica saw them: no replica counted a 413.
    # A replica's own 413 for each path (sent to it directly, after this check) is nginx's, to the byte.
    for replica in cluster["replicas"]:
        text = requests.get(replica.url + "/metrics", timeout=10).text
        assert 'code="413"' not in text, text
    live = next(r for r in cluster["replicas"] if r.healthy())
    for path, shape in shapes.items():
        r = requests.post(live.url + path, data=body(limit + 1), headers=headers, timeout=60)
        assert (r.status_code, r.json()) == (413, shape), (path, r.text[:300])


def test_shipped_config_passes_nginx_t(tmp_path):
    """deploy/nginx/nginx.conf as shipped (replicas on 8081/8082) is valid."""
    conf = ROOT / "deploy" / "nginx" / "nginx.conf"
    r = subprocess.run([rp.find_nginx(), "-t", "-p", str(tmp_path), "-c", str(conf), "-e", "stderr"],
                       check=False, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "syntax is ok" in r.stderr
    rendered = rp.render_nginx_conf(9000, [9001, 9002, 9003])
    assert re.findall(r"server 127\.0\.0\.1:(\d+) max_fails=0;", rendered) == [
        "9001", "9002", "9003"]
    assert "listen 127.0.0.1:9000;" in rendered
    assert Path(conf).read_text().count("server 127.0.0.1:") == 2
