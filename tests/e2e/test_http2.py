"""HTTP/2 with prior knowledge (h2c) on the HTTP port, through curl (its
nghttp2 client): the same answers as HTTP/1.1, byte for byte, the same
limits, many streams on one connection each answered its own, and a drain
that lets an HTTP/2 request finish."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import threading
import time

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import httpx
import numpy as np
import pytest
import requests

from harness import start_server
from test_overload import HOLD, metrics, start_held_server, wait_until_model_runs


def _curl_speaks_http2() -> bool:
    curl = shutil.which("curl")
    if curl is None:
        return False
    version = subprocess.run([curl, "-V"], capture_output=True, text=True, timeout=10).stdout
    return any(line.startswith("Features:") and " HTTP2" in line for line in version.splitlines())


@pytest.fixture(autouse=True, scope="module")
def _curl_with_http2():
    """`make setup` installs curl (Debian's is built with nghttp2): a curl
    without HTTP/2 fails these tests rather than skipping them."""
    assert _curl_speaks_http2(), "needs curl built with HTTP/2 (nghttp2): install the OS's curl"


def curl_h2(server, path: str, body=None, *, flag: str = "--http2-prior-knowledge", timeout: float = 60):
    """One request over HTTP/2 with prior knowledge (or `flag`): status, HTTP
    version as curl names it, Content-Type and the body's bytes."""
    cmd = [
        "curl",
        "-sS",
        flag,
        "--max-time",
        str(timeout),
        "-o",
        "-",
        "-w",
        "\n%{http_code} %{http_version} %{content_type}",
    ]
    data = None
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        cmd += ["-H", "content-type: application/json", "--data-binary", "@-"]
    out = subprocess.run([*cmd, server.url + path], input=data, capture_output=True, timeout=timeout + 10)
    assert out.returncode == 0, out.stderr.decode()
    answer, _, trailer = out.stdout.rpartition(b"\n")
    status, version, ctype = (trailer.decode().split(" ", 2) + [""])[:3]
    return int(status), version, ctype, answer


def h1(server, path: str, body=None):
    resp = (
        requests.get(server.url + path, timeout=60)
        if body is None
        else requests.post(
            server.url + path,
            data=body if isinstance(body, bytes) else json.dumps(body),
            headers={"content-type": "application/json"},
            timeout=60,
        )
    )
    assert resp.raw.version == 11
    return resp.status_code, resp.headers.get("content-type", ""), resp.content


SAME_BYTES = [
    ("/embed", {"inputs": ["HTTP/2 and HTTP/1.1 give one answer", "a second input"]}),
    ("/v1/embeddings", {"input": ["HTTP/2 and HTTP/1.1 give one answer"], "model": "m"}),
    ("/v1/embeddings", {"input": "hi", "encoding_format": "base64"}),
    ("/health", None),
    # Errors: the same status and JSON body in each route's shape.
    ("/v1/embeddings", {"input": "hi", "dimensions": 0}),
    ("/embed", {"inputs": []}),
    ("/api/v1/embed", {"texts": ["ok", 3]}),
    ("/no/such/route", None),
]


@pytest.mark.parametrize("path,body", SAME_BYTES)
def test_http2_answers_the_same_bytes_as_http1(server, path, body):
    # First over HTTP/1, so both answers below are the cache's (`usage` counts its hits).
    h1(server, path, body)
    status, version, ctype, answer = curl_h2(server, path, body)
    assert version == "2"
    assert (status, ctype, answer) == h1(server, path, body)


def test_metrics_over_http2_have_the_same_series(server):
    def series(text: str) -> set[str]:
        return {line.rsplit(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")}

    h1(server, "/metrics")  # so /metrics itself is counted in both
    status, version, ctype, answer = curl_h2(server, "/metrics")
    h1_status, h1_ctype, h1_answer = h1(server, "/metrics")
    assert (status, version, ctype) == (h1_status, "2", h1_ctype)
    assert series(answer.decode()) == series(h1_answer.decode())


def test_upgrade_h2c_is_answered_over_http1(server):
    """`Upgrade: h2c` (curl --http2 on http://) is not taken: HTTP/1.1 answers."""
    status, version, _, answer = curl_h2(server, "/health", flag="--http2")
    assert (status, version) == (200, "1.1")


def test_a_body_over_max_body_bytes_is_413_over_http2(server):
    body = json.dumps({"inputs": "a" * (3 << 20)}).encode()
    status, version, _, answer = curl_h2(server, "/embed", body)
    assert (status, version) == (413, "2")
    assert (status, answer) == h1(server, "/embed", body)[::2]
    assert b"--max-body-bytes" in answer
    # The connection's refusal leaves the server serving.
    assert curl_h2(server, "/embed", {"inputs": "still fine"})[0] == 200


def test_many_streams_on_one_connection_each_get_their_own_vectors(server):
    """Through httpx's HTTP/2 client (the `h2` package) on one connection:
    curl 7.88 cannot multiplex with prior knowledge (its later transfers fail
    with "Error in the HTTP2 framing layer" before sending a frame)."""

    n = 100
    texts = [f"stream {i} of one HTTP/2 connection asks about topic {i * 7 % 13}" for i in range(n)]

    async def all_at_once():
        # One connection, so every request is a stream of it.
        limits = httpx.Limits(max_connections=1)
        async with httpx.AsyncClient(http1=False, http2=True, limits=limits, timeout=120) as client:
            return await asyncio.gather(*(client.post(server.url + "/embed", json={"inputs": t}) for t in texts))

    answers = asyncio.run(all_at_once())
    assert [(a.status_code, a.http_version) for a in answers] == [(200, "HTTP/2")] * n
    got = [np.array(a.json()[0]) for a in answers]
    singles = np.stack([np.array(json.loads(h1(server, "/embed", {"inputs": t})[2])[0]) for t in texts])
    for i, vector in enumerate(got):
        # Its own: as close as a batch lets it be to its lone answer, and
        # far from every other one.
        np.testing.assert_allclose(vector, singles[i], atol=1e-5, err_msg=f"stream {i}")
        assert np.abs(np.delete(singles, i, axis=0) - vector).max(axis=1).min() > 1e-3
    print(f"\n{n} streams on one HTTP/2 connection, each its own vector")


def test_sigterm_during_an_http2_request_lets_it_finish_and_exits_0(tmp_path):
    server, release = start_held_server(tmp_path, "--no-warmup", "--no-cache", "--drain-timeout-secs", "30")
    before = metrics(server)["mlx_embed_queue_wait_seconds_count"]
    answer = {}
    body = {"inputs": [f"{HOLD} an HTTP/2 request in flight at SIGTERM"]}
    caller = threading.Thread(target=lambda: answer.update(zip("svcb", curl_h2(server, "/embed", body))))
    caller.start()
    asyncio.run(wait_until_model_runs(server, before))
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert caller.is_alive(), "the request was answered before the model let go"
    release.touch()
    caller.join(timeout=30)
    assert (answer["s"], answer["v"]) == (200, "2"), answer
    assert len(json.loads(answer["b"])) == 1
    assert server.proc.wait(timeout=30) == 0, server.log()[-3000:]
    assert "shut down" in server.log()


def test_a_header_list_over_the_head_limit_is_431_and_the_connection_goes_on(server):
    """The HTTP/1 head limit (408 KiB) holds HTTP/2's header list: past it
    the stream gets 431 (from the h2 library, before any of ours sees it:
    no body, unlike HTTP/1's JSON one) and the connection serves on. curl's nghttp2 sends no
    header over 64 KiB, so httpx's HTTP/2 client sends these."""

    with httpx.Client(http1=False, http2=True, limits=httpx.Limits(max_connections=1), timeout=60) as client:
        under = client.get(server.url + "/health", headers={"x-big": "a" * (400 << 10)})
        over = client.get(server.url + "/health", headers={"x-big": "a" * (420 << 10)})
        after = client.get(server.url + "/health")
    assert (under.status_code, under.http_version) == (200, "HTTP/2")
    assert (over.status_code, over.content) == (431, b"")
    assert after.status_code == 200


def test_bodies_refused_unread_leave_the_connection_serving(server):
    """A body refused before it is read (over --max-body-bytes on its
    Content-Length, or of a wrong content type) is read away over HTTP/2 as
    over HTTP/1 (up to 16x the limit), so the client reads its answer: RFC
    9113 8.1 lets a server answer early and reset the stream (NO_ERROR), but
    curl 7.88 then fails the transfer ("Stream error in the HTTP/2 framing
    layer") and httpx's h2 raises, so neither would see the 413. The
    connection's next request is answered."""

    big = json.dumps({"inputs": "a" * (3 << 20)}).encode()
    with httpx.Client(http1=False, http2=True, limits=httpx.Limits(max_connections=1), timeout=60) as client:
        start = time.monotonic()
        too_large = client.post(server.url + "/embed", content=big, headers={"content-type": "application/json"})
        wrong_type = client.post(server.url + "/embed", content=big[: 1 << 20], headers={"content-type": "text/plain"})
        after = client.post(server.url + "/embed", json={"inputs": "the connection serves on"})
        took = time.monotonic() - start
    assert (too_large.status_code, too_large.http_version) == (413, "HTTP/2")
    assert "--max-body-bytes" in too_large.json()["error"]
    assert wrong_type.status_code == 415
    assert (after.status_code, len(after.json())) == (200, 1)
    assert took < 10


def test_a_stream_whose_window_stays_shut_drops_its_connection_at_the_client_timeout(tmp_path):
    """A client that never opens a stream's flow-control window, while it
    answers pings and so keeps its connection alive, cannot hold an answer
    past --client-timeout-secs (over HTTP/1 a client not reading blocks the
    socket's writes, which the same timeout bounds): the connection is
    dropped and the answer counted as dropped."""
    import socket

    server = start_server(tmp_path, "--no-warmup", "--client-timeout-secs", "2")
    host, port = server.url.removeprefix("http://").split(":")
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
    body = json.dumps({"inputs": "an answer never let through"}).encode()
    headers = [
        (":method", "POST"),
        (":scheme", "http"),
        (":authority", f"{host}:{port}"),
        (":path", "/embed"),
        ("content-type", "application/json"),
        ("content-length", str(len(body))),
    ]
    conn.send_headers(1, headers)
    conn.send_data(1, body, end_stream=True)
    events = []
    with socket.create_connection((host, int(port)), timeout=15) as sock:
        sock.sendall(conn.data_to_send())
        start = time.monotonic()
        try:
            while data := sock.recv(65536):
                events += conn.receive_data(data)  # pings are answered by h2 itself
                sock.sendall(conn.data_to_send())
        except ConnectionResetError:
            pass
        closed_after = time.monotonic() - start
    kinds = {type(e) for e in events}
    # The answer's head came (its body waits on the window), then the connection ended.
    assert h2.events.ResponseReceived in kinds and h2.events.DataReceived not in kinds, events
    assert 2 <= closed_after < 8, closed_after
    assert metrics(server)["mlx_embed_http_answers_dropped_total"] == 1
    assert server.stop() == 0


class RawH2:
    """One HTTP/2 connection driven frame by frame (the `h2` package), for
    what no client library sends: a stalled or abusive peer."""

    def __init__(self, server):
        import socket

        self.host, port = server.url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((self.host, int(port)), timeout=15)
        self.authority = f"{self.host}:{port}"
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        self.flush()

    def flush(self):
        self.sock.sendall(self.conn.data_to_send())

    def headers(self, path: str, *, method: str = "POST", end_stream: bool = False, extra=()):
        sid = self.conn.get_next_available_stream_id()
        head = [(":method", method), (":scheme", "http"), (":authority", self.authority), (":path", path)]
        self.conn.send_headers(sid, [*head, *extra], end_stream=end_stream)
        return sid

    def events_until_closed(self, limit: float):
        """Every event until the server closes the connection, each GOAWAY's
        error code (read from the frames as they came: `h2` takes a GOAWAY's
        PING that follows as an error, losing the events), and when it
        closed; `None` for that when `limit` seconds passed first."""
        events, goaways, raw = [], [], b""
        start = time.monotonic()
        self.sock.settimeout(0.2)
        while time.monotonic() - start < limit:
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:
                data = b""
            if not data:
                return events, goaways, time.monotonic() - start
            raw += data
            while len(raw) >= 9 and len(raw) >= 9 + int.from_bytes(raw[:3], "big"):
                size, kind = int.from_bytes(raw[:3], "big"), raw[3]
                if kind == 0x7:
                    goaways.append(int.from_bytes(raw[9 + 4 : 9 + 8], "big"))
                raw = raw[9 + size :]
            try:
                events += self.conn.receive_data(data)
                self.flush()
            except (h2.exceptions.ProtocolError, BrokenPipeError, ConnectionResetError):
                pass
        return events, goaways, None


def test_host_and_api_key_checks_read_authority_over_http2(tmp_path):
    """HTTP/2 has no Host header: its `:authority` is what --allowed-hosts
    checks, as HTTP/1's Host is (httpx sends a `host` header as `:authority`),
    and the API key is asked for as over HTTP/1."""
    server = start_server(tmp_path, "--no-warmup", "--allowed-hosts", "example.com", "--api-key", "k")
    key = {"authorization": "Bearer k"}
    with httpx.Client(http1=False, http2=True, timeout=60) as client:

        def post(host: str, headers=None):
            answer = client.post(
                server.url + "/embed", json={"inputs": "hi"}, headers={"host": host, **(headers or {})}
            )
            assert answer.http_version == "HTTP/2"
            return answer.status_code

        assert post("rebound.attacker.test", key) == 403
        assert post("example.com") == 401
        assert post("example.com:8080", key) == 200
        assert client.get(server.url + "/health", headers={"host": "example.com"}).status_code == 200
        assert client.get(server.url + "/health", headers={"host": "evil.test"}).status_code == 403
    assert server.stop() == 0


def test_a_body_without_length_over_max_body_bytes_is_413_over_http2(tmp_path):
    """An HTTP/2 body need not declare its length (no Content-Length, no
    chunked coding): --max-body-bytes still cuts it at the limit, answered
    413 and the stream reset (as HTTP/1 closes the connection of a chunked
    body cut there), and the connection serves on."""
    server = start_server(tmp_path, "--no-warmup", "--max-body-bytes", "4096")
    peer = RawH2(server)
    sid = peer.headers("/embed", extra=[("content-type", "application/json")])
    peer.conn.send_data(sid, b'{"inputs": "' + b"a" * 8192)
    peer.flush()
    events = []
    peer.sock.settimeout(15)
    while not any(isinstance(e, (h2.events.StreamEnded, h2.events.StreamReset)) for e in events):
        events += peer.conn.receive_data(peer.sock.recv(65536))
        peer.flush()
    heads = [dict(e.headers) for e in events if isinstance(e, h2.events.ResponseReceived)]
    body = b"".join(e.data for e in events if isinstance(e, h2.events.DataReceived))
    assert [h[b":status"] for h in heads] == [b"413"], events
    assert b"--max-body-bytes" in body
    with httpx.Client(http1=False, http2=True, timeout=60) as client:
        assert client.post(server.url + "/embed", json={"inputs": "the server serves on"}).status_code == 200
    assert server.stop() == 0


def test_an_http2_request_whose_body_never_comes_is_408_at_the_client_timeout(tmp_path):
    """HEADERS without END_STREAM and then no DATA: the body's deadline
    (--client-timeout-secs) answers 408, as over HTTP/1, and the idle
    connection is then closed."""
    server = start_server(tmp_path, "--no-warmup", "--client-timeout-secs", "2")
    peer = RawH2(server)
    sid = peer.headers("/embed", extra=[("content-type", "application/json"), ("content-length", "100")])
    peer.flush()
    start = time.monotonic()
    events, _, closed_after = peer.events_until_closed(limit=20)
    assert closed_after is not None, "still open after 20 s"
    statuses = [dict(e.headers).get(b":status") for e in events if isinstance(e, h2.events.ResponseReceived)]
    answered = [e for e in events if isinstance(e, h2.events.StreamEnded) and e.stream_id == sid]
    assert statuses == [b"408"] and answered, events
    assert 2 <= time.monotonic() - start < 10
    assert server.stop() == 0


def test_rapid_reset_leaves_the_server_serving(tmp_path):
    """CVE-2023-44487 ("rapid reset"): streams opened and reset at once, in
    their thousands, on one connection. h2 bounds the streams reset before
    the server took them (20, then GOAWAY ENHANCE_YOUR_CALM); each one taken
    is cancelled with its reset. The server answers others throughout and
    shuts down cleanly."""
    server = start_server(tmp_path, "--no-warmup")
    peer = RawH2(server)
    start = time.monotonic()
    sent = 0
    try:
        for _ in range(50):
            for _ in range(200):
                sid = peer.headers("/embed", extra=[("content-type", "application/json")])
                peer.conn.reset_stream(sid)
                sent += 1
            peer.flush()
    except (BrokenPipeError, ConnectionResetError, h2.exceptions.ProtocolError):
        pass
    flood_s = time.monotonic() - start
    health = requests.get(server.url + "/health", timeout=10)
    answer = requests.post(server.url + "/embed", json={"inputs": "still serving"}, timeout=30)
    assert health.status_code == 200 and answer.status_code == 200
    _, goaways, closed_after = peer.events_until_closed(limit=5)
    print(f"\n{sent} streams opened and reset in {flood_s:.2f} s; GOAWAY codes {goaways}")
    # ENHANCE_YOUR_CALM, and the connection closed: not left to reset more.
    assert goaways == [0xB] and closed_after is not None, goaways
    assert sent < 10_000
    assert server.stop() == 0


def test_sigterm_with_idle_http2_connections_exits_promptly_and_0(tmp_path):
    """Open HTTP/2 connections with no stream in progress (one that was
    answered, one that never asked) are sent a GOAWAY and closed at a
    shutdown: they do not hold the drain to --drain-timeout-secs."""
    server = start_server(tmp_path, "--no-warmup", "--drain-timeout-secs", "30")
    answered, silent = RawH2(server), RawH2(server)
    answered.headers("/health", method="GET", end_stream=True)
    answered.flush()
    answered.sock.settimeout(10)
    got = []
    while not any(isinstance(e, h2.events.StreamEnded) for e in got):
        got += answered.conn.receive_data(answered.sock.recv(65536))
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=20) == 0, server.log()[-3000:]
    assert time.monotonic() - start < 5
    for peer in (answered, silent):
        _, goaways, closed_after = peer.events_until_closed(limit=5)
        assert closed_after is not None
        assert goaways and set(goaways) == {0}, goaways


@pytest.mark.parametrize("window", [0, 1])
def test_a_shut_stream_is_dropped_while_its_connection_reads_other_streams(tmp_path, window):
    """A stream whose window stays shut (or at 1 byte) holds its answer no
    longer than --client-timeout-secs, even while the client keeps its
    connection busy: a /health stream every 0.3 s, each given a window and
    read. Neither the connection's idleness nor its other streams' progress
    may keep the stalled answer in memory."""
    server = start_server(tmp_path, "--no-warmup", "--client-timeout-secs", "2")
    peer = RawH2(server)
    peer.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
    body = json.dumps({"inputs": [f"an answer held back {i}" for i in range(8)]}).encode()
    stuck = peer.headers("/embed", extra=[("content-type", "application/json"), ("content-length", str(len(body)))])
    peer.conn.send_data(stuck, body, end_stream=True)
    peer.flush()
    peer.sock.settimeout(0.1)
    start, healthy, closed_after = time.monotonic(), 0, None
    while time.monotonic() - start < 12:
        try:
            sid = peer.headers("/health", method="GET", end_stream=True)
            peer.conn.increment_flow_control_window(65535, stream_id=sid)
            peer.flush()
        except (BrokenPipeError, ConnectionResetError, h2.exceptions.ProtocolError):
            closed_after = time.monotonic() - start
            break
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            try:
                data = peer.sock.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:
                data = b""
            if not data:
                closed_after = time.monotonic() - start
                break
            try:
                for event in peer.conn.receive_data(data):
                    healthy += isinstance(event, h2.events.StreamEnded) and event.stream_id != stuck
                peer.flush()
            except h2.exceptions.ProtocolError:
                pass
        if closed_after is not None:
            break
    assert closed_after is not None, f"the stalled answer was held 12 s ({healthy} /health answers read)"
    assert healthy >= 3 and 2 <= closed_after < 7, (healthy, closed_after)
    assert metrics(server)["mlx_embed_http_answers_dropped_total"] == 1
    assert server.stop() == 0
