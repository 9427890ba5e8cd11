"""Infinity's and Voyage AI's own Python clients (`infinity_client`,
`voyageai` on PyPI) against the real server binary. The OpenAI, Cohere and
Ollama clients have tests of their own (test_server_api.py,
test_cohere_embed.py, test_ollama.py)."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import defaultdict

import numpy as np
import pytest
import voyageai
from infinity_client import Client as InfinityClient
from infinity_client.api.default import classify as inf_classify
from infinity_client.api.default import embeddings as inf_embeddings
from infinity_client.api.default import models as inf_models
from infinity_client.api.default import rerank as inf_rerank
from infinity_client.models import (
    ClassifyInput,
    ClassifyResult,
    OpenAIEmbeddingInputText,
    OpenAIEmbeddingResult,
    OpenAIModelInfo,
    RerankInput,
    ReRankResult,
)

import requests
from harness import FIXTURES, NOMIC, cosine_rows, start_server
from test_overload import HOLD, start_held_server, wait_for_in_flight

RERANKER = FIXTURES / "tiny-bert-reranker"
CLASSIFIER = FIXTURES / "tiny-bert-classifier"
TEXTS = ["The capital of France is Paris.", "Rivers flow into the sea.", "A recipe for bread"]


@pytest.fixture(scope="module")
def duo(tmp_path_factory):
    """NomicBERT (query/document prompts, default document) beside the BERT reranker."""
    srv = start_server(tmp_path_factory.mktemp("clients"), "--model", str(NOMIC),
                       "--rerank-model", str(RERANKER), "--no-warmup")
    yield srv
    assert srv.stop() == 0, srv.log()[-4000:]


def native(server, texts, **fields) -> np.ndarray:
    r = server.post("/api/v1/embed", {"texts": texts, **fields})
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["embeddings"], dtype=np.float32)


def reference_rerank() -> tuple[str, list[str], np.ndarray]:
    """A query of the reranker fixture's pairs with several documents, and
    the transformers scores (sigmoid of the logit) of each pair."""
    pairs = json.loads((RERANKER / "pairs.json").read_text())
    scores = np.load(RERANKER / "reference_pair_scores.npy").reshape(-1)
    by_query = defaultdict(list)
    for (query, doc), score in zip(pairs, scores):
        by_query[query].append((doc, float(score)))
    query, docs = max(by_query.items(), key=lambda kv: len(kv[1]))
    assert len(docs) >= 3, docs
    return query, [d for d, _ in docs], np.array([s for _, s in docs])


# --- Infinity -----------------------------------------------------------------

def test_infinity_client_lists_embeds_and_reranks(duo):
    client = InfinityClient(base_url=duo.url, timeout=60)
    listed = inf_models.sync(client=client)
    assert isinstance(listed, OpenAIModelInfo), listed
    assert [m.id for m in listed.data] == ["tiny-nomic-bert", "tiny-bert-reranker"]
    assert all(m.owned_by == "infinity" for m in listed.data)

    # The client's defaults: dimensions 0 and modality text (the full vector).
    out = inf_embeddings.sync(client=client, body=OpenAIEmbeddingInputText(input_=TEXTS, model="tiny-nomic-bert"))
    assert isinstance(out, OpenAIEmbeddingResult), out
    got = np.asarray([d.embedding for d in out.data], dtype=np.float32)
    assert got.shape == (3, 64)
    assert cosine_rows(got, native(duo, TEXTS)).min() >= 0.99999
    short = inf_embeddings.sync(client=client, body=OpenAIEmbeddingInputText(input_=TEXTS, dimensions=16))
    got16 = np.asarray([d.embedding for d in short.data], dtype=np.float32)
    assert got16.shape == (3, 16)
    assert cosine_rows(got16, native(duo, TEXTS, dimensions=16)).min() >= 0.99999

    query, docs, expected = reference_rerank()
    ranked = inf_rerank.sync(client=client, body=RerankInput(query=query, documents=docs, return_documents=True))
    assert isinstance(ranked, ReRankResult), ranked
    assert len(ranked.results) == len(docs)
    for item in ranked.results:
        assert item.relevance_score == pytest.approx(expected[item.index], abs=1e-5)
        assert item.document == docs[item.index]
    scores = [r.relevance_score for r in ranked.results]
    assert scores == sorted(scores, reverse=True)


def test_infinity_client_classifies(tmp_path):
    srv = start_server(tmp_path, "--model", str(CLASSIFIER), "--no-warmup")
    try:
        texts = json.loads((FIXTURES / "golden" / "minilm_texts.json").read_text())[5:9]
        logits = np.load(CLASSIFIER / "reference_text_logits.npy")[5:9]
        labels = ["negative", "neutral", "positive"]
        client = InfinityClient(base_url=srv.url, timeout=60)
        for raw in (True, False):
            out = inf_classify.sync(client=client, body=ClassifyInput(input_=texts, raw_scores=raw))
            assert isinstance(out, ClassifyResult), out
            assert len(out.data) == len(texts)
            for row, ref in zip(out.data, logits):
                want = ref if raw else np.exp(ref - ref.max()) / np.exp(ref - ref.max()).sum()
                got = {c.label: c.score for c in row}
                assert sorted(got) == labels
                np.testing.assert_allclose([got[label] for label in labels], want, rtol=1e-5, atol=1e-5)
                assert [c.score for c in row] == sorted(got.values(), reverse=True), "best first"
    finally:
        assert srv.stop() == 0, srv.log()[-4000:]


# --- Voyage AI ----------------------------------------------------------------

def voyage(server) -> voyageai.Client:
    # The client refuses an empty key; the server takes any when it has none set.
    return voyageai.Client(api_key="unused", base_url=server.url + "/v1", max_retries=0)


def test_voyage_client_embeds_with_its_roles_dimensions_and_dtypes(duo):
    vo = voyage(duo)
    for role in ("query", "document"):
        got = np.asarray(vo.embed(TEXTS, model="voyage-3.5", input_type=role).embeddings, dtype=np.float32)
        assert got.shape == (3, 64)
        assert cosine_rows(got, native(duo, TEXTS, prompt_name=role)).min() >= 0.99999, role
    query, document = (native(duo, TEXTS, prompt_name=p) for p in ("query", "document"))
    assert cosine_rows(query, document).max() < 0.999, "the roles' prompts give other vectors"

    short = vo.embed(TEXTS, model="voyage-3.5", input_type="query", output_dimension=16)
    got16 = np.asarray(short.embeddings, dtype=np.float32)
    assert got16.shape == (3, 16)
    assert cosine_rows(got16, native(duo, TEXTS, prompt_name="query", dimensions=16)).min() >= 0.99999
    assert short.total_tokens > 0

    unit = native(duo, TEXTS, prompt_name="query")
    int8 = np.round(np.clip(unit, -1, 1) * 127).astype(np.int64)
    bits = np.packbits(unit > 0, axis=1).astype(np.int64)
    for dtype, want in (("int8", int8), ("uint8", int8 + 128), ("binary", bits - 128), ("ubinary", bits)):
        got = np.asarray(vo.embed(TEXTS, model="voyage-3.5", input_type="query", output_dtype=dtype).embeddings,
                         dtype=np.int64)
        np.testing.assert_array_equal(got, want, err_msg=dtype)

    # The client reads the message from FastAPI's `detail` and types the error by its status
    # (without `detail` every refusal was an untyped APIError, and a 429 was not retried).
    with pytest.raises(voyageai.error.InvalidRequestError) as refused:
        vo.embed(["word " * 5000], model="voyage-3.5", truncation=False)
    assert refused.value.http_status == 400
    assert re.fullmatch(r"input 0 has \d+ tokens, more than the model's maximum of \d+; "
                        r"shorten it or set truncation to true", str(refused.value)), refused.value


def test_voyage_client_reads_a_429_as_its_rate_limit_error(tmp_path):
    """The error a retrying client must tell apart: with the model held and no
    room left, Voyage's client raises its RateLimitError (which it retries
    with backoff when max_retries allows), not an untyped APIError."""
    server, release = start_held_server(tmp_path, "--no-warmup", "--no-cache", "--max-concurrent-requests", "1",
                                        "--max-waiting", "0")
    try:
        held = threading.Thread(target=requests.post, args=(server.url + "/api/v1/embed",),
                                kwargs={"json": {"texts": [f"{HOLD} the model"]}, "timeout": 60})
        held.start()
        asyncio.run(wait_for_in_flight(server, 1))
        with pytest.raises(voyageai.error.RateLimitError) as refused:
            voyage(server).embed(["one more"], model="voyage-3.5")
        assert refused.value.http_status == 429
        assert str(refused.value).startswith("server is overloaded: "), refused.value
    finally:
        release.touch()
    held.join(timeout=60)
    assert server.stop() == 0, server.log()[-4000:]


def test_voyage_client_reranks(duo):
    vo = voyage(duo)
    query, docs, expected = reference_rerank()
    ranked = vo.rerank(query, docs, model="rerank-2.5", top_k=2)
    assert len(ranked.results) == 2
    best = np.argsort(-expected)[:2]
    assert [r.index for r in ranked.results] == best.tolist()
    for r in ranked.results:
        assert r.relevance_score == pytest.approx(expected[r.index], abs=1e-5)
        assert r.document == docs[r.index]
    assert ranked.total_tokens > 0
    assert len(vo.rerank(query, docs, model="rerank-2.5").results) == len(docs)
