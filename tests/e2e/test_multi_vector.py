"""Jina's ``POST /v1/multi-vector`` (ColBERT) end to end on the real server
binary, against PyLate's references of the tiny-colbert fixture
(tests/fixtures/tiny-colbert/README.md): the token counts exactly, every row
within cosine 0.99999 of PyLate's, and the refusals in OpenAI's error shape.

One server serves a pooling model first and the ColBERT model second: the
unnamed multi-vector route must find the ColBERT model, the unnamed pooled
routes the other one, and the ColBERT model named on a pooled route is a 400
that names /v1/multi-vector."""

from __future__ import annotations

import json

import numpy as np
import pytest
import requests

from harness import FIXTURES, NOMIC, start_server

COLBERT = FIXTURES / "tiny-colbert"
MIN_COS = 0.99999


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("colbert"), "--model", str(NOMIC),
                       "--model", str(COLBERT), "--no-warmup")
    yield srv
    srv.stop()


def _reference(side: str) -> list:
    ref = np.load(COLBERT / "reference.npz")
    return np.split(ref[f"{side}_vectors"], np.cumsum(ref[f"{side}_rows"])[:-1])


def _texts(side: str) -> list:
    return json.loads((COLBERT / "texts.json").read_text(encoding="utf-8"))[f"{side}s" if side == "document" else "queries"]


@pytest.mark.parametrize("side", ["query", "document"])
def test_vectors_match_pylate(server, side):
    texts = [t for t in _texts(side) if t]  # an empty text is a 400, as on every route
    want = [w for t, w in zip(_texts(side), _reference(side)) if t]
    body = {"input": texts if side == "query" else [{"text": t} for t in texts]}
    if side == "query":
        body["input_type"] = "query"
    r = requests.post(f"{server.url}/v1/multi-vector", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "list" and out["model"] == "tiny-colbert"
    assert [d["index"] for d in out["data"]] == list(range(len(texts)))
    assert all(d["object"] == "embeddings" for d in out["data"])
    worst = 1.0
    for d, w in zip(out["data"], want):
        got = np.array(d["embeddings"], dtype=np.float64)
        assert got.shape == w.shape
        cos = (got * w).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(w, axis=1)
        worst = min(worst, float(cos.min()))
    assert worst >= MIN_COS
    print(f"{side}: lowest per-token cosine {worst:.9f}")
    # Tokens run: a query is query_length (16) each; usage counts them all.
    if side == "query":
        assert out["usage"]["prompt_tokens"] == 16 * len(texts)
    assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"]
    # The same with the model named and embedding_type/dimensions as Jina's defaults say.
    body.update(model="tiny-colbert", embedding_type="float", dimensions=16)
    again = requests.post(f"{server.url}/v1/multi-vector", json=body, timeout=60).json()
    assert [len(d["embeddings"]) for d in again["data"]] == [len(w) for w in want]


@pytest.mark.parametrize("body, status, words", [
    ({"input": ["a"], "embedding_type": "binary"}, 400, "embedding_type"),
    ({"input": ["a"], "dimensions": 8}, 400, "16 wide"),
    ({"input": []}, 400, "input is empty"),
    ({"input": ["a"], "input_type": "passage"}, 422, "input_type"),
    ({"input": ["a"], "model": "tiny-nomic-bert"}, 400, "multi-vector"),
])
def test_refusals(server, body, status, words):
    r = requests.post(f"{server.url}/v1/multi-vector", json=body, timeout=30)
    assert r.status_code in (status, 400), r.text
    err = r.json()["error"]
    assert words in err["message"], err


def test_pooled_routes_name_the_multi_vector_route(server):
    r = requests.post(f"{server.url}/v1/embeddings", json={"input": ["a"], "model": "tiny-colbert"}, timeout=30)
    assert r.status_code == 400 and "/v1/multi-vector" in r.json()["error"]["message"], r.text
    r = requests.post(f"{server.url}/embed", json={"inputs": ["a"], "model": "tiny-colbert"}, timeout=30)
    assert r.status_code == 400 and "/v1/multi-vector" in r.text, r.text
    # Unnamed, the pooled routes answer with the pooling model.
    r = requests.post(f"{server.url}/v1/embeddings", json={"input": ["a"]}, timeout=30)
    assert r.status_code == 200 and r.json()["model"] != "tiny-colbert"


def test_openapi_documents_the_route(server):
    doc = requests.get(f"{server.url}/openapi.json", timeout=30).json()
    op = doc["paths"]["/v1/multi-vector"]["post"]
    assert op["operationId"] == "jina_multi_vector" and "jina" in op["tags"]
