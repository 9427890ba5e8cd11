"""scripts/bench_long_input.py runs end to end (the jina-embeddings-v2-base
shape and a Qwen3-0.6B-shaped decoder, one input in two processes each), so
the long-input measurements in docs/benchmarks.md keep working; with small
blocks the blocked process peaks lower than the one-block one."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT


@pytest.mark.parametrize("model, heads", [("jina-v2-base", 12), ("qwen3-0.6b", 16)])
def test_bench_long_input_small_run(tmp_path, model, heads):
    out = tmp_path / "long.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_long_input.py"), "--model", model, "--lengths", "1200",
         "--rounds", "1", "--layers", "2", "--block-bytes", str(2 << 20), "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["model"] == model and res["shape"]["num_attention_heads"] == heads
    by = {row["config"]: row for row in res["rows"]}
    assert set(by) == {"blocked", "whole"}
    # The same input in both; its heads x L x L scores (~50-70 MB, more than
    # any other buffer of the pass) span many 2 MB blocks, each gone before
    # the next: the peak in blocks is lower by most of one score matrix.
    assert by["blocked"]["tokens"] == by["whole"]["tokens"] > 1000
    scores = heads * by["whole"]["tokens"] ** 2 * 4
    assert by["whole"]["mlx_peak_bytes"] - by["blocked"]["mlx_peak_bytes"] > scores / 2
    assert "| blocked |" in r.stdout and "| whole |" in r.stdout
