"""Cross-encoder heads end to end: the real server binary serving a tiny
reranker (--rerank-model) next to a classifier (--model), over loopback HTTP:

- deberta: the DeBERTa-v3 reranker next to the 3-label DeBERTa-v2 NLI
  classifier;
- modernbert: the ModernBERT reranker (mean-pooled head, no token types) next
  to the 2-label DistilBERT classifier.

References: each fixture's README.md (transformers / CrossEncoder)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from harness import FIXTURES, start_server

# name -> (classifier folder, reranker folder)
SERVED = {
    "deberta": (FIXTURES / "tiny-deberta-v2-nli", FIXTURES / "tiny-deberta-v3-reranker"),
    "modernbert": (FIXTURES / "tiny-distilbert-classifier", FIXTURES / "tiny-modernbert-reranker"),
}


def _pairs(folder):
    return json.loads((folder / "pairs.json").read_text())


@pytest.fixture(scope="module", params=sorted(SERVED))
def served(request, tmp_path_factory):
    """(classifier folder, reranker folder, server)."""
    classifier, reranker = SERVED[request.param]
    srv = start_server(
        tmp_path_factory.mktemp(request.param), "--model", str(classifier), "--rerank-model", str(reranker),
        "--no-warmup",
    )
    yield classifier, reranker, srv
    assert srv.stop() == 0, srv.log()[-4000:]


def _by_query(pairs):
    groups: dict[str, list[int]] = {}
    for i, (q, _) in enumerate(pairs):
        groups.setdefault(q, []).append(i)
    return groups


def test_tei_rerank_matches_reference(served):
    """/rerank (TEI) answers every fixture pair with CrossEncoder's sigmoid
    score, best first, the truncated pairs included."""
    _, reranker, srv = served
    pairs = _pairs(reranker)
    ref = np.load(reranker / "reference_pair_scores.npy")
    checked = 0
    for q, idx in _by_query(pairs).items():
        texts = [pairs[i][1] for i in idx]
        r = srv.post("/rerank", {"query": q, "texts": texts})
        assert r.status_code == 200, r.text
        ranks = r.json()
        want = sorted(range(len(idx)), key=lambda k: -float(ref[idx[k]]))
        assert [x["index"] for x in ranks] == want
        for x in ranks:
            assert abs(x["score"] - float(ref[idx[x["index"]]])) <= 1e-5
            checked += 1
    assert checked == len(pairs)
    logits = np.load(reranker / "reference_pair_logits.npy")
    raw = srv.post("/rerank", {"query": pairs[40][0], "texts": [pairs[40][1]], "raw_scores": True}).json()
    assert abs(raw[0]["score"] - float(logits[40, 0])) <= 1e-5


def test_cohere_rerank_matches_reference(served):
    _, reranker, srv = served
    pairs = _pairs(reranker)
    ref = np.load(reranker / "reference_pair_scores.npy")
    q, idx = next((q, idx) for q, idx in _by_query(pairs).items() if len(idx) >= 6)
    docs = [pairs[i][1] for i in idx]
    body = {"model": reranker.name, "query": q, "documents": docs, "top_n": 4}
    r = srv.post("/v1/rerank", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["model"] == reranker.name
    want = sorted(range(len(idx)), key=lambda k: -float(ref[idx[k]]))[:4]
    assert [x["index"] for x in out["results"]] == want
    assert [x["relevance_score"] for x in out["results"]] == pytest.approx(
        [float(ref[idx[k]]) for k in want], abs=1e-5)
    assert [x["document"]["text"] for x in out["results"]] == [docs[k] for k in want]
    # The tokens counted are the pairs' own: [CLS] q [SEP] d [SEP], cut at 128.
    assert 0 < out["usage"]["total_tokens"] <= 128 * len(docs)


def test_classifier_predict_matches_reference(served):
    """/predict on the default model (the classifier): pairs (with token
    types where the model has them), softmax over its labels, raw logits on
    request; /info names the labels."""
    classifier, _, srv = served
    pairs = _pairs(classifier)
    ref = np.load(classifier / "reference_pair_logits.npy")
    id2label = json.loads((classifier / "config.json").read_text())["id2label"]
    labels = [id2label[str(i)] for i in range(len(id2label))]
    assert len(labels) == ref.shape[1] >= 2
    r = srv.post("/predict", {"inputs": [list(p) for p in pairs], "raw_scores": True})
    assert r.status_code == 200, r.text
    got = np.array([[{p["label"]: p["score"] for p in row}[lab] for lab in labels] for row in r.json()])
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    one = srv.post("/predict", {"inputs": list(pairs[35])}).json()
    e = np.exp(ref[35].astype(np.float64) - ref[35].max())
    probs = dict(zip(labels, e / e.sum()))
    assert [p["label"] for p in one] == sorted(labels, key=lambda k: -probs[k])
    assert all(abs(p["score"] - probs[p["label"]]) <= 1e-5 for p in one)
    info = srv.get("/info").json()
    assert info["model_type"] == {"classifier": {
        "id2label": {str(i): lab for i, lab in enumerate(labels)},
        "label2id": {lab: i for i, lab in enumerate(labels)},
    }}


def test_several_rerank_models_each_answer_their_own_scores(tmp_path):
    """`--rerank-model a,b --rerank-model c`: each folder is served as a reranker,
    and a request's `model` picks which one scores it (Cohere's /v1/rerank)."""
    rerankers = [FIXTURES / "tiny-bert-reranker", FIXTURES / "tiny-xlmr-reranker", FIXTURES / "tiny-electra-reranker"]
    srv = start_server(
        tmp_path, "--rerank-model", f"{rerankers[0]},{rerankers[1]}", "--rerank-model", str(rerankers[2]),
        "--no-warmup",
    )
    try:
        served = {m["id"] for m in srv.get("/v1/models").json()["data"]}
        assert served >= {r.name for r in rerankers}
        for reranker in rerankers:
            pairs = _pairs(reranker)
            logits = np.load(reranker / "reference_pair_logits.npy")
            q, idx = next((q, idx) for q, idx in _by_query(pairs).items() if len(idx) >= 3)
            r = srv.post("/v1/rerank", {"model": reranker.name, "query": q, "documents": [pairs[i][1] for i in idx],
                                        "raw_scores": True})
            assert r.status_code == 200, r.text
            got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
            assert sorted(got) == list(range(len(idx)))
            for k, i in enumerate(idx):
                assert abs(got[k] - float(logits[i, 0])) <= 1e-5, (reranker.name, k)
    finally:
        assert srv.stop() == 0, srv.log()[-4000:]
