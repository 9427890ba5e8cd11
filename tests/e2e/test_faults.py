"""Model faults, model-thread death and shutdown under load, against the real server."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import time

import numpy as np
import pytest

import rawhttp
from harness import SERVER_BINARY, TEST_SERVER_BINARY, start_server
from test_overload import (HOLD, HOST, metrics, port_of, send_until_all_accepted, start_held_server,
                           wait_for_in_flight, wait_until_model_runs)

BLOCKER = [f"{HOLD} occupies the model"] + [f"occupy {i}" for i in range(7)]


async def occupy_model(server, port: int) -> asyncio.Task:
    """Sends BLOCKER and returns once the model holds it (so later requests queue)."""
    started = metrics(server)["mlx_embed_queue_wait_seconds_count"]
    blocker = asyncio.create_task(rawhttp.request(HOST, port, "/api/v1/embed", {"texts": BLOCKER}))
    await wait_until_model_runs(server, started)
    return blocker


async def release_when_queued(server, release, queued: int):
    """Lets the held model go on once `queued` more inputs wait behind BLOCKER."""
    await wait_for_in_flight(server, len(BLOCKER) + queued)
    release.touch()


@pytest.mark.parametrize("pipeline", ["false", "true"])
def test_model_fault_fails_only_its_own_request(tmp_path, pipeline):
    """Also with the across-batch pipeline forced on (the GPU default): the
    failed batch is the one queued behind the running one."""
    marker = "@@boom@@"
    # No cache: the requests below repeat the texts of the singles, and must reach the model together.
    server, release = start_held_server(tmp_path, "--no-warmup", "--no-cache", "--pipeline", pipeline,
                                        env={"MLX_EMBED_TEST_FAULT": marker})
    port = port_of(server)
    good = [[f"healthy neighbour {i} talks about rivers and {i}"] for i in range(6)]
    good.append(["two texts in one request", "the second one of them"])
    singles = [np.asarray(server.post("/api/v1/embed", {"texts": t}).json()["embeddings"], dtype=np.float32)
               for t in good]
    bad = {"input": ["a fine first text", f"second text carries {marker}"]}

    async def scenario():
        # The model holds BLOCKER, so the next eight requests queue up and go
        # into one batch together.
        blocker = await occupy_model(server, port)
        tasks = [rawhttp.request(HOST, port, "/api/v1/embed", {"texts": t}) for t in good[:3]]
        tasks.append(rawhttp.request(HOST, port, "/v1/embeddings", bad))
        tasks += [rawhttp.request(HOST, port, "/api/v1/embed", {"texts": t}) for t in good[3:]]
        queued = sum(map(len, good)) + len(bad["input"])
        results = await asyncio.wait_for(
            asyncio.gather(*tasks, release_when_queued(server, release, queued)), timeout=120)
        results.pop()
        return (await blocker), results

    blocked, results = asyncio.run(scenario())
    assert blocked.status == 200
    failed = results.pop(3)
    assert failed.status == 500, failed.body
    assert failed.json() == {"error": {
        "message": "model error: RuntimeError: injected test fault on input 1",
        "type": "server_error", "param": None, "code": None},
        "detail": "model error: RuntimeError: injected test fault on input 1"}
    for texts, single, resp in zip(good, singles, results):
        assert resp.status == 200, resp.body
        np.testing.assert_allclose(np.asarray(resp.json()["embeddings"], dtype=np.float32), single, atol=1e-5,
                                   err_msg=str(texts))
    # The eight shared one batch, which failed and was re-run request by request.
    log = re.sub(r"\x1b\[[0-9;]*m", "", server.log())  # the log is colored
    retries = re.findall(r"batch failed; retrying each request alone.*parts=(\d+)", log)
    assert retries == ["8"], retries
    assert server.healthy()
    m = metrics(server)
    assert m['mlx_embed_batcher_requests_total{outcome="model_error"}'] == 1
    assert server.stop() == 0


KILL_MESSAGE = "model thread died: test hook MLX_EMBED_TEST_KILL: killing the model thread"
UNAVAILABLE = {
    "/api/v1/embed": ({"texts": ["after death"]},
                      {"error": {"message": f"model unavailable: {KILL_MESSAGE}", "type": "service_unavailable",
                                 "code": 503}}),
    "/v1/embeddings": ({"input": "after death"},
                       {"error": {"message": f"model unavailable: {KILL_MESSAGE}", "type": "service_unavailable",
                                  "param": None, "code": None}, "detail": f"model unavailable: {KILL_MESSAGE}"}),
    "/embed": ({"inputs": "after death"},
               {"error": f"model unavailable: {KILL_MESSAGE}", "error_type": "Unhealthy"}),
    "/api/embed": ({"input": "after death"}, {"error": f"model unavailable: {KILL_MESSAGE}"}),
}


def test_model_thread_death_is_503_and_nothing_hangs(tmp_path):
    marker = "@@die@@"
    server, release = start_held_server(tmp_path, "--no-warmup", "--drain-timeout-secs", "10",
                                        env={"MLX_EMBED_TEST_KILL": marker})
    port = port_of(server)

    async def scenario():
        blocker = await occupy_model(server, port)
        # The killer and its neighbours queue behind BLOCKER, then it dies.
        first = [rawhttp.request(HOST, port, "/api/v1/embed", {"texts": [f"neighbour {i}"]}) for i in range(4)]
        first.append(rawhttp.request(HOST, port, "/api/v1/embed", {"texts": [f"this one {marker} kills"]}))
        return await asyncio.wait_for(
            asyncio.gather(blocker, *first, release_when_queued(server, release, len(first))), timeout=120)

    blocked, *results, _ = asyncio.run(scenario())
    assert blocked.status == 200
    for resp in results:
        assert resp.status == 503, resp.body
        assert resp.json() == UNAVAILABLE["/api/v1/embed"][1]

    health = server.get("/health", timeout=5)
    assert health.status_code == 503
    assert health.json() == {"status": "unhealthy", "reason": KILL_MESSAGE}
    for path, (body, expected) in UNAVAILABLE.items():
        started = time.monotonic()
        resp = server.post(path, body, timeout=5)
        assert resp.status_code == 503 and resp.json() == expected, (path, resp.text)
        assert time.monotonic() - started < 2
    assert metrics(server)["mlx_embed_healthy"] == 0

    started = time.monotonic()
    assert server.stop(timeout=20) == 0, server.log()[-3000:]
    assert time.monotonic() - started < 10


def test_release_binary_carries_no_test_hooks():
    # The hooks live behind the launcher's `test-hooks` feature: the shipped
    # server and the Python extension do not even contain their names.
    native = sorted((SERVER_BINARY.parents[2] / "python" / "mlx_embed").glob("_native*.so"))
    assert native, "the extension module is missing: run `make build`"
    for binary in (SERVER_BINARY, *native):
        data = binary.read_bytes()
        for hook in (b"MLX_EMBED_TEST_FAULT", b"MLX_EMBED_TEST_KILL"):
            assert hook not in data, f"{binary.name} contains {hook.decode()}"
    assert b"MLX_EMBED_TEST_KILL" in TEST_SERVER_BINARY.read_bytes()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_under_load_drains_then_refuses_and_exits_0(tmp_path, signum):
    """SIGTERM, and SIGHUP alike (a closed terminal: it killed the server
    at once, requests in flight and all)."""
    drain = 30
    server = start_server(tmp_path, "--no-warmup", "--drain-timeout-secs", str(drain))
    port = port_of(server)
    n = 32

    async def scenario():
        tasks, answered = await send_until_all_accepted(server, port, n)
        assert answered < n, "all answered before SIGTERM; make the load heavier"
        signalled = time.monotonic()
        server.proc.send_signal(signum)
        # New connections are refused while the accepted requests are still draining.
        refused_at = None
        while time.monotonic() - signalled < 5:
            try:
                with socket.create_connection((HOST, port), timeout=1):
                    pass
            # A connection caught in the closing listener's backlog is reset instead of refused.
            except (ConnectionRefusedError, ConnectionResetError):
                refused_at = time.monotonic()
                break
            await asyncio.sleep(0.01)
        pending_when_refused = sum(not t.done() for t in tasks)
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=drain + 10)
        return signalled, refused_at, pending_when_refused, results

    signalled, refused_at, pending_when_refused, results = asyncio.run(scenario())
    assert refused_at is not None, "new connections still accepted 5 s after SIGTERM"
    assert pending_when_refused > 0, "the listener closed only after the drain"
    for resp in results:
        assert resp.status == 200, resp.body
        assert len(resp.json()["embeddings"]) == 2
    code = server.proc.wait(timeout=drain + 10)
    exited = time.monotonic() - signalled
    print(f"\nshutdown: {n} accepted requests all 200, refused new connections after "
          f"{refused_at - signalled:.2f}s with {pending_when_refused} still running, exit {code} after {exited:.1f}s")
    assert code == 0
    assert exited < drain
    log = server.log()
    assert f"received {signal.Signals(signum).name}" in log and "shut down" in log
    assert "drain timeout" not in log


def test_drain_timeout_answers_what_still_waits_with_503(tmp_path):
    """A model held past --drain-timeout-secs: the request it holds and those
    queued behind it are answered 503 (shutting down) in their route's shape
    when the timeout runs out, not left on dropped connections, and the
    server exits 0 soon after."""
    drain = 2
    server, release = start_held_server(tmp_path, "--no-warmup", "--no-cache", "--drain-timeout-secs", str(drain))
    port = port_of(server)

    async def scenario():
        blocker = await occupy_model(server, port)
        queued = [rawhttp.request(HOST, port, "/api/v1/embed", {"texts": [f"queued {i}"]}) for i in range(3)]
        queued.append(rawhttp.request(HOST, port, "/v1/embeddings", {"input": "queued openai"}))
        queued.append(rawhttp.request(HOST, port, "/embed", {"inputs": "queued tei"}))
        queued = [asyncio.create_task(q) for q in queued]
        await wait_for_in_flight(server, len(BLOCKER) + len(queued))
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        results = await asyncio.wait_for(asyncio.gather(blocker, *queued), timeout=drain + 20)
        return signalled, time.monotonic(), results

    try:
        signalled, answered, results = asyncio.run(scenario())
        code = server.proc.wait(timeout=20)
    finally:
        release.touch()
    exited = time.monotonic() - signalled
    message = "server is shutting down; retry elsewhere"
    blocked, *native, openai, tei = results
    for resp in (blocked, *native):
        assert resp.status == 503, resp.body
        assert resp.json() == {"error": {"message": message, "type": "service_unavailable", "code": 503}}
    assert openai.status == 503 and openai.json() == {"error": {
        "message": message, "type": "service_unavailable", "param": None, "code": None}, "detail": message}
    assert tei.status == 503 and tei.json() == {"error": message, "error_type": "Unhealthy"}
    # Answered when the timeout ran out, not before and not much after.
    assert drain - 0.2 <= answered - signalled < drain + 1.5, answered - signalled
    assert code == 0 and exited < drain + 5, (code, exited)
    log = re.sub(r"\x1b\[[0-9;]*m", "", server.log())
    assert "drain timeout: connections still open; requests still waiting for a model or a body are answered 503" in log
    assert "connections still open after the drain timeout are dropped" not in log


def test_an_answer_a_slow_client_is_still_reading_is_not_cut_at_shutdown(tmp_path):
    """At shutdown a connection with no request in progress is closed after a
    second, but one whose answer (8 MB here) still waits in the socket for a
    client that reads slowly is kept: the client reads it whole, and the stop
    is a clean one."""
    server = start_server(tmp_path, "--no-warmup", "--no-cache")
    port = port_of(server)
    n = 2048
    body = json.dumps({"texts": [f"slow reader {i}" for i in range(n)]}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((HOST, port))
    sock.sendall(b"POST /api/v1/embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    # Computed and being written (the socket is full, nothing read yet).
    deadline = time.monotonic() + 120
    while metrics(server)['mlx_embed_batcher_requests_total{outcome="ok"}'] < 1:
        assert time.monotonic() < deadline, "the request was never answered"
        time.sleep(0.05)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(2.5)  # past the second a connection with nothing in progress gets
    sock.settimeout(30)
    answer = bytearray()
    while chunk := sock.recv(1 << 20):
        answer += chunk
    sock.close()
    head, _, payload = bytes(answer).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    assert len(json.loads(payload)["embeddings"]) == n
    assert server.proc.wait(timeout=30) == 0, server.log()[-3000:]


def test_a_second_signal_drops_open_connections_and_exits_1(tmp_path):
    """SIGTERM, then SIGTERM again while the model holds a request: the server
    stops waiting at once, drops the held request's connection unanswered, and
    says so in its log and its exit code (1, where a finished drain exits 0)."""
    server, release = start_held_server(tmp_path, "--no-warmup", "--no-cache", "--drain-timeout-secs", "30")
    port = port_of(server)

    async def scenario():
        blocker = await occupy_model(server, port)
        server.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)
        assert not blocker.done(), "the held request cannot be answered before the second signal"
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            await asyncio.wait_for(blocker, timeout=10)
        return signalled

    try:
        signalled = asyncio.run(scenario())
        code = server.proc.wait(timeout=20)
    finally:
        release.touch()
    exited = time.monotonic() - signalled
    assert code == 1 and exited < 5, (code, exited)
    log = re.sub(r"\x1b\[[0-9;]*m", "", server.log())
    assert ("stopped before every open connection was done (second signal: not waiting for open "
            "connections): their requests got no answer") in log
    assert "shut down\n" not in log
    # The held request is the server's doing, not a client that went away.
    assert "request dropped unanswered: the server stopped without waiting for it" in log
    assert "the client went away" not in log
