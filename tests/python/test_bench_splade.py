"""scripts/bench_splade.py runs end to end in its dry mode (tiny shape, the
engine alone), so the benchmark behind docs/benchmarks.md's SPLADE section
keeps working."""

import json
import os
import subprocess
import sys

from conftest import ROOT


def test_bench_splade_dry_run(tmp_path):
    out = tmp_path / "splade.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_splade.py"), "--dry-run", "--no-peer",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (run,) = json.loads(out.read_text())["runs"].values()
    meta = run["meta"]["mlx_embed"]
    assert meta["dim"] == 30522 and meta["texts"] == 16 and meta["tokens"] > 16 * 3
    summary = run["summary"]
    assert summary["engine_best"] > 0 and summary["latency_ms"]["mlx_embed"] > 0
    # SPLADE-like sparsity on the random checkpoint: some words, never most.
    nnz = summary["nnz_per_text"]
    assert 0 < nnz["min"] <= nnz["median"] <= nnz["max"] < 30522 // 10
