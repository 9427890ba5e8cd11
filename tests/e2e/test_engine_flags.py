"""Engine settings given as server flags reach the Python engine and show in /info."""

import concurrent.futures as cf
import re
import sys
import time

import numpy as np
from harness import start_server


def test_engine_flags_reach_the_engine(tmp_path, golden):
    server = start_server(
        tmp_path, "--no-warmup", "--fast-ops", "exact", "--cache-limit-mb", "16",
        "--workers", "1", "--device-batch-tokens", "512",
    )
    try:
        details = server.get("/info").json()["details"]
        assert details["elementwise_ops"] == "exact"
        assert details["cache_limit_mb"] == "16"
        assert details["workers"] == "1"
        assert details["device_batch_tokens"] == "512"
        texts, reference = golden
        resp = server.post("/api/v1/embed", {"texts": texts[:3]})
        assert resp.status_code == 200, resp.text
        got = np.array(resp.json()["embeddings"], dtype=np.float32)
        assert np.abs(got - reference[:3]).max() <= 1e-5
    finally:
        server.stop()


def test_packed_rows_flag_reaches_the_engine(tmp_path, golden):
    """``--packed-rows true``: the BERT family's layers on each pass's real
    tokens alone; answers equal the references for texts of mixed lengths
    sent together (one pass, mostly padding)."""
    server = start_server(
        tmp_path, "--no-warmup", "--no-cache", "--fast-ops", "exact", "--workers", "1",
        "--device-batch-tokens", "8192", "--packed-rows", "true",
    )
    try:
        details = server.get("/info").json()["details"]
        assert details["packed_rows"] == "true"
        texts, reference = golden
        keep = [i for i, t in enumerate(texts) if t]  # this route refuses an empty text
        assert len(keep) >= 16
        resp = server.post("/api/v1/embed", {"texts": [texts[i] for i in keep]})
        assert resp.status_code == 200, resp.text
        got = np.array(resp.json()["embeddings"], dtype=np.float32)
        assert got.shape == reference[keep].shape
        assert float((got * reference[keep]).sum(axis=1).min()) >= 0.99999
    finally:
        server.stop()


def test_old_fast_ops_env_spelling_still_works(tmp_path):
    server = start_server(tmp_path, "--no-warmup", env={"MLX_EMBED_FAST_OPS": "0"})
    try:
        assert server.get("/info").json()["details"]["elementwise_ops"] == "exact"
    finally:
        server.stop()


# The server as `python -m mlx_embed serve` runs it, with MLX's device taken
# for a GPU: the launcher asks the engine where it computes before loading.
AS_IF_ON_A_GPU = (
    "import sys; import mlx_embed.device as d; d.is_cpu = lambda: False; "
    "from mlx_embed.cli import main; sys.exit(main(['serve', *sys.argv[1:]]))"
)


def test_batch_caps_default_by_device(tmp_path, golden):
    """On a GPU the collector's caps default to 256 inputs and 32768 tokens
    (64 and 8192 on the CPU, test_rerank's /info check) and the regroup window
    to 4 ms (0 on the CPU); a flag given wins."""
    texts, reference = golden
    keep = [i for i, t in enumerate(texts) if t][:6]
    for flags, want, regroup in (([], (256, 32768), 4),
                                 (["--max-batch-size", "48", "--regroup-window-ms", "0"], (48, 32768), 0)):
        server = start_server(tmp_path, "--no-warmup", *flags, command=[sys.executable, "-c", AS_IF_ON_A_GPU])
        try:
            info = server.get("/info").json()
            assert (info["batching"]["max_batch_size"], info["batching"]["max_batch_tokens"]) == want
            assert info["batching"]["regroup_window_ms"] == regroup
            assert (info["max_batch_requests"], info["max_batch_tokens"]) == want
            assert info["details"]["pipeline"] == "true"
            resp = server.post("/api/v1/embed", {"texts": [texts[i] for i in keep]})
            assert resp.status_code == 200, resp.text
            got = np.array(resp.json()["embeddings"], dtype=np.float32)
            assert np.abs(got - reference[keep]).max() <= 1e-5
        finally:
            server.stop()


def _batches(server) -> int:
    return int(re.findall(r"^mlx_embed_batches_total (\d+)$", server.get("/metrics").text, re.M)[0])


def test_regroup_window_keeps_returning_callers_in_one_batch(tmp_path, golden):
    """`--regroup-window-ms`: after a batch of two texts is answered, one text
    that comes back waits for the second instead of running alone; it waits
    only until the second comes, and a caller that comes straight back with
    as many texts as were answered never waits."""
    texts, reference = golden
    keep = [i for i, t in enumerate(texts) if t][:6]
    server = start_server(tmp_path, "--no-warmup", "--no-cache", "--regroup-window-ms", "5000")
    try:
        assert server.get("/info").json()["batching"]["regroup_window_ms"] == 5000

        def embed(rows):
            resp = server.post("/api/v1/embed", {"texts": [texts[i] for i in rows]})
            assert resp.status_code == 200, resp.text
            got = np.array(resp.json()["embeddings"], dtype=np.float32)
            assert np.abs(got - reference[rows]).max() <= 1e-5
            return time.monotonic()

        embed(keep[:2])
        before = _batches(server)
        started = time.monotonic()
        with cf.ThreadPoolExecutor(2) as pool:
            first = pool.submit(embed, keep[2:3])
            time.sleep(0.5)
            second = pool.submit(embed, keep[3:4])
            ended = first.result(), second.result()
        assert _batches(server) - before == 1, "the two came back to one batch"
        assert 0.4 <= min(ended) - started < 4.0, ended
        # Two answered, two back at once, ten times over: no wait for the window.
        started = time.monotonic()
        for k in range(10):
            embed(keep[k % 5: k % 5 + 2])
        assert time.monotonic() - started < 4.0
    finally:
        server.stop()


def test_eval_chunk_mb_flag_reaches_the_engine(tmp_path, golden):
    """``--eval-chunk-mb 1``: a pass evaluated after every layer (MiniLM's
    layers output more than 1 MB for 20 texts); the answers equal the
    references. Its env fallback, and 0 leaving the pass whole, as on this CPU."""
    server = start_server(
        tmp_path, "--no-warmup", "--no-cache", "--fast-ops", "exact", "--workers", "1",
        "--device-batch-tokens", "8192", "--pipeline", "true", "--eval-chunk-mb", "1",
    )
    try:
        details = server.get("/info").json()["details"]
        assert details["eval_chunk_mb"] == "1"
        texts, reference = golden
        keep = [i for i, t in enumerate(texts) if t]
        resp = server.post("/api/v1/embed", {"texts": [texts[i] for i in keep]})
        assert resp.status_code == 200, resp.text
        got = np.array(resp.json()["embeddings"], dtype=np.float32)
        assert float((got * reference[keep]).sum(axis=1).min()) >= 0.99999
    finally:
        server.stop()
    server = start_server(tmp_path, "--no-warmup", env={"MLX_EMBED_EVAL_CHUNK_MB": "3"})
    try:
        assert server.get("/info").json()["details"]["eval_chunk_mb"] == "3"
    finally:
        server.stop()
    server = start_server(tmp_path, "--no-warmup")
    try:
        assert "eval_chunk_mb" not in server.get("/info").json()["details"]
    finally:
        server.stop()


def test_metrics_count_clients_work_not_the_warm_up(tmp_path, golden):
    """The server's warm-up call (on by default) runs a maximum-length input
    through the model before /health answers; /metrics then starts from
    zero, so a client's first request counts as the first request and batch."""
    server = start_server(tmp_path)
    try:
        text = server.get("/metrics").text

        def count(name: str) -> int:
            return int(float(re.findall(rf"^{re.escape(name)} (\S+)$", text, re.M)[0]))

        assert count('mlx_embed_batcher_requests_total{outcome="ok"}') == 0
        assert count("mlx_embed_batches_total") == 0
        texts, reference = golden
        resp = server.post("/api/v1/embed", {"texts": texts[:2]})
        assert resp.status_code == 200, resp.text
        text = server.get("/metrics").text
        assert count('mlx_embed_batcher_requests_total{outcome="ok"}') == 1
        assert count("mlx_embed_batches_total") == 1
    finally:
        server.stop()
