"""A client that asks for a large answer and never reads it, on the real
server binary: once the answer could not be written for
``--client-timeout-secs``, the connection is dropped with the answer it held,
and the server goes on; a client that reads with pauses shorter than that
gets its answer whole."""

from __future__ import annotations

import json
import re
import socket
import time

import pytest

from harness import start_server
from test_overload import HOST, metrics, port_of

CLIENT_TIMEOUT_S = 3
# all-MiniLM-L6-v2 keeps 256 tokens of each; /embed_all answers 384 floats
# for every one of them: about 9 MB in all, far more than the sockets' buffers.
INPUTS = 8
LONG_TEXT = "words that each make a token of their own " * 60
OK = 'mlx_embed_batcher_requests_total{outcome="ok"}'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("write-timeout"), "--no-warmup", "--no-cache",
                       "--client-timeout-secs", str(CLIENT_TIMEOUT_S), env={"MLX_EMBED_LOG": "debug"})
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def ask_for_a_large_answer(server) -> socket.socket:
    """A connection with a 4 KiB receive buffer, its request sent and answered
    (the answer waiting to be written), nothing read yet."""
    before = metrics(server).get(OK, 0)
    body = json.dumps({"inputs": [f"{i} {LONG_TEXT}" for i in range(INPUTS)]}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((HOST, port_of(server)))
    sock.sendall(b"POST /embed_all HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    deadline = time.monotonic() + 120
    while metrics(server).get(OK, 0) <= before:
        assert time.monotonic() < deadline, "the request was never answered"
        time.sleep(0.05)
    return sock


def split_answer(data: bytes) -> tuple[bytes, int, bytes]:
    """Head, Content-Length, and what of the body came."""
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:300]
    length = int(re.search(rb"(?im)^content-length: *(\d+)", head).group(1))
    return head, length, body


def test_an_answer_never_read_drops_its_connection_at_the_client_timeout(server):
    sock = ask_for_a_large_answer(server)
    answered = time.monotonic()
    # Nothing read until well past the timeout: then what the sockets' buffers
    # took before the server stalled comes, and the end of the connection.
    time.sleep(CLIENT_TIMEOUT_S + 3)
    sock.settimeout(10)
    data = bytearray()
    try:
        while chunk := sock.recv(1 << 20):
            data += chunk
    except TimeoutError:
        pytest.fail(f"the connection was kept ({len(data)} bytes read)")
    except ConnectionResetError:
        pass
    finally:
        sock.close()
    _, length, body = split_answer(bytes(data))
    assert len(body) < length, "the whole answer came: the server never stalled"
    assert time.monotonic() - answered < CLIENT_TIMEOUT_S + 5 + 10
    log = re.sub(r"\x1b\[[0-9;]*m", "", server.log())
    assert (f"dropping a connection: its answer could not be written for {CLIENT_TIMEOUT_S} s, "
            "the client not reading it (--client-timeout-secs)") in log
    assert server.healthy()


def test_a_client_that_reads_with_short_pauses_gets_its_whole_answer(server):
    sock = ask_for_a_large_answer(server)
    sock.settimeout(10)
    data = bytearray()
    expected = None
    paused = 0.0
    try:
        # A third of the timeout without reading (slack for a loaded CI
        # machine), then 2 MB, again and again: the server waits on this
        # client longer than the timeout in all, never that long at once.
        while expected is None or len(data) < expected:
            time.sleep(CLIENT_TIMEOUT_S / 3)
            paused += CLIENT_TIMEOUT_S / 3
            burst = len(data) + (2 << 20)
            while len(data) < min(burst, expected or burst):
                chunk = sock.recv(1 << 20)
                assert chunk, f"the connection was dropped after {len(data)} bytes"
                data += chunk
                if expected is None and b"\r\n\r\n" in data:
                    head, length, _ = split_answer(bytes(data))
                    expected = len(head) + 4 + length
    finally:
        sock.close()
    assert paused > CLIENT_TIMEOUT_S
    _, _, body = split_answer(bytes(data))
    rows = json.loads(body)
    assert len(rows) == INPUTS
    assert all(len(r) == 256 and len(r[0]) == 384 for r in rows)
