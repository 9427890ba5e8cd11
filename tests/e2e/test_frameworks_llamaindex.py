"""LlamaIndex's integration packages against the real server binary: its
OpenAI, OpenAI-like, Ollama and TEI embeddings (sync and async) and its TEI
rerank postprocessor, checked as test_frameworks.py checks the others.

In a module of its own because LlamaIndex's core is large (35 packages, about
110 MB: SQLAlchemy, NLTK, networkx and pytest-asyncio); the `test` extra
installs it (as the `llamaindex` extra), and a missing package fails here, not
a skip."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from llama_index.embeddings.ollama import OllamaEmbedding
from llama_index.embeddings.openai import OpenAIEmbedding
from llama_index.embeddings.openai_like import OpenAILikeEmbedding
from llama_index.embeddings.text_embeddings_inference import TextEmbeddingsInference
from llama_index.postprocessor.tei_rerank import TextEmbeddingInference as TEIRerank

from test_client_libraries import reference_rerank
import test_frameworks
from test_frameworks import MODEL, assert_golden, native, server_ranks

# The same server and texts as test_frameworks.py's (a server of this module's own).
srv = test_frameworks.srv
texts_ref = test_frameworks.texts_ref


@pytest.mark.parametrize("kind", ["openai", "openai_like", "ollama", "tei"])
def test_llamaindex_embeddings(srv, texts_ref, kind):
    texts, ref = texts_ref
    embed = {
        # OpenAIEmbedding's `model` takes OpenAI's names only; `model_name` any.
        "openai": lambda: OpenAIEmbedding(model_name=MODEL, api_base=srv.url + "/v1", api_key="unused"),
        "openai_like": lambda: OpenAILikeEmbedding(model_name=MODEL, api_base=srv.url + "/v1", api_key="unused"),
        "ollama": lambda: OllamaEmbedding(model_name=MODEL, base_url=srv.url),
        "tei": lambda: TextEmbeddingsInference(model_name=MODEL, base_url=srv.url),
    }[kind]
    e = embed()
    assert_golden(e.get_text_embedding_batch(texts), ref)
    assert_golden([e.get_query_embedding(texts[0]), e.get_text_embedding(texts[1])], ref[:2])

    async def main():
        a = embed()
        return await a.aget_text_embedding_batch(texts[:12]), await a.aget_query_embedding(texts[2])

    docs, query = asyncio.run(main())
    assert_golden(docs, ref[:12])
    assert_golden([query], ref[2:3])


def test_llamaindex_openai_dimensions(srv, texts_ref):
    texts = texts_ref[0][:3]
    e = OpenAIEmbedding(model_name=MODEL, api_base=srv.url + "/v1", api_key="unused", dimensions=16)
    np.testing.assert_allclose(e.get_text_embedding_batch(texts), native(srv, texts, dimensions=16), atol=1e-6)


def test_llamaindex_tei_rerank(srv):
    query, docs, expected = reference_rerank()
    want = server_ranks(srv, query, docs)
    assert [i for i, _ in want] == np.argsort(-expected, kind="stable").tolist()
    rerank = TEIRerank(base_url=srv.url, top_n=2, model_name="tiny-bert-reranker")
    nodes = [NodeWithScore(node=TextNode(text=d, id_=str(i))) for i, d in enumerate(docs)]
    out = rerank.postprocess_nodes(nodes, query_bundle=QueryBundle(query))
    assert [(int(n.node.id_), n.score) for n in out] == [(i, pytest.approx(s, abs=1e-6)) for i, s in want[:2]]
    for n in out:
        assert n.score == pytest.approx(expected[int(n.node.id_)], abs=1e-5)
    nodes = [NodeWithScore(node=TextNode(text=d, id_=str(i))) for i, d in enumerate(docs)]
    out = asyncio.run(rerank.apostprocess_nodes(nodes, query_str=query))
    assert [int(n.node.id_) for n in out] == [i for i, _ in want[:2]]
