"""scripts/bench_encoder_attention.py runs end to end (the native path's
streaming kernel against the exact path's MLX attention, interleaved
calls), so the figures in docs/benchmarks.md ("An encoder's attention in the
streaming kernel") keep working, and the two paths give the same output."""

import json
import os
import subprocess
import sys

from conftest import ROOT


def test_bench_encoder_attention_small_run(tmp_path):
    out = tmp_path / "attention.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_encoder_attention.py"),
         "--shapes", "modernbert-local,jina-alibi", "--cases", "2x70", "--calls", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT / "python")},
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res) == {"modernbert-local 2x70", "jina-alibi 2x70"}
    for row in res.values():
        assert row["native"] > 0 and row["exact"] > 0
        assert row["max_abs_diff"] <= 1e-5
