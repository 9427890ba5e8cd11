"""Bulk embedding on a real local Ray cluster (2 CPUs), 2,000 short rows.

The output of `mlx-embed bulk` / `run_bulk` must equal the single-process
`mlx-embed embed` on the same rows (to 1e-6), hold every input id exactly
once, survive an actor killed mid-job, resume from what was written, and
fail loudly on a bad row with its id. Every job runs under a time bound.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
from mlx_embed.ray import (
    BATCH_RETRIES,
    RECORD_NAME,
    SPARSE_COLUMNS,
    BadRow,
    BulkError,
    MlxEmbedder,
    _check_and_record_settings,
    _folder_fingerprint,
    _settings_differences,
    model_identity,
    run_bulk,
)

ROOT = Path(__file__).resolve().parents[2]
TINY_MPNET = ROOT / "tests" / "fixtures" / "tiny-mpnet"  # 64 dims, beside the default's 384
TINY_BGE_M3 = ROOT / "tests" / "fixtures" / "tiny-bge-m3"  # lexical weights (sparse output)
TINY_SPLADE = ROOT / "tests" / "fixtures" / "tiny-splade"
CLI = [sys.executable, "-m", "mlx_embed"]
ROWS = 2000
JOB_TIMEOUT_S = 300
ACTOR_TITLE = "MapBatches(MlxEmbedder)"
WORDS = ["alpha", "beta", "gamma", "delta", "river", "mountain", "quantum", "sparse", "vector", "search", "embedding", "model", "cluster", "replica", "shard", "index", "query", "answer", "corpus", "token"]
# Two actors of half a CPU each leave one of the cluster's two CPUs to Ray
# Data's read and write tasks (run_bulk refuses a plan that leaves none).
SMALL_POOL = {"concurrency": 2, "cpus_per_actor": 0.5, "workers_per_actor": 1}


def make_rows(n: int, prefix: str = "doc") -> list[dict]:
    return [{"id": f"{prefix}-{i:05d}",
             "text": f"row {i}: " + " ".join(WORDS[(i * k + k) % len(WORDS)] for k in range(1, 3 + i % 11))}
            for i in range(n)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def ray_env(**extra) -> dict:
    # No usage reports from a test run (and nothing to reach here anyway).
    return {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **extra}


def folder_state(out: Path) -> dict[str, tuple[int, int]]:
    """Each file's size and modification time: what a refused run must leave alone."""
    return {f.name: (f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(out.iterdir())}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("corpus")
    rows = make_rows(ROWS)
    table = pa.Table.from_pylist(rows)
    (d / "parquet").mkdir()
    for k in range(4):
        pq.write_table(table.slice(k * 500, 500), d / "parquet" / f"part-{k}.parquet")
    return {"rows": rows, "jsonl": write_jsonl(d / "rows.jsonl", rows), "parquet": d / "parquet", "dir": d}


@pytest.fixture(scope="module")
def reference(corpus) -> dict[str, np.ndarray]:
    """id -> vector from the single-process CLI on the same rows."""
    out = corpus["dir"] / "reference.npy"
    r = subprocess.run([*CLI, "embed", "-i", str(corpus["jsonl"]), "-o", str(out), "--progress", "never"],
                       check=False, capture_output=True, text=True, timeout=JOB_TIMEOUT_S, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    vectors = np.load(out)
    assert vectors.shape == (ROWS, 384)
    return {row["id"]: v for row, v in zip(corpus["rows"], vectors)}


@pytest.fixture(scope="module")
def ray_session():
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=300 * 1024 * 1024,
             log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def cluster(ray_session):
    """The module's local cluster, once the previous job's actors have released
    its 2 CPUs (Ray stops them a moment after a job ends)."""
    deadline = time.monotonic() + 60
    while ray.available_resources().get("CPU", 0) < 2:
        assert time.monotonic() < deadline, f"CPUs still held: {ray.available_resources()}"
        time.sleep(0.2)


def read_output(out: Path) -> pa.Table:
    files = sorted(out.glob("*.parquet"))
    assert files, f"no output in {out}"
    return pa.concat_tables(pq.read_table(f) for f in files)


def check_output(out: Path, rows: list[dict], reference: dict[str, np.ndarray]) -> pa.Table:
    """Every input id exactly once, its own text, and the CLI's vector."""
    table = read_output(out)
    assert table.schema.field("embedding").type == pa.list_(pa.float32())
    assert table.column_names == ["id", "text", "embedding"]
    ids = table.column("id").to_pylist()
    assert len(ids) == len(rows), f"{len(ids)} rows written for {len(rows)} input rows"
    assert len(set(ids)) == len(rows), "some rows written twice"
    assert set(ids) == {r["id"] for r in rows}
    texts = dict(zip(ids, table.column("text").to_pylist()))
    assert all(texts[r["id"]] == r["text"] for r in rows)
    got = np.asarray(table.column("embedding").to_pylist(), dtype=np.float32)
    want = np.stack([reference[i] for i in ids])
    assert np.abs(got - want).max() <= 1e-6
    return table


def within_job_timeout(job, what: str):
    """job(), failing the test if it takes more than JOB_TIMEOUT_S."""
    box: dict = {}

    def target():
        try:
            box["result"] = job()
        except BaseException as e:  # noqa: BLE001  (handed to the test's thread)
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(JOB_TIMEOUT_S)
    assert not t.is_alive(), f"{what} still running after {JOB_TIMEOUT_S}s"
    if "error" in box:
        raise box["error"]
    return box["result"]


def bounded(**kwargs):
    """run_bulk, failing the test if it takes more than JOB_TIMEOUT_S."""
    return within_job_timeout(lambda: run_bulk(**kwargs), "bulk job")


def rows_written(out: Path) -> int:
    """Rows in the finished output files (one being written has no footer yet)."""
    n = 0
    for f in out.glob("*.parquet"):
        try:
            n += pq.read_metadata(f).num_rows
        except (OSError, pa.ArrowInvalid):
            pass
    return n


def embedder_pids() -> set[int]:
    """Processes of the MlxEmbedder actors (Ray names them after the class)."""
    pids = set()
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if ACTOR_TITLE in (p / "cmdline").read_bytes().decode(errors="replace"):
                    pids.add(int(p.name))
            except OSError:
                pass
    return pids


# ------------------------------------------------------------ the CLI, end to end
# Each CLI run starts (and stops) its own local Ray cluster of 2 CPUs.


def test_bulk_cli_with_an_actor_killed_mid_job(corpus, reference, tmp_path):
    """`mlx-embed bulk` equals `mlx-embed embed` on the same rows, even with one
    of its actors killed mid-job: Ray runs the killed actor's batches again
    (on its replacement or on the other actor), and no row is lost or written
    twice. Whether Ray starts a replacement is Ray's choice: holding the other
    actor until one appeared (SIGSTOP) hung the job when the kill came with
    no work left to hand a replacement, on a busy machine."""
    out = tmp_path / "out"
    cmd = [*CLI, "bulk", str(corpus["parquet"]), "-o", str(out), "--num-cpus", "2",
           "--concurrency", "2", "--cpus-per-actor", "0.5", "--batch-size", "50", "--rows-per-file", "200"]
    with open(tmp_path / "stdout", "w+") as stdout, open(tmp_path / "stderr", "w+") as stderr:
        job = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, cwd=ROOT, env=ray_env())
        killed, seen, written_at_kill = None, set(), 0
        deadline = time.monotonic() + JOB_TIMEOUT_S
        try:
            while job.poll() is None and time.monotonic() < deadline:
                seen |= embedder_pids()
                # Kill one actor once the job has written some rows but not all.
                if killed is None and len(seen) >= 2 and (written := rows_written(out)):
                    killed, written_at_kill = min(seen), written
                    os.kill(killed, signal.SIGKILL)
                time.sleep(0.05)
        finally:
            if job.poll() is None:
                job.kill()
            job.wait(30)
        stdout.seek(0), stderr.seek(0)
        out_text, err_text = stdout.read(), stderr.read()
    assert job.returncode == 0, err_text[-4000:]
    assert killed is not None, "the job ended before an actor could be killed"
    assert 0 < written_at_kill < ROWS
    summary = json.loads([line for line in out_text.splitlines() if line.startswith("{")][-1])
    assert (summary["input_rows"], summary["embedded"], summary["already_done"]) == (ROWS, ROWS, 0)
    # Ray's own progress report went to the terminal (stderr here).
    assert "MapBatches(MlxEmbedder)" in err_text
    check_output(out, corpus["rows"], reference)
    assert len(list(out.glob("*.parquet"))) == summary["output_files"] >= 2
    print(f"\nkilled actor pid {killed} with {written_at_kill} rows written; "
          f"{len(seen)} actor processes in all; {ROWS} rows out, none twice")


def test_bulk_cli_fails_loudly_on_a_bad_row(tmp_path):
    rows = make_rows(300, "bad")
    rows[157]["text"] = ""
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    r = subprocess.run(
        [*CLI, "bulk", str(path), "-o", str(tmp_path / "out"), "--num-cpus", "2", "--concurrency", "1",
         "--batch-size", "100"],
        check=False, capture_output=True, text=True, timeout=JOB_TIMEOUT_S, cwd=ROOT, env=ray_env())
    assert r.returncode == 1, r.stderr[-3000:]
    assert "mlx-embed bulk: error: row id='bad-00157': text is empty" in r.stderr


POISON = """
import os
from pathlib import Path
if os.environ.get("MLX_EMBED_TEST_POISON_ID") or os.environ.get("MLX_EMBED_TEST_DIE_ONCE_IN"):
    import mlx_embed.ray as bulk
    embed_table = bulk.MlxEmbedder.embed_table

    def dies(self, table):
        ids = table.column(self.id_column).to_pylist()
        if os.environ.get("MLX_EMBED_TEST_POISON_ID") in ids:
            os._exit(1)  # what the OOM killer or a native abort does to the actor
        once = os.environ.get("MLX_EMBED_TEST_DIE_ONCE_IN")
        if once and ids:
            mark = Path(once) / str(ids[0])
            if not mark.exists():
                mark.touch()
                os._exit(1)
        return embed_table(self, table)

    bulk.MlxEmbedder.embed_table = dies
"""


def test_bulk_cli_stops_when_a_batch_kills_its_actor_every_time(tmp_path):
    """Ray Data restarts a dead actor and reruns its batch without end by
    default: a batch that killed its actor every time kept the job going
    for ever (28 deaths in 150 s in a probe). Now after a few restarts the
    job stops with one line saying why, and the files written are kept."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(POISON)
    path = write_jsonl(tmp_path / "rows.jsonl", make_rows(300, "p"))
    started = time.monotonic()
    r = subprocess.run(
        [*CLI, "bulk", str(path), "-o", str(tmp_path / "out"), "--num-cpus", "2", "--concurrency", "1",
         "--batch-size", "50"],
        check=False, capture_output=True, text=True, timeout=JOB_TIMEOUT_S, cwd=ROOT,
        env=ray_env(PYTHONPATH=str(hook), MLX_EMBED_TEST_POISON_ID="p-00123"))
    assert r.returncode == 1, r.stderr[-3000:]
    assert (f"mlx-embed bulk: error: model actors died with the same batch on them {BATCH_RETRIES + 1} times"
            in r.stderr), r.stderr[-3000:]
    assert time.monotonic() - started < 200


def test_bulk_cli_survives_an_actor_dying_once_on_each_of_many_batches(tmp_path):
    """The bound is per batch: an actor killed once on each of 6 batches
    (sporadic OOM kills) is restarted each time and the job finishes with
    every row (an actor-wide limit of 3 restarts stopped it)."""
    hook, marks = tmp_path / "hook", tmp_path / "marks"
    hook.mkdir()
    marks.mkdir()
    (hook / "sitecustomize.py").write_text(POISON)
    rows = make_rows(180, "o")
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "out"
    r = subprocess.run(
        [*CLI, "bulk", str(path), "-o", str(out), "--num-cpus", "2", "--concurrency", "1",
         "--batch-size", "30"],
        check=False, capture_output=True, text=True, timeout=JOB_TIMEOUT_S, cwd=ROOT,
        env=ray_env(PYTHONPATH=str(hook), MLX_EMBED_TEST_DIE_ONCE_IN=str(marks)))
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(list(marks.iterdir())) >= 5, "the actor was not killed on each batch"
    assert sorted(read_output(out).column("id").to_pylist()) == [row["id"] for row in rows]


def interrupted(cmd: list, env: dict, stderr_path: Path, sig: int, preexec_fn=None) -> tuple[int, str, str]:
    """Runs the bulk command, sends it `sig` once its model actors have
    started (Ray Data writes the files in a burst at the end, so waiting for
    the first one raced with the job's end on a loaded machine), and returns
    (exit code, stdout, stderr)."""
    with open(stderr_path, "w+") as stderr:
        job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, cwd=ROOT, env=env,
                               text=True, preexec_fn=preexec_fn)
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while job.poll() is None and time.monotonic() < deadline:
            if f"-> ActorPoolMapOperator[{ACTOR_TITLE}]" in stderr_path.read_text():
                break
            time.sleep(0.05)
        assert job.poll() is None, "the job ended before it could be interrupted"
        job.send_signal(sig)
        try:
            out_text, _ = job.communicate(timeout=120)
        finally:
            if job.poll() is None:
                job.kill()
        stderr.seek(0)
        return job.returncode, out_text, stderr.read()


def test_bulk_cli_sigterm_stops_as_ctrl_c_does(corpus, tmp_path):
    """A supervisor's SIGTERM (timeout, a Kubernetes Job) got Ray's stack
    dump and left the session folder; it now ends the job as Ctrl-C does."""
    out = tmp_path / "out"
    ray_tmp = Path(tempfile.mkdtemp(prefix="rt"))  # short: Ray's socket paths have a length limit
    cmd = [*CLI, "bulk", str(corpus["parquet"]), "-o", str(out), "--num-cpus", "2",
           "--concurrency", "1", "--workers-per-actor", "1", "--batch-size", "50"]
    try:
        code, _, err_text = interrupted(cmd, ray_env(RAY_TMPDIR=str(ray_tmp)), tmp_path / "stderr",
                                        signal.SIGTERM)
        assert code == 130, err_text[-4000:]
        assert "SIGTERM received" not in err_text and "Traceback" not in err_text, err_text[-4000:]
        assert err_text.rstrip().splitlines()[-1] == (
            f"mlx-embed bulk: interrupted; the files written to {out} are kept: run the same "
            "command again to resume")
        assert not list((ray_tmp / "ray").glob("session_2*")), "the session folder was left behind"
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_bulk_cli_refuses_an_output_inside_its_input_and_num_cpus_when_joining(corpus, tmp_path):
    """An output folder inside the input folder was read back as input by
    the next run (duplicate ids: the resume refused for ever)."""
    inside = corpus["parquet"] / "vectors"
    r = subprocess.run([*CLI, "bulk", str(corpus["parquet"]), "-o", str(inside), "--num-cpus", "2"],
                       check=False, capture_output=True, text=True, timeout=JOB_TIMEOUT_S, cwd=ROOT,
                       env=ray_env())
    assert r.returncode == 1, r.stderr[-3000:]
    assert (f"mlx-embed bulk: error: the output folder {inside} is inside the input folder "
            f"{corpus['parquet']}") in r.stderr
    assert not inside.exists()
    r = subprocess.run([*CLI, "bulk", str(corpus["jsonl"]), "-o", str(tmp_path / "o"), "--num-cpus", "2",
                        "--address", "127.0.0.1:1"], check=False, capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env=ray_env())
    assert r.returncode == 2, r.stderr[-3000:]
    assert "--num-cpus sizes a local cluster" in r.stderr


def test_bulk_cli_ctrl_c_then_a_refused_and_a_good_resume(corpus, reference, tmp_path):
    """Ctrl-C ends the job with one line saying how to resume (exit 130, no
    traceback); a resume with another model is refused, exit 1, leaving the
    folder as it was (it once mixed 384- and 64-dim vectors in one folder
    with exit 0); the same command resumes and finishes. The local Ray
    cluster's session folder goes with each run."""
    out = tmp_path / "out"
    ray_tmp = Path(tempfile.mkdtemp(prefix="rt"))  # short: Ray's socket paths have a length limit
    env = ray_env(RAY_TMPDIR=str(ray_tmp))
    cmd = [*CLI, "bulk", str(corpus["parquet"]), "-o", str(out), "--num-cpus", "2",
           "--concurrency", "1", "--workers-per-actor", "1", "--batch-size", "50",
           "--rows-per-file", "100"]
    try:
        # SIGINT as a terminal's foreground job has it: a test run started in
        # the background (CI's) ignores it, and Python then leaves it ignored,
        # so the job ran to its end with exit 0.
        code, out_text, err_text = interrupted(
            cmd, env, tmp_path / "stderr", signal.SIGINT,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        assert code == 130, err_text[-4000:]
        assert "Traceback" not in err_text and "KeyboardInterrupt" not in err_text, err_text[-4000:]
        assert err_text.rstrip().splitlines()[-1] == (
            f"mlx-embed bulk: interrupted; the files written to {out} are kept: run the same "
            "command again to resume")
        assert not any(line.startswith("{") for line in out_text.splitlines()), out_text
        assert rows_written(out) < ROWS

        # A folder part written (the interrupt above may have come before any
        # file): the whole job, then half its files gone.
        done = subprocess.run(cmd, check=False, capture_output=True, text=True,
                              timeout=JOB_TIMEOUT_S, cwd=ROOT, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        for f in sorted(out.glob("*.parquet"))[::2]:
            f.unlink()
        written = rows_written(out)
        assert 0 < written < ROWS

        before = folder_state(out)
        other = subprocess.run([*cmd, "-m", str(TINY_MPNET)], check=False, capture_output=True,
                               text=True, timeout=JOB_TIMEOUT_S, cwd=ROOT, env=env)
        assert other.returncode == 1, other.stderr[-3000:]
        assert "mlx-embed bulk: error: " in other.stderr
        assert "was written with other settings (model: all-MiniLM-L6-v2 at " in other.stderr
        assert ", 384 dims then, tiny-mpnet at " in other.stderr and "64 dims now" in other.stderr
        assert "write to a new output folder" in other.stderr
        assert folder_state(out) == before

        again = subprocess.run(cmd, check=False, capture_output=True, text=True,
                               timeout=JOB_TIMEOUT_S, cwd=ROOT, env=env)
        assert again.returncode == 0, again.stderr[-3000:]
        summary = json.loads(again.stdout.strip().splitlines()[-1])
        assert summary["already_done"] == written and summary["embedded"] == ROWS - written
        check_output(out, corpus["rows"], reference)
        assert not list((ray_tmp / "ray").glob("session_2*")), "a Ray session folder was left"
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


# ------------------------------------------------------------ the library on one cluster


def test_run_bulk_equals_single_process_cli(cluster, corpus, reference, tmp_path):
    out = tmp_path / "out"
    result = bounded(inputs=str(corpus["jsonl"]), output_dir=out, batch_size=100, rows_per_file=500,
                     **SMALL_POOL)
    assert (result.input_rows, result.embedded, result.already_done) == (ROWS, ROWS, 0)
    check_output(out, corpus["rows"], reference)
    assert result.output_files == len(list(out.glob("*.parquet"))) >= 2


def test_resume_embeds_only_what_is_missing(cluster, corpus, reference, tmp_path):
    rows = corpus["rows"][:600]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "out"
    first = bounded(inputs=str(path), output_dir=out, batch_size=50, rows_per_file=100, **SMALL_POOL)
    assert first.embedded == len(rows) and first.output_files >= 4
    files = sorted(out.glob("*.parquet"))
    lost = sum(pq.read_metadata(f).num_rows for f in files[:3])
    files[0].unlink()
    files[1].unlink()
    # A write cut short by a killed job: no Parquet footer.
    files[2].write_bytes(files[2].read_bytes()[:200])

    again = bounded(inputs=str(path), output_dir=out, batch_size=50, rows_per_file=100, **SMALL_POOL)
    assert again.removed_files == [files[2].name]
    assert again.already_done == len(rows) - lost
    assert again.embedded == lost
    check_output(out, rows, reference)

    done = bounded(inputs=str(path), output_dir=out, **SMALL_POOL)
    assert (done.already_done, done.embedded) == (len(rows), 0)


def test_resume_with_another_model_or_options_is_refused(cluster, corpus, reference, tmp_path):
    """The output folder records the model and the options that change
    vectors; a resume with any other is refused, naming what differs, with
    nothing written. The input's own id and text column names are kept.
    A folder from before the record resumes only if its vectors fit."""
    rows = [{"doc": r["id"], "body": r["text"]} for r in corpus["rows"][:120]]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "out"
    job = {"inputs": str(path), "output_dir": out, "id_column": "doc", "text_column": "body",
           "batch_size": 30, "rows_per_file": 30, **SMALL_POOL}

    def check(table: pa.Table) -> None:
        assert table.column_names == ["doc", "body", "embedding"]
        ids = table.column("doc").to_pylist()
        assert sorted(ids) == sorted(r["doc"] for r in rows)
        got = np.asarray(table.column("embedding").to_pylist(), dtype=np.float32)
        assert np.abs(got - np.stack([reference[i] for i in ids])).max() <= 1e-6

    first = bounded(**job)
    assert first.embedded == len(rows) and first.output_files >= 3
    check(read_output(out))
    record = json.loads((out / RECORD_NAME).read_text())
    assert record["model"]["name"] == "all-MiniLM-L6-v2" and record["model"]["dim"] == 384
    assert (record["normalize"], record["dtype"], record["quantize"], record["instruction"]) == (
        True, "float32", None, None)
    assert (record["id_column"], record["text_column"]) == ("doc", "body")

    files = sorted(out.glob("*.parquet"))
    files[0].unlink()
    before = folder_state(out)
    for change, says in [
        ({"model": str(TINY_MPNET)}, r"model: all-MiniLM-L6-v2 at .*, 384 dims then, tiny-mpnet at .*, 64 dims now"),
        ({"normalize": False}, r"normalize: True then, False now"),
        ({"dtype": "float16"}, r"dtype: 'float32' then, 'float16' now"),
    ]:
        with pytest.raises(BulkError, match=rf"{out} was written with other settings \({says}.*"
                                            "write to a new output folder"):
            bounded(**{**job, **change})
        assert folder_state(out) == before, change

    again = bounded(**job)
    assert again.already_done + again.embedded == len(rows) and again.embedded > 0
    check(read_output(out))

    # A folder from before the record: the vectors' width is what is left to check.
    (out / RECORD_NAME).unlink()
    sorted(out.glob("*.parquet"))[0].unlink()
    before = folder_state(out)
    with pytest.raises(BulkError, match=rf"{out} has no {RECORD_NAME} .* vectors of 384 dims, "
                                        "where tiny-mpnet gives 64"):
        bounded(**{**job, "model": str(TINY_MPNET)})
    assert folder_state(out) == before
    adopted = bounded(**job)
    assert adopted.embedded > 0
    check(read_output(out))
    assert json.loads((out / RECORD_NAME).read_text())["model"] == record["model"]


def test_an_unrecorded_folder_of_unnormalized_vectors_is_refused_when_normalizing(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    vecs = np.full((3, 4), 2.0, dtype=np.float32)
    pq.write_table(pa.table({"id": ["a", "b", "c"], "text": ["x", "y", "z"],
                             "embedding": pa.array(vecs.tolist(), type=pa.list_(pa.float32()))}),
                   out / "part.parquet")
    settings = {"model": {"name": "m", "path": "/m", "dim": 4, "max_length": 8, "fingerprint": "f"},
                "normalize": True, "dtype": "float32", "quantize": None, "instruction": None,
                "id_column": "id", "text_column": "text"}
    with pytest.raises(BulkError, match="not unit length, where this run normalizes them"):
        _check_and_record_settings(out, settings)
    assert not (out / RECORD_NAME).exists()
    _check_and_record_settings(out, {**settings, "normalize": False})
    assert json.loads((out / RECORD_NAME).read_text())["normalize"] is False
    # A record with no vectors beside it (a first run stopped early) gives way.
    (out / "part.parquet").unlink()
    _check_and_record_settings(out, {**settings, "dtype": "float16"})
    assert json.loads((out / RECORD_NAME).read_text())["dtype"] == "float16"


def test_a_model_is_told_by_its_files_not_by_where_they_are(tmp_path):
    copy = tmp_path / "copy-of-mpnet"
    shutil.copytree(TINY_MPNET, copy)
    (copy / "README.md").write_text("edited")
    assert _folder_fingerprint(copy) == _folder_fingerprint(TINY_MPNET)
    here, there = model_identity(str(TINY_MPNET)), model_identity(str(copy))
    assert (here["dim"], here["name"], there["name"]) == (64, "tiny-mpnet", "copy-of-mpnet")
    options = {"normalize": True, "dtype": "float32", "quantize": None, "instruction": None,
               "id_column": "id", "text_column": "text"}
    assert _settings_differences({"model": here, **options}, {"model": there, **options}) == []
    assert _settings_differences({"model": here, **options},
                                 {"model": there, **options, "normalize": False}) == [
        "normalize: True then, False now"]
    # Another revision in the same place is another model.
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert _folder_fingerprint(copy) != _folder_fingerprint(TINY_MPNET)


def test_bad_input_fails_before_any_compute(cluster, tmp_path):
    rows = make_rows(50, "z")
    rows[40]["id"] = rows[3]["id"]
    with pytest.raises(BulkError, match=r"input: id 'z-00003' appears 2 times; ids must be unique"):
        bounded(inputs=write_jsonl(tmp_path / "dup.jsonl", rows), output_dir=tmp_path / "o1",
                concurrency=1)
    assert not (tmp_path / "o1").exists(), "nothing may be embedded before the ids are checked"

    for id_column, text_column in [("doc", "doc"), ("id", "embedding")]:
        with pytest.raises(BulkError, match="the id and text columns must be two columns, "
                                            "named neither 'embedding'"):
            bounded(inputs=write_jsonl(tmp_path / "cols.jsonl", rows), output_dir=tmp_path / "o1",
                    id_column=id_column, text_column=text_column, concurrency=1)
    with pytest.raises(BulkError, match=r"no \['text'\] column"):
        bounded(inputs=write_jsonl(tmp_path / "notext.jsonl", [{"id": "a", "body": "x"}]),
                output_dir=tmp_path / "o2", concurrency=1)

    # An empty file (or one of blank lines) has no rows, and no columns either.
    for name, body in [("empty.jsonl", ""), ("blank.jsonl", "\n\n")]:
        (tmp_path / name).write_text(body)
        with pytest.raises(BulkError, match="the input has no rows"):
            bounded(inputs=tmp_path / name, output_dir=tmp_path / "o4", concurrency=1)
    # JSON allows ids of mixed types; resuming goes by id, so they are refused.
    mixed = make_rows(5)
    mixed[1]["id"] = 1
    with pytest.raises(BulkError, match="input: ids must all have one type, such as all strings or all integers"):
        bounded(inputs=write_jsonl(tmp_path / "mixed.jsonl", mixed), output_dir=tmp_path / "o5",
                concurrency=1)
    assert not (tmp_path / "o4").exists() and not (tmp_path / "o5").exists()
    # An id JSON's reader cannot hold is the reader's error, said in one line.
    (tmp_path / "huge.jsonl").write_text('{"id": 1180591620717411303424, "text": "a"}\n')
    with pytest.raises(BulkError, match="cannot read the input: ValueError: .*too big"):
        bounded(inputs=tmp_path / "huge.jsonl", output_dir=tmp_path / "o6", concurrency=1)
    # A file whose ids are all null beside one with integer ids: a null id, not mixed types.
    (tmp_path / "nulls").mkdir()
    write_jsonl(tmp_path / "nulls" / "a.jsonl", [{"id": i, "text": f"t{i}"} for i in range(3)])
    write_jsonl(tmp_path / "nulls" / "b.jsonl", [{"id": None, "text": "x"}])
    with pytest.raises(BulkError, match="input: 1 rows have a null id"):
        bounded(inputs=tmp_path / "nulls", output_dir=tmp_path / "o7", concurrency=1)

    # Two actors of one CPU each would leave Ray Data's read tasks no CPU: the
    # job would wait forever, so it is refused up front.
    with pytest.raises(BulkError, match="leave less than 1 of the cluster's 2 CPUs"):
        bounded(inputs=write_jsonl(tmp_path / "ok.jsonl", make_rows(10)), output_dir=tmp_path / "o3",
                concurrency=2)


def test_map_batches_with_the_callable_class(cluster, tmp_path):
    """The documented use: ds.map_batches(MlxEmbedder, ...) with Ray's default
    (numpy) batches still gives a list<float32> embedding column."""
    rows = make_rows(200)
    ds = ray.data.from_items(rows).map_batches(
        MlxEmbedder, fn_constructor_kwargs={"workers": 1}, concurrency=1, num_cpus=1, batch_size=64)
    table = pa.concat_tables(ray.get(ds.to_arrow_refs()))
    assert table.schema.field("embedding").type == pa.list_(pa.float32())
    import mlx_embed

    model = mlx_embed.load()
    by_id = dict(zip(table.column("id").to_pylist(), table.column("embedding").to_pylist()))
    want = model.embed([r["text"] for r in rows])
    got = np.asarray([by_id[r["id"]] for r in rows], dtype=np.float32)
    assert np.abs(got - want).max() <= 1e-6


def test_the_scaling_docs_ray_program_runs_as_written(cluster, corpus, reference, tmp_path):
    """docs/scaling.md's map_batches program, its paths pointed here, on
    the 2-CPU cluster (as written before, with 4 actors of one CPU, it waited
    for CPUs forever)."""
    doc = (ROOT / "docs" / "scaling.md").read_text()
    program = doc.split("```python\n", 1)[1].split("```", 1)[0]
    assert "MlxEmbedder" in program and '"corpus/"' in program and '"vectors/"' in program
    out = tmp_path / "vectors"
    program = program.replace('"corpus/"', repr(str(corpus["parquet"]))).replace('"vectors/"', repr(str(out)))
    within_job_timeout(lambda: exec(compile(program, "docs/scaling.md", "exec"), {}), "the docs' program")
    table = read_output(out)
    assert table.num_rows == ROWS
    got = dict(zip(table.column("id").to_pylist(), table.column("embedding").to_pylist()))
    want = reference
    assert set(got) == set(want)
    worst = max(float(np.abs(np.asarray(got[i], dtype=np.float32) - want[i]).max()) for i in want)
    assert worst <= 1e-6, worst


def test_callable_class_keeps_the_batch_type(minilm):
    embedder = MlxEmbedder(workers=1)
    rows = make_rows(9)
    want = minilm.embed([r["text"] for r in rows])

    table = embedder(pa.Table.from_pylist(rows))
    assert isinstance(table, pa.Table)
    assert table.schema.field("embedding").type == pa.list_(pa.float32())
    assert np.abs(np.asarray(table.column("embedding").to_pylist()) - want).max() <= 1e-6

    frame = embedder(pd.DataFrame(rows))
    assert isinstance(frame, pd.DataFrame) and list(frame.columns) == ["id", "text", "embedding"]
    # Through Arrow the column stays list<float32> (no tensor or float64 detour).
    assert pa.Table.from_pandas(frame).schema.field("embedding").type == pa.list_(pa.float32())
    assert np.abs(np.stack(frame["embedding"].to_numpy()) - want).max() <= 1e-6

    numpy_batch = {"id": np.array([r["id"] for r in rows], dtype=object),
                   "text": np.array([r["text"] for r in rows], dtype=object)}
    out = embedder(numpy_batch)
    assert isinstance(out, pa.Table)
    assert out.schema.field("embedding").type == pa.list_(pa.float32())

    with pytest.raises(BadRow, match=r"row id='a': text must be a string, got int"):
        embedder(pa.table({"id": ["a", "b"], "text": [1, 2]}))
    with pytest.raises(BadRow, match=r"row id='b': text is null"):
        embedder(pa.table({"id": ["a", "b"], "text": ["fine", None]}))


def test_only_an_empty_text_is_refused_as_the_server_does(minilm):
    """The server's routes refuse "" and embed a whitespace-only text; so does bulk."""
    embedder = MlxEmbedder(workers=1)
    texts = ["fine", " ", "\t\n  "]
    table = embedder(pa.table({"id": ["a", "b", "c"], "text": texts}))
    got = np.asarray(table.column("embedding").to_pylist(), dtype=np.float32)
    assert np.abs(got - minilm.embed(texts)).max() <= 1e-6
    with pytest.raises(BadRow, match=r"row id='b': text is empty"):
        embedder(pa.table({"id": ["a", "b"], "text": [" ", ""]}))


def test_a_row_the_model_refuses_is_named_by_its_id():
    """Too long with truncate=False: the engine names the text's place in the
    call; the embedder finds the row and names its id."""
    embedder = MlxEmbedder(workers=1, truncate=False)
    rows = make_rows(40, "y")
    rows[27]["text"] = "long " * 600
    with pytest.raises(BadRow, match=r"row id='y-00027': text has 60\d tokens, more than max_length=256"):
        embedder(pa.Table.from_pylist(rows))


# ------------------------------------------------------------ sparse output


def sparse_by_id(table: pa.Table) -> dict:
    """id -> {token id: weight} from a sparse output's indices and values."""
    return {i: dict(zip(idx, val)) for i, idx, val in zip(
        table.column("id").to_pylist(), table.column("indices").to_pylist(),
        table.column("values").to_pylist())}


def worst_sparse_difference(got: dict, want: dict) -> float:
    """The largest weight difference over both entry sets (a missing entry weighs 0)."""
    return max((abs(got.get(k, 0.0) - want.get(k, 0.0)) for k in set(got) | set(want)), default=0.0)


@pytest.mark.parametrize("folder", [TINY_BGE_M3, TINY_SPLADE])
def test_callable_class_writes_sparse_weights(folder):
    """sparse=True: indices list<int32> and values list<float32>, the
    library's embed_sparse per row, for Table and DataFrame batches."""
    import mlx_embed

    embedder = MlxEmbedder(str(folder), workers=1, sparse=True)
    rows = make_rows(23, "s")
    want = mlx_embed.load(folder).embed_sparse([r["text"] for r in rows])
    assert sum(len(i) for i, _ in want) > 23

    table = embedder(pa.Table.from_pylist(rows))
    assert table.column_names == ["id", "text", *SPARSE_COLUMNS]
    assert table.schema.field("indices").type == pa.list_(pa.int32())
    assert table.schema.field("values").type == pa.list_(pa.float32())
    # The library's own model runs other sub-batches (its workers), so the
    # weights may differ in the last bits.
    for got_i, got_v, (idx, val) in zip(table.column("indices").to_pylist(),
                                        table.column("values").to_pylist(), want):
        assert worst_sparse_difference(dict(zip(got_i, got_v)),
                                       dict(zip(idx.tolist(), val.tolist()))) <= 1e-5

    frame = embedder(pd.DataFrame(rows))
    assert list(frame.columns) == ["id", "text", *SPARSE_COLUMNS]
    schema = pa.Table.from_pandas(frame).schema
    assert schema.field("indices").type == pa.list_(pa.int32())
    assert [list(x) for x in frame["indices"]] == table.column("indices").to_pylist()
    assert [list(x) for x in frame["values"]] == table.column("values").to_pylist()

    empty = embedder(pa.table({"id": pa.array([], pa.string()), "text": pa.array([], pa.string())}))
    assert empty.num_rows == 0 and empty.column_names == ["id", "text", *SPARSE_COLUMNS]
    with pytest.raises(BadRow, match=r"row id='b': text is empty"):
        embedder(pa.table({"id": ["a", "b"], "text": ["fine", ""]}))


def test_sparse_from_a_dense_model_is_refused():
    with pytest.raises(BulkError, match=r"^tiny-mpnet has no sparse output: sparse needs a SPLADE "
                                        r"model or a BGE-M3 folder \(its sparse_linear.pt\)$"):
        MlxEmbedder(str(TINY_MPNET), workers=1, sparse=True)


def test_a_record_from_before_sparse_output_reads_as_dense(tmp_path):
    """Records written before the sparse option existed lack its key; they
    were dense, so a dense resume goes on and a sparse one is refused."""
    model = model_identity(str(TINY_MPNET))
    model.pop("sparse_output")
    old = {"model": model, "normalize": True, "dtype": "float32", "quantize": None,
           "instruction": None, "id_column": "id", "text_column": "text"}
    assert _settings_differences(old, {**old, "sparse": False, "prompt_name": None}) == []
    assert _settings_differences(old, {**old, "sparse": True}) == ["sparse: False then, True now"]
    assert _settings_differences(old, {**old, "prompt_name": "document"}) == [
        "prompt_name: None then, 'document' now"]


def test_callable_class_puts_the_named_prompt_first():
    """prompt_name: a corpus's documents get the model's document prompt
    (`mlx-embed bulk --prompt-name document`)."""
    import mlx_embed

    folder = str(ROOT / "tests" / "fixtures" / "tiny-gemma3")
    rows = make_rows(12, "g")
    table = MlxEmbedder(folder, workers=1, prompt_name="document")(pa.Table.from_pylist(rows))
    want = mlx_embed.load(folder).embed([r["text"] for r in rows], prompt_name="document")
    assert np.abs(np.asarray(table.column("embedding").to_pylist(), dtype=np.float32) - want).max() <= 1e-6
    with pytest.raises(BulkError, match=r"tiny-gemma3 has no prompt named 'passage' \(its prompts: "
                                        r"document, query\)"):
        MlxEmbedder(folder, workers=1, prompt_name="passage")


def test_run_bulk_sparse_equals_the_library_and_resumes(cluster, tmp_path):
    """BGE-M3's lexical weights through the whole job: every id once, each
    row's entries the library's; a dense run on the folder and a sparse run
    of a dense model are refused with nothing written."""
    import mlx_embed

    rows = make_rows(240, "m3")
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "out"
    job = {"inputs": str(path), "output_dir": out, "model": str(TINY_BGE_M3), "sparse": True,
           "batch_size": 40, "rows_per_file": 80, **SMALL_POOL}
    first = bounded(**job)
    assert (first.input_rows, first.embedded, first.already_done) == (240, 240, 0)
    table = read_output(out)
    assert table.column_names == ["id", "text", *SPARSE_COLUMNS]
    got = sparse_by_id(table)
    assert sorted(got) == sorted(r["id"] for r in rows)
    model = mlx_embed.load(TINY_BGE_M3)
    want = {r["id"]: dict(zip(idx.tolist(), val.tolist())) for r, (idx, val) in
            zip(rows, model.embed_sparse([r["text"] for r in rows]))}
    assert max(worst_sparse_difference(got[i], want[i]) for i in want) <= 1e-5
    assert sum(len(v) for v in got.values()) > 240
    record = json.loads((out / RECORD_NAME).read_text())
    assert (record["sparse"], record["normalize"]) == (True, False)
    assert "sparse_output" not in record["model"]

    sorted(out.glob("*.parquet"))[0].unlink()
    before = folder_state(out)
    with pytest.raises(BulkError, match=r"was written with other settings \(normalize: False then, "
                                        r"True now; sparse: True then, False now;"):
        bounded(**{**job, "sparse": False})
    assert folder_state(out) == before
    again = bounded(**{**job, "normalize": False})  # normalize does not apply to sparse weights
    assert again.embedded > 0 and again.already_done + again.embedded == 240
    assert sorted(sparse_by_id(read_output(out))) == sorted(r["id"] for r in rows)

    with pytest.raises(BulkError, match="tiny-mpnet has no sparse output"):
        bounded(**{**job, "model": str(TINY_MPNET), "output_dir": tmp_path / "o2"})
    assert not (tmp_path / "o2").exists()
    with pytest.raises(BulkError, match="named neither 'indices' nor 'values'"):
        bounded(**{**job, "text_column": "values", "output_dir": tmp_path / "o3"})


def test_bulk_cli_sparse(tmp_path):
    rows = make_rows(60, "cli")
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "out"
    r = subprocess.run(
        [*CLI, "bulk", str(path), "-o", str(out), "-m", str(TINY_SPLADE), "--sparse",
         "--prompt-name", "document", "--address", "local", "--num-cpus", "2", "--concurrency", "1",
         "--batch-size", "20"],
        check=False, capture_output=True, text=True, timeout=JOB_TIMEOUT_S, cwd=ROOT, env=ray_env())
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert (summary["input_rows"], summary["embedded"]) == (60, 60)
    record = json.loads((out / RECORD_NAME).read_text())
    assert (record["sparse"], record["prompt_name"]) == (True, "document")
    import mlx_embed

    model = mlx_embed.load(TINY_SPLADE)
    got = sparse_by_id(read_output(out))
    want = {r["id"]: dict(zip(idx.tolist(), val.tolist())) for r, (idx, val) in
            zip(rows, model.embed_sparse([r["text"] for r in rows]))}
    assert sorted(got) == sorted(want)
    assert max(worst_sparse_difference(got[i], want[i]) for i in want) <= 1e-5
