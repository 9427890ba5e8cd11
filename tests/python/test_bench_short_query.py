"""scripts/bench_short_query.py runs end to end (long-lived workers per tree
and path, interleaved rounds, one short text per call), so the figures in
docs/benchmarks.md ("One short query, whole model") keep working; the native
and exact paths give the same vector."""

import json
import os
import subprocess
import sys

from conftest import ROOT


def test_bench_short_query_tiny_run(tmp_path):
    out = tmp_path / "short.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_short_query.py"), "--tiny",
         "--models", "modernbert,jina-v2", "--tokens", "8,16", "--calls", "2", "--rounds", "2",
         "--warmup", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT / "python")},
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res) == {"modernbert 8", "modernbert 16", "jina-v2 8", "jina-v2 16"}
    for case, row in res.items():
        target = int(case.split()[1])
        assert target <= row["tokens"] < target + 4
        assert set(row) == {"tokens", "this/native", "this/exact"}
        for key in ("this/native", "this/exact"):
            assert row[key]["median_ms"] > 0
            assert row[key]["calls"] == 4
            assert row[key]["tokens"] == row["tokens"]
        # Unit vectors: native against exact within float32 rounding.
        assert row["this/native"]["max_abs_diff"] == 0.0
        assert row["this/exact"]["max_abs_diff"] <= 1e-5
