"""`mlx-embed-server --model org/name`: a Hugging Face repo id served from the
local Hugging Face cache (offline too), or downloaded into it from the Hub
(a fake one here: scripts/fake_hub.py), as TEI's --model-id; named by its
repo id; refused at start, before any model loads, where neither works."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fake_hub import FakeHub, cache_repo, folder_files

from harness import FIXTURES, ROOT, SERVER_BINARY, cosine_rows, start_server

REPO = "test-org/tiny-mpnet"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _texts_and_reference():
    texts = json.loads((FIXTURES / "golden" / "minilm_texts.json").read_text())
    reference = np.load(FIXTURES / "tiny-mpnet" / "reference_mean_normalized.npy")
    keep = [i for i, t in enumerate(texts) if t != ""]
    return [texts[i] for i in keep], reference[keep]


def _clean_env(**extra) -> dict:
    """The environment with no Hugging Face or MLX_EMBED_ setting from outside."""
    drop = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_OFFLINE", "MLX_EMBED_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    return {**env, "HF_HUB_DISABLE_TELEMETRY": "1", **extra}


@pytest.fixture
def cache(tmp_path):
    root = tmp_path / "hub-cache"
    cache_repo(root, REPO, folder_files(FIXTURES / "tiny-mpnet"), commit=COMMIT, refs=("main", "v1"))
    return root


def _assert_serves_the_fixture(server, snapshot, served: str = REPO) -> None:
    info = server.get("/info").json()
    assert (info["model_id"], info["model"], info["model_sha"]) == (REPO, served, COMMIT), info
    assert (info["details"]["folder"], info["details"]["revision"]) == (str(snapshot), COMMIT), info["details"]
    assert [m["id"] for m in server.get("/v1/models").json()["data"]] == [served]
    texts, reference = _texts_and_reference()
    resp = server.post("/v1/embeddings", {"input": texts, "model": served})
    assert resp.status_code == 200, resp.text[:500]
    got = np.asarray([d["embedding"] for d in resp.json()["data"]], dtype=np.float32)
    cos = cosine_rows(got, reference)
    diff = float(np.abs(got - reference).max())
    print(f"min cosine {cos.min():.8f}, max |diff| {diff:.2e}")
    assert got.shape == reference.shape and cos.min() >= 0.99999 and diff <= 1e-5
    tei = np.asarray(server.post("/embed", {"inputs": texts}).json(), dtype=np.float32)
    assert np.array_equal(tei, got)


def test_a_repo_id_is_served_from_the_cache_offline(tmp_path, cache):
    snapshot = cache / "models--test-org--tiny-mpnet" / "snapshots" / COMMIT
    env = _clean_env(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    server = start_server(tmp_path, "--no-warmup", "--model", REPO, env=env)
    try:
        _assert_serves_the_fixture(server, snapshot)
        assert f"{REPO} (revision main): the Hugging Face cache's {snapshot}" in server.log()
    finally:
        assert server.stop() == 0
    # TEI's spellings: --model-id, --revision (a tag), --huggingface-hub-cache;
    # through the console script, and under a name of the operator's.
    env = _clean_env(HF_HUB_OFFLINE="1", HOME=str(tmp_path / "home"))
    server = start_server(tmp_path, "--no-warmup", "--model-id", REPO, "--revision", "v1",
                          "--huggingface-hub-cache", str(cache), "--served-model-name", "bge", env=env,
                          command=[str(Path(sys.prefix) / "bin" / "mlx-embed"), "serve"])
    try:
        _assert_serves_the_fixture(server, snapshot, served="bge")
    finally:
        assert server.stop() == 0


def test_a_repo_id_missing_from_the_cache_is_downloaded_from_the_hub(tmp_path):
    root = tmp_path / "empty-cache"
    files = folder_files(FIXTURES / "tiny-mpnet")
    files["onnx/model.onnx"] = b"another runtime's"
    with FakeHub() as hub:
        hub.add(REPO, files, commit=COMMIT)
        env = _clean_env(HF_HUB_CACHE=str(root), HF_ENDPOINT=hub.url)
        server = start_server(tmp_path, "--no-warmup", "--model", REPO, env=env)
        try:
            _assert_serves_the_fixture(server, root / "models--test-org--tiny-mpnet" / "snapshots" / COMMIT)
        finally:
            assert server.stop() == 0
        fetched = sorted(p.rsplit(f"/resolve/{COMMIT}/", 1)[1] for m, p in hub.requests
                         if m == "GET" and "/resolve/" in p)
    assert "onnx/model.onnx" not in fetched and "README.md" not in fetched
    assert "model.safetensors" in fetched and "1_Pooling/config.json" in fetched
    assert (root / "models--test-org--tiny-mpnet" / "refs" / "main").read_text() == COMMIT


def test_a_repo_whose_normalize_module_has_no_folder_is_served(tmp_path):
    """nomic-embed-text-v1.5, bge-m3 or potion list a Normalize module whose
    folder the Hub does not hold (sentence-transformers saves it empty): the
    server downloads such a repo and serves it, then offline from the cache
    (both were refused at start: "lacks 2_Normalize/")."""
    repo = "test-org/tiny-nomic"
    root = tmp_path / "hub-cache"
    texts = json.loads((FIXTURES / "golden" / "minilm_texts.json").read_text())
    keep = [i for i, t in enumerate(texts) if t != ""]
    texts = [texts[i] for i in keep]
    reference = np.load(FIXTURES / "tiny-nomic-bert" / "reference_document_normalized.npy")[keep]
    with FakeHub() as hub:
        hub.add(repo, folder_files(FIXTURES / "tiny-nomic-bert"), commit=COMMIT)
        for env in (_clean_env(HF_HUB_CACHE=str(root), HF_ENDPOINT=hub.url),
                    _clean_env(HF_HUB_CACHE=str(root), HF_HUB_OFFLINE="1")):
            server = start_server(tmp_path, "--no-warmup", "--model", repo, env=env)
            try:
                assert server.get("/info").json()["model_sha"] == COMMIT
                resp = server.post("/v1/embeddings", {"input": texts, "model": repo})
                assert resp.status_code == 200, resp.text[:500]
                got = np.asarray([d["embedding"] for d in resp.json()["data"]], dtype=np.float32)
                assert got.shape == reference.shape and cosine_rows(got, reference).min() >= 0.99999
                assert float(np.abs(got - reference).max()) <= 1e-5
            finally:
                assert server.stop() == 0


def test_a_cached_branch_that_moved_on_the_hub_is_served_at_its_new_commit(tmp_path):
    """Online, a start looks main up (as sentence-transformers and TEI do):
    it moved, so the new commit is fetched (its files are the old one's, so
    nothing is downloaded again, only linked) and served; with the Hub then
    unreachable, the next start serves that cached commit, with a warning."""
    import socket

    old = "fedcba9876543210fedcba9876543210fedcba98"
    root = tmp_path / "hub-cache"
    files = folder_files(FIXTURES / "tiny-mpnet")
    cache_repo(root, REPO, files, commit=old)
    snapshot = root / "models--test-org--tiny-mpnet" / "snapshots" / COMMIT
    with FakeHub() as hub:
        hub.add(REPO, files, commit=old)
        hub.add(REPO, files, commit=COMMIT)
        server = start_server(tmp_path, "--no-warmup", "--model", REPO,
                              env=_clean_env(HF_HUB_CACHE=str(root), HF_ENDPOINT=hub.url))
        try:
            _assert_serves_the_fixture(server, snapshot)
            assert f"{REPO}: revision main moved on the Hub from commit {old} to {COMMIT}: fetching it" in server.log()
        finally:
            assert server.stop() == 0
        assert [p for m, p in hub.requests if m == "GET" and "/resolve/" in p] == []
    assert (root / "models--test-org--tiny-mpnet" / "refs" / "main").read_text() == COMMIT
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        server = start_server(tmp_path, "--no-warmup", "--model", REPO,
                              env=_clean_env(HF_HUB_CACHE=str(root), HF_ENDPOINT=f"http://127.0.0.1:{port}"))
    try:
        _assert_serves_the_fixture(server, snapshot)
        assert (f"{REPO}: could not ask http://127.0.0.1:{port} which commit revision main is (ConnectError"
                in server.log()), server.log()[-3000:]
        assert f"): serving the cached commit {COMMIT}" in server.log()
    finally:
        assert server.stop() == 0


def _refused(*args: str, env: dict) -> subprocess.CompletedProcess:
    run = subprocess.run(
        [str(SERVER_BINARY), "--host", "127.0.0.1", "--port", "0", "--no-warmup", *args],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**env, "VIRTUAL_ENV": sys.prefix, "MLX_EMBED_LOG": "info"},
    )
    assert run.returncode == 1, (run.returncode, run.stdout[-2000:], run.stderr[-2000:])
    assert "python model loaded" not in run.stdout + run.stderr, run.stdout[-2000:]
    assert "Traceback" not in run.stdout + run.stderr, run.stderr[-2000:]
    return run


def test_a_repo_id_neither_cached_nor_downloadable_is_refused_at_start(tmp_path, cache):
    env = _clean_env(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    run = _refused("--model", "all-MiniLM-L6-v2", "--model", "test-org/absent", env=env)
    assert (
        "mlx-embed: --model test-org/absent: not a local folder, and revision main of the Hugging Face repo "
        f"test-org/absent is not in the cache {cache}; HF_HUB_OFFLINE is set, so nothing is downloaded: fetch it "
        f"with `hf download test-org/absent --cache-dir {cache}` where the Hub can be reached"
    ) in run.stderr, run.stderr[-2000:]
    run = _refused("--rerank-model", REPO, "--revision", "v2", env=env)
    assert f"mlx-embed: --rerank-model {REPO}: not a local folder, and revision v2 of" in run.stderr
    assert "(cached: main, v1)" in run.stderr, run.stderr[-2000:]
    # Online, the Hub's answer: no such repo.
    with FakeHub() as hub:
        run = _refused("--model", "test-org/absent", env=_clean_env(HF_HUB_CACHE=str(cache), HF_ENDPOINT=hub.url))
    assert (f"mlx-embed: --model test-org/absent: not a local folder, and revision main of the Hugging Face repo "
            f"test-org/absent is not in the cache {cache}, and downloading it from {hub.url} failed "
            "(RepositoryNotFoundError: 404 Client Error.)") in run.stderr, run.stderr[-2000:]


def test_a_repo_id_and_its_snapshot_folder_are_one_model(tmp_path, cache):
    snapshot = cache / "models--test-org--tiny-mpnet" / "snapshots" / COMMIT
    run = _refused("--model", f"{REPO},{snapshot}", env=_clean_env(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1"))
    assert (f"mlx-embed: --model {REPO} and --model {snapshot} are the same model (the folder {snapshot}): "
            "give each model once") in run.stderr, run.stderr[-2000:]


def test_a_partial_snapshot_or_a_path_for_a_revision_is_refused_at_start(tmp_path, cache):
    """An interrupted download is refused before any model loads, naming
    what it lacks (it was loaded, then failed with "no weights"); a revision
    that is a path never leaves the cache's refs/; a refused connection to
    the Hub is said at once, with no password of a mirror's in it."""
    import socket
    import time

    files = folder_files(FIXTURES / "tiny-mpnet")
    partial = cache_repo(cache, REPO, {"config.json": files["config.json"]}, commit="a" * 40, refs=("wip",))
    env = _clean_env(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    run = _refused("--model", REPO, "--revision", "wip", env=env)
    assert (f"mlx-embed: --model {REPO}: the Hugging Face cache's snapshot {partial} lacks a tokenizer "
            "(tokenizer.json), weights (*.safetensors or pytorch_model.bin); HF_HUB_OFFLINE is set") in run.stderr, run.stderr[-2000:]
    (tmp_path / "sha").write_text(COMMIT)
    run = _refused("--model", REPO, "--revision", str(tmp_path / "sha"), env=env)
    assert (f"mlx-embed: --model {REPO}: revision '{tmp_path / 'sha'}' is not a branch, tag or commit sha: it is "
            "an absolute path") in run.stderr, run.stderr[-2000:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    run = _refused("--model", "test-org/absent", env=_clean_env(
        HF_HUB_CACHE=str(cache), HF_ENDPOINT=f"http://user:s3cret@127.0.0.1:{port}", HF_TOKEN="hf_s3cretToken"))
    took = time.monotonic() - start
    assert f"downloading it from http://***@127.0.0.1:{port} failed (ConnectError:" in run.stderr, run.stderr[-2000:]
    assert "s3cret" not in run.stdout + run.stderr
    assert took < 10, took


def test_an_empty_hf_hub_cache_reads_as_unset(tmp_path, cache):
    """`HF_HUB_CACHE=` (a compose file's `${UNSET}`) is no cache: HF_HOME/hub
    is searched, and the server starts (it failed every start, with exit 2,
    when the flag read the variable through clap)."""
    home = tmp_path / "hf-home"
    home.mkdir()
    os.rename(cache, home / "hub")
    env = _clean_env(HF_HUB_CACHE="", HF_HOME=str(home), HF_HUB_OFFLINE="1")
    server = start_server(tmp_path, "--no-warmup", "--model", REPO, env=env)
    try:
        _assert_serves_the_fixture(server, home / "hub" / "models--test-org--tiny-mpnet" / "snapshots" / COMMIT)
    finally:
        assert server.stop() == 0
