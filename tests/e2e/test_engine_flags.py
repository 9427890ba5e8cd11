"""Engine settings given as server flags reach the Python engine and show in /info."""

import concurrent.futures as cf
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from harness import SERVER_BINARY, start_server


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


def test_why_a_request_failed_is_logged(tmp_path):
    """A server error's reason is logged at warn; a refusal's only at debug
    (it may quote what the client sent), never at the default info."""
    import re as _re

    from harness import TEST_SERVER_BINARY

    marker = "@@log-boom@@"
    for level, refusal_logged in (("info", False), ("debug", True)):
        server = start_server(tmp_path, "--no-warmup", "--no-cache", command=[str(TEST_SERVER_BINARY)],
                              env={"MLX_EMBED_LOG": level, "MLX_EMBED_TEST_FAULT": marker})
        try:
            bad = server.post("/v1/embeddings", {"input": [1, "a secret text"]})
            assert bad.status_code == 400, bad.text
            failed = server.post("/embed", {"inputs": [f"fails {marker}"]})
            assert failed.status_code == 500, failed.text
        finally:
            assert server.stop() == 0
        log = _re.sub(r"\x1b\[[0-9;]*m", "", server.log())
        assert _re.search(r"WARN .*route=/embed.*request failed: model error: RuntimeError: injected test fault",
                          log), log[-3000:]
        refused = [line for line in log.splitlines() if "request refused:" in line]
        if refusal_logged:
            assert len(refused) == 1 and "DEBUG" in refused[0] and "route=/v1/embeddings" in refused[0], refused
        else:
            assert refused == [] and "a secret text" not in log


def test_boolean_env_vars_take_the_usual_spellings(tmp_path):
    server = start_server(tmp_path, env={"MLX_EMBED_NO_WARMUP": "1", "MLX_EMBED_NO_BATCHING": "yes",
                                         "MLX_EMBED_NO_CACHE": "on"})
    try:
        info = server.get("/info").json()
        assert (info["batching"]["enabled"], info["batching"]["cache_bytes"]) == (False, 0), info["batching"]
        assert "warm-up skipped" in server.log()
        # The defaults of what a client's connection may take.
        limits = info["limits"]
        assert (limits["client_timeout_secs"], limits["drain_timeout_secs"], limits["max_unsent_answers_mb"]) == (
            75, 30, 1024)
    finally:
        server.stop()


def test_a_log_filter_that_is_not_a_level_is_refused(tmp_path):
    """`--log verbose` would read as a target called "verbose" and silence
    every line; it is refused at once with what to write instead."""
    import subprocess

    from harness import SERVER_BINARY

    for bad in ("verbose", "notalevel====="):
        r = subprocess.run([str(SERVER_BINARY), "--log", bad, "--port", "1"], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2, (bad, r.stdout, r.stderr)
        assert "invalid value" in r.stderr and "target=level" in r.stderr, r.stderr


def test_a_port_in_use_or_an_empty_api_key_fails_before_the_model_loads(tmp_path):
    import socket
    import subprocess

    from harness import SERVER_BINARY

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        for listen_on, env, why in (
            (port, {}, f"cannot listen on 127.0.0.1:{port}: Address already in use"),
            (1, {"MLX_EMBED_API_KEY": " "}, "--api-key must not be empty"),
        ):
            r = subprocess.run([str(SERVER_BINARY), "--host", "127.0.0.1", "--port", str(listen_on)],
                               capture_output=True, text=True, timeout=120,
                               env={**__import__("os").environ, "MLX_EMBED_LOG": "info", **env})
            assert r.returncode == 1, (r.stdout[-2000:], r.stderr[-2000:])
            assert why in r.stderr, r.stderr[-2000:]
            # Refused before any model was loaded.
            assert "python model loaded" not in r.stdout + r.stderr, r.stdout[-2000:]
    finally:
        taken.close()


def _json_events(server) -> list[dict]:
    """The server's log as `--log-format json` wrote it: every line one JSON object."""
    return [json.loads(line) for line in server.log().splitlines() if line.strip()]


def _one_python_warning(events: list[dict], text: str) -> None:
    """Exactly one event holds `text`: a WARN of the Python model code's logger."""
    found = [e for e in events if text in e.get("message", "")]
    assert len(found) == 1, events[-10:]
    assert found[0]["level"] == "WARN" and found[0]["logger"].startswith("mlx_embed"), found


def test_json_logs_are_one_object_per_line_with_the_request_span(tmp_path):
    server = start_server(tmp_path, "--no-warmup", "--log-format", "json")
    try:
        ok = server.post("/embed", {"inputs": ["hello"]}, headers={"x-request-id": "json-log-1"})
        assert ok.status_code == 200
    finally:
        assert server.stop() == 0
    events = _json_events(server)
    done = [e for e in events if e.get("message") == "request done" and e["span"]["route"] == "/embed"]
    assert len(done) == 1, events[-5:]
    assert done[0]["level"] == "INFO" and done[0]["status"] == 200 and done[0]["ms"] > 0, done
    assert done[0]["span"] == {"name": "request", "id": "json-log-1", "method": "POST", "route": "/embed"}, done
    assert any(e.get("message", "").startswith("serving ") for e in events)


def test_the_models_python_warnings_are_events_in_the_servers_log_format(tmp_path):
    """A warning of the Python model code (quantized weights, which are slow on
    this backend) comes out as one of the server's own log events, at its
    level: it was a bare line on stderr, which broke `--log-format json`."""
    server = start_server(tmp_path, "--no-warmup", "--log-format", "json", "--quantize", "4")
    assert server.stop() == 0
    _one_python_warning(_json_events(server), "quantized matmul")


@pytest.mark.parametrize("how", ["binary", "console script"])
def test_a_slow_blas_is_one_warning_event_in_the_servers_log_format(tmp_path, how):
    """The slow-BLAS warning was said at import, before the server routes
    the package's records into its log: a bare line beside the JSON lines
    (and, in text mode, a second copy). It is said when the model loads."""
    command = [str(Path(sys.prefix) / "bin" / "mlx-embed"), "serve"] if how == "console script" else None
    server = start_server(tmp_path, "--no-warmup", "--log-format", "json",
                          env={"MLX_EMBED_BLAS": "/nonexistent/libopenblas.so"}, command=command)
    assert server.stop() == 0
    events = _json_events(server)
    _one_python_warning(events, "slow reference BLAS")
    assert not [e for e in events if "added no packages" in e.get("message", "")], events[:5]


def test_max_input_tokens_cuts_every_input_where_the_model_would(tmp_path):
    """``--max-input-tokens 32``: the model's cut (load's max_length), shown
    in /info and `truncate: false`'s refusal; a long text's vector is the
    library's for the same cut, and a text within it is unchanged."""
    import mlx_embed

    long_text = "a text long enough to be cut well before the model's own limit of tokens " * 4
    short_text = "a short one"
    model = mlx_embed.load(max_length=32)
    reference = model.embed([long_text, short_text])
    server = start_server(tmp_path, "--no-warmup", "--max-input-tokens", "32")
    try:
        info = server.get("/info").json()
        assert info["max_input_length"] == 32, info
        resp = server.post("/embed", {"inputs": [long_text, short_text]})
        assert resp.status_code == 200, resp.text
        got = np.array(resp.json(), dtype=np.float32)
        assert float((got * reference).sum(axis=1).min()) >= 0.99999
        refused = server.post("/embed", {"inputs": long_text, "truncate": False})
        assert refused.status_code == 422, refused.text
        assert "32" in refused.json()["error"], refused.text
    finally:
        server.stop()


def test_max_input_tokens_over_the_positions_is_refused_at_start(tmp_path):
    run = subprocess.run([str(SERVER_BINARY), "--port", "0", "--no-warmup", "--max-input-tokens", "100000"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "VIRTUAL_ENV": sys.prefix})
    assert run.returncode == 1, (run.returncode, run.stdout, run.stderr[-2000:])
    assert "max_length 100000 > the 512 positions" in run.stderr, run.stderr[-2000:]
