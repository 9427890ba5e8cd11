"""Models by Hugging Face repo id (python/mlx_embed/hub.py): found in a local
Hugging Face cache laid out as huggingface_hub writes it, by branch, tag or
commit, else downloaded by the real huggingface_hub client from a fake Hub
(scripts/fake_hub.py) into a temporary cache; refused with what to do where
neither works."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES, load_fixture
from fake_hub import FakeHub, cache_repo, etag, folder_files

import mlx_embed
from mlx_embed import hub, loading

REPO = "test-org/tiny-mpnet"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OLD = "fedcba9876543210fedcba9876543210fedcba98"
TEXTS = ["A repo id names the same weights.", "Bit for bit.", "x"]
HUB_VARIABLES = (
    "HF_HUB_CACHE",
    "HUGGINGFACE_HUB_CACHE",
    "HF_HOME",
    "XDG_CACHE_HOME",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HF_ENDPOINT",
    "HF_TOKEN",
)


@pytest.fixture
def env(monkeypatch, tmp_path):
    """No Hugging Face variable from outside, HOME a fresh folder, offline."""
    for name in HUB_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return monkeypatch


@pytest.fixture
def cache(env, tmp_path) -> Path:
    """A cache holding tiny-mpnet as REPO: main and the tag v1 at COMMIT, an
    older commit (its config.json alone) at the branch old."""
    root = tmp_path / "cache"
    cache_repo(root, REPO, folder_files(FIXTURES / "tiny-mpnet"), commit=COMMIT, refs=("main", "v1"))
    cache_repo(
        root, REPO, {"config.json": (FIXTURES / "tiny-mpnet" / "config.json").read_bytes()}, commit=OLD, refs=("old",)
    )
    env.setenv("HF_HUB_CACHE", str(root))
    return root


def _snapshot(root: Path, commit: str = COMMIT) -> str:
    return str(root / "models--test-org--tiny-mpnet" / "snapshots" / commit)


def test_the_fake_cache_is_laid_out_as_huggingface_hub_reads_it(cache):
    """huggingface_hub's own offline lookup finds the same snapshot, through
    relative links into blobs/."""
    from huggingface_hub import snapshot_download

    link = Path(_snapshot(cache)) / "1_Pooling" / "config.json"
    assert link.is_symlink() and not os.path.isabs(os.readlink(link))
    assert os.readlink(link).startswith("../../../blobs/")
    for revision in ("main", "v1", COMMIT, "old"):
        theirs = snapshot_download(REPO, revision=revision, cache_dir=str(cache), local_files_only=True)
        expected = _snapshot(cache, OLD if revision == "old" else COMMIT)
        assert theirs == expected == hub.cached_snapshot(REPO, revision)
        if revision != "old":  # a partial snapshot (the next tests)
            assert hub.resolve_model(REPO, revision) == expected


def test_a_repo_id_loads_its_cached_snapshot_as_the_folder_does(cache):
    model = mlx_embed.load(REPO)
    assert model.path == _snapshot(cache)
    assert model.name == REPO
    direct = load_fixture("tiny-mpnet")
    assert np.array_equal(model.embed(TEXTS), direct.embed(TEXTS))
    # The name rule the server refuses duplicates by, known before loading.
    assert loading.served_name(model.path) == REPO
    assert hub.snapshot_of(model.path) == (REPO, COMMIT)


def test_branches_tags_and_commits_pick_their_snapshot(cache):
    assert hub.resolve_model(REPO) == _snapshot(cache)
    assert hub.resolve_model(REPO, "main") == _snapshot(cache)
    assert hub.resolve_model(REPO, "v1") == _snapshot(cache)
    assert hub.resolve_model(REPO, COMMIT) == _snapshot(cache)
    assert hub.cached_snapshot(REPO, "old") == hub.cached_snapshot(REPO, OLD) == _snapshot(cache, OLD)
    # huggingface_hub's own layout for a pull request's ref: refs/refs/pr/1.
    (cache / "models--test-org--tiny-mpnet" / "refs" / "refs" / "pr").mkdir(parents=True)
    (cache / "models--test-org--tiny-mpnet" / "refs" / "refs" / "pr" / "1").write_text(COMMIT + "\n")
    assert hub.resolve_model(REPO, "refs/pr/1") == _snapshot(cache)


def test_a_missing_repo_or_revision_is_refused_offline_with_how_to_fetch_it(cache):
    with pytest.raises(hub.ModelNotFound) as e:
        hub.resolve_model("test-org/absent")
    assert str(e.value) == (
        f"test-org/absent: not a local folder, and revision main of the Hugging Face repo test-org/absent is "
        f"not in the cache {cache}; HF_HUB_OFFLINE is set, so nothing is downloaded: fetch it with "
        f"`hf download test-org/absent --cache-dir {cache}` where the Hub can be reached"
    )
    assert e.value.name == "test-org/absent" and isinstance(e.value, FileNotFoundError)
    with pytest.raises(hub.ModelNotFound) as e:
        mlx_embed.load(REPO, revision="v2")
    assert e.value.why == (
        f"not a local folder, and revision v2 of the Hugging Face repo {REPO} is not in the cache {cache} "
        f"(cached: main, old, v1); HF_HUB_OFFLINE is set, so nothing is downloaded: fetch it with "
        f"`hf download {REPO} --revision v2 --cache-dir {cache}` where the Hub can be reached"
    )
    # An abbreviated sha is no revision the cache knows (nor huggingface_hub offline).
    with pytest.raises(hub.ModelNotFound, match="revision 0123456 of"):
        hub.resolve_model(REPO, COMMIT[:7])
    with pytest.raises(hub.ModelNotFound, match=r"revision '\.\./x' is not a branch, tag or commit sha"):
        hub.resolve_model(REPO, "../x")


def test_a_revision_or_a_ref_file_cannot_lead_out_of_the_cache(cache, tmp_path):
    """A revision is a path under refs/ and a ref file's text a folder under
    snapshots/: neither may name a folder elsewhere."""
    outside = tmp_path / "outside"
    outside.symlink_to(FIXTURES / "tiny-mpnet")
    refs = cache / "models--test-org--tiny-mpnet" / "refs"
    # A ref file with a path in it (what a junk or hostile ref holds).
    (refs / "evil").write_text(os.path.relpath(outside, refs.parent / "snapshots"))
    (refs / "half").write_text(COMMIT[:20])
    for revision in ("evil", "half"):
        with pytest.raises(hub.ModelNotFound, match=f"revision {revision} of the Hugging Face repo"):
            hub.resolve_model(REPO, revision)
    # A revision that is a path out of refs/, to a file holding a sha.
    (tmp_path / "sha").write_text(COMMIT)
    for revision in (str(tmp_path / "sha"), "v1/../../../../sha", "a//b", "./main", "a\\b", "main\n", " "):
        with pytest.raises(hub.ModelNotFound, match="is not a branch, tag or commit sha: it"):
            hub.resolve_model(REPO, revision)
    # What huggingface_hub writes (no newline) and a newline after it are both read.
    (refs / "nl").write_text(COMMIT + "\n")
    assert hub.resolve_model(REPO, "nl") == _snapshot(cache)


def _partial(cache: Path, files: dict, commit: str = OLD) -> str:
    cache_repo(cache, REPO, files, commit=commit, refs=("partial",))
    return _snapshot(cache, commit)


def test_a_partial_snapshot_is_refused_offline_naming_what_it_lacks(cache):
    """An interrupted download, or an `hf download` of a few files, is no
    model: refused at once, not loaded until the loader trips (or loaded
    without a module)."""
    files = folder_files(FIXTURES / "tiny-mpnet")
    weights = files.pop("model.safetensors")
    lacks = {
        "weights (*.safetensors or pytorch_model.bin)": dict(files),
        "1_Pooling/": {k: v for k, v in files.items() if not k.startswith("1_Pooling/")} | {"x.safetensors": weights},
        "model-00002-of-00002.safetensors": files
        | {
            "model-00001-of-00002.safetensors": weights,
            "model.safetensors.index.json": b'{"weight_map": {"a": "model-00001-of-00002.safetensors", '
            b'"b": "model-00002-of-00002.safetensors"}}',
        },
        "config.json": {k: v for k, v in files.items() if k not in ("config.json", "modules.json")}
        | {"model.safetensors": weights},
        "a tokenizer (tokenizer.json)": {k: v for k, v in files.items() if k != "tokenizer.json"}
        | {"model.safetensors": weights},
    }
    for i, (missing, content) in enumerate(lacks.items()):
        snapshot = _partial(cache, content, commit=f"{i:040x}")
        with pytest.raises(hub.ModelNotFound) as e:
            hub.resolve_model(REPO, "partial")
        assert e.value.why == (
            f"the Hugging Face cache's snapshot {snapshot} lacks {missing}; HF_HUB_OFFLINE is set, so nothing is "
            f"downloaded: fetch it with `hf download {REPO} --revision partial --cache-dir {cache}` where the Hub "
            "can be reached"
        ), missing
    # A file whose blob was deleted.
    snapshot = Path(_partial(cache, files | {"model.safetensors": weights}, commit="f" * 40))
    os.remove(snapshot / os.readlink(snapshot / "tokenizer_config.json"))
    with pytest.raises(hub.ModelNotFound, match=f"snapshot {snapshot} lacks tokenizer_config.json;"):
        hub.resolve_model(REPO, "partial")
    # A sentence-transformers folder of modules alone (a static embedding) needs no config.json.
    del files["config.json"]
    assert hub.missing_files(_partial(cache, files | {"model.safetensors": weights}, commit="e" * 40)) == []


def test_the_cache_folder_follows_huggingface_hubs_order(env, tmp_path):
    home = tmp_path / "home"
    assert hub.hub_cache() == str(home / ".cache" / "huggingface" / "hub")
    env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub.hub_cache() == str(tmp_path / "xdg" / "huggingface" / "hub")
    env.setenv("HF_HOME", str(tmp_path / "hf-home"))
    assert hub.hub_cache() == str(tmp_path / "hf-home" / "hub")
    env.setenv("HUGGINGFACE_HUB_CACHE", str(tmp_path / "legacy"))
    assert hub.hub_cache() == str(tmp_path / "legacy")
    env.setenv("HF_HUB_CACHE", str(tmp_path / "new"))
    assert hub.hub_cache() == str(tmp_path / "new")
    assert hub.hub_cache(str(tmp_path / "given")) == str(tmp_path / "given")
    # The same order as huggingface_hub's constants, read in a fresh process.
    import subprocess
    import sys

    for unset in (
        (),
        ("HF_HUB_CACHE",),
        ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"),
        ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME"),
    ):
        child = {k: v for k, v in os.environ.items() if k not in unset}
        theirs = subprocess.run(
            [sys.executable, "-c", "from huggingface_hub import constants as c; print(c.HF_HUB_CACHE)"],
            env=child,
            capture_output=True,
            text=True,
            check=True,
        )
        for name in unset:
            env.delenv(name, raising=False)
        assert theirs.stdout.strip() == hub.hub_cache(), unset


def test_hf_home_finds_the_cache(cache, env, tmp_path):
    env.delenv("HF_HUB_CACHE")
    (tmp_path / "hf-home").mkdir()
    os.rename(cache, tmp_path / "hf-home" / "hub")
    env.setenv("HF_HOME", str(tmp_path / "hf-home"))
    assert hub.resolve_model(REPO) == str(
        tmp_path / "hf-home" / "hub" / "models--test-org--tiny-mpnet" / "snapshots" / COMMIT
    )


def test_a_local_folder_of_the_same_name_wins(cache, env, tmp_path):
    local = tmp_path / "cwd"
    (local / "test-org").mkdir(parents=True)
    (local / "test-org" / "tiny-mpnet").symlink_to(FIXTURES / "tiny-mpnet")
    env.chdir(local)
    assert hub.resolve_model(REPO) == REPO
    assert hub.resolve_model(REPO, "v1") == REPO
    assert mlx_embed.load(REPO).name == "tiny-mpnet"
    # A path that is not there, and cannot be a repo id, is the loader's to name.
    assert hub.resolve_model(str(tmp_path / "nope")) == str(tmp_path / "nope")
    assert hub.resolve_model("all-MiniLM-L6-v2") == "all-MiniLM-L6-v2"


def test_a_repo_without_an_organization(env, tmp_path):
    root = tmp_path / "cache"
    cache_repo(root, "tiny-mpnet", folder_files(FIXTURES / "tiny-mpnet"), commit=COMMIT)
    env.setenv("HF_HUB_CACHE", str(root))
    path = hub.resolve_model("tiny-mpnet")
    assert path == str(root / "models--tiny-mpnet" / "snapshots" / COMMIT)
    assert loading.served_name(path) == "tiny-mpnet"
    assert hub.snapshot_of(path) == ("tiny-mpnet", COMMIT)
    assert hub.repo_name(str(root / "models--BAAI--bge-reranker-base" / "snapshots" / COMMIT)) == "bge-reranker-base"


def test_only_the_files_the_engine_reads_are_fetched():
    files = [
        "README.md",
        ".gitattributes",
        "config.json",
        "model.safetensors",
        "pytorch_model.bin",
        "tf_model.h5",
        "flax_model.msgpack",
        "onnx/model.onnx",
        "onnx/config.json",
        "tokenizer.json",
        "vocab.txt",
        "sentencepiece.bpe.model",
        "chat_template.jinja",
        "1_Pooling/config.json",
        "2_Dense/config.json",
        "2_Dense/pytorch_model.bin",
        "3_Dense/model.safetensors",
        "3_Dense/pytorch_model.bin",
        "sparse_linear.pt",
        "colbert_linear.pt",
        "artifact.metadata",
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        "openvino/openvino_model.bin",
    ]
    assert hub.engine_files(files) == sorted(
        [
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "vocab.txt",
            "sentencepiece.bpe.model",
            "chat_template.jinja",
            "1_Pooling/config.json",
            "2_Dense/config.json",
            "2_Dense/pytorch_model.bin",
            "3_Dense/model.safetensors",
            "sparse_linear.pt",
            "artifact.metadata",
            "model-00001-of-00002.safetensors",
            "model.safetensors.index.json",
        ]
    )
    # PyTorch weights, sharded or not, where a folder has no safetensors.
    assert hub.engine_files(
        [
            "config.json",
            "pytorch_model-00001-of-00002.bin",
            "pytorch_model.bin.index.json",
            "pytorch_model-00002-of-00002.bin",
        ]
    ) == [
        "config.json",
        "pytorch_model-00001-of-00002.bin",
        "pytorch_model-00002-of-00002.bin",
        "pytorch_model.bin.index.json",
    ]


def test_a_repo_missing_from_the_cache_is_downloaded_from_the_hub(env, tmp_path):
    """The real huggingface_hub client, against the fake Hub, into an empty
    cache: the engine's files only, then served from the cache offline."""
    from huggingface_hub import constants

    env.delenv("HF_HUB_OFFLINE")
    # huggingface_hub read the variable once, when an earlier test imported it.
    env.setattr(constants, "HF_HUB_OFFLINE", False)
    env.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    root = tmp_path / "cache"
    env.setenv("HF_HUB_CACHE", str(root))
    files = folder_files(FIXTURES / "tiny-mpnet")
    # Beside the engine's: what other runtimes and libraries read.
    files.update({"onnx/model.onnx": b"not for us", "pytorch_model.bin": b"the safetensors' twin"})
    with FakeHub() as fake:
        fake.add(REPO, files, commit=COMMIT, refs=("main", "v1"))
        env.setenv("HF_ENDPOINT", fake.url)
        model = mlx_embed.load(REPO)
        assert model.path == _snapshot(root) and model.name == REPO
        fetched = sorted(
            p.split(f"/resolve/{COMMIT}/", 1)[1] for m, p in fake.requests if m == "GET" and "/resolve/" in p
        )
        assert fetched == [
            "1_Pooling/config.json",
            "2_Normalize/config.json",
            "config.json",
            "config_sentence_transformers.json",
            "model.safetensors",
            "modules.json",
            "sentence_bert_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
        assert (root / "models--test-org--tiny-mpnet" / "refs" / "main").read_text() == COMMIT
        assert np.array_equal(model.embed(TEXTS), load_fixture("tiny-mpnet").embed(TEXTS))
        # One lookup of the branch: snapshot_download is told the commit.
        assert [p for _, p in fake.requests if "/revision/" in p] == [f"/api/models/{REPO}/revision/main"]
        # Cached now: offline found without asking the Hub; online, one
        # lookup of the branch (unmoved) and nothing fetched.
        asked = len(fake.requests)
        env.setenv("HF_HUB_OFFLINE", "1")
        assert hub.resolve_model(REPO) == _snapshot(root)
        assert len(fake.requests) == asked
        env.delenv("HF_HUB_OFFLINE")
        assert hub.resolve_model(REPO) == _snapshot(root)
        assert fake.requests[asked:] == [("GET", f"/api/models/{REPO}/revision/main")]
        # A tag not cached yet is looked up, and lands on the same snapshot
        # without a download.
        assert hub.resolve_model(REPO, "v1") == _snapshot(root)
        assert fake.requests[asked + 1 :] == [("GET", f"/api/models/{REPO}/revision/v1")]
        assert (root / "models--test-org--tiny-mpnet" / "refs" / "v1").read_text() == COMMIT
        for absent, revision, error in (
            ("test-org/absent", None, "RepositoryNotFoundError"),
            (REPO, "v9", "RevisionNotFoundError"),
        ):
            with pytest.raises(hub.ModelNotFound) as e:
                hub.resolve_model(absent, revision)
            rev = f" --revision {revision}" if revision else ""
            assert e.value.why.endswith(
                f"and downloading it from {fake.url} failed ({error}: 404 Client Error.): fetch it with "
                f"`hf download {absent}{rev} --cache-dir {root}` where the Hub can be reached"
            ), e.value.why


def test_the_cli_embeds_by_repo_id(cache, tmp_path, capsys):
    from mlx_embed import cli

    out = tmp_path / "vectors.npy"
    assert cli.main(["embed", *TEXTS, "-m", REPO, "--revision", "v1", "-o", str(out), "--progress", "never"]) == 0
    assert np.array_equal(np.load(out), load_fixture("tiny-mpnet").embed(TEXTS))
    assert cli.main(["embed", "x", "-m", REPO, "--revision", "v2", "--progress", "never"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"mlx-embed: error: {REPO}: not a local folder, and revision v2 of"), err
    assert "Traceback" not in err


@pytest.fixture
def online(env, tmp_path):
    """No HF_HUB_OFFLINE, an empty cache; yields the cache folder."""
    from huggingface_hub import constants

    env.delenv("HF_HUB_OFFLINE")
    env.setattr(constants, "HF_HUB_OFFLINE", False)
    env.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    root = tmp_path / "cache"
    env.setenv("HF_HUB_CACHE", str(root))
    return root


def test_a_partial_snapshot_is_filled_from_the_hub_online(online, env):
    files = folder_files(FIXTURES / "tiny-mpnet")
    snapshot = cache_repo(online, REPO, {"config.json": files["config.json"]}, commit=COMMIT)
    with FakeHub() as fake:
        fake.add(REPO, files, commit=COMMIT)
        env.setenv("HF_ENDPOINT", fake.url)
        assert hub.resolve_model(REPO) == str(snapshot)
        fetched = {p.split(f"/resolve/{COMMIT}/", 1)[1] for m, p in fake.requests if m == "GET" and "/resolve/" in p}
    assert {"model.safetensors", "tokenizer.json", "1_Pooling/config.json"} <= fetched, fetched
    assert hub.missing_files(str(snapshot)) == []
    assert np.array_equal(mlx_embed.load(REPO).embed(TEXTS), load_fixture("tiny-mpnet").embed(TEXTS))


def test_a_hub_that_has_no_weights_is_refused_by_name(online, env):
    files = {"config.json": b"{}", "tf_model.h5": b"not ours"}
    with FakeHub() as fake:
        fake.add(REPO, files, commit=COMMIT)
        env.setenv("HF_ENDPOINT", fake.url)
        with pytest.raises(hub.ModelNotFound) as e:
            hub.resolve_model(REPO)
    assert e.value.why == (
        f"the Hub's revision main of {REPO} lacks a tokenizer (tokenizer.json), weights (*.safetensors or "
        "pytorch_model.bin)"
    )


def test_an_unreachable_hub_fails_at_once_and_shows_no_secret(online, env, caplog):
    """A refused connection is said at once (huggingface_hub's tree listing
    retried it five times: 24 s), and neither a mirror's password nor the
    token shows in the message or the log."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env.setenv("HF_ENDPOINT", f"http://user:s3cret-pw@127.0.0.1:{port}")
    env.setenv("HF_TOKEN", "hf_s3cretTokenValue")
    start = time.monotonic()
    with caplog.at_level("DEBUG"), pytest.raises(hub.ModelNotFound) as e:
        hub.resolve_model(REPO)
    took = time.monotonic() - start
    assert took < 5, took
    assert f"downloading it from http://***@127.0.0.1:{port} failed (ConnectError:" in e.value.why, e.value.why
    for text in (e.value.why, caplog.text):
        assert "s3cret" not in text, text


def test_bulk_takes_a_repo_id_at_a_revision_and_pins_its_commit(cache, env, tmp_path):
    """`mlx-embed bulk --revision` reaches run_bulk; the identity a job
    records names the commit, which every actor then loads."""
    pytest.importorskip("ray")
    import pyarrow as pa

    from mlx_embed import cli
    from mlx_embed import ray as bulk

    identity = bulk.model_identity(REPO, revision="v1")
    assert (identity["commit"], identity["path"]) == (COMMIT, os.path.realpath(_snapshot(cache)))
    assert bulk.model_identity(_snapshot(cache))["commit"] is None
    table = bulk.MlxEmbedder(REPO, revision=COMMIT, workers=1)(pa.table({"id": [1, 2, 3], "text": TEXTS}))
    got = np.asarray(table.column("embedding").to_pylist(), dtype=np.float32)
    assert np.array_equal(got, load_fixture("tiny-mpnet").embed(TEXTS))
    with pytest.raises(hub.ModelNotFound, match="revision v2 of"):
        bulk.MlxEmbedder(REPO, revision="v2", workers=1)

    import ray

    seen = {}

    def fake_run_bulk(inputs, output, **kwargs):
        seen.update(kwargs)
        raise bulk.BulkError("stop here")

    corpus = tmp_path / "in.jsonl"
    corpus.write_text('{"id": 1, "text": "x"}\n')
    env.setattr(ray, "is_initialized", lambda: True)
    env.setattr(bulk, "run_bulk", fake_run_bulk)
    assert cli.main(["bulk", str(corpus), "-o", str(tmp_path / "out"), "-m", REPO, "--revision", "v1"]) == 1
    assert (seen["model"], seen["revision"]) == (REPO, "v1")


def test_a_busy_hub_is_asked_again(online, env):
    """A 503 from the Hub is waited out (huggingface_hub's retried statuses),
    a refused connection is not (the test above)."""
    env.setattr(hub, "_WAITS", (0.01, 0.01, 0.01))
    with FakeHub() as fake:
        fake.add(REPO, folder_files(FIXTURES / "tiny-mpnet"), commit=COMMIT)
        env.setenv("HF_ENDPOINT", fake.url)
        fake.unavailable = 2
        assert hub.resolve_model(REPO) == _snapshot(online)
        fake.unavailable = 10
        with pytest.raises(hub.ModelNotFound, match=r"failed \(HfHubHTTPError: .*503"):
            hub.resolve_model("test-org/other")
        assert fake.unavailable == 6  # four tries


def _moved(old_files: dict) -> dict:
    """tiny-mpnet's files as a later commit has them: CLS pooling instead of
    the mean (other vectors, from one changed file), and an ONNX export."""
    pooling = json.loads(old_files["1_Pooling/config.json"])
    pooling["pooling_mode_mean_tokens"], pooling["pooling_mode_cls_token"] = False, True
    return old_files | {"1_Pooling/config.json": json.dumps(pooling).encode(), "onnx/model.onnx": b"not for us"}


def _lookups(fake) -> list[str]:
    return [p.rsplit("/revision/", 1)[1] for _, p in fake.requests if "/revision/" in p]


def test_a_branch_that_moved_on_the_hub_is_fetched_again(online, env, tmp_path, caplog):
    """As huggingface_hub does for sentence-transformers: one lookup of the
    branch; it moved, so the new commit's engine files are fetched (what
    the old one shares is linked, not fetched again), refs/main follows,
    and the new files' vectors come out. A tag that stayed put is looked up
    and nothing more."""
    old_files = folder_files(FIXTURES / "tiny-mpnet")
    cache_repo(online, REPO, old_files, commit=OLD, refs=("main", "v1"))
    new_files = _moved(old_files)
    folder = tmp_path / "new-commit"
    for rel, data in new_files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    with FakeHub() as fake:
        fake.add(REPO, old_files, commit=OLD, refs=("main", "v1"))
        fake.add(REPO, new_files, commit=COMMIT, refs=("main",))
        env.setenv("HF_ENDPOINT", fake.url)
        with caplog.at_level("INFO", logger="mlx_embed"):
            assert hub.resolve_model(REPO) == _snapshot(online, COMMIT)
        assert f"{REPO}: revision main moved on the Hub from commit {OLD} to {COMMIT}: fetching it" in caplog.text
        assert _lookups(fake) == ["main"]
        fetched = [p.split(f"/resolve/{COMMIT}/", 1)[1] for m, p in fake.requests if m == "GET" and "/resolve/" in p]
        assert fetched == ["1_Pooling/config.json"]
        assert not any("onnx" in p for _, p in fake.requests)
        refs = online / "models--test-org--tiny-mpnet" / "refs"
        assert (refs / "main").read_text() == COMMIT and (refs / "v1").read_text() == OLD
        assert hub.missing_files(_snapshot(online, COMMIT)) == []
        assert sorted(os.listdir(refs)) == ["main", "v1"]  # no scratch file left
        # Served: the new files' vectors, not the cached commit's.
        asked = len(fake.requests)
        got = mlx_embed.load(REPO).embed(TEXTS)
        assert np.array_equal(got, mlx_embed.load(folder).embed(TEXTS))
        assert not np.allclose(got, load_fixture("tiny-mpnet").embed(TEXTS), atol=1e-3)
        # Unmoved now, and the tag never moved: one lookup each, nothing fetched.
        assert hub.resolve_model(REPO, "v1") == _snapshot(online, OLD)
        assert fake.requests[asked:] == [
            ("GET", f"/api/models/{REPO}/revision/main"),
            ("GET", f"/api/models/{REPO}/revision/v1"),
        ]
        # A full sha is its snapshot for good: no request.
        assert hub.resolve_model(REPO, OLD) == _snapshot(online, OLD)
        assert len(fake.requests) == asked + 2


def test_a_branch_that_moved_to_a_cached_commit_is_not_fetched(online, env):
    files = folder_files(FIXTURES / "tiny-mpnet")
    cache_repo(online, REPO, files, commit=OLD, refs=("main",))
    cache_repo(online, REPO, _moved(files), commit=COMMIT, refs=("v2",))
    with FakeHub() as fake:
        fake.add(REPO, files, commit=OLD)
        fake.add(REPO, _moved(files), commit=COMMIT, refs=("main", "v2"))
        env.setenv("HF_ENDPOINT", fake.url)
        assert hub.resolve_model(REPO) == _snapshot(online, COMMIT)
        assert fake.requests == [("GET", f"/api/models/{REPO}/revision/main")]
    assert (online / "models--test-org--tiny-mpnet" / "refs" / "main").read_text() == COMMIT


def test_offline_a_cached_branch_serves_without_a_request(env, tmp_path):
    """HF_HUB_OFFLINE: the cache's commit, even where the Hub has moved on,
    and not one request."""
    root = tmp_path / "cache"
    files = folder_files(FIXTURES / "tiny-mpnet")
    cache_repo(root, REPO, files, commit=OLD)
    env.setenv("HF_HUB_CACHE", str(root))
    with FakeHub() as fake:
        fake.add(REPO, _moved(files), commit=COMMIT)
        env.setenv("HF_ENDPOINT", fake.url)
        assert hub.resolve_model(REPO) == _snapshot(root, OLD)
        assert np.array_equal(mlx_embed.load(REPO).embed(TEXTS), load_fixture("tiny-mpnet").embed(TEXTS))
        assert fake.requests == []
    assert (root / "models--test-org--tiny-mpnet" / "refs" / "main").read_text() == OLD


def test_a_hub_that_cannot_be_asked_leaves_the_cached_commit_serving(online, env, caplog):
    """Refused at once, silent past HF_HUB_ETAG_TIMEOUT, busy (not waited
    out: the cache serves), or refusing the token: the cached snapshot,
    with one warning that names its commit and no secret."""
    import socket
    import time

    cache_repo(online, REPO, folder_files(FIXTURES / "tiny-mpnet"), commit=OLD)
    env.setenv("HF_TOKEN", "hf_s3cretTokenValue")
    with socket.socket() as refused, socket.socket() as silent:
        refused.bind(("127.0.0.1", 0))
        # Listening but never accepting: the connection is made, no answer comes.
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        env.setenv("HF_HUB_ETAG_TIMEOUT", "1")
        for where, limit, error in (
            (f"http://user:s3cret-pw@127.0.0.1:{refused.getsockname()[1]}", 1.0, "ConnectError"),
            (f"http://127.0.0.1:{silent.getsockname()[1]}", 3.0, "ReadTimeout"),
        ):
            env.setenv("HF_ENDPOINT", where)
            caplog.clear()
            start = time.monotonic()
            with caplog.at_level("DEBUG"):
                assert hub.resolve_model(REPO) == _snapshot(online, OLD)
            took = time.monotonic() - start
            assert took < limit, (where, took)
            warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
            assert len(warnings) == 1, warnings
            shown = hub._hide_userinfo(where)
            assert warnings[0].startswith(f"{REPO}: could not ask {shown} which commit revision main is ({error}"), (
                warnings
            )
            assert warnings[0].endswith(f"): serving the cached commit {OLD}"), warnings
            assert "s3cret" not in caplog.text
    env.setattr(hub, "_WAITS", (5.0, 5.0, 5.0))
    with FakeHub() as fake:
        env.setenv("HF_ENDPOINT", fake.url)
        fake.add("test-org/other", {}, commit=COMMIT)  # REPO itself: 404 RepositoryNotFound, as a gated one's
        fake.unavailable = 1
        caplog.clear()
        with caplog.at_level("WARNING"):
            assert hub.resolve_model(REPO) == _snapshot(online, OLD)
            assert hub.resolve_model(REPO) == _snapshot(online, OLD)
        assert len(fake.requests) == 2
        warnings = [r.getMessage() for r in caplog.records]
        assert [w.split("(", 1)[1].split(":", 1)[0] for w in warnings] == ["HfHubHTTPError", "RepositoryNotFoundError"]


def test_a_branch_gone_from_the_hub_is_refused_naming_the_cached_commit(online, env):
    """The Hub answered that the revision does not exist (huggingface_hub
    refuses it too): no cache hides that; its commit stays servable by sha."""
    cache_repo(online, REPO, folder_files(FIXTURES / "tiny-mpnet"), commit=OLD, refs=("wip",))
    with FakeHub() as fake:
        fake.add(REPO, {}, commit=COMMIT)
        env.setenv("HF_ENDPOINT", fake.url)
        with pytest.raises(hub.ModelNotFound) as e:
            hub.resolve_model(REPO, "wip")
    assert e.value.why == (
        f"the Hub {fake.url} has no revision wip of {REPO} (RevisionNotFoundError: 404 Client Error.); the cache "
        f"{online} holds it at commit {OLD}: name that commit as the revision to serve it"
    )


def test_offline_reads_the_variables_as_huggingface_hub_does(env):
    import subprocess
    import sys

    for hf, transformers in (
        ("1", None),
        ("true", None),
        ("ON", None),
        ("yes", None),
        ("0", None),
        ("false", None),
        ("", None),
        (None, "1"),
        ("0", "1"),
        ("", "1"),
        (None, None),
    ):
        for name, value in (("HF_HUB_OFFLINE", hf), ("TRANSFORMERS_OFFLINE", transformers)):
            if value is None:
                env.delenv(name, raising=False)
            else:
                env.setenv(name, value)
        theirs = subprocess.run(
            [sys.executable, "-c", "from huggingface_hub import constants as c; print(c.HF_HUB_OFFLINE)"],
            env=dict(os.environ),
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert str(hub.offline()) == theirs, (hf, transformers)


def test_a_normalize_module_without_a_folder_is_whole(online, env):
    """sentence-transformers saves a Normalize module's folder empty, and the
    Hub keeps no empty folder (nomic-embed-text-v1.5's 2_Normalize, potion's
    1_Normalize, as the fixtures are laid out): such a repo downloads and
    serves offline, not refused as lacking that folder."""
    for fixture in ("tiny-nomic-bert", "tiny-model2vec", "tiny-bge-m3"):
        assert hub.missing_files(str(FIXTURES / fixture)) == [], fixture
    with FakeHub() as fake:
        fake.add(REPO, folder_files(FIXTURES / "tiny-nomic-bert"), commit=COMMIT)
        env.setenv("HF_ENDPOINT", fake.url)
        assert hub.resolve_model(REPO) == _snapshot(online)
    assert not os.path.exists(os.path.join(_snapshot(online), "2_Normalize"))
    env.setenv("HF_HUB_OFFLINE", "1")
    assert hub.resolve_model(REPO) == _snapshot(online)
    assert np.array_equal(mlx_embed.load(REPO).embed(TEXTS), load_fixture("tiny-nomic-bert").embed(TEXTS))


def test_a_snapshot_cut_short_is_completed_from_the_hubs_listing(online, env):
    """A download cut short (a crash, or a second server still fetching)
    leaves a file's folder made before the file: 1_Pooling/ without its
    config, which was taken for whole and the loader then refused at every
    start. Now that file alone is fetched: where the branch moved to that
    commit and where it was there already."""
    old_files = folder_files(FIXTURES / "tiny-mpnet")
    new_files = _moved(old_files)
    cache_repo(online, REPO, old_files, commit=OLD, refs=("main",))
    kept = {f: new_files[f] for f in hub.engine_files(new_files) if f != "1_Pooling/config.json"}
    cut = cache_repo(online, REPO, kept, commit=COMMIT, refs=("v2",))
    (cut / "1_Pooling").mkdir()
    # The cache alone tells it from the empty folder (offline, or by sha).
    assert hub.missing_files(str(cut)) == ["1_Pooling/"]
    with FakeHub() as fake:
        fake.add(REPO, old_files, commit=OLD)
        fake.add(REPO, new_files, commit=COMMIT, refs=("main", "v2"))
        env.setenv("HF_ENDPOINT", fake.url)
        for revision in ("main", "v2"):
            asked = len(fake.requests)
            assert hub.resolve_model(REPO, revision) == str(cut), revision
            fetched = {p.split(f"/resolve/{COMMIT}/", 1)[1] for _, p in fake.requests[asked:] if "/resolve/" in p}
            assert fetched == {"1_Pooling/config.json"}, (revision, fetched)
            assert (cut / "1_Pooling" / "config.json").read_bytes() == new_files["1_Pooling/config.json"]
            (cut / "1_Pooling" / "config.json").unlink()  # cut short again, for the tag
        (cut / "1_Pooling" / "config.json").symlink_to("../../../blobs/" + etag(new_files["1_Pooling/config.json"]))
        asked = len(fake.requests)
        assert mlx_embed.load(REPO).embed(TEXTS).shape == (len(TEXTS), 64)
        assert fake.requests[asked:] == [("GET", f"/api/models/{REPO}/revision/main")]


def test_a_timeout_variable_huggingface_hub_refuses_is_named_and_the_cache_serves(online, env):
    """huggingface_hub's client will not import over HF_HUB_ETAG_TIMEOUT=abc
    (nor 1.5), with an error that names no variable: a cached snapshot still
    serves, with a warning naming the variable, and a model not cached is
    refused naming it. In a fresh process: this one imported the client."""
    import subprocess
    import sys

    cache_repo(online, REPO, folder_files(FIXTURES / "tiny-mpnet"), commit=OLD)
    env.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    script = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.WARNING, format='%(levelname)s %(message)s', stream=sys.stdout)\n"
        "from mlx_embed import hub\n"
        f"print(hub.resolve_model({REPO!r}))\n"
        "try:\n"
        "    hub.resolve_model('test-org/absent')\n"
        "except hub.ModelNotFound as e:\n"
        "    print('REFUSED', e.why)\n"
    )
    for value in ("abc", "1.5"):
        env.setenv("HF_HUB_ETAG_TIMEOUT", value)
        run = subprocess.run([sys.executable, "-c", script], env=dict(os.environ), capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        named = (
            f"ValueError: huggingface_hub cannot start: HF_HUB_ETAG_TIMEOUT={value!r} is not a whole number of seconds"
        )
        # huggingface_hub prints its own import error to stdout too.
        lines = [line for line in run.stdout.splitlines() if not line.startswith("Error importing huggingface_hub")]
        assert lines[0] == (
            f"WARNING {REPO}: could not ask http://127.0.0.1:9 which commit revision main is ({named}): "
            f"serving the cached commit {OLD}"
        ), run.stdout
        assert lines[1] == _snapshot(online, OLD), run.stdout
        assert lines[2].startswith("REFUSED not a local folder") and f"({named})" in lines[2], run.stdout


def test_a_ref_that_cannot_be_written_leaves_no_scratch_file(env, tmp_path, caplog):
    """The ref is written to a scratch file renamed over it; where the rename
    fails (here a folder stands where the ref goes), the scratch file goes
    too: left in refs/, huggingface_hub's cache scan takes it for a ref to no
    commit and calls the repo corrupted."""
    from huggingface_hub import scan_cache_dir

    root = tmp_path / "cache"
    cache_repo(root, REPO, folder_files(FIXTURES / "tiny-mpnet"), commit=COMMIT, refs=("v1",))
    refs = root / "models--test-org--tiny-mpnet" / "refs"
    (refs / "main").mkdir()
    with caplog.at_level("WARNING"):
        hub._write_ref(str(root), REPO, "main", COMMIT)
    assert f"{REPO}: could not record revision main as commit {COMMIT} in the cache" in caplog.text
    assert sorted(os.listdir(refs)) == ["main", "v1"]
    (refs / "main").rmdir()
    assert scan_cache_dir(root).warnings == []


def test_a_cached_commit_short_of_a_listed_file_serves_where_it_cannot_be_fetched(online, env, caplog):
    """A snapshot that lacks a file the Hub lists but the loader can do
    without (a cache made by `hf download --include ...`): that file is
    fetched; where it cannot be (a read-only cache), the snapshot serves as
    it is, with a warning, as it did before the Hub's listing was read."""
    files = folder_files(FIXTURES / "tiny-mpnet")
    snapshot = cache_repo(
        online, REPO, {f: d for f, d in files.items() if f != "config_sentence_transformers.json"}, commit=COMMIT
    )
    with FakeHub() as fake:
        fake.add(REPO, files, commit=COMMIT)
        env.setenv("HF_ENDPOINT", fake.url)

        def read_only(*args, **kwargs):
            raise OSError(30, "Read-only file system")

        with env.context() as patched, caplog.at_level("WARNING"):
            patched.setattr(hub, "download", read_only)
            assert hub.resolve_model(REPO) == str(snapshot)
        assert [r.getMessage() for r in caplog.records] == [
            f"{REPO}: fetching commit {COMMIT} of revision main from {fake.url} failed (OSError: [Errno 30] "
            f"Read-only file system): serving the cached commit {COMMIT}"
        ]
        asked = len(fake.requests)
        assert hub.resolve_model(REPO) == str(snapshot)
        fetched = {p.split(f"/resolve/{COMMIT}/", 1)[1] for _, p in fake.requests[asked:] if "/resolve/" in p}
        assert fetched == {"config_sentence_transformers.json"}
