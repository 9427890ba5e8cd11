"""scripts/bench_decoder.py runs end to end (two trees, interleaved rounds,
the vectors compared), so the decoder measurements in docs/benchmarks.md
keep working. Here both trees are this one, on the tiny decoder fixtures:
the same vectors, a timing for every case, round and tree."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT


@pytest.mark.parametrize("fixture", ["tiny-qwen3", "tiny-gemma3"])
def test_bench_decoder_small_run(tmp_path, fixture):
    out = tmp_path / "decoder.json"
    tree = ROOT / "python"
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_decoder.py"), "--tree", f"a={tree}", "--tree", f"b={tree}",
         "--folder", str(ROOT / "tests" / "fixtures" / fixture), "--cases", "2x8,1x40", "--calls", "1",
         "--rounds", "2", "--workdir", str(tmp_path / "work"), "--json", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["model"] == fixture and res["rounds"] == 2
    for name in ("a", "b"):
        assert len(res["runs_ms"][name]) == 2
        assert all(set(run) == {"2x8", "1x40"} for run in res["runs_ms"][name])
        assert all(ms > 0 for ms in res["medians_ms"][name].values())
    diff = res["vs_a"]["b"]
    assert set(diff) == {"2x8", "1x40"}
    assert all(d["min_cosine"] >= 0.99999 and d["max_abs_diff"] <= 1e-6 for d in diff.values())
    assert "b vs a: min cosine" in r.stdout


def test_bench_decoder_attention_alone(tmp_path):
    """``--attention``: MLX's, the native kernel's and the engine's (Qwen3's
    causal attention as the engine wraps it) for each case."""
    out = tmp_path / "attention.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_decoder.py"), "--attention", "--shape", "qwen3-0.6b",
         "--cases", "1x8,1x256", "--json", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT / "python")},
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())["attention"]
    assert set(res) == {"1x8", "1x256"}
    assert all(row["mlx_ms"] > 0 and row["native_ms"] > 0 and row["engine_ms"] > 0 for row in res.values())
