"""Overload and clients that leave: 429 for the surplus with nothing mixed up,
and abandoned requests never computed."""

from __future__ import annotations

import asyncio
import resource
import time

import numpy as np
import pytest

import rawhttp
from harness import TEST_SERVER_BINARY, start_server

HOST = "127.0.0.1"
# A batch holding a text with this marker holds the test server's model thread
# until the test creates the release file (MLX_EMBED_TEST_HOLD): requests can
# then queue and leave behind a busy model however fast or loaded the machine is.
HOLD = "@@hold@@"


def metrics(server) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (histogram buckets included)."""
    out = {}
    for line in server.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


async def wait_until_model_runs(server, started_before: float, timeout: float = 30):
    """Waits until the model has started one more batch than `started_before`
    (the queue-wait histogram counts each request whose first batch started), so
    requests sent from now on cannot join that batch."""
    deadline = time.monotonic() + timeout
    while metrics(server)["mlx_embed_queue_wait_seconds_count"] <= started_before:
        assert time.monotonic() < deadline, "the model never started the batch"
        await asyncio.sleep(0.01)


def start_held_server(tmp_path, *args: str, env: dict | None = None):
    """The test-hooks server, whose model holds any batch with a HOLD text
    until the returned release file exists."""
    release = tmp_path / "release-the-model"
    hooks = {"MLX_EMBED_TEST_HOLD": HOLD, "MLX_EMBED_TEST_RELEASE": str(release), **(env or {})}
    return start_server(tmp_path, *args, env=hooks, command=[str(TEST_SERVER_BINARY)]), release


async def wait_for_in_flight(server, inputs: int, timeout: float = 30):
    """Waits until exactly `inputs` inputs are admitted and not yet answered."""
    deadline = time.monotonic() + timeout
    while (now := metrics(server)["mlx_embed_in_flight_inputs"]) != inputs:
        assert time.monotonic() < deadline, f"{now:.0f} inputs in flight, waited for {inputs}"
        await asyncio.sleep(0.02)


async def send_until_all_accepted(server, port: int, n: int, timeout: float = 30):
    """Sends n native requests of two ~40-word texts each (work a 2-core CPU
    is still computing a moment later) and returns their tasks once each is
    answered or has its inputs in flight, with how many were answered by then."""
    texts = [[f"request {i} part {k}: " + " ".join(f"load{i}w{j}" for j in range(40)) for k in range(2)]
             for i in range(n)]
    ok_before = metrics(server)['mlx_embed_batcher_requests_total{outcome="ok"}']
    tasks = [asyncio.create_task(rawhttp.request(HOST, port, "/api/v1/embed", {"texts": t})) for t in texts]
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        answered = m['mlx_embed_batcher_requests_total{outcome="ok"}'] - ok_before
        if answered * 2 + m["mlx_embed_in_flight_inputs"] >= 2 * n:
            return tasks, answered
        assert time.monotonic() < deadline, "requests never all accepted"
        await asyncio.sleep(0.02)


def port_of(server) -> int:
    return int(server.url.rsplit(":", 1)[1])


def raise_fd_limit(needed: int):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        if hard < needed:
            pytest.fail(f"need {needed} file descriptors, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


@pytest.fixture
def fd_room():
    # 2,000 client sockets here and as many in the server (which inherits the limit).
    raise_fd_limit(8192)


def test_2000_concurrent_requests_surplus_gets_429(tmp_path, fd_room):
    server = start_server(tmp_path, "--max-concurrent-requests", "64", "--max-queue-wait-ms", "200",
                          "--max-waiting", "256", "--no-warmup")
    port = port_of(server)
    n = 2000
    texts = [f"overload caller {i} asks about subject {i % 37} and detail {i * 7919 % 1000}" for i in range(n)]
    sample = list(range(0, n, 50))  # 40 texts checked against their own single-request vectors
    singles = {}
    for i in sample:
        resp = server.post("/api/v1/embed", {"texts": [texts[i]]})
        assert resp.status_code == 200
        singles[i] = np.asarray(resp.json()["embeddings"][0], dtype=np.float32)
    before = metrics(server)

    async def one(i):
        return await asyncio.wait_for(
            rawhttp.request(HOST, port, "/api/v1/embed", {"texts": [texts[i]]}), timeout=90)

    async def health_poller(stop: asyncio.Event, seen: list):
        # (sent at, status) for each poll. The storm can be over in under a
        # second on the event loop it shares with 2,000 clients, so polling
        # goes on until it is over *and* 3 polls are in.
        while not stop.is_set() or len(seen) < 3:
            sent = time.monotonic()
            resp = await asyncio.wait_for(rawhttp.request(HOST, port, "/health", b"", method="GET"), timeout=30)
            seen.append((sent, resp.status))
            await asyncio.sleep(0.05)

    async def storm():
        stop, health = asyncio.Event(), []
        poller = asyncio.create_task(health_poller(stop, health))
        started = time.monotonic()
        results = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
        ended = time.monotonic()
        stop.set()
        await poller
        return results, health, started, ended

    results, health, started, ended = asyncio.run(storm())
    elapsed = ended - started
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, f"{len(errors)} requests failed at the transport level: {errors[:3]!r}"
    ok = [i for i, r in enumerate(results) if r.status == 200]
    refused = [i for i, r in enumerate(results) if r.status == 429]
    print(f"\noverload: {n} concurrent -> {len(ok)} x 200, {len(refused)} x 429 in {elapsed:.1f}s; "
          f"health polls {len(health)} all 200: {set(s for _, s in health) == {200}}")
    assert len(ok) + len(refused) == n, sorted({r.status for r in results})
    assert len(ok) >= 64 and len(refused) > 0

    for i in refused:
        r = results[i]
        assert int(r.headers["retry-after"]) >= 1
        # Past --max-waiting, or past --max-queue-wait-ms (200 ms here): the message says which.
        assert r.json() in [{"error": {"message": f"server is overloaded: {why}; retry later",
                                       "type": "rate_limit_error", "code": 429}}
                            for why in ("too many inputs waiting (--max-waiting)",
                                        "waited longer than the queue allows (--max-queue-wait-ms)")]
    vectors = {}
    for i in ok:
        body = results[i].json()
        assert len(body["embeddings"]) == 1 and body["dimension"] == 384
        vectors[i] = np.asarray(body["embeddings"][0], dtype=np.float32)
        if i in singles:
            np.testing.assert_allclose(vectors[i], singles[i], atol=1e-5, err_msg=f"request {i}")
    # Every caller got a vector for its own (distinct) text: no two answers alike.
    assert len({tuple(np.round(v, 5)) for v in vectors.values()}) == len(ok)
    # Answers that were not sampled are checked after the storm, a few of them.
    for i in ok[:: max(1, len(ok) // 20)]:
        again = server.post("/api/v1/embed", {"texts": [texts[i]]}).json()["embeddings"][0]
        np.testing.assert_allclose(vectors[i], again, atol=1e-5, err_msg=f"request {i}")

    # /health answers 200 throughout, including while the storm is queued.
    assert len(health) >= 3 and {status for _, status in health} == {200}, health
    assert any(sent < ended for sent, _ in health), (health, started, ended)
    after = metrics(server)
    ok_key, over_key = ('mlx_embed_batcher_requests_total{outcome="ok"}',
                        'mlx_embed_batcher_requests_total{outcome="overloaded"}')
    assert after[over_key] - before[over_key] == len(refused)
    # The re-checks above are ok requests too.
    assert after[ok_key] - before[ok_key] == len(ok) + len(ok[:: max(1, len(ok) // 20)])
    assert after["mlx_embed_in_flight_inputs"] == 0 and after["mlx_embed_waiting_inputs"] == 0
    assert server.healthy()
    assert server.stop() == 0


def test_clients_that_leave_while_queued_are_not_computed(tmp_path, fd_room):
    # Room for every request, so all 500 are admitted and queued behind the held model.
    server, release = start_held_server(tmp_path, "--max-concurrent-requests", "1024", "--no-warmup")
    port = port_of(server)
    n = 500
    blocker_texts = [f"{HOLD} the blocker holds the model"] + [f"blocker text {i}" for i in range(29)]
    blockers = len(blocker_texts)
    before = metrics(server)

    async def scenario():
        blocker = asyncio.create_task(rawhttp.request(HOST, port, "/api/v1/embed", {"texts": blocker_texts}))
        await wait_until_model_runs(server, before["mlx_embed_queue_wait_seconds_count"])
        async def abandoned(i: int):
            reader, writer = await asyncio.open_connection(HOST, port)
            writer.write(rawhttp.encode_request(HOST, port, "/api/v1/embed",
                                                {"texts": [f"abandoned request number {i}"]}))
            await writer.drain()
            return reader, writer

        writers = await asyncio.gather(*(abandoned(i) for i in range(n)))
        # All 500 admitted and queued behind the blocker's inputs.
        await wait_for_in_flight(server, blockers + n)
        for _, w in writers:
            w.close()
        await asyncio.gather(*(w.wait_closed() for _, w in writers), return_exceptions=True)
        # The server has let go of every abandoned request before the model
        # moves on: out of the queue, counted cancelled, and each logged and
        # counted as a 499 (client closed request) on its route.
        await wait_for_in_flight(server, blockers)
        m = metrics(server)
        assert m["mlx_embed_queued_inputs"] == 0
        assert m['mlx_embed_lane_queued_inputs{priority="normal"}'] == 0
        assert (m['mlx_embed_batcher_requests_total{outcome="cancelled"}']
                - before['mlx_embed_batcher_requests_total{outcome="cancelled"}']) == n
        assert m['mlx_embed_http_requests_total{route="/api/v1/embed",code="499"}'] == n
        # And each once as TEI's dropped request.
        dropped = 'te_request_failure{err="dropped"}'
        assert m.get(dropped, 0) - before.get(dropped, 0) == n
        assert not blocker.done()
        release.touch()
        return await asyncio.wait_for(blocker, timeout=120)

    blocked = asyncio.run(scenario())
    assert blocked.status == 200 and len(blocked.json()["embeddings"]) == blockers

    deadline = time.monotonic() + 30
    while (m := metrics(server))["mlx_embed_in_flight_inputs"] != 0:
        assert time.monotonic() < deadline, "abandoned inputs never released"
        time.sleep(0.05)
    cancelled = m["mlx_embed_inputs_cancelled_total"] - before["mlx_embed_inputs_cancelled_total"]
    computed = m["mlx_embed_batch_size_sum"] - before["mlx_embed_batch_size_sum"]
    print(f"\nclient gone: {n} abandoned -> cancelled before compute {cancelled:.0f}, "
          f"texts computed {computed:.0f} ({blockers} of them the blocker's)")
    assert cancelled == n
    assert computed == blockers
    assert (m['mlx_embed_batcher_requests_total{outcome="cancelled"}']
            - before['mlx_embed_batcher_requests_total{outcome="cancelled"}']) == n

    assert server.healthy()
    resp = server.post("/api/v1/embed", {"texts": ["still serving after 500 callers left"]})
    assert resp.status_code == 200 and len(resp.json()["embeddings"][0]) == 384
    assert server.stop() == 0
