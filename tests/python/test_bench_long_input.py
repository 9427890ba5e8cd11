"""scripts/bench_long_input.py runs end to end (the jina-embeddings-v2-base
shape, one input in two processes), so the long-input measurement in
docs/benchmarks.md keeps working; with small blocks the blocked process
peaks lower than the one-block one."""

import json
import os
import subprocess
import sys

from conftest import ROOT


def test_bench_long_input_small_run(tmp_path):
    out = tmp_path / "long.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_long_input.py"), "--lengths", "1200", "--rounds", "1",
         "--block-bytes", str(2 << 20), "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["shape"]["num_attention_heads"] == 12
    by = {row["config"]: row for row in res["rows"]}
    assert set(by) == {"blocked", "whole"}
    # The same input in both; its 12 x L x L scores (~70 MB, more than any
    # other buffer of the pass) span many 2 MB blocks. The native softmax
    # works in place, so one block holds one score matrix: the peak in
    # blocks is lower by most of it.
    assert by["blocked"]["tokens"] == by["whole"]["tokens"] > 1000
    scores = 12 * by["whole"]["tokens"] ** 2 * 4
    assert by["whole"]["mlx_peak_bytes"] - by["blocked"]["mlx_peak_bytes"] > scores / 2
    assert "| blocked |" in r.stdout and "| whole |" in r.stdout
