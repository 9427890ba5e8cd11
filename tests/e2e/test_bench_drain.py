"""scripts/bench_drain.py runs end to end against the real server, so the
drain figures in docs/benchmarks.md keep working: calls in flight at SIGTERM
are answered within a drain long enough for them, and the server exits 0."""

import json
import subprocess
import sys

from harness import ROOT, SERVER_BINARY, free_port


def test_bench_drain_small_run(tmp_path):
    out = tmp_path / "drain.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_drain.py"), "--binary", str(SERVER_BINARY),
         "--calls", "6", "--texts", "4", "--words", "20", "--signal-after", "0.3",
         "--drain-timeout-secs", "30", "--runs", "1", "--port", str(free_port()),
         "--log-dir", str(tmp_path), "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (result,) = json.loads(out.read_text())["results"].values()
    (run,) = result["runs"]
    assert (run["answered"], run["refused_503"], run["other"], run["exit_code"]) == (6, 0, {}, 0), run
    assert f"{SERVER_BINARY}: 6 of 6 answered, 0 refused 503 (median of 1)" in r.stdout, r.stdout
