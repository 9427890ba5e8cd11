"""Engine settings given as server flags reach the Python engine and show in /info."""

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


def test_old_fast_ops_env_spelling_still_works(tmp_path):
    server = start_server(tmp_path, "--no-warmup", env={"MLX_EMBED_FAST_OPS": "0"})
    try:
        assert server.get("/info").json()["details"]["elementwise_ops"] == "exact"
    finally:
        server.stop()
