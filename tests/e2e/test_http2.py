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

import httpx
import numpy as np
import pytest
import requests

from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import DataReceived, ResponseReceived
from h2.settings import SettingCodes
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


def h2(server, path: str, body=None, *, flag: str = "--http2-prior-knowledge", timeout: float = 60):
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
    status, version, ctype, answer = h2(server, path, body)
    assert version == "2"
    assert (status, ctype, answer) == h1(server, path, body)


def test_metrics_over_http2_have_the_same_series(server):
    def series(text: str) -> set[str]:
        return {line.rsplit(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")}

    h1(server, "/metrics")  # so /metrics itself is counted in both
    status, version, ctype, answer = h2(server, "/metrics")
    h1_status, h1_ctype, h1_answer = h1(server, "/metrics")
    assert (status, version, ctype) == (h1_status, "2", h1_ctype)
    assert series(answer.decode()) == series(h1_answer.decode())


def test_upgrade_h2c_is_answered_over_http1(server):
    """`Upgrade: h2c` (curl --http2 on http://) is not taken: HTTP/1.1 answers."""
    status, version, _, answer = h2(server, "/health", flag="--http2")
    assert (status, version) == (200, "1.1")


def test_a_body_over_max_body_bytes_is_413_over_http2(server):
    body = json.dumps({"inputs": "a" * (3 << 20)}).encode()
    status, version, _, answer = h2(server, "/embed", body)
    assert (status, version) == (413, "2")
    assert (status, answer) == h1(server, "/embed", body)[::2]
    assert b"--max-body-bytes" in answer
    # The connection's refusal leaves the server serving.
    assert h2(server, "/embed", {"inputs": "still fine"})[0] == 200


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
    caller = threading.Thread(target=lambda: answer.update(zip("svcb", h2(server, "/embed", body))))
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
    the stream gets 431 (from the h2 library: no body, as hyper's HTTP/1
    431 has none) and the connection serves on. curl's nghttp2 sends no
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
    conn = H2Connection(H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: 0})
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
    assert ResponseReceived in kinds and DataReceived not in kinds, events
    assert 2 <= closed_after < 8, closed_after
    assert metrics(server)["mlx_embed_http_answers_dropped_total"] == 1
    assert server.stop() == 0
