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
    ({"input": ["a"], "input_type": 1}, 400, "input_type: invalid type: integer `1`, expected a string"),
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
    fields = doc["components"]["schemas"]["MultiVectorRequest"]["properties"]
    assert fields["pool_factor"]["minimum"] == 1 and "PyLate" in fields["pool_factor"]["description"]
    assert fields["protected_tokens"]["minimum"] == 0


# PyLate's encode(documents, pool_factor=k, protected_tokens=p) of each
# fixture's documents, in pooled.npz (its README says how it was made).
POOLED = {"pool2_protect1": (2, 1), "pool3_protect1": (3, 1), "pool2_protect0": (2, 0)}


def _pooled_reference(name: str, key: str) -> list:
    ref = np.load(FIXTURES / name / "pooled.npz")
    return np.split(ref[f"{key}_vectors"], np.cumsum(ref[f"{key}_rows"])[:-1])


def _lowest_cosine(got: np.ndarray, want: np.ndarray) -> float:
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    return float(cos.min())


def _pool(url: str, texts: list, model: str, **fields) -> dict:
    r = requests.post(f"{url}/v1/multi-vector", json={"input": texts, "model": model, **fields}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("name", ["tiny-colbert", "tiny-modern-colbert"])
@pytest.mark.parametrize("key", list(POOLED))
def test_pool_factor_pools_documents_as_pylate_does(server, name, key):
    """``pool_factor`` / ``protected_tokens``: PyLate's pooled rows (row
    counts exactly, every row within cosine 0.99999, the means not
    rescaled: their norms are PyLate's), the Python API's rows to the bit,
    and ``usage`` the tokens run, as unpooled."""
    import mlx_embed

    factor, protected = POOLED[key]
    keep = [i for i, t in enumerate(_texts("document", name)) if t]
    texts = [_texts("document", name)[i] for i in keep]
    want = [_pooled_reference(name, key)[i] for i in keep]
    out = _pool(server.url, texts, name, pool_factor=factor, protected_tokens=protected)
    got = [np.array(d["embeddings"], dtype=np.float64) for d in out["data"]]
    assert [g.shape for g in got] == [w.shape for w in want]
    worst = min(_lowest_cosine(g, w) for g, w in zip(got, want))
    norms = max(float(np.abs(np.linalg.norm(g, axis=1) - np.linalg.norm(w, axis=1)).max()) for g, w in zip(got, want))
    print(f"{name} {key}: lowest per-row cosine {worst:.9f}, norms within {norms:.2e}")
    assert worst >= MIN_COS and norms <= 1e-5
    # Pooled means of several unit rows are shorter than one.
    assert min(float(np.linalg.norm(g, axis=1).min()) for g in got) < 0.99
    api = mlx_embed.load(str(FIXTURES / name)).embed_multi_vector(
        texts, pool_factor=factor, protected_tokens=protected)
    # The same bits: both normalize with l2_normalize before pooling.
    assert all(np.array_equal(g.astype(np.float32), a) for g, a in zip(got, api))
    plain = _pool(server.url, texts, name)
    assert out["usage"] == plain["usage"]
    assert sum(len(d["embeddings"]) for d in out["data"]) < sum(len(d["embeddings"]) for d in plain["data"])
    if protected:
        # The protected row as it was (normalized by the engine there, by the server here: one function).
        assert all(d["embeddings"][0] == p["embeddings"][0] for d, p in zip(out["data"], plain["data"]))
    # pool_factor 1 is no pooling: the plain answer (protected_tokens then has nothing to protect).
    assert _pool(server.url, texts, name, pool_factor=1, protected_tokens=protected)["data"] == plain["data"]


def test_pooled_and_unpooled_requests_at_once_each_get_their_own(server):
    """Requests with different factors (and queries, and none) sent
    together share batches; each answers as it does alone."""
    from concurrent.futures import ThreadPoolExecutor

    texts = [t for t in _texts("document") if t]
    asks = [{}, {"pool_factor": 2}, {"pool_factor": 3}, {"pool_factor": 2, "protected_tokens": 0},
            {"input_type": "query"}, {"pool_factor": 1}]
    alone = [_pool(server.url, texts, "tiny-colbert", **a)["data"] for a in asks]
    assert len({tuple(len(d["embeddings"]) for d in a) for a in alone}) == 5
    work = [asks[i % len(asks)] for i in range(6 * len(asks))]
    with ThreadPoolExecutor(max_workers=12) as pool:
        together = list(pool.map(lambda a: _pool(server.url, texts, "tiny-colbert", **a)["data"], work))
    for i, data in enumerate(together):
        want = alone[i % len(asks)]
        assert [len(d["embeddings"]) for d in data] == [len(d["embeddings"]) for d in want], work[i]
        for d, w in zip(data, want):
            assert np.abs(np.array(d["embeddings"]) - np.array(w["embeddings"])).max() <= 1e-5, work[i]


@pytest.mark.parametrize("fields, param, words", [
    ({"pool_factor": 0}, "pool_factor",
     "pool_factor 0: it must be a whole number from 1 to the model's document length of 40"),
    ({"pool_factor": -2}, "pool_factor", "pool_factor -2: it must be a whole number from 1"),
    ({"pool_factor": 41}, "pool_factor", "pool_factor 41: it must be a whole number from 1"),
    ({"pool_factor": 2, "protected_tokens": -1}, "protected_tokens",
     "protected_tokens -1: it must be a whole number from 0"),
    ({"pool_factor": 2, "protected_tokens": 41}, "protected_tokens", "protected_tokens 41:"),
    ({"pool_factor": 2, "input_type": "query"}, "pool_factor", "a query is never pooled"),
    ({"protected_tokens": 1, "input_type": "query"}, "protected_tokens", "a query is never pooled"),
    # Wrong shapes: named in serde's words (OpenAI's clients read no 422) and in param.
    ({"pool_factor": 1.5}, "pool_factor", "pool_factor"),
    ({"pool_factor": "2"}, "pool_factor", "pool_factor"),
    ({"pool_factor": True}, "pool_factor", "pool_factor"),
    ({"pool_factor": 1e30}, "pool_factor", "pool_factor"),
    ({"protected_tokens": 0.5}, "protected_tokens", "protected_tokens"),
])
def test_pool_factor_refusals(server, fields, param, words):
    r = requests.post(f"{server.url}/v1/multi-vector", json={"input": ["a b c"], **fields}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"], err
    if param:
        assert err["param"] == param, err
