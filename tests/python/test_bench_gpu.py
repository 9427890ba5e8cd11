"""scripts/bench_gpu.py runs end to end in its CPU dry mode (tiny shapes, no
torch), so the script is ready for the next GPU machine."""

import json
import os
import subprocess
import sys

from conftest import ROOT


def test_bench_gpu_dry_run(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_gpu.py"), "--dry-run", "--variants",
         "--sweep", "--quantized", "--small-calls", "--graph-ops", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((tmp_path / "results.json").read_text())
    assert out["meta"]["device"].startswith("cpu")
    assert set(out["results"]) == {"tiny-bert", "tiny-qwen3"}
    for name, res in out["results"].items():
        assert res["texts"] == 48 and res["tokens"] > 48 * 3
        for dtype in ("bfloat16", "float32"):
            rates = res[f"engine_{dtype}"]
            assert set(rates) == {"one_call", "calls_of_8", "calls_of_8_overlapped"}
            assert all(v > 0 for v in rates.values()), (name, dtype, rates)
        assert res["latency_ms_fp32"] > 0
        mem = res["memory"]
        assert mem["calls"] == 40
        before, after = mem["before"], mem["after"]
        assert after["cache_bytes"] == 0  # CPU: no cache
        assert after["active_bytes"] <= before["active_bytes"] * 1.1
        assert len(mem["samples"]) == 8 and mem["samples"][-1]["calls"] == 40
        # Every optional section ran (a failure stops a dry run).
        shapes = res["new_shapes"]
        assert set(shapes) == {"shape_buckets=True", "shape_buckets=False"}
        assert all(v > 0 for d in shapes.values() for v in d.values())
        assert set(res["streams_2"]) == {"calls_of_8", "calls_of_8_overlapped"}
        assert res["batch_tokens_1024"]["one_call"] > 0
        graphs = res["graph_ops"]  # each value ran in a child process
        assert set(graphs) == {"ops_per_graph_20", "ops_per_graph_60", "ops_per_graph_200"}
        assert all(set(r) == {"one_call", "calls_of_8", "calls_of_8_overlapped"} and min(r.values()) > 0
                   for r in graphs.values())
        small = res["small_calls"]
        assert set(small) == {"defaults", "threads_2", "threads_4"}
        assert all(v > 0 for d in small.values() for v in d.values())
        # Calls of 8 mixed lengths pad more than one call sorted by length.
        pad = small["defaults"]
        assert 1.0 <= pad["padding_one_call"] < pad["padding_calls_of_8"]
    bert, qwen = out["results"]["tiny-bert"], out["results"]["tiny-qwen3"]
    # The CPU default is the matmul path, so the variant is the fused one.
    for dtype in ("bfloat16", "float32"):
        assert bert[f"attention_fused_{dtype}"]["rates"]["one_call"] > 0
    assert bert["engine_float16"]["one_call"] > 0
    assert {"quantized_bf16", "quantized_8-bit", "quantized_4-bit"} <= set(qwen)
    assert "| tiny-bert |" in r.stdout and "| tiny-qwen3 |" in r.stdout
