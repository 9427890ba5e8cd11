"""Architectures whose reference is Hugging Face remote code, end to end:
the real server binary serving each tiny embedder (--model) next to its
sequence-classification reranker (--rerank-model), over loopback HTTP.

- Alibaba GTE (`model_type: "new"`): tiny-gte-en (gte-base-en-v1.5 style,
  CLS pooling) and tiny-gte-reranker (NewForSequenceClassification);
- JinaBERT (`model_type: "bert"`, ALiBi), both layer layouts:
  tiny-jina-bert (jina-embeddings-v2-base-code style, qk-post-norm) with
  tiny-jina-reranker, and tiny-jina-v2 (jina-embeddings-v2-base-en style,
  jina-bert-implementation) with tiny-jina-reranker-v1
  (JinaBertForSequenceClassification, mean pooling for the embedders).

References: each fixture's README.md (scripts/fixtures/make_gte.py,
make_jina.py and make_jina_v2.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from harness import FIXTURES, cosine_rows, non_empty_golden, start_server

# embedder folder, its reference vectors, reranker folder
SERVED = {
    "gte": ("tiny-gte-en", "reference_cls_normalized.npy", "tiny-gte-reranker"),
    "jina": ("tiny-jina-bert", "reference_mean_normalized.npy", "tiny-jina-reranker"),
    "jina-v2": ("tiny-jina-v2", "reference_mean_normalized.npy", "tiny-jina-reranker-v1"),
}


@pytest.fixture(scope="module", params=sorted(SERVED))
def served(request, tmp_path_factory):
    """(embedder name, its reference, reranker folder, server)."""
    embedder, reference, reranker = SERVED[request.param]
    srv = start_server(
        tmp_path_factory.mktemp(request.param), "--model", str(FIXTURES / embedder),
        "--rerank-model", str(FIXTURES / reranker), "--no-warmup",
    )
    yield embedder, np.load(FIXTURES / embedder / reference), FIXTURES / reranker, srv
    assert srv.stop() == 0, srv.log()[-4000:]


def test_embed_routes_match_reference(served, golden):
    embedder, reference, _, srv = served
    texts, ref, _ = non_empty_golden((golden[0], reference), 39)
    bodies = {
        "/api/v1/embed": ({"texts": texts}, lambda r: r["embeddings"]),
        "/embed": ({"inputs": texts}, lambda r: r),
        "/v1/embeddings": ({"input": texts, "model": embedder},
                           lambda r: [d["embedding"] for d in sorted(r["data"], key=lambda d: d["index"])]),
    }
    for path, (body, extract) in bodies.items():
        r = srv.post(path, body)
        assert r.status_code == 200, f"{path}: {r.text[:500]}"
        got = np.asarray(extract(r.json()), dtype=np.float32)
        assert got.shape == ref.shape, path
        c, d = cosine_rows(got, ref).min(), np.abs(got - ref).max()
        print(f"{path}: min cosine {c:.8f}, max |diff| {d:.2e}")
        assert c >= 0.99999 and d <= 1e-5, path


def test_tei_rerank_matches_reference(served):
    """/rerank answers every fixture pair with the sigmoid of the reference
    logit, best first, the truncated pairs included."""
    _, _, reranker, srv = served
    pairs = json.loads((reranker / "pairs.json").read_text())
    ref = np.load(reranker / "reference_pair_scores.npy")
    groups: dict[str, list[int]] = {}
    for i, (q, _) in enumerate(pairs):
        groups.setdefault(q, []).append(i)
    checked = 0
    for q, idx in groups.items():
        r = srv.post("/rerank", {"query": q, "texts": [pairs[i][1] for i in idx]})
        assert r.status_code == 200, r.text
        ranks = r.json()
        assert [x["index"] for x in ranks] == sorted(range(len(idx)), key=lambda k: -float(ref[idx[k]]))
        for x in ranks:
            assert abs(x["score"] - float(ref[idx[x["index"]]])) <= 1e-5
            checked += 1
    assert checked == len(pairs)
    logits = np.load(reranker / "reference_pair_logits.npy")
    raw = srv.post("/rerank", {"query": pairs[41][0], "texts": [pairs[41][1]], "raw_scores": True}).json()
    assert abs(raw[0]["score"] - float(logits[41, 0])) <= 1e-5 * max(1.0, abs(float(logits[41, 0])))


def test_cohere_rerank_names_the_reranker(served):
    _, _, reranker, srv = served
    pairs = json.loads((reranker / "pairs.json").read_text())
    ref = np.load(reranker / "reference_pair_scores.npy")
    idx = [i for i, (q, _) in enumerate(pairs) if q == pairs[0][0]]
    docs = [pairs[i][1] for i in idx]
    r = srv.post("/v1/rerank", {"model": reranker.name, "query": pairs[0][0], "documents": docs, "top_n": 3})
    assert r.status_code == 200, r.text
    out = r.json()
    want = sorted(range(len(idx)), key=lambda k: -float(ref[idx[k]]))[:3]
    assert out["model"] == reranker.name
    assert [x["index"] for x in out["results"]] == want
    assert [x["relevance_score"] for x in out["results"]] == pytest.approx([float(ref[idx[k]]) for k in want], abs=1e-5)
