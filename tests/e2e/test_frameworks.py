"""The RAG frameworks' own integration packages against the real server
binary, unchanged but for their base URL: Graphiti's OpenAIEmbedder,
LangChain's OpenAIEmbeddings and OllamaEmbeddings, Haystack's OpenAI
embedders and its Hugging Face API (TEI) embedders and ranker (LlamaIndex's:
test_frameworks_llamaindex.py). Vectors are checked against sentence-transformers' golden references
for all-MiniLM-L6-v2, scores against the server's own /rerank.

Not here: LangChain's HuggingFaceEndpointEmbeddings (1.2 refuses a URL as
`model`), Graphiti's rerankers (a chat model, Gemini, or a local
sentence-transformers), Haystack's gRPC ranker and embedders (grpc_requests
pulls google-auth and cryptography; checked by hand, README)."""

from __future__ import annotations

import asyncio
import os
import threading
import time

# Nothing may phone home from a test: Haystack reads its switch at import,
# Graphiti's and LangSmith's are read when they would send.
os.environ.update(
    {
        "HAYSTACK_TELEMETRY_ENABLED": "False",
        "GRAPHITI_TELEMETRY_ENABLED": "false",
        "LANGCHAIN_TRACING_V2": "false",
        "LANGSMITH_TRACING": "false",
    }
)

import numpy as np  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402
import requests  # noqa: E402
import tiktoken  # noqa: E402
from graphiti_core.embedder.openai import OpenAIEmbedder, OpenAIEmbedderConfig  # noqa: E402
from haystack import Document  # noqa: E402
from haystack.components.embedders import OpenAIDocumentEmbedder, OpenAITextEmbedder  # noqa: E402
from haystack.utils import Secret  # noqa: E402
from haystack_integrations.components.embedders.huggingface_api import (  # noqa: E402
    HuggingFaceAPIDocumentEmbedder,
    HuggingFaceAPITextEmbedder,
)
from haystack_integrations.components.rankers.huggingface_api import (  # noqa: E402
    HuggingFaceTEIRanker,
    TruncationDirection,
)
from langchain_ollama import OllamaEmbeddings  # noqa: E402
from langchain_openai import OpenAIEmbeddings  # noqa: E402

from harness import FIXTURES, cosine_rows, start_server  # noqa: E402
from test_overload import HOLD, start_held_server, wait_for_in_flight  # noqa: E402
from test_client_libraries import reference_rerank  # noqa: E402

MODEL = "all-MiniLM-L6-v2"
RERANKER = FIXTURES / "tiny-bert-reranker"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    """all-MiniLM-L6-v2 (the golden references' model) beside the BERT reranker."""
    server = start_server(tmp_path_factory.mktemp("frameworks"), "--rerank-model", str(RERANKER))
    yield server
    assert server.stop() == 0, server.log()[-4000:]


@pytest.fixture(scope="module")
def texts_ref(golden):
    """The golden texts every framework sends as they are: LlamaIndex's TEI
    client strips each text, so a blank one becomes "" (refused by TEI's
    /embed, as by TEI itself)."""
    texts, ref = golden
    idx = [i for i, t in enumerate(texts) if t.strip()]
    return [texts[i] for i in idx], ref[idx]


def assert_golden(got, ref) -> None:
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == ref.shape, got.shape
    assert cosine_rows(got, ref).min() >= 0.99999


def native(srv, texts, **fields) -> np.ndarray:
    r = srv.post("/api/v1/embed", {"texts": texts, **fields})
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["embeddings"], dtype=np.float64)


def server_ranks(srv, query, docs, **fields) -> list[tuple[int, float]]:
    r = srv.post("/rerank", {"query": query, "texts": docs, **fields})
    assert r.status_code == 200, r.text
    return [(x["index"], x["score"]) for x in r.json()]


# --- Graphiti -----------------------------------------------------------------


def graphiti(srv, dim: int = 384) -> OpenAIEmbedder:
    return OpenAIEmbedder(
        OpenAIEmbedderConfig(base_url=srv.url + "/v1", api_key="unused", embedding_model=MODEL, embedding_dim=dim)
    )


def test_graphiti_openai_embedder(srv, texts_ref):
    texts, ref = texts_ref

    async def main():
        g = graphiti(srv)
        one = [await g.create(t) for t in texts[:3]]
        # Graphiti's own calls send a list of one text (nodes' and edges' names).
        listed = [await g.create([t]) for t in texts[:3]]
        return one, listed, await g.create_batch(texts), await graphiti(srv, 16).create(texts[0])

    one, listed, batch, short = asyncio.run(main())
    assert_golden(one, ref[:3])
    assert_golden(listed, ref[:3])
    assert_golden(batch, ref)
    # embedding_dim cuts on the client side, without renormalizing.
    np.testing.assert_allclose(short, native(srv, texts[:1])[0, :16], atol=1e-6)


def test_graphiti_concurrent_creates_get_their_own_vectors(srv, texts_ref):
    """Graphiti embeds an episode's nodes and edges with one `create` each,
    all at once (asyncio.gather): 100 distinct texts in flight together."""
    texts = [f"{t} (#{i})" for i, t in enumerate(texts_ref[0][:25] * 4)]

    async def main():
        g = graphiti(srv)
        return await asyncio.gather(*(g.create([t]) for t in texts))

    got = np.asarray(asyncio.run(main()))
    want = np.concatenate([native(srv, texts[i : i + 50]) for i in (0, 50)])
    assert cosine_rows(got, want).min() >= 0.99999
    assert len({tuple(np.round(v, 4)) for v in got}) == len(texts), "each text its own vector"


def test_graphiti_retries_a_429_and_gets_its_vector(tmp_path):
    """A burst can meet a full server: Graphiti's OpenAI client (two retries
    by default) waits out the 429's Retry-After and its retry gets the
    vector. The held model is let go when the client reads the 429, so the
    retry finds room."""
    server, release = start_held_server(
        tmp_path, "--no-warmup", "--no-cache", "--max-concurrent-requests", "1", "--max-waiting", "0"
    )
    seen = []

    async def on_response(response):
        seen.append((response.status_code, response.headers.get("retry-after")))
        if response.status_code == 429:
            release.touch()

    async def main():
        async with openai.DefaultAsyncHttpxClient(event_hooks={"response": [on_response]}) as http:
            client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", http_client=http)
            embedder = OpenAIEmbedder(OpenAIEmbedderConfig(embedding_model=MODEL, embedding_dim=384), client=client)
            return await embedder.create(["Rivers flow into the sea."])

    held = threading.Thread(
        target=requests.post,
        args=(server.url + "/api/v1/embed",),
        kwargs={"json": {"texts": [f"{HOLD} the model"]}, "timeout": 60},
    )
    try:
        held.start()
        asyncio.run(wait_for_in_flight(server, 1))
        started = time.monotonic()
        got = asyncio.run(main())
        waited = time.monotonic() - started
    finally:
        release.touch()
    held.join(timeout=60)
    assert [status for status, _ in seen] == [429, 200], seen
    assert waited >= int(seen[0][1]) >= 1, (waited, seen)
    assert cosine_rows(np.asarray([got]), native(server, ["Rivers flow into the sea."])).min() >= 0.99999
    assert server.stop() == 0, server.log()[-4000:]


# --- LangChain ----------------------------------------------------------------


def test_langchain_openai_embeddings(srv, texts_ref):
    texts, ref = texts_ref
    lc = OpenAIEmbeddings(base_url=srv.url + "/v1", api_key="unused", model=MODEL, check_embedding_ctx_length=False)
    assert_golden(lc.embed_documents(texts), ref)
    assert_golden([lc.embed_query(texts[0])], ref[:1])

    async def main():
        return await lc.aembed_documents(texts[:5]), await lc.aembed_query(texts[1])

    docs, query = asyncio.run(main())
    assert_golden(docs, ref[:5])
    assert_golden([query], ref[1:2])
    short = OpenAIEmbeddings(
        base_url=srv.url + "/v1", api_key="unused", model=MODEL, check_embedding_ctx_length=False, dimensions=16
    )
    np.testing.assert_allclose(short.embed_documents(texts[:3]), native(srv, texts[:3], dimensions=16), atol=1e-6)


def test_langchain_openai_default_sends_tiktoken_ids_and_gets_a_400(srv, monkeypatch):
    """By default OpenAIEmbeddings tokenizes with tiktoken (downloading its BPE
    file on first use) and sends the ids, which mean other text to this
    model: the server refuses them, naming the setting that sends text. A
    byte-level tiktoken Encoding stands in for cl100k_base, offline."""
    byte_level = tiktoken.Encoding(
        name="bytes", pat_str=r"\S+|\s+", mergeable_ranks={bytes([i]): i for i in range(256)}, special_tokens={}
    )
    monkeypatch.setattr(tiktoken, "encoding_for_model", lambda name: byte_level)
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: byte_level)
    texts = ["The capital of France is Paris.", "Rivers flow into the sea."]
    for model, says in (
        (MODEL, "check_embedding_ctx_length=False"),
        ("text-embedding-3-small", "names OpenAI's `text-embedding-3-small`"),
    ):
        lc = OpenAIEmbeddings(base_url=srv.url + "/v1", api_key="unused", model=model, max_retries=0)
        with pytest.raises(openai.BadRequestError) as refused:
            lc.embed_documents(texts)
        assert refused.value.status_code == 400
        assert says in str(refused.value), refused.value
        assert "check_embedding_ctx_length=False" in str(refused.value), refused.value


def test_langchain_ollama_embeddings(srv, texts_ref):
    texts, ref = texts_ref
    lo = OllamaEmbeddings(base_url=srv.url, model=MODEL)
    assert_golden(lo.embed_documents(texts), ref)
    assert_golden([lo.embed_query(texts[0])], ref[:1])

    async def main():
        return await lo.aembed_documents(texts[:5]), await lo.aembed_query(texts[1])

    docs, query = asyncio.run(main())
    assert_golden(docs, ref[:5])
    assert_golden([query], ref[1:2])
    # Its dimensions and options.num_ctx (Ollama's context length: the cut) travel.
    cut = OllamaEmbeddings(
        base_url=srv.url, model=MODEL, dimensions=16, num_ctx=8, keep_alive=30, validate_model_on_init=True
    )
    np.testing.assert_allclose(
        cut.embed_documents(texts[:3]), native(srv, texts[:3], dimensions=16, truncate_to=8), atol=1e-6
    )


# --- Haystack -----------------------------------------------------------------


def test_haystack_openai_embedders(srv, texts_ref):
    texts, ref = texts_ref
    key = Secret.from_token("unused")
    text = OpenAITextEmbedder(api_key=key, model=MODEL, api_base_url=srv.url + "/v1")
    assert_golden([text.run(texts[0])["embedding"]], ref[:1])
    documents = OpenAIDocumentEmbedder(
        api_key=key, model=MODEL, api_base_url=srv.url + "/v1", batch_size=16, progress_bar=False
    )
    out = documents.run([Document(content=t) for t in texts])["documents"]
    assert_golden([d.embedding for d in out], ref)
    short = OpenAITextEmbedder(api_key=key, model=MODEL, api_base_url=srv.url + "/v1", dimensions=16)
    np.testing.assert_allclose(short.run(texts[0])["embedding"], native(srv, texts[:1], dimensions=16)[0], atol=1e-6)


def test_haystack_tei_embedders(srv, texts_ref):
    texts, ref = texts_ref
    params = {"api_type": "text_embeddings_inference", "api_params": {"url": srv.url}}
    text = HuggingFaceAPITextEmbedder(**params)
    got = np.asarray(text.run(texts[0])["embedding"])
    # Their default normalize: false answers the vector before normalization, as TEI does.
    np.testing.assert_allclose(got, native(srv, texts[:1], normalize=False)[0], rtol=1e-5, atol=1e-6)
    assert_golden([got], ref[:1])
    documents = HuggingFaceAPIDocumentEmbedder(**params, normalize=True, batch_size=16, progress_bar=False)
    out = documents.run([Document(content=t) for t in texts])["documents"]
    assert_golden([d.embedding for d in out], ref)
    assert np.allclose(np.linalg.norm([d.embedding for d in out], axis=1), 1, atol=1e-5)

    async def main():
        return (await text.run_async(texts[1]))["embedding"], await documents.run_async(
            [Document(content=t) for t in texts[:5]]
        )

    one, many = asyncio.run(main())
    assert_golden([one], ref[1:2])
    assert_golden([d.embedding for d in many["documents"]], ref[:5])


def test_haystack_tei_ranker(srv):
    query, docs, expected = reference_rerank()
    documents = [Document(content=d) for d in docs]
    for raw in (False, True):
        want = server_ranks(srv, query, docs, raw_scores=raw)
        ranker = HuggingFaceTEIRanker(url=srv.url, top_k=2, raw_scores=raw)
        # TEI's casing of truncation_direction ("Left", "Right"), as the ranker sends it.
        for direction in (None, TruncationDirection.LEFT, TruncationDirection.RIGHT):
            out = ranker.run(query=query, documents=documents, truncation_direction=direction)["documents"]
            got = [(docs.index(d.content), d.score) for d in out]
            assert got == [(i, pytest.approx(s, abs=1e-6)) for i, s in want[:2]], (raw, direction)
        if not raw:
            for i, s in got:
                assert s == pytest.approx(expected[i], abs=1e-5)
    out = asyncio.run(HuggingFaceTEIRanker(url=srv.url, top_k=3).run_async(query=query, documents=documents))
    assert [docs.index(d.content) for d in out["documents"]] == [i for i, _ in server_ranks(srv, query, docs)[:3]]
