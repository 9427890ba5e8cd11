"""scripts/bench_static.py runs end to end in its dry mode (tiny Model2Vec
shape, the engine alone: no torch, no peer, no server), so the benchmark
behind docs/benchmarks.md's static-embeddings section keeps working."""

import json
import os
import subprocess
import sys

from conftest import ROOT


def test_bench_static_dry_run(tmp_path):
    out = tmp_path / "static.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_static.py"), "--dry-run", "--no-peer", "--no-server",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (run,) = json.loads(out.read_text())["runs"].values()
    meta = run["meta"]["mlx_embed"]
    # The tiny shape: a Model2Vec folder over MiniLM's WordPiece, no specials.
    assert meta["model_type"] == "model2vec" and meta["dim"] == 32 and meta["texts"] == 64
    assert meta["max_length"] == 512 and meta["tokens"] > 64 * 20
    # The static default budget and the transformers CPU default both ran.
    assert meta["device_batch_tokens"] == 8192 and meta["bt256_device_batch_tokens"] == 256
    summary = run["summary"]
    tps = summary["texts_per_s"]
    assert tps["mlx_embed default"] > 0 and tps["mlx_embed bt256"] > 0
    assert summary["latency_ms"]["mlx_embed"] > 0
    assert "parity" not in summary and set(run["meta"]) == {"mlx_embed"}
    prof = run["profiles"]["mlx_embed"]
    assert 0 < prof["seconds"]["tokenize (model.encode)"] < prof["whole_call"] * 2
