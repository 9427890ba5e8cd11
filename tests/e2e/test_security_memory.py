"""Loopback by default, the API key, what the log says (and does not), and
memory that stays flat over 20,000 requests."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import pytest
import requests

import rawhttp
from harness import start_server
from test_overload import HOST, metrics, port_of


def listening_addresses(port: int) -> list[str]:
    """Local addresses of the LISTEN sockets on `port`, from /proc (no traffic sent)."""
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if state == "0A" and int(p, 16) == port:
                found.append(addr if width == 8 else "v6:" + addr)
    return found


def test_listens_on_loopback_only_by_default(tmp_path):
    server = start_server(tmp_path, "--no-warmup", host=None)
    port = port_of(server)
    # 0100007F is 127.0.0.1 in /proc's little-endian hex; a wildcard bind
    # (00000000 or a tcp6 socket) would be reachable from other addresses.
    assert listening_addresses(port) == ["0100007F"]
    assert f"on http://127.0.0.1:{port}" in server.log()
    assert server.stop() == 0


API_KEY = "s3cret-test-key-7f1c"
APP_ORIGIN = "http://app.example"
UNAUTHORIZED = "missing or invalid API key: send `Authorization: Bearer <key>`"
AUTH_ROUTES = [
    # (method, path, body, shape of the 401 body)
    ("POST", "/api/v1/embed", {"texts": ["hi"]}, "native"),
    ("POST", "/v1/embeddings", {"input": "hi"}, "openai"),
    ("POST", "/embed", {"inputs": "hi"}, "tei"),
    ("POST", "/api/embed", {"input": "hi"}, "ollama"),
    ("POST", "/api/embeddings", {"prompt": "hi"}, "ollama"),
    ("POST", "/v1/embed", {"texts": ["hi"]}, "openai"),
    ("POST", "/v2/embed", {"texts": ["hi"]}, "openai"),
    ("POST", "/vectors", {"text": "hi"}, "weaviate"),
    ("GET", "/meta", None, "weaviate"),
    ("GET", "/api/tags", None, "ollama"),
    ("GET", "/api/ps", None, "ollama"),
    ("GET", "/api/version", None, "ollama"),
    ("POST", "/api/show", {"model": "x"}, "ollama"),
    ("GET", "/v1/models", None, "openai"),
    ("GET", "/v1/models/all-MiniLM-L6-v2", None, "openai"),
    ("GET", "/info", None, "native"),
    ("GET", "/metrics", None, "native"),
    ("GET", "/openapi.json", None, "native"),
    ("POST", "/pooling", {"input": "hi"}, "openai"),
    # An embedder serves no classifier: with the key, the route's own 400.
    ("POST", "/classify", {"input": "hi"}, "openai", 400),
    ("GET", "/version", None, "openai"),
    ("POST", "/invocations", {"inputs": "hi"}, "tei"),
    ("POST", "/vertex", {"instances": [{"inputs": "hi"}]}, "tei"),
]
UNAUTHORIZED_BODY = {
    "native": {"error": {"message": UNAUTHORIZED, "type": "authentication_error", "code": 401}},
    "openai": {"error": {"message": UNAUTHORIZED, "type": "authentication_error", "param": None,
                         "code": "invalid_api_key"}, "detail": UNAUTHORIZED},
    "tei": {"error": UNAUTHORIZED, "error_type": "Unauthorized"},
    "ollama": {"error": UNAUTHORIZED},
    "weaviate": {"error": UNAUTHORIZED},
}


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("keyed"), "--no-warmup", "--api-key", API_KEY,
                          "--cors-allow-origin", APP_ORIGIN)
    yield server
    assert server.stop() == 0


@pytest.mark.parametrize("method,path,body,shape,answered",
                         [(*route, 200) if len(route) == 4 else route for route in AUTH_ROUTES])
def test_api_key_protects_every_route(keyed_server, method, path, body, shape, answered):
    url = keyed_server.url + path
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {API_KEY}"},
                    {"authorization": f"Bearer {API_KEY}x"}):
        resp = requests.request(method, url, json=body, headers=headers, timeout=30)
        assert resp.status_code == 401, (headers, resp.text)
        assert resp.headers["www-authenticate"] == "Bearer"
        assert resp.json() == UNAUTHORIZED_BODY[shape]
    ok = requests.request(method, url, json=body, headers={"authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert ok.status_code == answered, ok.text


def test_browser_pages_of_listed_origins_only(keyed_server):
    """--cors-allow-origin: the preflight needs no key (browsers send none),
    and the listed origin can read answers, a 401 included; others cannot."""
    url = keyed_server.url + "/v1/embeddings"
    for origin, allowed in ((APP_ORIGIN, True), ("http://evil.example", False)):
        pre = requests.options(url, headers={"origin": origin, "access-control-request-method": "POST",
                                             "access-control-request-headers": "authorization,content-type"},
                               timeout=30)
        assert pre.status_code == 200
        assert pre.headers.get("access-control-allow-origin") == (origin if allowed else None)
        for headers, status in (({}, 401), ({"authorization": f"Bearer {API_KEY}"}, 200)):
            r = requests.post(url, json={"input": "hi"}, headers={"origin": origin, **headers}, timeout=60)
            assert r.status_code == status
            assert r.headers.get("access-control-allow-origin") == (origin if allowed else None)


def test_health_needs_no_key(keyed_server):
    resp = requests.get(keyed_server.url + "/health", timeout=10)
    assert resp.status_code == 200 and resp.json() == {"status": "ok"}
    for probe in ("/.well-known/live", "/.well-known/ready"):
        assert requests.get(keyed_server.url + probe, timeout=10).status_code == 204, probe


def test_log_has_request_ids_but_no_request_text(keyed_server):
    marker = "zebra-quartz-marker-5521 private words"
    headers = {"authorization": f"Bearer {API_KEY}"}
    given = requests.post(keyed_server.url + "/api/v1/embed", json={"texts": [marker]},
                          headers={**headers, "x-request-id": "client-chosen-id-42"}, timeout=60)
    assert given.status_code == 200 and given.headers["x-request-id"] == "client-chosen-id-42"
    made = requests.post(keyed_server.url + "/v1/embeddings", json={"input": [marker, "other"]},
                         headers=headers, timeout=60)
    assert made.status_code == 200
    made_id = made.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{6}", made_id), made_id
    failed = requests.post(keyed_server.url + "/embed", json={"inputs": [marker, ""]},
                           headers={**headers, "x-request-id": "client-id-of-a-400"}, timeout=60)
    assert failed.status_code == 400

    # The log is written asynchronously to the file; give it a moment.
    deadline = time.monotonic() + 5
    while "client-id-of-a-400" not in keyed_server.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    log = re.sub(r"\x1b\[[0-9;]*m", "", keyed_server.log())  # the log is colored
    lines = {rid: [line for line in log.splitlines() if rid in line]
             for rid in ("client-chosen-id-42", made_id, "client-id-of-a-400")}
    assert all(len(v) == 1 for v in lines.values()), lines
    assert "status=200" in lines["client-chosen-id-42"][0] and "/api/v1/embed" in lines["client-chosen-id-42"][0]
    assert "status=200" in lines[made_id][0] and "/v1/embeddings" in lines[made_id][0]
    assert "status=400" in lines["client-id-of-a-400"][0]
    assert "zebra-quartz" not in log
    assert API_KEY not in log


def test_rss_flat_over_20000_requests(tmp_path):
    server = start_server(tmp_path)
    port = port_of(server)
    workers = 64

    async def run(total: int, offset: int):
        counter = iter(range(total))
        statuses = {}

        async def worker():
            async with rawhttp.Connection(HOST, port) as conn:
                for i in counter:
                    resp = await conn.post("/api/v1/embed", {"texts": [f"memory probe {offset + i}"]})
                    statuses[resp.status] = statuses.get(resp.status, 0) + 1

        started = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(workers))), timeout=240)
        return statuses, time.monotonic() - started

    def rss_kib() -> int:
        status = Path(f"/proc/{server.proc.pid}/status").read_text()
        return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1))

    rss_start = rss_kib()
    warm, warm_s = asyncio.run(run(2_000, 0))
    rss_warm = rss_kib()
    cache_warm = metrics(server)["mlx_embed_cache_bytes"]
    load, load_s = asyncio.run(run(20_000, 2_000))
    rss_after = rss_kib()
    # Every text is distinct, so the embedding cache grows by design (within
    # --cache-mb): its accounted bytes are not a leak.
    cache_growth_kib = (metrics(server)["mlx_embed_cache_bytes"] - cache_warm) / 1024
    growth = (rss_after - cache_growth_kib - rss_warm) / rss_warm
    print(f"\nmemory: RSS start {rss_start / 1024:.1f} MiB, after 2,000-request warm-up {rss_warm / 1024:.1f} MiB "
          f"({warm_s:.1f}s), after 20,000 more {rss_after / 1024:.1f} MiB ({load_s:.1f}s, "
          f"{20_000 / load_s:.0f} req/s at {workers} connections), of which the cache's entries "
          f"{cache_growth_kib / 1024:.1f} MiB: {growth * 100:+.1f}% without them")
    assert warm == {200: 2_000}
    assert load == {200: 20_000}
    assert cache_growth_kib > 0
    assert rss_after - cache_growth_kib <= rss_warm * 1.10
    assert server.healthy()
    assert server.stop() == 0
