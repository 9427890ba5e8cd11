"""scripts/bench_gpu.py runs end to end in its CPU dry mode (tiny shapes, no
torch), so the script is ready for the next GPU machine."""

import json
import os
import shutil
import subprocess
import sys

from conftest import ROOT


def test_bench_gpu_dry_run(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_gpu.py"), "--dry-run", "--variants",
         "--sweep", "--quantized", "--small-calls", "--graph-ops", "--pass-profile", "--kernel-probe",
         "--joined-ab", "--float16", "--mlx-env", "graphs_off,cudnn_sdpa_off,graphs_off_unbounded", "--packed-ab",
         "--eval-chunk-mb", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((tmp_path / "results.json").read_text())
    assert out["meta"]["device"].startswith("cpu")
    probe = out["meta"]["kernel_probe"]
    assert probe["chain"] == 20 and probe["passes"] == 3
    # One Add alone; then 20 more primitives of each kind (views: Reshapes).
    assert probe["one"]["primitives"] == 1
    assert {k: probe[k]["primitives"] for k in ("views", "adds", "matmuls")} == {
        "views": 21, "adds": 21, "matmuls": 21}
    assert all(probe[k]["total_ms"] > 0 for k in ("one", "views", "adds", "matmuls"))
    # Twenty matmuls cost more than the add alone, on any device.
    assert probe["matmuls"]["us_each"]["total_ms"] > 0
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
        # MLX's CUDA settings, each in a child process beside MLX's defaults
        # (no-ops on the CPU, where the child must still run and report).
        sets = res["mlx_env"]
        assert list(sets) == ["mlx_defaults", "graphs_off", "cudnn_sdpa_off", "graphs_off_unbounded"]
        assert sets["graphs_off"]["env"] == {"MLX_USE_CUDA_GRAPHS": "0"}
        # --eval-chunk-mb reaches each child; the unbounded set overrides it
        # with evaluation points off, as the fifth lease ran graphs off.
        assert sets["graphs_off_unbounded"]["env"] == {"MLX_USE_CUDA_GRAPHS": "0"}
        assert sets["graphs_off_unbounded"]["engine_args"] == ["--eval-chunk-mb", "0"]
        assert {label: row["peak_memory"]["eval_chunk_mb"] for label, row in sets.items()} == {
            "mlx_defaults": 1, "graphs_off": 1, "cudnn_sdpa_off": 1, "graphs_off_unbounded": 0}
        for row in sets.values():
            assert min(row["rates"].values()) > 0 and set(row["rates"]) == {
                "one_call", "calls_of_8", "calls_of_8_overlapped"}
            assert list(row["pass_profile"]["rows"]) == ["1", "8", "32"]
            assert row["pass_profile"]["ms_per_text"] > 0
            assert row["peak_memory"]["peak_mb_one_call"] > 0 and row["peak_memory"]["peak_mb_calls_of_8"] > 0
        small = res["small_calls"]
        assert set(small) == {"defaults", "threads_2", "threads_4", "streams_2", "streams_4"}
        assert set(small["streams_2"]) == {"calls_of_8", "calls_of_8_overlapped"}
        assert all(v > 0 for d in small.values() for v in d.values())
        # Calls of 8 mixed lengths pad more than one call sorted by length.
        pad = small["defaults"]
        assert 1.0 <= pad["padding_one_call"] < pad["padding_calls_of_8"]
        profile = res["pass_profile"]
        assert profile["length"] == 64 and list(profile["rows"]) == ["1", "8", "32"]
        for rows, row in profile["rows"].items():
            phases = ("host_ms", "graph_ms", "submit_ms", "wait_ms")
            assert all(row[k] >= 0 for k in phases) and row["total_ms"] > 0
            assert row["total_ms"] >= max(row[k] for k in phases)
            # One graph per pass shape: the same primitives whatever the rows
            # (a pass of one row may have up to two fewer: MLX leaves out the
            # Broadcast of a pooling mask over a batch of one).
            graph = sum(profile["primitives_by_name"].values())
            assert row["primitives"] == graph if rows != "1" else 0 <= graph - row["primitives"] <= 2
        assert profile["ms_per_text"] > 0 and "Matmul" in str(profile["primitives_by_name"])
    bert, qwen = out["results"]["tiny-bert"], out["results"]["tiny-qwen3"]
    # The CPU default is the matmul path, so the variant is the fused one.
    for dtype in ("bfloat16", "float32"):
        assert bert[f"attention_fused_{dtype}"]["rates"]["one_call"] > 0
    for res in (bert, qwen):
        half = res["engine_float16"]
        assert half["one_call"] > 0 and half["calls_of_8"] > 0 and half["latency_ms"] > 0
        # The tiny shapes' activations stay far inside fp16's range.
        assert half["finite"] and half["vs_float32"]["min_cosine"] >= 0.999
    assert {"quantized_bf16", "quantized_8-bit", "quantized_4-bit"} <= set(qwen)
    # The decoder's joined projections against separate ones: the same
    # vectors (to float32 rounding: on the CPU the separate gate takes the
    # native SiLU kernel, the joined one's slice MLX's), three fewer matrix
    # products a layer (two layers), and the joined pass profiled beside the
    # default's.
    joined = qwen["joined_linears"]
    assert joined["groups"] == 4 and joined["max_abs_diff"] <= 1e-5
    assert joined["matmuls"]["separate"] - joined["matmuls"]["joined"] == 6
    assert list(joined["rows"]) == ["1", "8", "32"]
    assert all(r["joined_ms"] > 0 and r["separate_ms"] > 0 for r in joined["rows"].values())
    assert (sum(qwen["pass_profile"]["primitives_by_name"].values())
            > sum(qwen["pass_profile_joined"]["primitives_by_name"].values()))
    assert "joined_linears" not in bert
    # Packed rows against padded passes (an encoder's layers, a decoder's
    # feed-forward): both paths' rates and the same vectors.
    for res in (bert, qwen):
        packed = res["packed_rows"]
        assert set(packed["padded"]) == set(packed["packed"]) == set(packed["speedup"]) == {
            "one_call", "calls_of_8", "calls_of_8_overlapped", "calls_of_64", "calls_of_64_overlapped"}
        assert min(packed["packed"].values()) > 0 and packed["vectors"]["min_cosine"] >= 0.99999
        assert all(v > 0 for side in packed["new_shapes"].values() for v in side.values())
    assert "| tiny-bert |" in r.stdout and "| tiny-qwen3 |" in r.stdout
    assert "MLX settings, tiny-qwen3" in r.stdout and "| graphs_off | " in r.stdout
    # No torch in the dry run: no peer or parity columns, and no "nan" cells.
    assert "torch half" not in r.stdout and "parity min cos" not in r.stdout
    assert " nan " not in r.stdout


def test_bench_gpu_refuses_an_unknown_server_flag_set():
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_gpu.py"), "--dry-run", "--server",
         "--server-flags", "defaults,nope"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT / "python")},
    )
    assert r.returncode == 2
    assert "unknown --server-flags nope; known: defaults, streams_2" in r.stderr


def test_bench_gpu_server_that_does_not_start_fails_the_run(tmp_path):
    """A --server flag set whose server does not start is recorded and the
    other sets still run, but the exit status says so."""
    driver = (
        "import sys; sys.path.insert(0, sys.argv[1]); import bench_gpu\n"
        "def fail(*a, **k): raise RuntimeError('the server exited with 1 before /health answered')\n"
        "bench_gpu.start_server = fail\n"
        "sys.exit(bench_gpu.main(['--dry-run', '--no-core', '--server', '--shapes', 'tiny-bert',\n"
        "                         '--server-flags', 'defaults', '--out', sys.argv[2]]))\n")
    r = subprocess.run(
        [sys.executable, "-c", driver, str(ROOT / "scripts"), str(tmp_path)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT / "python")},
    )
    assert r.returncode == 1, r.stderr[-3000:]
    assert "error: --server tiny-bert defaults: the server exited with 1" in r.stderr
    server = json.loads((tmp_path / "results.json").read_text())["results"]["tiny-bert"]["server"]
    assert "before /health" in server["defaults"]["error"]


def test_gpu_architectures_refuses_an_unknown_model_name():
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_architectures.py"), "--dry-run", "--only", "tiny-mpnet,tiny-mpnt"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT / "python")},
    )
    assert r.returncode == 2
    assert "unknown model name(s) tiny-mpnt (known" in r.stderr and "tiny-bert-reranker" in r.stderr


def test_bench_gpu_refuses_an_unknown_mlx_setting():
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_gpu.py"), "--dry-run", "--mlx-env", "graphs_off,mlx_defaults"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT / "python")},
    )
    assert r.returncode == 2
    assert "unknown --mlx-env mlx_defaults; known: graphs_off, cudnn_sdpa_off" in r.stderr


def test_gpu_architectures_dry_run(tmp_path):
    """scripts/gpu_architectures.py, which runs every fixture on the next GPU
    against that machine's CPU, checks here every architecture with the GPU's
    settings forced (pipelined passes, shape buckets, MLX's own element-wise
    ops, fused attention, attention in query blocks, packed rows, a pass
    evaluated after every layer) against the CPU path."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_architectures.py"), "--dry-run", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=900, env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    rows = json.loads((tmp_path / "architectures.json").read_text())["rows"]
    fixtures = sorted(p.name for p in (ROOT / "tests" / "fixtures").glob("tiny-*") if (p / "README.md").is_file())
    models = ["all-MiniLM-L6-v2", *fixtures]
    assert len(fixtures) >= 29
    assert sorted(rows) == sorted(f"{m}:{run}" for m in models for run in ("float32", "float32_blocked",
                                                                           "float32_packed", "float32_points"))
    kinds = {}
    for key, row in rows.items():
        assert row["ok"] and row["device"].startswith("cpu"), (key, row)
        kinds[key.split(":")[0]] = row["kind"]
        if row["kind"] == "embedding":
            assert row["min_cosine"] >= 0.9999, (key, row)
        else:
            assert row["max_abs_diff"] <= 1e-3 * (1 + row["max_abs_score"]), (key, row)
    assert (kinds["tiny-qwen3-reranker"], kinds["tiny-bert-classifier"], kinds["tiny-splade"]) == (
        "reranker", "classifier", "embedding")
    # Four runs a model (no bfloat16 on the CPU), matched as the whole count line:
    # a check that "93" (then three runs) was absent once failed on the run's
    # seconds in the header ('seconds': 19.893...).
    assert f"\n{4 * len(models)} of {4 * len(models)} rows pass\n" in r.stdout


def test_bench_gpu_server_dry_run(tmp_path):
    """``--server`` starts the real server (``python -m mlx_embed serve``)
    under each flag set, drives it with scripts/http_load.py, and checks its
    answers against the engine's vectors: all of it on the CPU here."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_gpu.py"), "--dry-run", "--no-core", "--server",
         "--shapes", "tiny-bert", "--workdir", str(tmp_path / "work"), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    assert shutil.which("wrk"), "make setup installs wrk"
    server = json.loads((tmp_path / "results.json").read_text())["results"]["tiny-bert"]["server"]
    assert server["dtype"] == "float32" and server["engine_one_call"] > 0
    # The dry run's server is on the CPU, whose default window is 0.
    configs = (("defaults", 0), ("regroup_off", 0), ("regroup_2", 2))
    assert set(server) == {"dtype", "engine_one_call"} | {c[0] for c in configs}
    for label, regroup_ms in configs:
        row = server[label]
        assert row["exit_code"] == 0, label
        assert row["device"].startswith("cpu"), row["device"]
        assert row["model_threads"] == 1
        assert row["batching"]["regroup_window_ms"] == regroup_ms
        for key, requests in (("texts_1_per_request_c64", 48), ("texts_32_per_request_c4", 2)):
            load = row[key]
            # Every text once, each request answered 200, answers equal to the engine's.
            assert load["requests"] == requests and load["answered"] == requests, load
            assert load["statuses"] == {"200": requests} and load["errors"] == 0
            assert load["min_cosine_vs_engine"] >= 0.99999
            assert load["texts_per_s"] > 0 and load["vs_engine_one_call"] > 0
            # Every text reached the model, in at least one call and at most one per request.
            assert 1 <= load["model_calls"] <= requests, load
            assert round(load["inputs_per_call"] * load["model_calls"]) == 48, load
            # Where a round went: the server's time on a request lies inside the
            # client's latency, and holds the time queued for a model call.
            b = load["round_ms"]
            assert b["round"] >= b["client_latency"] >= b["server"] > b["queued"] >= 0, b
            assert b["model_call"] > 0 and b["gil_wait"] >= 0, b
            # The same load with wrk as the client (make setup installs it):
            # the bodies over and over for a second, every answer 200.
            w = load["wrk"]
            assert w["answered"] >= 1 and w["statuses"] == {"under_400": w["answered"]}, w
            assert 0.9 <= w["seconds"] <= 3.0, w
            assert w["texts_per_s"] > 0 and w["vs_engine_one_call"] > 0
            assert w["model_calls"] >= 1 and w["inputs_per_call"] >= 1, w
            # Not client >= server as above: wrk stops at its deadline with a
            # request on every connection, which the server still times (its
            # /metrics totals hold them) while wrk's latencies do not; on a
            # loaded machine those last waits tipped the means (118 vs 131 ms).
            assert w["round_ms"]["client_latency"] > 0 and w["round_ms"]["server"] > 0, w
    # The lease's output shows the table even if results.json does not come back.
    assert "server, tiny-bert (float32;" in r.stdout and "| regroup_2 | " in r.stdout
    assert "| regroup_2 | texts_1_per_request_c64 | " in r.stdout
    assert "| regroup_2, wrk | texts_1_per_request_c64 | " in r.stdout
