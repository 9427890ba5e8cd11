"""TEI's ``/embed_sparse`` (SPLADE) end to end on the real server binary,
against sentence-transformers' SparseEncoder references of the tiny-splade
fixture (tests/fixtures/tiny-splade/README.md).

One server serves a dense model first and the SPLADE model second, so the
unnamed sparse route must find the SPLADE model and the unnamed dense routes
the dense one; a second server loads a bare BertForMaskedLM folder with
``--pooling splade`` (TEI's flag)."""

from __future__ import annotations

import json
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests

from harness import FIXTURES, NOMIC, non_empty_golden, start_server

SPLADE = FIXTURES / "tiny-splade"
VOCAB = 3000
MAX_LENGTH = 128


def _reference(name: str = "reference_max.npz", dtype=np.float32) -> np.ndarray:
    """A tiny-splade reference (its rows stored sparse), vocabulary-wide."""
    with np.load(SPLADE / name, allow_pickle=False) as ref:
        offsets, indices, values = ref["offsets"], ref["indices"], ref["values"]
    out = np.zeros((len(offsets) - 1, VOCAB), dtype=dtype)
    for i in range(len(offsets) - 1):
        out[i, indices[offsets[i]: offsets[i + 1]]] = values[offsets[i]: offsets[i + 1]]
    return out


def _dense(answer: list) -> np.ndarray:
    """A /embed_sparse answer as vocabulary-wide rows, checking its form."""
    out = np.zeros((len(answer), VOCAB), dtype=np.float32)
    for i, entries in enumerate(answer):
        assert entries, "a SPLADE vector is never empty"
        idx = [e["index"] for e in entries]
        assert idx == sorted(set(idx)), "indices in increasing order, each once"
        assert all(set(e) == {"index", "value"} and e["value"] > 0 for e in entries)
        out[i, idx] = [e["value"] for e in entries]
    return out


def _assert_matches(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 5e-5
    cos = (got * want).sum(axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cos.min() >= 0.99999
    differ = (got > 0) != (want > 0)
    assert np.maximum(got, want)[differ].max(initial=0.0) < 1e-4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("sparse"), "--model", str(NOMIC),
                       "--model", str(SPLADE), "--no-warmup")
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def test_sparse_vectors_match_the_sparse_encoder(pair, golden):
    texts, _, idx = non_empty_golden(golden, 40)
    r = pair.post("/embed_sparse", {"inputs": texts})
    assert r.status_code == 200, r.text
    _assert_matches(_dense(r.json()), _reference()[idx])
    # The same raw vectors on the dense routes when the SPLADE model is named.
    r = pair.post("/embed", {"model": "tiny-splade", "inputs": texts[:6], "normalize": False})
    assert r.status_code == 200, r.text
    dense = np.array(r.json(), dtype=np.float32)
    assert dense.shape == (6, VOCAB)
    _assert_matches(dense, _reference()[idx[:6]])
    r = pair.post("/v1/embeddings", {"model": "tiny-splade", "input": texts[:2]})
    assert r.status_code == 200, r.text
    unit = np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)
    assert np.abs(np.linalg.norm(unit, axis=1) - 1).max() < 1e-5


def test_models_are_picked_by_task(pair):
    # Unnamed dense routes: the first model (NomicBERT), not the SPLADE one.
    r = pair.post("/embed", {"inputs": "hello"})
    assert r.status_code == 200 and len(r.json()[0]) != VOCAB
    # The dense model named on the sparse route: a 400 in TEI's shape.
    r = pair.post("/embed_sparse", {"model": "tiny-nomic-bert", "inputs": "hello"})
    assert r.status_code == 400
    body = r.json()
    assert body["error_type"] == "Validation" and "a sparse model (SPLADE" in body["error"]
    # An unknown name on the sparse route: the one model that can answer it.
    r = pair.post("/embed_sparse", {"model": "nope", "inputs": "hello"})
    assert r.status_code == 200 and r.json() == pair.post("/embed_sparse", {"inputs": "hello"}).json()
    # Both answer dense vectors: there an unknown name is a 404.
    assert pair.post("/embed", {"model": "nope", "inputs": "hello"}).status_code == 404
    info = pair.get("/info").json()
    assert [(m["model"], m["sparse"], m["dimension"]) for m in info["models"]] == [
        ("tiny-nomic-bert", False, info["models"][0]["dimension"]),
        ("tiny-splade", True, VOCAB),
    ]
    # Each model's own prompts and pooling, not only the default model's.
    nomic, splade = info["models"]
    assert (nomic["prompts"], nomic["default_prompt_name"]) == (info["prompts"], "document")
    assert set(nomic["prompts"]) == {"query", "document", "classification", "clustering"}
    assert (splade["prompts"], splade["default_prompt_name"]) == ({"document": "", "query": ""}, None)
    assert (nomic["pooling"], splade["pooling"]) == ("mean", "splade")
    doc = pair.get("/openapi.json").json()
    assert "/embed_sparse" in doc["paths"]


def test_the_root_route_answers_a_splade_model_sparse(pair):
    """TEI serves a SPLADE model's /embed_sparse at `POST /` (as /invocations
    here): its root answered dense vocabulary-wide vectors instead."""
    body = {"model": "tiny-splade", "inputs": ["hello world", "second text"]}
    want = pair.post("/embed_sparse", body).json()
    for path in ("/", "/invocations"):
        r = pair.post(path, body)
        assert r.status_code == 200, (path, r.text)
        assert r.json() == want, path
    # The dense model still answers vectors there.
    r = pair.post("/", {"inputs": "hello world"})
    assert r.status_code == 200, r.text
    assert r.json() == pair.post("/embed", {"inputs": "hello world"}).json()


def test_request_options(pair, golden):
    one = pair.post("/embed_sparse", {"inputs": "hello world"})
    assert one.status_code == 200, one.text
    assert len(one.json()) == 1
    both = pair.post("/embed_sparse", {"inputs": ["hello world", "hello world"],
                                       "prompt_name": "query"})
    assert both.status_code == 200, both.text
    assert both.json()[0] == both.json()[1] == one.json()[0]  # the query prompt is ""
    long = "one two three four five six seven eight nine ten " * 30
    left = _dense(pair.post("/embed_sparse", {"inputs": long, "truncation_direction": "Left"}).json())
    right = _dense(pair.post("/embed_sparse", {"inputs": long}).json())
    assert np.abs(left - right).max() > 0.01  # each side kept its own end
    for body, status in [
        ({"inputs": long, "truncate": False}, 422),
        ({"inputs": []}, 400),
        ({"inputs": [""]}, 400),
        ({"inputs": "a", "prompt_name": "nope"}, 400),
        ({"input": "a"}, 422),
    ]:
        r = pair.post("/embed_sparse", body)
        assert r.status_code == status, (body, r.text)
        assert set(r.json()) == {"error", "error_type"}


def test_dimensions_are_refused_on_a_sparse_model(pair):
    """SPLADE vectors are one weight per vocabulary entry: their first N are
    no embedding, so every route's cut is a 400 pointing to /embed_sparse."""
    message = ("tiny-splade is a sparse (SPLADE) model: its vectors are vocabulary weights and {f} cannot cut "
               "them; leave {f} out, or use /embed_sparse for the non-zero weights")
    for path, body, field in [
        ("/v1/embeddings", {"input": "hello", "dimensions": 10}, "dimensions"),
        ("/v2/embed", {"texts": ["hello"], "output_dimension": 10}, "output_dimension"),
        ("/embed", {"inputs": "hello", "dimensions": 10}, "dimensions"),
        ("/api/v1/embed", {"texts": ["hello"], "dimensions": VOCAB}, "dimensions"),
        ("/api/embed", {"input": "hello", "dimensions": 10}, "dimensions"),
    ]:
        r = pair.post(path, {"model": "tiny-splade", **body})
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        got = error if isinstance(error, str) else error["message"]
        assert got == message.format(f=field), path
        if path in ("/v1/embeddings", "/v2/embed"):
            assert error["param"] == field
    # The dense model next to it still takes dimensions.
    r = pair.post("/v1/embeddings", {"model": "tiny-nomic-bert", "input": "hello", "dimensions": 8})
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 8, r.text


def test_concurrent_callers_get_their_own_vectors(pair, golden):
    texts, _, idx = non_empty_golden(golden, 24)
    want = _reference()[idx]

    def one(i: int) -> tuple[int, np.ndarray]:
        r = requests.post(pair.url + "/embed_sparse", json={"inputs": [texts[i]]}, timeout=60)
        assert r.status_code == 200, r.text
        return i, _dense(r.json())[0]

    with ThreadPoolExecutor(8) as pool:
        got = dict(pool.map(one, range(len(texts))))
    _assert_matches(np.stack([got[i] for i in range(len(texts))]), want)


def test_a_dense_server_refuses_sparse(server):
    r = server.post("/embed_sparse", {"inputs": "hello"})
    assert r.status_code == 400
    assert "--pooling splade" in r.json()["error"]


def test_pooling_flag_makes_a_masked_lm_folder_sparse(tmp_path, golden):
    bare = tmp_path / "bare-mlm"
    shutil.copytree(SPLADE, bare)
    for extra in ("modules.json", "config_sentence_transformers.json"):
        (bare / extra).unlink()
    shutil.rmtree(bare / "1_SpladePooling")
    srv = start_server(tmp_path, "--model", str(bare), "--pooling", "splade", "--no-warmup")
    try:
        texts, _, idx = non_empty_golden(golden, 8)
        r = srv.post("/embed_sparse", {"inputs": texts})
        assert r.status_code == 200, r.text
        _assert_matches(_dense(r.json()), _reference()[idx])
        info = srv.get("/info").json()
        assert info["model_type"] == {"embedding": {"pooling": "splade"}}
        assert info["sparse"] is True and info["max_input_length"] == MAX_LENGTH
        assert json.loads((bare / "config.json").read_text())["architectures"] == ["BertForMaskedLM"]
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]


def _metric(srv, name: str) -> float:
    for line in srv.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name}")


def test_sparse_answers_keep_room_like_dense_ones(tmp_path):
    """Room is kept for a SPLADE answer once it is computed, for its entries,
    so clients that never read sparse answers cannot hold more than
    --max-unsent-answers-mb (sparse requests kept none: 12 unread ones held
    45 MB past a 16 MB room), while a query's small answer never waits (kept
    before, at one entry per vocabulary word, a one-word query was told at
    1.1 MB and refused 429 behind a large call)."""
    srv = start_server(tmp_path, "--model", str(SPLADE), "--no-warmup", "--max-unsent-answers-mb", "1",
                       "--max-queue-wait-ms", "1000")
    unread = socket.socket()
    try:
        unread.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        unread.connect(("127.0.0.1", int(srv.url.rsplit(":", 1)[1])))
        # The most inputs a request takes: ~50 non-zero entries each (of
        # tiny-splade's 3000), an answer of over 2 MiB, twice the room.
        body = json.dumps({"inputs": [f"text number {i} about sparse retrieval" for i in range(2048)]}).encode()
        unread.sendall(b"POST /embed_sparse HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.monotonic() + 60
        while _metric(srv, "mlx_embed_http_unsent_answer_bytes") < 2 << 20:
            assert time.monotonic() < deadline, "the unread answer was never counted"
            time.sleep(0.05)
        # A query's answer is small: it does not wait.
        started = time.monotonic()
        r = srv.post("/embed_sparse", {"inputs": "one more"})
        assert r.status_code == 200, r.text
        assert time.monotonic() - started < 0.9, "the query waited for the room"
        # Another large one waits for the room, then 429.
        r = srv.post("/embed_sparse", {"inputs": [f"another text {i} about sparse retrieval" for i in range(2048)]})
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "1"
        assert "--max-unsent-answers-mb" in r.json()["error"]
    finally:
        unread.close()
    deadline = time.monotonic() + 30
    while _metric(srv, "mlx_embed_http_unsent_answer_bytes") > 0:
        assert time.monotonic() < deadline, "the closed connection's answer was kept"
        time.sleep(0.05)
    r = srv.post("/embed_sparse", {"inputs": [f"another text {i} about sparse retrieval" for i in range(2048)]})
    assert r.status_code == 200, r.text
    assert srv.stop() == 0, srv.log()[-3000:]


def test_long_inputs_match_float64(tmp_path):
    """Short texts and texts cut at 512 tokens in one request, sum and max
    pooling, against the float64 references (tests/python/test_sparse_long_inputs.py
    says where the bounds come from; sentence-transformers in float32 is 6.3e-5 and
    8.4e-6 off them)."""
    summed = tmp_path / "tiny-splade-sum"
    shutil.copytree(SPLADE, summed)
    cfg = summed / "1_SpladePooling" / "config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "pooling_strategy": "sum"}))
    texts = json.loads((SPLADE / "reference_long_texts.json").read_text(encoding="utf-8"))
    srv = start_server(tmp_path, "--model", str(SPLADE), "--model", str(summed),
                       "--max-input-tokens", "512", "--no-warmup")
    try:
        for model, name, bound in (("tiny-splade", "max", 5e-6), ("tiny-splade-sum", "sum", 6e-5)):
            r = srv.post("/embed_sparse", {"model": model, "inputs": texts})
            assert r.status_code == 200, r.text
            got = _dense(r.json()).astype(np.float64)
            want = _reference(f"reference_long_{name}.npz", np.float64)
            assert np.abs(got - want).max() <= bound, name
            differ = (got > 0) != (want > 0)
            assert np.maximum(got, want)[differ].max(initial=0.0) < 1e-4
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
