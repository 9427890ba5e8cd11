"""DeBERTa-v2/v3 cross-encoders end to end: the real server binary serving
the tiny DeBERTa-v3 reranker (--rerank-model) next to the 3-label DeBERTa-v2
NLI classifier (--model), over loopback HTTP.

References: tests/fixtures/tiny-deberta-v3-reranker/README.md and
tests/fixtures/tiny-deberta-v2-nli/README.md (transformers / CrossEncoder)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from harness import FIXTURES, start_server

RERANKER = FIXTURES / "tiny-deberta-v3-reranker"
NLI = FIXTURES / "tiny-deberta-v2-nli"


def _pairs(folder):
    return json.loads((folder / "pairs.json").read_text())


@pytest.fixture(scope="module")
def deberta(tmp_path_factory):
    srv = start_server(
        tmp_path_factory.mktemp("deberta"), "--model", str(NLI), "--rerank-model", str(RERANKER), "--no-warmup",
    )
    yield srv
    assert srv.stop() == 0, srv.log()[-4000:]


def _by_query(pairs):
    groups: dict[str, list[int]] = {}
    for i, (q, _) in enumerate(pairs):
        groups.setdefault(q, []).append(i)
    return groups


def test_tei_rerank_matches_reference(deberta):
    """/rerank (TEI) answers every fixture pair with CrossEncoder's sigmoid
    score, best first, the truncated pairs included."""
    pairs = _pairs(RERANKER)
    ref = np.load(RERANKER / "reference_pair_scores.npy")
    checked = 0
    for q, idx in _by_query(pairs).items():
        texts = [pairs[i][1] for i in idx]
        r = deberta.post("/rerank", {"query": q, "texts": texts})
        assert r.status_code == 200, r.text
        ranks = r.json()
        want = sorted(range(len(idx)), key=lambda k: -float(ref[idx[k]]))
        assert [x["index"] for x in ranks] == want
        for x in ranks:
            assert abs(x["score"] - float(ref[idx[x["index"]]])) <= 1e-5
            checked += 1
    assert checked == len(pairs)
    logits = np.load(RERANKER / "reference_pair_logits.npy")
    raw = deberta.post("/rerank", {"query": pairs[40][0], "texts": [pairs[40][1]], "raw_scores": True}).json()
    assert abs(raw[0]["score"] - float(logits[40, 0])) <= 1e-5


def test_cohere_rerank_matches_reference(deberta):
    pairs = _pairs(RERANKER)
    ref = np.load(RERANKER / "reference_pair_scores.npy")
    q, idx = next((q, idx) for q, idx in _by_query(pairs).items() if len(idx) >= 6)
    docs = [pairs[i][1] for i in idx]
    body = {"model": "tiny-deberta-v3-reranker", "query": q, "documents": docs, "top_n": 4}
    r = deberta.post("/v1/rerank", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["model"] == "tiny-deberta-v3-reranker"
    want = sorted(range(len(idx)), key=lambda k: -float(ref[idx[k]]))[:4]
    assert [x["index"] for x in out["results"]] == want
    assert [x["relevance_score"] for x in out["results"]] == pytest.approx(
        [float(ref[idx[k]]) for k in want], abs=1e-5)
    assert [x["document"]["text"] for x in out["results"]] == [docs[k] for k in want]
    # The tokens counted are the pairs' own: [CLS] q [SEP] d [SEP], cut at 128.
    assert 0 < out["usage"]["total_tokens"] <= 128 * len(docs)


def test_nli_predict_matches_reference(deberta):
    """/predict on the default model (the NLI classifier): pairs with their
    token types, softmax over three labels, raw logits on request."""
    pairs = _pairs(NLI)
    ref = np.load(NLI / "reference_pair_logits.npy")
    labels = ["contradiction", "entailment", "neutral"]
    r = deberta.post("/predict", {"inputs": [list(p) for p in pairs], "raw_scores": True})
    assert r.status_code == 200, r.text
    got = np.array([[{p["label"]: p["score"] for p in row}[lab] for lab in labels] for row in r.json()])
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    one = deberta.post("/predict", {"inputs": list(pairs[35])}).json()
    e = np.exp(ref[35].astype(np.float64) - ref[35].max())
    probs = dict(zip(labels, e / e.sum()))
    assert [p["label"] for p in one] == sorted(labels, key=lambda k: -probs[k])
    assert all(abs(p["score"] - probs[p["label"]]) <= 1e-5 for p in one)
    info = deberta.get("/info").json()
    assert info["model_type"] == {"classifier": {
        "id2label": {"0": "contradiction", "1": "entailment", "2": "neutral"},
        "label2id": {"contradiction": 0, "entailment": 1, "neutral": 2},
    }}
