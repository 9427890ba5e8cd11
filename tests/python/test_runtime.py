"""BLAS selection, offline loading, threads and the CLI."""

import json
import os
import subprocess
import sys
import threading
import time

import mlx_embed
import numpy as np
import pytest
from conftest import ROOT

PY_ENV = {**os.environ, "PYTHONPATH": str(ROOT / "python")}


def _run_py(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env={**PY_ENV, **env},
    )


def _blas_info_in_subprocess(**env) -> dict:
    r = _run_py("import json, mlx_embed; print(json.dumps(mlx_embed.blas_info()))", **env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def reference_gflops() -> float:
    info = _blas_info_in_subprocess(MLX_EMBED_BLAS="none")
    assert info["library"] == "reference"
    print(f"\nreference: {info['gflops']:.1f} GFLOP/s")
    return info["gflops"]


# The speed checks compare with the reference BLAS measured in the same run
# rather than a fixed figure: the machine may be busy (the optimized BLAS
# measured 90-200 GFLOP/s quiet, ~22 while a build ran; the reference 3-6).
def test_blas_info_reports_openblas_far_above_reference(reference_gflops):
    info = mlx_embed.blas_info()
    print(f"\nblas: {info['library']} {info['gflops']:.1f} GFLOP/s")
    # `make test` installs OpenBLAS (libopenblas0-pthread): its absence is a failure, not a skip.
    assert "openblas" in info["library"].lower(), info
    assert info["gflops"] > 2 * reference_gflops


def test_blas_env_path_is_used():
    info = mlx_embed.blas_info()
    if info["library"] == "reference":
        pytest.skip("no optimized BLAS on this machine")
    lib = info["library"].split(" -> ")[0]
    r = _run_py(
        "import json, mlx_embed; print(json.dumps(mlx_embed.blas_info()))",
        MLX_EMBED_BLAS=lib,
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["source"] == "env" and got["library"] == lib and got["effective"]


def test_default_model_loads_offline_without_network():
    # Any socket use fails; HF_HUB_OFFLINE as the issue requires.
    code = (
        "import socket\n"
        "def _no(*a, **k): raise OSError('network access attempted')\n"
        "socket.socket.connect = _no\n"
        "socket.create_connection = _no\n"
        "import mlx_embed\n"
        "m = mlx_embed.load()\n"
        "print(m.embed(['offline works']).shape)\n"
    )
    r = _run_py(code, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    assert r.returncode == 0, r.stderr
    assert "(1, 384)" in r.stdout


def test_load_and_embed_on_a_non_main_thread(golden_texts, golden_mean):
    out = {}

    def work():
        try:
            m = mlx_embed.load()
            out["vec"] = m.embed(golden_texts[:5])
            out["ids"] = m.embed_ids([[101, 7592, 102]])
        except BaseException as e:
            out["err"] = e

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert "err" not in out, out.get("err")
    assert np.abs(out["vec"] - golden_mean[:5]).max() <= 1e-5
    assert len(out["ids"].vectors) == 384 * 4


def test_cli_embed_jsonl_and_npy(tmp_path, minilm):
    from mlx_embed.cli import main

    src = tmp_path / "in.jsonl"
    # Blank lines at the end shift no index, so they are let through.
    src.write_text('{"text": "hello world"}\n{"text": ""}\n{"text": "third"}\n\n \n')
    out_npy = tmp_path / "out.npy"
    assert main(["embed", "-i", str(src), "-o", str(out_npy), "--progress", "never"]) == 0
    arr = np.load(out_npy)
    assert arr.shape == (3, 384)
    assert np.abs(arr - minilm.embed(["hello world", "", "third"])).max() <= 1e-6

    lines = tmp_path / "in.txt"
    lines.write_text("one\ntwo\n")
    out_jsonl = tmp_path / "out.jsonl"
    assert main(["embed", "-i", str(lines), "-o", str(out_jsonl), "--chunk", "1",
                 "--progress", "always"]) == 0
    recs = [json.loads(x) for x in out_jsonl.read_text().splitlines()]
    assert [r["index"] for r in recs] == [0, 1]
    assert len(recs[0]["embedding"]) == 384 and recs[0]["tokens"] == 3


def test_cli_embed_refuses_a_blank_jsonl_line_naming_it(tmp_path):
    """A blank line was skipped, so every later text's output index was off
    its line by one; it is refused like the other bad lines, by its number."""
    from mlx_embed.cli import main

    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "one"}\n{"text": "two"}\n  \n\n{"text": "five"}\n')
    out = tmp_path / "out.npy"
    with pytest.raises(SystemExit) as exit_:
        main(["embed", "-i", str(src), "-o", str(out), "--progress", "never"])
    assert exit_.value.code == f"{src}:3: blank line (each line must hold a JSON object: the output's index goes by the lines)"
    assert not out.exists()
    src.write_text('{"text": "one"}\n{"text": 2}\n')
    with pytest.raises(SystemExit, match=rf"{src}:2: expected an object with a string 'text'"):
        main(["embed", "-i", str(src), "--progress", "never"])


def test_cli_args_and_module_entry(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "mlx_embed", "embed", "hi there", "-o", str(tmp_path / "o.npy")],
        capture_output=True, text=True, timeout=120, env=PY_ENV,
    )
    assert r.returncode == 0, r.stderr
    assert np.load(tmp_path / "o.npy").shape == (1, 384)


@pytest.mark.parametrize("args", [
    ["embed", "x", "--chunk", "-5"],
    ["embed", "x", "--chunk", "0"],
    ["embed", "x", "--chunk", "2.5"],
    ["bulk", "in.jsonl", "-o", "out", "--batch-size", "0"],
    ["bulk", "in.jsonl", "-o", "out", "--concurrency", "-1"],
    ["bulk", "in.jsonl", "-o", "out", "--rows-per-file", "0"],
    ["bulk", "in.jsonl", "-o", "out", "--cpus-per-actor", "0"],
])
def test_cli_refuses_counts_below_one_naming_the_flag(args, capsys):
    """A negative --chunk once embedded nothing and wrote uninitialized
    memory as the vectors, with exit code 0."""
    from mlx_embed.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    assert f"argument {args[-2]}:" in capsys.readouterr().err


def test_cli_answers_unreadable_and_unwritable_files_with_a_message(tmp_path):
    """A folder given as the input or the output file was a Python
    traceback (IsADirectoryError); now a one-line error and exit 1."""
    folder_named_jsonl = tmp_path / "out.jsonl"
    folder_named_jsonl.mkdir()
    for args in (["embed", "-i", str(tmp_path), "x"], ["embed", "-o", str(folder_named_jsonl), "x"]):
        r = subprocess.run([sys.executable, "-m", "mlx_embed", *args, "--progress", "never"],
                           capture_output=True, text=True, timeout=120, env=PY_ENV)
        assert r.returncode == 1, r.stderr
        assert r.stderr.startswith("mlx-embed: error: ") and "Traceback" not in r.stderr, r.stderr
        assert "Is a directory" in r.stderr


def test_cli_refuses_an_output_name_it_would_not_write_in_that_format(tmp_path, capsys, minilm):
    """`-o vectors.csv` once got JSONL, and `-o vectors.NPY` too."""
    from mlx_embed.cli import main

    for name in ("out.csv", "out.npz", "out"):
        assert main(["embed", "x", "-o", str(tmp_path / name), "--progress", "never"]) == 2
        assert "-o must name a .jsonl or .npy file" in capsys.readouterr().err
        assert not (tmp_path / name).exists()
    assert main(["embed", "x", "-o", str(tmp_path / "OUT.NPY"), "--progress", "never"]) == 0
    assert np.abs(np.load(tmp_path / "OUT.NPY") - minilm.embed(["x"])).max() <= 1e-6


def test_cli_names_its_own_flag_for_a_text_too_long(tmp_path, capsys):
    from mlx_embed.cli import main

    src = tmp_path / "in.txt"
    src.write_text("short\n" + "word " * 400 + "\n")
    args = ["embed", "-i", str(src), "--no-truncate", "--chunk", "1", "--progress", "never"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "text 1 has 402 tokens, more than the model's 256 (drop --no-truncate to cut it)" in err, err


def test_cli_stops_quietly_when_its_reader_goes_away(tmp_path):
    """`mlx-embed embed ... | head -c 10`: the closed pipe ends the command
    without a BrokenPipeError traceback."""
    r = subprocess.run(
        f"{sys.executable} -m mlx_embed embed a b c d e f g h --progress never | head -c 10",
        shell=True, capture_output=True, text=True, timeout=120, env=PY_ENV,
    )
    assert len(r.stdout) == 10
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr


def test_cli_serve_passes_arguments_through(monkeypatch):
    import types

    from mlx_embed import cli

    seen = {}
    fake = types.ModuleType("mlx_embed._native")
    fake.serve = lambda argv: seen.setdefault("argv", argv) and 7
    monkeypatch.setitem(sys.modules, "mlx_embed._native", fake)
    monkeypatch.setattr(mlx_embed, "_native", fake, raising=False)
    # cmd_serve ends the process with os._exit (skips finalization after the
    # server drained); record the code instead.
    exits = []
    monkeypatch.setattr(cli.os, "_exit", lambda code: exits.append(code))
    cli.main(["serve", "--port", "8080", "--help", "-x"])
    assert seen["argv"] == ["mlx-embed", "--port", "8080", "--help", "-x"]
    assert exits == [7]


def test_scipy_openblas32_shim(tmp_path, reference_gflops):
    """The pip-only route: forwarding shim compiled into a cache dir."""
    import scipy_openblas32  # noqa: F401  (the `test` extra installs it: fail, never skip)

    info = _blas_info_in_subprocess(MLX_EMBED_BLAS="scipy-openblas32", XDG_CACHE_HOME=str(tmp_path))
    assert info["source"] == "scipy-openblas32", info
    assert info["gflops"] > 2 * reference_gflops, info
    assert list((tmp_path / "mlx_embed").glob("cblas-shim-*.so"))


@pytest.mark.parametrize("name", ["all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"])
def test_the_default_models_name_loads_the_bundled_model(name, golden_texts, golden_mean, tmp_path, monkeypatch):
    """``--model all-MiniLM-L6-v2`` (the flag's documented default, named)
    serves the bundled model under the name it was asked by, so a server of
    several models can name it; a folder of that name here still wins."""
    monkeypatch.chdir(tmp_path)
    model = mlx_embed.load(name)
    assert model.name == name
    got = model.embed(golden_texts[:4])
    assert float((got * golden_mean[:4]).sum(axis=1).min()) >= 0.99999
    (tmp_path / "all-MiniLM-L6-v2").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        mlx_embed.load("all-MiniLM-L6-v2")


DROPPED_MODELS = r"""
import gc, json, os, threading, weakref
import mlx_embed
texts = [f"text number {i} about something" for i in range(40)]
dead, threads, rss = [], [], []
for i in range(4):
    m = mlx_embed.load(workers=2)
    m.embed(texts)  # two workers: the worker pool's path
    held = [weakref.ref(m), weakref.ref(m.scheduler), weakref.ref(m.model)]
    del m
    gc.collect()
    dead.append([r() is None for r in held])
    threads.append((threading.active_count(), len(os.listdir("/proc/self/task"))))
    rss.append(int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
print(json.dumps({"dead": dead, "threads": threads, "rss": rss}))
"""


def test_a_dropped_model_lets_go_of_its_weights_and_threads():
    """A program that loads model after model (a vector database swapping
    models) must not grow: the worker threads are the process's, made once,
    and none keeps a dropped model's closure (it held ~130 MB of MiniLM a
    load, and one more thread each)."""
    out = subprocess.run([sys.executable, "-c", DROPPED_MODELS], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["dead"] == [[True, True, True]] * 4
    # From the second load on, no new thread (the first may start MLX's own).
    assert len(set(map(tuple, got["threads"][1:]))) == 1
    assert got["rss"][-1] - got["rss"][1] < 40 << 20


def test_a_model_loaded_after_the_workers_ran_keeps_every_blas_thread():
    """The CPU workers set OpenBLAS to one thread for their passes; a model
    loaded afterwards must still run a lone pass on all of them (it read 1
    and kept it: one core for every single-pass call)."""
    from mlx_embed import _blas
    first = mlx_embed.load(workers=2, batch_tokens=64)
    own = _blas.own_num_threads()
    first.embed(["a text of a few words"] * 16)  # several passes: the workers' path
    assert _blas.get_num_threads() == 1
    later = mlx_embed.load(workers=2, batch_tokens=64)
    assert later.scheduler._blas_threads == own == (os.cpu_count() or 1)
    assert later.context.kernel_threads == first.context.kernel_threads == own


def test_a_call_does_not_wait_for_a_worker_busy_with_another_models_call():
    """The worker threads are the process's: while one is still on model A's
    long call, model B's call runs its passes on its own thread and returns,
    rather than waiting for that worker to come round to it."""
    import mlx_embed.scheduler as sched

    a = mlx_embed.load(workers=2, batch_tokens=64)
    b = mlx_embed.load(workers=2, batch_tokens=64)
    texts = ["a text of a few words", "another one, a little longer than that"] * 8
    want = b.embed(texts)
    entered, go_on = threading.Event(), threading.Event()

    def hold_the_worker():
        entered.set()
        go_on.wait(60)

    sched._WORKERS.submit(hold_the_worker, 1)  # the only worker, held as if by A's call
    assert entered.wait(30)
    try:
        started = time.monotonic()
        got = b.embed(texts)
        assert time.monotonic() - started < 20
        assert np.array_equal(got, want)
    finally:
        go_on.set()
    assert np.array_equal(a.embed(texts), want)


def test_a_slow_blas_is_said_once_when_a_model_loads_not_at_import():
    """Said at import, the warning came before a server routes the package's
    records into its own log; a library user still gets it, on stderr."""
    r = _run_py(
        "import sys, mlx_embed; print('imported', file=sys.stderr); "
        "mlx_embed.load(); mlx_embed.load()",
        MLX_EMBED_BLAS="/nonexistent/libopenblas.so",
    )
    assert r.returncode == 0, r.stderr
    before, _, after = r.stderr.partition("imported")
    assert "slow reference BLAS" not in before, r.stderr
    assert after.count("slow reference BLAS") == 1, r.stderr


@pytest.mark.parametrize("pipeline", [False, True])
def test_a_solo_call_runs_beside_a_call_holding_the_models_lock(pipeline, minilm, golden_texts, golden_mean):
    """The Rust query thread's calls (`scheduler.call_solo`) run while another
    call holds the engine's CPU lock, instead of after it, with the same
    vectors, also on a model loaded with ``pipeline=True`` (whose pipelined
    path queues passes under that lock); the flag is this thread's and ends
    with the call, error or not."""
    import mlx_embed
    import mlx_embed.scheduler as sched

    if pipeline:
        minilm = mlx_embed.load(pipeline=True)
        assert minilm.scheduler.pipeline

    texts = [t for t in golden_texts[:8] if t]
    rows = [i for i, t in enumerate(golden_texts[:8]) if t]
    out = {}
    solo = threading.Thread(target=lambda: out.update(vec=sched.call_solo(minilm, "embed", texts)))
    assert minilm.scheduler._lock.acquire(timeout=30)  # as a long call would hold it
    try:
        solo.start()
        solo.join(timeout=30)
        assert "vec" in out, "the solo call waited for the lock"
    finally:
        minilm.scheduler._lock.release()
        solo.join(timeout=60)
    assert np.abs(out["vec"] - golden_mean[rows]).max() <= 1e-5
    with pytest.raises(AttributeError):
        sched.call_solo(minilm, "no_such_method")
    assert not getattr(sched._SOLO, "on", False)
