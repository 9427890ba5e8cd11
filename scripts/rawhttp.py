"""A minimal asyncio HTTP/1.1 client for the load tests and ``http_load.py``.

Plain streams instead of an HTTP library: thousands of concurrent connections
from one Python process on a 2-core machine need the cheapest client there is,
the tests must control exactly when a socket opens and closes, and the GPU
relay's machine has nothing beyond the standard library.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)


def encode_request(host: str, port: int, path: str, body, *, method: str = "POST",
                   keep_alive: bool = False, headers: dict[str, str] | None = None) -> bytes:
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    lines = [
        f"{method} {path} HTTP/1.1",
        f"Host: {host}:{port}",
        "Content-Type: application/json",
        f"Content-Length: {len(payload)}",
        f"Connection: {'keep-alive' if keep_alive else 'close'}",
    ]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


async def read_response(reader: asyncio.StreamReader) -> Response:
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    status = int(status_line.split(" ", 2)[1])
    headers = {}
    for line in header_lines:
        if line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        chunks = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            chunks.append(await reader.readexactly(size + 2))
            if size == 0:
                break
        body = b"".join(c[:-2] for c in chunks)
    else:
        body = await reader.read()
    return Response(status, headers, body)


async def request(host: str, port: int, path: str, body, *, method: str = "POST",
                  headers: dict[str, str] | None = None) -> Response:
    """One request on its own connection (Connection: close)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(encode_request(host, port, path, body, method=method, headers=headers))
        await writer.drain()
        return await read_response(reader)
    finally:
        writer.close()


class Connection:
    """One keep-alive connection for a sequence of requests."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader = self.writer = None

    async def __aenter__(self):
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def __aexit__(self, *exc):
        self.writer.close()

    async def post(self, path: str, body, headers: dict[str, str] | None = None) -> Response:
        self.writer.write(encode_request(self.host, self.port, path, body, keep_alive=True, headers=headers))
        await self.writer.drain()
        return await read_response(self.reader)
