"""The query thread (--query-threads, 1 on the CPU by default) on the real
server and model: one-text queries are answered, with the model's own
vectors, while a long bulk request holds the model thread; SIGTERM drains
both threads."""

from __future__ import annotations

import threading
import time

import numpy as np

from harness import cosine_rows, start_server
from test_overload import metrics

WORDS = "river museum kernel village history library cluster weather festival science".split()


def bulk_texts(tag: str, n: int) -> list[str]:
    # ~300 words: cut to MiniLM's 256 tokens, so a batch is 32 inputs of 8192 padded tokens.
    return [f"{tag} {i} " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(300)) for i in range(n)]


class Bulk(threading.Thread):
    """One bulk request in its own thread; `status` once answered."""

    def __init__(self, server, texts: list[str]):
        super().__init__(daemon=True)
        self.server, self.texts, self.status = server, texts, None

    def run(self):
        self.status = self.server.post("/api/v1/embed", {"texts": self.texts}, timeout=600).status_code


def wait_running(server, batches_before: float, bulk: Bulk) -> None:
    """Until the bulk request's first batch is on the model (bounded)."""
    deadline = time.monotonic() + 60
    while metrics(server)["mlx_embed_batches_total"] <= batches_before and bulk.is_alive():
        assert time.monotonic() < deadline, "the bulk request never reached the model"
        time.sleep(0.01)
    # Counted when a batch is answered: wait for the queue to show the rest cut and running instead.
    while metrics(server)["mlx_embed_queued_inputs"] > 0 and bulk.is_alive():
        assert time.monotonic() < deadline, "the bulk request's batches never started"
        time.sleep(0.01)


def test_queries_are_answered_while_a_long_bulk_request_runs(tmp_path, golden):
    texts, reference = golden
    server = start_server(tmp_path, "--no-cache")
    info = server.get("/info").json()["batching"]
    assert (info["query_threads"], info["query_threads_running"]) == (1, 1), info
    before = metrics(server)
    # 96 long texts: three batches of 32, seconds of model time on this CPU.
    bulk = Bulk(server, bulk_texts("bulk", 96))
    bulk.start()
    # The first batch is answered once the model has run it; the second one then holds the model thread.
    deadline = time.monotonic() + 120
    while metrics(server)["mlx_embed_batches_total"] < before["mlx_embed_batches_total"] + 1:
        assert time.monotonic() < deadline and bulk.is_alive(), "the bulk request's first batch never ran"
        time.sleep(0.01)
    answered = []
    picks = [i for i, t in enumerate(texts) if t and len(t) < 80][:6]
    for k, i in enumerate(picks):
        if not bulk.is_alive():
            break
        headers = {"X-Priority": "high"} if k % 2 else {}
        resp = server.post("/api/v1/embed", {"texts": [texts[i]]}, headers=headers, timeout=120)
        assert resp.status_code == 200, resp.text
        vec = np.asarray(resp.json()["embeddings"], dtype=np.float32)
        assert cosine_rows(vec, reference[i][None])[0] >= 0.99999, f"query {i} got another text's vector"
        answered.append((i, bulk.is_alive()))
    assert len(answered) >= 3, f"the bulk request finished after {len(answered)} queries"
    # Every query but maybe the last was answered while the bulk request ran.
    assert all(alive for _, alive in answered[:-1]), answered
    bulk.join(timeout=600)
    assert bulk.status == 200
    after = metrics(server)
    ran = after["mlx_embed_query_thread_batches_total"] - before["mlx_embed_query_thread_batches_total"]
    # The query thread ran them (the last may have found the model thread free).
    assert len(answered) - 1 <= ran <= len(answered), (ran, answered)
    # A second bulk request on the model and a query beside it, then SIGTERM:
    # both threads drain, every request is answered, the exit is clean.
    bulk = Bulk(server, bulk_texts("drain", 64))
    bulk.start()
    wait_running(server, after["mlx_embed_batches_total"], bulk)
    query = server.post("/api/v1/embed", {"texts": [texts[picks[0]]]}, headers={"X-Priority": "high"})
    assert query.status_code == 200
    assert server.stop() == 0, server.log()[-3000:]
    bulk.join(timeout=600)
    assert bulk.status == 200


def test_query_threads_zero_runs_none(tmp_path):
    server = start_server(tmp_path, "--no-cache", "--no-warmup", "--query-threads", "0")
    info = server.get("/info").json()["batching"]
    assert (info["query_threads"], info["query_threads_running"]) == (0, 0), info
    assert server.post("/api/v1/embed", {"texts": ["one query"]}).status_code == 200
    assert metrics(server)["mlx_embed_query_thread_batches_total"] == 0
    assert server.stop() == 0
