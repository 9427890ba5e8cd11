"""scripts/bench_regroup.py runs end to end against the test server with a
simulated fixed-cost device (MLX_EMBED_TEST_PASS_MS), so the regroup figures
in docs/benchmarks.md keep working: with a window, callers that wait for their
answers share bigger model calls; a lone caller does not wait for it."""

import json
import subprocess
import sys

from harness import ROOT


def test_bench_regroup_small_run(tmp_path):
    out = tmp_path / "regroup.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_regroup.py"), "--pass-ms", "20", "--windows", "0,30",
         "--loads", "1x16,1x1", "--texts", "192", "--lone-texts", "12", "--rounds", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    raw = json.loads(out.read_text())["raw"]
    assert set(raw) == {"0", "30"} and all(set(raw[w]) == {"1x16", "1x1"} for w in raw)
    off, on = raw["0"]["1x16"][0], raw["30"]["1x16"][0]
    # Every text reached the model once in each run.
    for run in (off, on):
        assert round(run["model_calls"] * run["inputs_per_call"]) == 192, run
    # Without the window the 16 callers split into groups on the 20 ms
    # device; with it they come back to shared calls.
    assert on["inputs_per_call"] >= 1.5 * off["inputs_per_call"], (off, on)
    # A lone caller is answered after one pass: it never waits out the 30 ms.
    lone = raw["30"]["1x1"][0]
    assert lone["inputs_per_call"] == 1.0 and lone["p50_ms"] < 45, lone
    assert "| 1 x 16 | 30 |" in r.stdout


def test_bench_regroup_with_wrk_as_the_client(tmp_path):
    """``--client wrk``: the same loads from wrk (make setup installs it),
    the bodies over and over for --wrk-seconds; the window still regroups."""
    out = tmp_path / "regroup-wrk.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_regroup.py"), "--pass-ms", "20", "--windows", "0,30",
         "--loads", "1x16", "--texts", "192", "--rounds", "1", "--client", "wrk", "--wrk-seconds", "2",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["client"] == "wrk"
    off, on = got["raw"]["0"]["1x16"][0], got["raw"]["30"]["1x16"][0]
    for run in (off, on):
        # Two seconds of 20 ms passes: dozens of model calls, each answered.
        assert 20 <= run["model_calls"] <= 110, run
        assert run["client_latency_ms"] >= run["server_ms"] > 0, run
    assert on["inputs_per_call"] >= 1.5 * off["inputs_per_call"], (off, on)
    assert "client threads (wrk)" in r.stdout
