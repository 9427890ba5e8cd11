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
# A Stanford ColBERT checkpoint (HF_ColBERT, artifact.metadata): query
# length 12; a ModernBERT one (GTE-ModernColBERT-v1's layout): 32.
STANFORD = FIXTURES / "tiny-colbert-stanford"
MODERN = FIXTURES / "tiny-modern-colbert"
QUERY_LENGTHS = {"tiny-colbert": 16, "tiny-colbert-stanford": 12, "tiny-modern-colbert": 32}
MIN_COS = 0.99999


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("colbert"), "--model", str(NOMIC),
                       "--model", str(COLBERT), "--model", str(STANFORD), "--model", str(MODERN),
                       "--no-warmup")
    yield srv
    srv.stop()


def _reference(side: str, name: str = "tiny-colbert") -> list:
    ref = np.load(FIXTURES / name / "reference.npz")
    return np.split(ref[f"{side}_vectors"], np.cumsum(ref[f"{side}_rows"])[:-1])


def _texts(side: str, name: str = "tiny-colbert") -> list:
    texts = json.loads((FIXTURES / name / "texts.json").read_text(encoding="utf-8"))
    return texts[f"{side}s" if side == "document" else "queries"]


@pytest.mark.parametrize("name", list(QUERY_LENGTHS))
@pytest.mark.parametrize("side", ["query", "document"])
def test_vectors_match_pylate(server, side, name):
    texts = [t for t in _texts(side, name) if t]  # an empty text is a 400, as on every route
    want = [w for t, w in zip(_texts(side, name), _reference(side, name)) if t]
    body = {"input": texts if side == "query" else [{"text": t} for t in texts]}
    if side == "query":
        body["input_type"] = "query"
    if name != "tiny-colbert":
        body["model"] = name
    r = requests.post(f"{server.url}/v1/multi-vector", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "list" and out["model"] == name
    assert [d["index"] for d in out["data"]] == list(range(len(texts)))
    assert all(d["object"] == "embeddings" for d in out["data"])
    worst = 1.0
    for d, w in zip(out["data"], want):
        got = np.array(d["embeddings"], dtype=np.float64)
        assert got.shape == w.shape
        cos = (got * w).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(w, axis=1)
        worst = min(worst, float(cos.min()))
    assert worst >= MIN_COS
    print(f"{name} {side}: lowest per-token cosine {worst:.9f}")
    # Tokens run: a query is query_length each; usage counts them all.
    if side == "query":
        assert out["usage"]["prompt_tokens"] == QUERY_LENGTHS[name] * len(texts)
    assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"]
    # The same with the model named and embedding_type/dimensions as Jina's defaults say.
    body.update(model=name, embedding_type="float", dimensions=16)
    again = requests.post(f"{server.url}/v1/multi-vector", json=body, timeout=60).json()
    assert [len(d["embeddings"]) for d in again["data"]] == [len(w) for w in want]


# 21 tokens as tiny-colbert tokenizes it ([CLS], [unused0] or [unused1],
# 18 words and marks, [SEP]): over the query length 16, under the document
# length 40 and the model's longest input (40).
TWENTY_ONE = "what is the capital of france? and of spain? and of italy?"


def test_truncate_false_holds_a_query_to_the_query_length(server):
    """``truncate: false`` refuses a text over the length of its side (a 400
    ``context_length_exceeded`` naming it, as the other /v1 routes answer an
    over-long input), not over the model's longest input; the default cuts
    it as PyLate does."""
    url = f"{server.url}/v1/multi-vector"
    r = requests.post(url, json={"input": ["a", TWENTY_ONE], "input_type": "query", "truncate": False}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded", err
    assert err["message"] == (
        "input 1 has 21 tokens, more than the model's query length of 16; shorten it or set truncate to true"
    ), err
    cut = requests.post(url, json={"input": [TWENTY_ONE], "input_type": "query"}, timeout=30)
    assert cut.status_code == 200 and len(cut.json()["data"][0]["embeddings"]) == 16, cut.text
    same = requests.post(url, json={"input": [TWENTY_ONE], "input_type": "query", "truncate": True}, timeout=30)
    assert same.status_code == 200 and same.json()["data"] == cut.json()["data"]
    # As a document it fits (21 tokens, 3 of them punctuation rows left out).
    doc = requests.post(url, json={"input": [TWENTY_ONE], "truncate": False}, timeout=30)
    assert doc.status_code == 200, doc.text
    assert doc.json()["usage"]["prompt_tokens"] == 21 and len(doc.json()["data"][0]["embeddings"]) == 18
    # A query within its length passes, and one over a document's length is named so.
    ok = requests.post(url, json={"input": ["how do I reset my password"], "input_type": "query",
                                  "truncate": False}, timeout=30)
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embeddings"]) == 16, ok.text
    r = requests.post(url, json={"input": [" ".join([TWENTY_ONE] * 3)], "truncate": False}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(
        "input 0 has 57 tokens, more than the model's document length of 40;"), r.text
    # The Stanford checkpoint's own query length (12, from artifact.metadata).
    r = requests.post(url, json={"input": [TWENTY_ONE], "input_type": "query", "truncate": False,
                                 "model": "tiny-colbert-stanford"}, timeout=30)
    assert r.status_code == 400, r.text
    assert "more than the model's query length of 12" in r.json()["error"]["message"], r.text


def test_a_colbert_model_is_warmed_up_on_its_document_rows(tmp_path):
    """The warm-up (on by default) runs a ColBERT model as /v1/multi-vector
    does: as a pooled vector it was refused and the server failed to start
    ("is a multi-vector (ColBERT) model ... not a pooled vector")."""
    srv = start_server(tmp_path, "--model", str(MODERN))
    try:
        assert "model warm" in srv.log(), srv.log()[-2000:]
        r = requests.post(f"{srv.url}/v1/multi-vector", json={"input": ["warm"]}, timeout=30)
        assert r.status_code == 200 and r.json()["model"] == "tiny-modern-colbert", r.text
    finally:
        srv.stop()


@pytest.mark.parametrize("body, status, words", [
    ({"input": ["a"], "embedding_type": "binary"}, 400, "embedding_type"),
    ({"input": ["a"], "dimensions": 8}, 400, "16 wide"),
    ({"input": []}, 400, "input is empty"),
    # A body of the wrong shape: 400 on the /v1 routes (OpenAI's clients read no 422).
    ({"input": ["a"], "input_type": "passage"}, 400, "input_type"),
    ({"input": ["a"], "truncate": "no"}, 400, "truncate"),
    ({"input": ["a"], "model": "tiny-nomic-bert"}, 400, "multi-vector"),
])
def test_refusals(server, body, status, words):
    r = requests.post(f"{server.url}/v1/multi-vector", json=body, timeout=30)
    assert r.status_code == status, r.text
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
