"""HTTP/1 request heads the server cannot read (malformed, or past its
limits): answered with the right status and a JSON error that says what was
wrong and which limit, `Connection: close`, then the connection closed.
Raw sockets against the real server over loopback, byte for byte."""

from __future__ import annotations

import json
import re
import socket
import time

import pytest

from harness import start_server

# The server's limits (crates/mlx-embed-server/src/serve.rs).
HEAD_BYTES = 417_792
HEADER_LINES = 100
URI_BYTES = 65_534

TOO_LARGE = (431, "Request Header Fields Too Large",
             "the request's head (its request line and header lines) is over the limit of 417792 bytes "
             "or of 100 header lines")
URI_TOO_LONG = (414, "URI Too Long", "the request's URI is longer than the limit of 65534 bytes")
BAD_METHOD = (400, "Bad Request",
              "malformed HTTP/1 request: the request line does not start with a method (a token: letters, "
              "digits and !#$%&'*+-.^_`|~) and one space; a request line is `METHOD target HTTP/1.1`")
BAD_VERSION = (400, "Bad Request",
               "malformed HTTP/1 request: the request line's version is not HTTP/1.1 or HTTP/1.0 (HTTP/2 is "
               "spoken to a client that opens the connection with its preface, prior knowledge)")
BAD_HEADER = (400, "Bad Request",
              "malformed HTTP/1 request: a header line is not `Name: value` (a name is a token: letters, "
              "digits and !#$%&'*+-.^_`|~, with no space before the colon; a value has no control "
              "characters), or a line does not end in CRLF")
BAD_TARGET = (400, "Bad Request", "malformed HTTP/1 request: the request line's target is not a valid URI")
BAD_LENGTH = (400, "Bad Request",
              "malformed HTTP/1 request: Content-Length is not a decimal number, or two Content-Length "
              "headers differ")
TE_ON_HTTP10 = (400, "Bad Request",
                "malformed HTTP/1 request: an HTTP/1.0 request has no Transfer-Encoding (chunked bodies are "
                "HTTP/1.1's)")


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("heads"), "--no-warmup")
    yield server
    assert server.stop() == 0, server.log()[-3000:]


def port_of(server) -> int:
    return int(server.url.rsplit(":", 1)[1])


def exchange(server, data: bytes) -> bytes:
    """Sends `data` on a new connection and reads until the server closes it."""
    with socket.create_connection(("127.0.0.1", port_of(server)), timeout=30) as s:
        s.sendall(data)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        return got


def responses(raw: bytes) -> list[tuple[str, dict, bytes]]:
    """The responses in `raw`, each whole (its Content-Length): status line,
    headers (lower-case names), body."""
    out = []
    while raw:
        head, sep, rest = raw.partition(b"\r\n\r\n")
        assert sep, f"a response head without its end: {raw[:200]!r}"
        lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            assert name.lower() not in headers, f"{name} twice: {head!r}"
            headers[name.lower()] = value.strip()
        length = int(headers["content-length"])
        assert len(rest) >= length, f"a body cut short: {raw[:300]!r}"
        out.append((lines[0], headers, rest[:length]))
        raw = rest[length:]
    return out


def assert_refusal(response, want) -> None:
    status, reason, message = want
    status_line, headers, body = response
    assert status_line == f"HTTP/1.1 {status} {reason}", (status_line, body)
    assert set(headers) == {"content-type", "content-length", "connection", "date"}, headers
    assert headers["content-type"] == "application/json"
    assert headers["connection"] == "close"
    assert re.fullmatch(r"[A-Z][a-z]{2}, \d\d [A-Z][a-z]{2} \d{4} \d\d:\d\d:\d\d GMT", headers["date"]), headers
    assert int(headers["content-length"]) == len(body)
    assert json.loads(body) == {"error": {"message": message, "type": "invalid_request_error", "code": status}}


def refused(server, data: bytes, want) -> None:
    """`data` alone on a connection: the one answer is the refusal, then EOF."""
    got = responses(exchange(server, data))
    assert len(got) == 1, got
    assert_refusal(got[0], want)


def get(target: str = "/health", version: str = "1.1", extra: bytes = b"") -> bytes:
    return f"GET {target} HTTP/{version}\r\nHost: x\r\n".encode() + extra + b"\r\n"


def padded_to(size: int, version: str = "1.1") -> bytes:
    """A GET /health head of exactly `size` bytes (request line, headers and
    the blank line) that closes its connection, the rest in one header's value."""
    bare = get(version=version, extra=b"Connection: close\r\nX-Pad: \r\n")
    return get(version=version, extra=b"Connection: close\r\nX-Pad: " + b"a" * (size - len(bare)) + b"\r\n")


def answers_health(raw: bytes, version: str = "1.1") -> None:
    (status_line, _, body), = responses(raw)
    assert (status_line, json.loads(body)) == (f"HTTP/{version} 200 OK", {"status": "ok"}), (status_line, body)


def read_one(s: socket.socket, buf: bytearray) -> tuple[str, dict, bytes]:
    """The next whole response on `s` (`buf` keeps what follows it)."""
    while True:
        head, sep, rest = bytes(buf).partition(b"\r\n\r\n")
        if sep:
            length = int(re.search(rb"(?im)^content-length: *(\d+)", head).group(1))
            if len(rest) >= length:
                (response,) = responses(head + sep + rest[:length])
                del buf[: len(head) + len(sep) + length]
                return response
        chunk = s.recv(65536)
        assert chunk, f"EOF inside a response: {bytes(buf)!r}"
        buf += chunk


@pytest.mark.parametrize("version", ["1.1", "1.0"])
def test_a_head_over_the_byte_limit_is_431_at_the_byte(srv, version):
    """A head of exactly the limit is read; one byte more is 431, with
    `Connection: close` on HTTP/1.1 (which would keep the connection) and
    on HTTP/1.0 alike. Before, a head past the limit that arrived quickly
    was read whole and answered 200, and a refused one had no body."""
    at_limit = padded_to(HEAD_BYTES, version)
    assert len(at_limit) == HEAD_BYTES
    answers_health(exchange(srv, at_limit), version)
    refused(srv, padded_to(HEAD_BYTES + 1, version), TOO_LARGE)
    # Far past it, sent whole: the answer still reaches the client, the
    # rest of what it sent read away rather than reset.
    refused(srv, padded_to(4 * HEAD_BYTES, version), TOO_LARGE)


def test_more_header_lines_than_the_limit_is_431(srv):
    lines = lambda n: b"".join(b"X-H%d: v\r\n" % i for i in range(n))  # noqa: E731
    # Host is a header line too.
    answers_health(exchange(srv, get(extra=lines(HEADER_LINES - 2) + b"Connection: close\r\n")))
    refused(srv, get(extra=lines(HEADER_LINES)), TOO_LARGE)


def test_a_uri_over_the_limit_is_414(srv):
    at_limit = "/" + "a" * (URI_BYTES - 1)
    (status_line, headers, body), = responses(exchange(srv, get(at_limit, extra=b"Connection: close\r\n")))
    # Read, routed and not found: a route's own JSON 404.
    assert status_line == "HTTP/1.1 404 Not Found" and json.loads(body)["error"]["code"] == 404, (status_line, body)
    refused(srv, get(at_limit + "a"), URI_TOO_LONG)
    refused(srv, get(at_limit + "a", version="1.0"), URI_TOO_LONG)


@pytest.mark.parametrize("data,want", [
    (b"HELLO\r\n\r\n", BAD_METHOD),
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(32), BAD_METHOD),  # TLS to a plain port
    (b"GET /health HTTP/1.2\r\nHost: x\r\n\r\n", BAD_VERSION),
    (b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n", BAD_VERSION),
    (b"GET /health HTTX/1.1\r\nHost: x\r\n\r\n", BAD_VERSION),
    (b"GET /he\x01alth HTTP/1.1\r\nHost: x\r\n\r\n", BAD_TARGET),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nBad Name: y\r\n\r\n", BAD_HEADER),
    (b"GET /health HTTP/1.0\r\nBad(Name): y\r\n\r\n", BAD_HEADER),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: b\x01c\r\n\r\n", BAD_HEADER),
    (b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabc", BAD_LENGTH),
    (b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Length: 3x\r\n\r\nabc", BAD_LENGTH),
    (b"POST /embed HTTP/1.0\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", TE_ON_HTTP10),
], ids=["garbage-line", "tls-hello", "http-1.2", "http-2.0", "not-http", "control-in-target",
        "space-in-name", "http-1.0-bad-name", "control-in-value", "two-lengths", "bad-length",
        "te-on-http-1.0"])
def test_a_malformed_head_is_400_saying_what_is_wrong(srv, data, want):
    refused(srv, data, want)


def test_on_a_keep_alive_connection_after_answers(srv):
    """Good requests answered on a kept connection, then a malformed head:
    the answers as ever, then the refusal, then EOF. Sent one at a time, and
    pipelined in one write (the bad head then read with the requests before
    it, one of them a POST whose body it follows)."""
    body = json.dumps({"inputs": "a kept connection"}).encode()
    post = (b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    bad = b"GET /health HTTP/1.1\r\nHost: x\r\nBad Name: y\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port_of(srv)), timeout=30) as s:
        buf = bytearray()
        for data in (get(), post):
            s.sendall(data)
            status_line, headers, _ = read_one(s, buf)
            assert status_line == "HTTP/1.1 200 OK" and "connection" not in headers, (status_line, headers)
        s.sendall(bad)
        assert_refusal(read_one(s, buf), BAD_HEADER)
        assert s.recv(1) == b"" and not buf

    http10 = get(version="1.0", extra=b"Connection: keep-alive\r\n")
    for first, answered in ((get() + post, ["HTTP/1.1 200 OK"] * 2), (post + get(), ["HTTP/1.1 200 OK"] * 2),
                            (get() + http10, ["HTTP/1.1 200 OK", "HTTP/1.0 200 OK"])):
        got = responses(exchange(srv, first + padded_to(HEAD_BYTES + 1)))
        assert [r[0] for r in got[:-1]] == answered, got
        assert [r[1].get("connection") for r in got[:-1]] == [None if a.startswith("HTTP/1.1") else "keep-alive"
                                                               for a in answered], got
        assert_refusal(got[-1], TOO_LARGE)


def test_refusals_are_counted_and_the_server_serves_on(srv):
    def counts():
        text = srv.get("/metrics").text
        return {reason: float(re.search(
            r'^mlx_embed_http_unreadable_requests_total\{reason="%s"\} (\S+)$' % reason, text, re.M).group(1))
            for reason in ("malformed", "too_large")}
    before = counts()
    refused(srv, b"HELLO\r\n\r\n", BAD_METHOD)
    refused(srv, get(extra=b"".join(b"X-H%d: v\r\n" % i for i in range(HEADER_LINES))), TOO_LARGE)
    refused(srv, get("/" + "a" * URI_BYTES), URI_TOO_LONG)
    after = counts()
    assert (after["malformed"] - before["malformed"], after["too_large"] - before["too_large"]) == (1, 2)
    assert srv.post("/embed", {"inputs": "still serving"}).status_code == 200


def test_100_continue_on_a_kept_connection_is_written_at_once(srv):
    """`100 Continue` is written while an answer is owed (the request handed
    on), never held back as a refusal would be: on a connection whose
    earlier answers are all written, it reaches the client before the body
    is sent, and the answer follows, twice over."""
    body = json.dumps({"inputs": "x"}).encode()
    with socket.create_connection(("127.0.0.1", port_of(srv)), timeout=10) as s:
        buf = bytearray()
        s.sendall(get())
        status_line, _, answer = read_one(s, buf)
        assert (status_line, json.loads(answer)) == ("HTTP/1.1 200 OK", {"status": "ok"}), (status_line, answer)
        for _ in range(2):
            s.sendall(b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body))
            while b"\r\n\r\n" not in buf:
                chunk = s.recv(65536)
                assert chunk, bytes(buf)
                buf += chunk
            assert bytes(buf) == b"HTTP/1.1 100 Continue\r\n\r\n", bytes(buf)
            buf.clear()
            s.sendall(body)
            status_line, headers, answer = read_one(s, buf)
            assert status_line == "HTTP/1.1 200 OK" and "connection" not in headers, (status_line, headers)
            assert [len(v) for v in json.loads(answer)] == [384], answer[:200]


def test_a_bad_head_pipelined_behind_an_answer_the_client_has_not_read(srv):
    """A request whose answer (/embed_all's token vectors, ~8 MB) is far
    more than the sockets hold, and a malformed head pipelined behind it in
    the same write, from a client with a 4 KiB receive buffer that reads
    nothing for a while: the server waits with the answer half written.
    Then read whole: the 200 answer, then our JSON refusal (not hyper's
    bodyless 400), then EOF."""
    texts = [" ".join(f"word{i}x{j}" for j in range(300)) for i in range(8)]
    body = json.dumps({"inputs": texts}).encode()
    post = (b"POST /embed_all HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    bad = b"GET /health HTTP/1.1\r\nHost: x\r\nBad Name: y\r\n\r\n"
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(60)
        s.connect(("127.0.0.1", port_of(srv)))
        s.sendall(post + bad)
        # Long enough for the model to answer and the server's socket to fill.
        time.sleep(3)
        got = b""
        while chunk := s.recv(1 << 20):
            got += chunk
    answer, refusal = responses(got)
    assert answer[0] == "HTTP/1.1 200 OK" and len(answer[2]) > 6_000_000, (answer[0], len(answer[2]))
    # Cut at the model's 256 tokens.
    assert [len(v) for v in json.loads(answer[2])] == [256] * 8
    assert_refusal(refusal, BAD_HEADER)
