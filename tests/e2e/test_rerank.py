"""Cross-encoders and two models in one server, end to end: the real server
binary serving all-MiniLM-L6-v2 next to the tiny BERT reranker, classifier
and Qwen3 yes/no reranker fixtures, driven over HTTP and with the real
clients (huggingface_hub's InferenceClient, cohere's Client and ClientV2).

References: tests/fixtures/tiny-*/README.md (transformers / CrossEncoder)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import cohere
import huggingface_hub
import numpy as np
import pytest
import requests

from harness import FIXTURES, assert_template_instruction_limit, start_server

BERT_RERANKER = FIXTURES / "tiny-bert-reranker"
BERT_CLASSIFIER = FIXTURES / "tiny-bert-classifier"
QWEN3_RERANKER = FIXTURES / "tiny-qwen3-reranker"
EMBEDDER = "all-MiniLM-L6-v2"


def _pairs(folder):
    return json.loads((folder / "pairs.json").read_text())


def _ref(folder, name):
    return np.load(folder / name)


@pytest.fixture(scope="module")
def duo(tmp_path_factory):
    """The default embedding model plus the BERT reranker (--rerank-model)."""
    srv = start_server(tmp_path_factory.mktemp("duo"), "--rerank-model", str(BERT_RERANKER))
    yield srv
    assert srv.stop() == 0, srv.log()[-4000:]


@pytest.fixture(scope="module")
def scorers(tmp_path_factory):
    """Three cross-encoders by repeated --model: classifier first (the default
    model), then the two rerankers."""
    srv = start_server(
        tmp_path_factory.mktemp("scorers"),
        "--model", str(BERT_CLASSIFIER), "--model", str(BERT_RERANKER), "--model", str(QWEN3_RERANKER),
    )
    yield srv
    assert srv.stop() == 0, srv.log()[-4000:]


def _sort_desc(scores):
    return sorted(range(len(scores)), key=lambda i: -scores[i])


# ---------------------------------------------------------------- reranking


def test_tei_rerank_matches_reference(duo):
    pairs = _pairs(BERT_RERANKER)
    ref = _ref(BERT_RERANKER, "reference_pair_scores.npy")
    # All pairs under one query at a time: group the fixture's pairs by query.
    by_query: dict[str, list[int]] = {}
    for i, (q, _) in enumerate(pairs):
        by_query.setdefault(q, []).append(i)
    checked = 0
    for q, idx in by_query.items():
        texts = [pairs[i][1] for i in idx]
        r = duo.post("/rerank", {"query": q, "texts": texts, "return_text": True})
        assert r.status_code == 200, r.text
        ranks = r.json()
        assert [x["index"] for x in ranks] == _sort_desc([float(ref[i]) for i in idx])
        for x in ranks:
            assert abs(x["score"] - float(ref[idx[x["index"]]])) <= 1e-5
            assert x["text"] == texts[x["index"]]
            checked += 1
    assert checked == len(pairs)
    raw = duo.post("/rerank", {"query": pairs[0][0], "texts": [pairs[0][1]], "raw_scores": True}).json()
    assert abs(raw[0]["score"] - float(_ref(BERT_RERANKER, "reference_pair_logits.npy")[0, 0])) <= 1e-5
    assert "text" not in raw[0]


def test_cohere_shape_over_http(duo):
    docs = [p[1] for p in _pairs(BERT_RERANKER)[:6]]
    query = "a query"
    body = {"model": "tiny-bert-reranker", "query": query, "documents": docs, "top_n": 3}
    r = duo.post("/v1/rerank", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["model"] == "tiny-bert-reranker" and out["id"]
    assert len(out["results"]) == 3
    assert [x["document"]["text"] for x in out["results"]] == [docs[x["index"]] for x in out["results"]]
    tei = duo.post("/rerank", {"query": query, "texts": docs}).json()
    assert [x["index"] for x in out["results"]] == [x["index"] for x in tei[:3]]
    assert [x["relevance_score"] for x in out["results"]] == pytest.approx([x["score"] for x in tei[:3]], abs=1e-6)
    assert out["usage"]["total_tokens"] > 0
    # Jina-style document objects, no documents back, v2 path.
    r = duo.post("/v2/rerank", {"model": "tiny-bert-reranker", "query": query, "documents": [{"text": d} for d in docs]})
    assert r.status_code == 200, r.text
    v2 = r.json()
    assert len(v2["results"]) == len(docs) and "document" not in v2["results"][0]


def test_platform_routes_rerank_a_rerank_body_beside_an_embedder(duo):
    """SageMaker's /invocations and Vertex's /vertex send a `query` + `texts`
    body with no model: the reranker answers it, though the default model is
    the embedder (/invocations refused it with 422 as an /embed body)."""
    pairs = _pairs(BERT_RERANKER)[:3]
    body = {"query": pairs[0][0], "texts": [p[1] for p in pairs]}
    want = duo.post("/rerank", body).json()
    # TEI serves a reranker's /rerank at `POST /` too: that was a 422 (no `inputs`).
    for path in ("/invocations", "/"):
        r = duo.post(path, body)
        assert r.status_code == 200, (path, r.text)
        assert r.json() == want, path
    documents = {"query": body["query"], "documents": body["texts"], "top_n": 2}
    r = duo.post("/", documents)
    assert r.status_code == 200, r.text
    assert [(x["index"], x["relevance_score"]) for x in r.json()["results"]] == [
        (x["index"], x["score"]) for x in want[:2]]
    r = duo.post("/vertex", {"instances": [body, {"inputs": "hello"}]})
    assert r.status_code == 200, r.text
    assert r.json()["predictions"][0] == want
    assert len(r.json()["predictions"][1][0]) == 384


def test_vertex_names_the_form_a_documents_rerank_instance_should_take(duo):
    """TEI's /vertex takes /rerank's `texts` form only; a `documents` instance
    was read as an /embed body and refused for a missing `inputs`."""
    r = duo.post("/vertex", {"instances": [{"inputs": "hello"}, {"query": "q", "documents": ["a", "b"]}]})
    assert r.status_code == 422, r.text
    assert r.json() == {
        "error": "instance 1: a rerank instance takes TEI's `query` and `texts` (`documents` is the "
        "/v1/rerank form, which /vertex does not take)",
        "error_type": "Validation",
    }


def test_a_voyage_body_on_v2_rerank_gets_voyages_answer(duo):
    """Voyage AI's body (`top_k`, `truncation`) on Cohere's v2 route passed as
    Cohere's with `top_k` unread: every document came back."""
    docs = [p[1] for p in _pairs(BERT_RERANKER)[:4]]
    body = {"model": "tiny-bert-reranker", "query": "a query", "documents": docs, "top_k": 2, "truncation": True}
    v1 = duo.post("/v1/rerank", body)
    v2 = duo.post("/v2/rerank", body)
    assert v1.status_code == v2.status_code == 200, (v1.text, v2.text)
    got, want = v2.json(), v1.json()
    assert got["object"] == "list" and len(got["data"]) == 2
    assert [x["index"] for x in got["data"]] == [x["index"] for x in want["data"]]
    assert [x["relevance_score"] for x in got["data"]] == [x["relevance_score"] for x in want["data"]]
    r = duo.post("/v2/rerank", {**body, "top_k": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k", r.text


def test_rerank_with_both_top_k_and_top_n(duo):
    """A body with Voyage's `top_k` and Cohere's/Jina's `top_n` was read as
    Voyage's and `top_n` dropped: the other count of results, with a 200. Equal,
    they are one setting; different, a 400 naming both; `top_k: null` (which
    Voyage's client always sends) leaves `top_n` in force."""
    docs = [p[1] for p in _pairs(BERT_RERANKER)[:4]]
    body = {"model": "tiny-bert-reranker", "query": "a query", "documents": docs}
    r = duo.post("/v1/rerank", {**body, "top_k": 3, "top_n": 1})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "top_n", r.text
    assert "top_k (3) and top_n (1)" in r.json()["error"]["message"], r.text
    for top_k, top_n in ((2, 2), (None, 2)):
        r = duo.post("/v1/rerank", {**body, "top_k": top_k, "top_n": top_n})
        assert r.status_code == 200, r.text
        assert len(r.json()["data"]) == 2, r.text


def test_rerank_takes_the_documents_shape_too(duo):
    """Infinity, vLLM and Jina serve `/rerank` with `documents` (and Infinity
    `/embeddings` without the version prefix): that body gets /v1/rerank's answer."""
    docs = [p[1] for p in _pairs(BERT_RERANKER)[:5]]
    body = {"model": "tiny-bert-reranker", "query": "a query", "documents": docs, "top_n": 2}
    r = duo.post("/rerank", body)
    assert r.status_code == 200, r.text
    got, want = r.json(), duo.post("/v1/rerank", body).json()
    assert [x["index"] for x in got["results"]] == [x["index"] for x in want["results"]]
    assert [x["relevance_score"] for x in got["results"]] == [x["relevance_score"] for x in want["results"]]
    assert got["results"][0]["document"]["text"] == docs[got["results"][0]["index"]]
    # (cache_hits differ: the second call finds the first one's pairs cached.)
    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    assert got["model"] == "tiny-bert-reranker"
    # Infinity's return_documents: false; object documents (Jina).
    r = duo.post("/rerank", {"query": "a query", "documents": [{"text": d} for d in docs],
                             "return_documents": False})
    assert r.status_code == 200 and "document" not in r.json()["results"][0]
    # Its errors come in the same (Cohere/OpenAI) shape as /v1/rerank's; TEI's body keeps TEI's.
    bad = duo.post("/rerank", {"query": "q", "documents": ["d"], "top_n": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_n"
    # 0 is all, as vLLM's protocol sends it by default.
    every = duo.post("/rerank", {"query": "q", "documents": ["d", "e", "f"], "top_n": 0})
    assert every.status_code == 200 and len(every.json()["results"]) == 3, every.text
    bad = duo.post("/rerank", {"query": "q", "documents": "nope"})
    assert bad.status_code == 400 and "message" in bad.json()["error"]
    bad = duo.post("/rerank", {"query": "q"})
    assert bad.status_code == 422 and "missing field `texts`" in bad.json()["error"]
    emb = duo.post("/embeddings", {"model": EMBEDDER, "input": ["hello"]})
    assert emb.status_code == 200, emb.text
    v1 = duo.post("/v1/embeddings", {"model": EMBEDDER, "input": ["hello"]}).json()
    assert emb.json()["data"] == v1["data"]
    assert duo.get("/models").json() == duo.get("/v1/models").json()
    # models.retrieve from a client whose base_url has no /v1.
    one = duo.get(f"/models/{EMBEDDER}")
    assert one.status_code == 200 and one.json() == duo.get(f"/v1/models/{EMBEDDER}").json(), one.text


def test_vllm_score_api(duo, scorers):
    """vLLM's /score and /v1/score: a reranker's sigmoid scores (the default
    when no model is named), or an embedding model's cosine."""
    docs = [p[1] for p in _pairs(BERT_RERANKER)[:4]]
    query = "a query"
    tei = {x["index"]: x["score"] for x in duo.post("/rerank", {"query": query, "texts": docs}).json()}
    for path in ("/score", "/v1/score"):
        r = duo.post(path, {"text_1": query, "text_2": docs})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["object"] == "list" and out["model"] == "tiny-bert-reranker" and out["id"]
        assert [d["index"] for d in out["data"]] == list(range(len(docs)))
        assert all(d["object"] == "score" for d in out["data"])
        assert [d["score"] for d in out["data"]] == pytest.approx([tei[i] for i in range(len(docs))], abs=1e-6)
        assert out["usage"]["prompt_tokens"] > 0
    # Two lists side by side: pair i is (text_1[i], text_2[i]).
    side = duo.post("/score", {"text_1": [query, "other"], "text_2": docs[:2]}).json()["data"]
    alone = duo.post("/score", {"text_1": "other", "text_2": docs[1]}).json()["data"]
    assert side[1]["score"] == pytest.approx(alone[0]["score"], abs=1e-6)
    assert side[0]["score"] == pytest.approx(tei[0], abs=1e-6)
    # An embedding model named: the cosine TEI's /similarity gives (an empty
    # text is a 400 on the embed path, as everywhere; a reranker scores it).
    assert "" in docs
    texts = [d for d in docs if d]
    cos = duo.post("/score", {"model": EMBEDDER, "text_1": query, "text_2": texts}).json()
    sim = duo.post("/similarity", {"inputs": {"source_sentence": query, "sentences": texts}}).json()
    assert cos["model"] == EMBEDDER
    assert [d["score"] for d in cos["data"]] == pytest.approx(sim, abs=1e-6)
    # vLLM's rerank takes its truncate_prompt_tokens as its score API does.
    cut = {d["index"]: d["score"] for d in duo.post(
        "/v1/score", {"text_1": query, "text_2": docs, "truncate_prompt_tokens": 5}).json()["data"]}
    whole = {d["index"]: d["score"] for d in duo.post("/v1/score", {"text_1": query, "text_2": docs}).json()["data"]}
    assert cut != whole
    for path in ("/v1/rerank", "/rerank"):
        r = duo.post(path, {"query": query, "documents": docs, "truncate_prompt_tokens": 5})
        assert r.status_code == 200, r.text
        ranked = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
        assert ranked == pytest.approx(cut, abs=1e-6)
    r = duo.post("/v1/rerank", {"query": query, "documents": docs, "truncate_prompt_tokens": -1})
    assert {x["index"]: x["relevance_score"] for x in r.json()["results"]} == pytest.approx(whole, abs=1e-6)
    for extra, says in [
        ({"truncate_prompt_tokens": 3}, "special tokens"),
        ({"truncate_prompt_tokens": 5, "max_chunks_per_doc": 2}, "give one or the other"),
    ]:
        r = duo.post("/v1/rerank", {"query": query, "documents": docs, **extra})
        assert r.status_code == 400, r.text
        assert says in r.text, r.text
    # /similarity names a refused input as its body names it.
    for inputs, says in [
        ({"source_sentence": "a", "sentences": ["b", ""]}, "inputs.sentences[1] is an empty string"),
        ({"source_sentence": "", "sentences": ["b"]}, "inputs.source_sentence is an empty string"),
    ]:
        r = duo.post("/similarity", {"inputs": inputs})
        assert r.status_code == 400, r.text
        assert r.json()["error"].startswith(says), r.text
    r = duo.post("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b", "word " * 600]},
                                 "parameters": {"truncate": False}})
    assert r.status_code == 422, r.text
    assert r.json()["error"].startswith("inputs.sentences[1] has "), r.text
    for body, status in [
        ({"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, 400),
        ({"text_1": "a", "text_2": []}, 400),
        ({"text_1": "a"}, 400),  # a wrong shape, as vLLM answers it
        ({"model": "nope", "text_1": "a", "text_2": "b"}, 404),
    ]:
        r = duo.post("/score", body)
        assert r.status_code == status, (body, r.text)
        assert "message" in r.json()["error"]
    r = scorers.post("/score", {"model": "tiny-bert-classifier", "text_1": "a", "text_2": "b"})
    assert r.status_code == 400 and "a reranker or an embedding model" in r.json()["error"]["message"]


def test_cohere_clients_unchanged(duo):
    docs = ["Paris is the capital of France.", "Pizza is food.", "", "Berlin is in Germany."]
    http = duo.post("/rerank", {"query": "capital of france", "texts": docs}).json()
    co = cohere.Client(api_key="unused", base_url=duo.url)
    res = co.rerank(model="tiny-bert-reranker", query="capital of france", documents=docs, top_n=2,
                    return_documents=True)
    assert [r.index for r in res.results] == [x["index"] for x in http[:2]]
    assert [r.relevance_score for r in res.results] == pytest.approx([x["score"] for x in http[:2]], abs=1e-6)
    assert res.results[0].document.text == docs[res.results[0].index]
    co2 = cohere.ClientV2(api_key="unused", base_url=duo.url)
    res2 = co2.rerank(model="tiny-bert-reranker", query="capital of france", documents=docs)
    assert [r.index for r in res2.results] == [x["index"] for x in http]


def test_qwen3_and_bert_rerankers_side_by_side(scorers):
    for folder, name in ((QWEN3_RERANKER, "tiny-qwen3-reranker"), (BERT_RERANKER, "tiny-bert-reranker")):
        pairs = _pairs(folder)
        scores = _ref(folder, "reference_pair_scores.npy")
        logits = _ref(folder, "reference_pair_logits.npy")
        # One request per pair through /predict ([query, document] is one pair in TEI's shape).
        got = [scorers.post("/predict", {"model": name, "inputs": list(p)}).json() for p in pairs[:12]]
        for i, g in enumerate(got):
            assert g[0]["label"] in ("LABEL_0", "score")
            assert abs(g[0]["score"] - float(scores[i])) <= 1e-5, (name, i)
        # A batch of all pairs in one request, raw logits.
        r = scorers.post("/predict", {"model": name, "inputs": [list(p) for p in pairs], "raw_scores": True})
        assert r.status_code == 200, r.text
        raw = np.array([row[0]["score"] for row in r.json()])
        np.testing.assert_allclose(raw, logits[:, 0], rtol=1e-5, atol=1e-5)


def test_qwen3_reranker_cut_from_the_left_still_reads_the_query(scorers):
    """A long document cut from the left keeps the instruction and the
    query (it once cut them first: every query scored alike), and the
    server's Rust tokenization gives the Python model's own scores."""
    import mlx_embed

    doc = " ".join(f"w{i}" for i in range(2000)) + " Paris"
    queries = ["capital of france", "best pizza in town"]
    got = [scorers.post("/rerank", {"model": "tiny-qwen3-reranker", "query": q, "texts": [doc, "short one"],
                                    "raw_scores": True, "truncation_direction": "left"}).json()
           for q in queries]
    by_index = [{x["index"]: x["score"] for x in g} for g in got]
    assert by_index[0][0] != by_index[1][0]
    want = mlx_embed.load(str(QWEN3_RERANKER)).score(
        [(q, d) for q in queries for d in (doc, "short one")], truncation_direction="left", raw_scores=True)[:, 0]
    np.testing.assert_allclose([by_index[0][0], by_index[0][1], by_index[1][0], by_index[1][1]], want,
                               rtol=1e-5, atol=1e-5)


def test_qwen3_reranker_refuses_an_instruction_that_leaves_no_document(scorers):
    """Qwen3-Reranker's <Instruct> past the room of its input: a 400 naming
    the instruction (it cut every document away, all scored alike, 200)."""
    import mlx_embed

    assert_template_instruction_limit(scorers, "tiny-qwen3-reranker", mlx_embed.load(str(QWEN3_RERANKER)))


def test_cohere_chunks_and_cuts_long_documents(duo):
    """Cohere's max_chunks_per_doc scores a document by its best chunk of as
    many tokens as fit beside the query; max_tokens_per_doc cuts it first.
    Both were accepted and ignored: two long documents that differed only
    past the model's limit scored the same."""
    import mlx_embed
    from tokenizers import Tokenizer

    model = mlx_embed.load(str(BERT_RERANKER))
    tok = Tokenizer.from_file(str(BERT_RERANKER / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    query = "capital of france"
    # Period 25: the fixture's 8th chunk (0.538) outscores its first (0.319).
    filler = " ".join(f"word{i % 25}" for i in range(700))
    docs = [filler + " Paris is the capital of France.", filler + " Bananas are yellow fruit."]

    def pieces(doc, max_tokens=None, max_chunks=None):
        # The rule the server documents: token offsets of the document alone,
        # chunks of (max length - the pair without its document) tokens.
        offsets = tok.encode(doc, add_special_tokens=False).offsets[:max_tokens]
        if max_chunks is None:
            return [doc[:offsets[-1][1]]]
        (frame,), _, _ = model.encode_pairs([(query, "")])
        per = model.max_length - len(frame)
        groups = [offsets[i:i + per] for i in range(0, len(offsets), per)][:max_chunks]
        return [doc[(0 if n == 0 else g[0][0]):g[-1][1]] for n, g in enumerate(groups)]

    def best(doc, **limits):
        return float(model.score([(query, p) for p in pieces(doc, **limits)])[:, 0].max())

    co = cohere.Client(api_key="unused", base_url=duo.url)
    plain = {r.index: r.relevance_score for r in co.rerank(model="tiny-bert-reranker", query=query,
                                                           documents=docs).results}
    assert plain[0] == pytest.approx(plain[1], abs=1e-6)  # both cut to the same first ~120 tokens
    chunked = {r.index: r.relevance_score for r in co.rerank(model="tiny-bert-reranker", query=query,
                                                             documents=docs, max_chunks_per_doc=10).results}
    for i, doc in enumerate(docs):
        assert len(pieces(doc, max_chunks=10)) == 10
        assert chunked[i] == pytest.approx(best(doc, max_chunks=10), abs=1e-5)
        # The first chunk is what the cut keeps; a later one scores higher here.
        assert chunked[i] > plain[i] + 1e-3
    co2 = cohere.ClientV2(api_key="unused", base_url=duo.url)
    cut = {r.index: r.relevance_score for r in co2.rerank(model="tiny-bert-reranker", query=query,
                                                          documents=docs, max_tokens_per_doc=5).results}
    for i, doc in enumerate(docs):
        assert cut[i] == pytest.approx(best(doc, max_tokens=5), abs=1e-5)
    # Each chunk is a model input: the chunks count against the input limit (2048), as
    # documents do (one-token chunks beside a long query made a small request hundreds
    # of times its documents' work).
    many = ["short one"] * 2046 + [docs[0]]  # 2046 chunks, and 2 of the long one
    r = duo.post("/v1/rerank", {"model": "tiny-bert-reranker", "query": query, "documents": many,
                                "max_chunks_per_doc": 2, "top_n": 1})
    assert r.status_code == 200, r.text[:300]
    r = duo.post("/v1/rerank", {"model": "tiny-bert-reranker", "query": query, "documents": ["x"] + many,
                                "max_chunks_per_doc": 2})
    assert r.status_code == 413, r.text[:300]
    assert r.json()["error"]["message"] == (
        "max_chunks_per_doc splits these documents into more than 2048 chunks, the inputs one "
        "request may have (--max-inputs-per-request); lower max_chunks_per_doc or send fewer documents")
    # A query beside every document: over 16 MiB of pairs is refused before any is built.
    r = duo.post("/v1/rerank", {"model": "tiny-bert-reranker", "query": "q " * 500_000,
                                "documents": ["d"] * 17})
    assert r.status_code == 413, r.text[:300]
    assert r.json()["error"]["message"] == (
        "these 17 query/document pairs hold 17000017 bytes of text, each pair's query counted, more "
        "than the 16 MiB one request may have; send a shorter query or fewer documents per request")
    r = duo.post("/v1/score", {"model": "tiny-bert-reranker", "text_1": "q " * 500_000, "text_2": ["d"] * 17})
    assert r.status_code == 413, r.text[:300]
    for field in ("max_chunks_per_doc", "max_tokens_per_doc"):
        r = duo.post("/v1/rerank", {"model": "tiny-bert-reranker", "query": query, "documents": docs, field: 0})
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


def test_cohere_chunks_keep_half_the_window_beside_a_long_query(duo):
    """With max_chunks_per_doc, a query at or over the model's maximum (128
    tokens here) made one-token chunks: a 1,000-word document became
    hundreds of inputs that each saw one of its tokens, and a short document
    that needs no chunking scored otherwise than without max_chunks_per_doc.
    As Cohere's, a query takes at most half of the input beside a chunk: the
    chunks of a split document go with the query's first tokens that leave
    them half.  Since a template reranker's truncation cut a short document
    away whole beside such a query (every short document scored the same),
    every document goes with the cut query, one that fits a chunk too."""
    import mlx_embed
    from tokenizers import Tokenizer

    model = mlx_embed.load(str(BERT_RERANKER))
    tok = Tokenizer.from_file(str(BERT_RERANKER / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    window = model.max_length
    assert window == 128

    def frame(q):
        (ids,), _, _ = model.encode_pairs([(q, "")])
        return len(ids)

    def post(query, documents, **extra):
        r = duo.post("/v1/rerank", {"model": "tiny-bert-reranker", "query": query,
                                    "documents": documents, "return_documents": False, **extra})
        assert r.status_code == 200, r.text[:300]
        body = r.json()
        return {x["index"]: x["relevance_score"] for x in body["results"]}, body["usage"]["prompt_tokens"]

    filler = " ".join(f"word{i % 50}" for i in range(1000)) + " alpha beta"
    for query in ["alpha " * 300, "alpha beta " * 45]:  # 300 tokens; 90, which leaves 35
        q_offsets = tok.encode(query, add_special_tokens=False).offsets
        specials = frame("")  # [CLS] [SEP] [SEP]
        assert len(q_offsets) + specials > window // 2
        # The query the chunks go with: its first tokens that leave half.
        cut = query[:q_offsets[window // 2 - specials - 1][1]]
        per = window - frame(cut)
        assert per >= window // 2
        d_offsets = tok.encode(filler, add_special_tokens=False).offsets
        groups = [d_offsets[i:i + per] for i in range(0, len(d_offsets), per)]
        chunks = [filler[(0 if n == 0 else g[0][0]):g[-1][1]] for n, g in enumerate(groups)]
        assert 1 < len(chunks) <= -(-len(d_offsets) // (window // 2))
        ids, _, _ = model.encode_pairs([(cut, c) for c in chunks])
        want = float(model.score([(cut, c) for c in chunks])[:, 0].max())
        (short_plain,), _, _ = model.encode_pairs([(query, "short doc here")])
        _, plain_tokens = post(query, ["short doc here", filler])
        assert plain_tokens == len(short_plain) + window
        (short,), _, _ = model.encode_pairs([(cut, "short doc here")])
        short_want = float(model.score([(cut, "short doc here")])[0, 0])
        for n in (len(chunks), 2048):
            got, tokens = post(query, ["short doc here", filler], max_chunks_per_doc=n)
            # A document that fits one chunk goes with the cut query too.
            assert got[0] == pytest.approx(short_want, abs=1e-5)
            assert got[1] == pytest.approx(want, abs=1e-5)
            assert tokens == len(short) + sum(len(x) for x in ids)
        # One chunk: the document's first half-window beside the cut query.
        got, tokens = post(query, [filler], max_chunks_per_doc=1)
        assert got[0] == pytest.approx(float(model.score([(cut, chunks[0])])[0, 0]), abs=1e-5)
        assert tokens == len(ids[0])


def test_template_reranker_chunks_read_each_short_document_beside_a_long_query(scorers):
    """Qwen3-Reranker's prompt cut at the window keeps its start: beside a
    query that fills the window a short document was cut away whole, and
    with max_chunks_per_doc every short document scored the same. With
    chunking the query takes at most half the window, for every document."""
    import mlx_embed
    from tokenizers import Tokenizer

    model = mlx_embed.load(str(QWEN3_RERANKER))
    tok = Tokenizer.from_file(str(QWEN3_RERANKER / "tokenizer.json"))
    window = model.max_length
    query = " ".join(f"topic{i % 7}" for i in range(300))
    offsets = tok.encode(query, add_special_tokens=False).offsets
    frame = model.encode_pairs([(query, "")])[2][0]  # tokens before truncation
    assert frame > window
    keep = window // 2 - (frame - len(offsets))
    cut = query[:offsets[keep - 1][1]]
    docs = ["beta", "omega lambda kappa", "zzz qqq xxx"]
    r = scorers.post("/v1/rerank", {"model": "tiny-qwen3-reranker", "query": query, "documents": docs,
                                    "max_chunks_per_doc": 4, "return_documents": False})
    assert r.status_code == 200, r.text[:300]
    got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    want = model.score([(cut, d) for d in docs])[:, 0]
    np.testing.assert_allclose([got[i] for i in range(len(docs))], want, atol=1e-5)
    assert len({round(got[i], 4) for i in range(len(docs))}) == len(docs), got


def test_classifier_predict(scorers):
    texts = json.loads((FIXTURES / "golden" / "minilm_texts.json").read_text())
    ref = _ref(BERT_CLASSIFIER, "reference_text_logits.npy")
    labels = ["negative", "neutral", "positive"]
    # Texts 5..24 (3 and 4 are empty and blank: an empty string is a 400 here as on every route).
    # TEI's batch: a list of [text] lists (the default model).
    r = scorers.post("/predict", {"inputs": [[t] for t in texts[5:25]], "raw_scores": True})
    assert r.status_code == 200, r.text
    assert len(r.json()) == 20
    for i, row in enumerate(r.json(), start=5):
        got = {p["label"]: p["score"] for p in row}
        np.testing.assert_allclose([got[label] for label in labels], ref[i], rtol=1e-5, atol=1e-5)
        assert [p["score"] for p in row] == sorted((p["score"] for p in row), reverse=True)
    # A batch of two is two inputs (a flat list of two texts would be one pair).
    two = scorers.post("/predict", {"inputs": [[texts[5]], [texts[6]]], "raw_scores": True})
    assert two.status_code == 200, two.text
    assert [[p["label"] for p in row] for row in two.json()] == [[p["label"] for p in row] for row in r.json()[:2]]
    np.testing.assert_allclose([[p["score"] for p in row] for row in two.json()],
                               [[p["score"] for p in row] for row in r.json()[:2]], atol=1e-6)
    # A flat list of three texts is refused, not read as a batch.
    flat = scorers.post("/predict", {"inputs": texts[5:8]})
    assert flat.status_code == 422 and "list of lists" in flat.json()["error"], flat.text
    one = scorers.post("/predict", {"inputs": texts[1]}).json()
    # A flat [text] is that one input too, answered flat, as TEI does.
    assert scorers.post("/predict", {"inputs": [texts[1]]}).json() == one
    e = np.exp(ref[1] - ref[1].max())
    probs = dict(zip(labels, e / e.sum()))
    assert [p["label"] for p in one] == sorted(labels, key=lambda k: -probs[k])
    assert all(abs(p["score"] - probs[p["label"]]) <= 1e-5 for p in one)


def test_inference_client(duo, scorers, golden):
    hub = huggingface_hub
    texts, mean = golden
    client = hub.InferenceClient(model=duo.url)
    vec = client.feature_extraction(texts[1])
    assert vec.shape == (1, 384)
    assert float(np.dot(vec[0], mean[1])) >= 0.99999
    sims = client.sentence_similarity(texts[8], other_sentences=[texts[8], texts[9], texts[13]])
    want = [float(np.dot(mean[8], mean[j])) for j in (8, 9, 13)]
    assert sims == pytest.approx(want, abs=1e-5)
    classifier = hub.InferenceClient(model=scorers.url)
    out = classifier.text_classification(texts[1])
    http = scorers.post("/predict", {"inputs": texts[1]}).json()
    assert [(o.label, round(o.score, 5)) for o in out] == [(p["label"], round(p["score"], 5)) for p in http]
    top = classifier.text_classification(texts[1], top_k=1, function_to_apply="none")
    raw = _ref(BERT_CLASSIFIER, "reference_text_logits.npy")[1]
    assert len(top) == 1 and abs(top[0].score - float(raw.max())) <= 1e-4
    # The client's other tasks post to the same URL with their own parameters:
    # refused by name, not answered with a classifier's labels.
    from huggingface_hub.errors import HfHubHTTPError

    with pytest.raises(HfHubHTTPError) as e:
        classifier.zero_shot_classification(texts[1], candidate_labels=["a", "b"])
    assert e.value.response.status_code == 400
    assert "candidate_labels (a zero-shot classification parameter)" in e.value.response.text
    assert "  " not in e.value.response.text
    for params, task in (({"targets": ["a"]}, "fill-mask"), ({"aggregation_strategy": "simple"}, "token")):
        r = scorers.post("/", {"inputs": texts[1], "parameters": params})
        assert r.status_code == 400 and task in r.json()["error"], r.text


def test_tei_info_for_tei_clients(duo, scorers):
    """/info carries TEI's names too: huggingface_hub reads it as an endpoint's
    info, and Dify checks model_type and sizes its calls by the two maxima."""
    info = huggingface_hub.InferenceClient(model=duo.url, provider="hf-inference").get_endpoint_info()
    assert info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert (info["model_id"], info["model_dtype"], info["model_sha"]) == (EMBEDDER, "float32", None)
    assert (info["max_input_length"], info["max_client_batch_size"], info["max_batch_requests"],
            info["max_batch_tokens"], info["max_concurrent_requests"], info["auto_truncate"]) == (
        256, 2048, 64, 8192, 512, True)
    labels = json.loads((BERT_CLASSIFIER / "config.json").read_text())["id2label"]
    got = scorers.get("/info").json()["model_type"]
    assert got == {"classifier": {"id2label": labels, "label2id": {v: int(k) for k, v in labels.items()}}}


# ------------------------------------------------------------ two models


def test_models_listed_and_labelled(duo):
    models = duo.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == [EMBEDDER, "tiny-bert-reranker"]
    info = duo.get("/info").json()
    assert [(m["model"], m["kind"]) for m in info["models"]] == [(EMBEDDER, "embedding"), ("tiny-bert-reranker", "reranker")]
    assert info["models"][1]["labels"] == ["LABEL_0"]
    assert [m["pooling"] for m in info["models"]] == ["mean", None]
    duo.post("/rerank", {"query": "q", "texts": ["d"]})
    metrics = duo.get("/metrics").text
    assert f'mlx_embed_batches_total{{model="{EMBEDDER}"}}' in metrics
    assert 'mlx_embed_batches_total{model="tiny-bert-reranker"}' in metrics
    assert metrics.count("# TYPE mlx_embed_batches_total counter") == 1
    assert 'mlx_embed_info{model="tiny-bert-reranker",kind="reranker"' in metrics


def _http_counts(server) -> dict[str, float]:
    text = server.get("/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(r"^mlx_embed_http_requests_total(\{.*\}) (\S+)$", text, re.M)}


def test_http_metrics_of_two_models_carry_the_model(duo):
    """With several models served, the HTTP metrics carry the model each
    request named or was given (`""`: it reached none), as the batcher's do;
    a request refused for naming a model of the wrong kind counts under it."""
    before = _http_counts(duo)
    assert duo.post("/embed", {"inputs": "hello"}).status_code == 200
    assert duo.post("/rerank", {"query": "q", "texts": ["d"]}).status_code == 200
    assert duo.get("/v1/models/nope").status_code == 404
    assert duo.post("/v1/rerank", {"model": EMBEDDER, "query": "q", "documents": ["d"]}).status_code == 400
    # Refused by the input checks, which come before the model is picked:
    # still counted under the model named (or given).
    assert duo.post("/v1/embeddings", {"model": EMBEDDER, "input": []}).status_code == 400
    assert duo.post("/rerank", {"query": "q", "texts": []}).status_code == 400
    after = _http_counts(duo)
    grew = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    assert grew == {
        f'{{route="/embed",model="{EMBEDDER}",code="200"}}': 1,
        '{route="/rerank",model="tiny-bert-reranker",code="200"}': 1,
        '{route="/v1/models/{*model}",model="",code="404"}': 1,
        f'{{route="/v1/rerank",model="{EMBEDDER}",code="400"}}': 1,
        f'{{route="/v1/embeddings",model="{EMBEDDER}",code="400"}}': 1,
        '{route="/rerank",model="tiny-bert-reranker",code="400"}': 1,
        '{route="/metrics",model="",code="200"}': 1,
    }


def test_openai_client_retrieves_each_model(duo, server):
    import openai

    c = openai.OpenAI(base_url=duo.url + "/v1", api_key="unused")
    for name in (EMBEDDER, "tiny-bert-reranker"):
        got = c.models.retrieve(name)
        # owned_by: the one value Infinity's client takes (an enum of it).
        assert (got.id, got.object, got.owned_by) == (name, "model", "infinity")
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"
    # A one-model server answers any name with its model, as its embed routes do.
    one = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    assert one.models.retrieve("text-embedding-3-small").id == EMBEDDER
    assert one.models.retrieve("BAAI/bge-m3").id == EMBEDDER


def test_an_unknown_model_is_the_one_that_can_answer_else_404_in_openai_shape(duo):
    """Beside a reranker, the one embedder answers the embed routes whatever
    name a client sends (its own default: text-embedding-3-small, nomic-embed-text),
    and the one reranker the rerank routes; where both could answer, an unknown
    name is a 404."""
    named = duo.post("/v1/embeddings", {"model": EMBEDDER, "input": ["x"]}).json()
    other = duo.post("/v1/embeddings", {"model": "text-embedding-3-small", "input": ["x"]})
    assert other.status_code == 200, other.text
    assert other.json()["data"] == named["data"] and other.json()["model"] == EMBEDDER
    for path, body in [
        ("/v1/rerank", {"model": "nope", "query": "q", "documents": ["d"]}),
        ("/rerank", {"model": "nope", "query": "q", "texts": ["d"]}),
        ("/embed", {"model": "nope", "inputs": "x"}),
        ("/api/embed", {"model": "nomic-embed-text", "input": "x"}),
    ]:
        assert duo.post(path, body).status_code == 200, path
    r = duo.post("/v1/score", {"model": "no-such-model", "text_1": "a", "text_2": "b"})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model" and "no-such-model" in err["message"]
    assert err["type"] == "invalid_request_error"  # as OpenAI answers it
    assert duo.get("/v1/models/no-such-model").status_code == 404


def test_two_models_under_concurrent_load(duo, golden):
    """Embeddings and reranks interleaved from 16 threads: every answer is
    the one its own request asked for, from the model it named."""
    texts, mean = golden
    pairs = _pairs(BERT_RERANKER)
    ref = _ref(BERT_RERANKER, "reference_pair_scores.npy")
    session = requests.Session()
    session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=16))
    usable = [i for i, t in enumerate(texts) if t]  # "" is a 400 on every embed route

    def one(k: int):
        if k % 2:
            i = usable[k % len(usable)]
            r = session.post(duo.url + "/v1/embeddings", json={"model": EMBEDDER, "input": [texts[i]]}, timeout=120)
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["model"] == EMBEDDER
            return float(np.dot(np.array(body["data"][0]["embedding"]), mean[i])) >= 0.99999
        i = k % len(pairs)
        r = session.post(duo.url + "/rerank", json={"query": pairs[i][0], "texts": [pairs[i][1]]}, timeout=120)
        assert r.status_code == 200, r.text
        return abs(r.json()[0]["score"] - float(ref[i])) <= 1e-5

    with ThreadPoolExecutor(16) as pool:
        ok = list(pool.map(one, range(320)))
    assert sum(ok) == len(ok), f"{len(ok) - sum(ok)} mixed-up answers"


def test_cohere_rank_fields_pick_what_is_ranked(duo):
    """Cohere's structured documents: an object is ranked on its `text`, or on
    its `rank_fields` in order, one `field: value` line each (a non-string
    value as compact JSON); `return_documents` answers each document as sent."""
    query = "capital of france"
    doc = {"title": "Paris", "text": "France", "year": 1900}

    def tei_scores(texts):
        r = duo.post("/rerank", {"query": query, "texts": texts})
        assert r.status_code == 200, r.text
        return {x["index"]: x["score"] for x in r.json()}

    def cohere_score(path, **extra):
        r = duo.post(path, {"query": query, "documents": [doc], "return_documents": True, **extra})
        assert r.status_code == 200, r.text
        (result,) = r.json()["results"]
        assert result["document"] == doc  # the whole object, as sent
        return result["relevance_score"]

    texts = ["France", "title: Paris", "year: 1900\ntitle: Paris\ntext: France"]
    want = tei_scores(texts)
    assert len(set(want.values())) == 3, want  # the three texts score apart
    for path in ("/v1/rerank", "/v2/rerank", "/rerank"):
        assert cohere_score(path) == pytest.approx(want[0], abs=1e-6)
        assert cohere_score(path, rank_fields=["title"]) == pytest.approx(want[1], abs=1e-6)
        assert cohere_score(path, rank_fields=["year", "title", "text"]) == pytest.approx(want[2], abs=1e-6)
    # A string document is ranked as it is and answered in Cohere's form.
    r = duo.post("/v1/rerank", {"query": query, "documents": ["France", doc], "rank_fields": ["title"]})
    assert r.status_code == 200, r.text
    by_index = {x["index"]: x for x in r.json()["results"]}
    assert by_index[0]["document"] == {"text": "France"}
    assert by_index[0]["relevance_score"] == pytest.approx(want[0], abs=1e-6)
    assert by_index[1]["relevance_score"] == pytest.approx(want[1], abs=1e-6)


def test_cohere_rank_fields_errors_are_exact(duo):
    def error(body, path="/v1/rerank"):
        r = duo.post(path, {"query": "q", **body})
        return r.status_code, r.json()["error"]

    def cohere(message, param, status=400):
        return status, {"message": message, "type": "invalid_request_error", "param": param, "code": None}

    assert error({"documents": [{"title": "a", "text": "b"}, {"text": "c"}], "rank_fields": ["title"]}) == cohere(
        "document 1 has no field `title` (named in rank_fields)", "documents")
    no_text = cohere("document 0 has no `text` field: send `text`, or name the fields to rank on in rank_fields",
                     "documents")
    assert error({"documents": [{"title": "a"}]}) == no_text
    assert error({"documents": [{"title": "a"}]}, "/rerank") == no_text
    for value in (5, None, ["a"]):
        assert error({"documents": ["fine", {"text": value}]}) == cohere(
            "document 1's `text` must be a string; to rank on other values, name their fields in rank_fields",
            "documents")
    for bad in ([], ["title", 3]):
        assert error({"documents": [{"title": "a"}], "rank_fields": bad}) == cohere(
            "rank_fields must be a non-empty list of field names (strings)", "rank_fields")
    status, body = error({"documents": ["a", 3]})
    assert status == 400 and "each document must be a string or a JSON object" in body["message"], body
    assert "untagged" not in body["message"] and "RerankDocument" not in body["message"]


# -------------------------------------------------------------- bad input


def test_rerank_bad_input(duo, tmp_path):
    q = "query"
    cases = [
        ("/rerank", {"query": q, "texts": []}, 400),
        ("/v1/rerank", {"query": q, "documents": []}, 400),
        ("/v1/rerank", {"query": q, "documents": ["d"], "top_n": -1}, 400),
        ("/v2/rerank", {"model": "tiny-bert-reranker", "query": q, "documents": ["d"], "top_n": -3}, 400),
        ("/rerank", {"query": q, "texts": ["d"] * 2049}, 413),
        ("/rerank", {"query": q, "texts": ["word " * 300], "truncate": False}, 422),
        ("/rerank", {"query": q, "texts": "not a list"}, 422),
        ("/rerank", {"texts": ["d"]}, 422),
        ("/v1/rerank", {"model": EMBEDDER, "query": q, "documents": ["d"]}, 400),
        ("/predict", {"model": EMBEDDER, "inputs": "x"}, 400),
        ("/predict", {"inputs": [["a", "b", "c"]]}, 422),
        ("/predict", {"inputs": [[]]}, 422),
    ]
    for path, body, status in cases:
        r = duo.post(path, body)
        assert r.status_code == status, (path, body if len(json.dumps(body)) < 200 else "...", r.text)
    too_long = duo.post("/rerank", {"query": q, "texts": ["ok", "word " * 300], "truncate": False})
    assert "input 1 has" in too_long.json()["error"]
    # A pair that fits is fine with truncate: false; an empty document is a valid pair.
    assert duo.post("/rerank", {"query": q, "texts": ["short", ""], "truncate": False}).status_code == 200


def test_rerank_against_an_embedding_only_server(server):
    for path, body in [
        ("/rerank", {"query": "q", "texts": ["d"]}),
        ("/v1/rerank", {"query": "q", "documents": ["d"]}),
        ("/v2/rerank", {"model": EMBEDDER, "query": "q", "documents": ["d"]}),
        ("/predict", {"inputs": "x"}),
    ]:
        r = server.post(path, body)
        assert r.status_code == 400, (path, r.text)
    body = server.post("/rerank", {"query": "q", "texts": ["d"]}).json()
    assert "--rerank-model" in body["error"] and body["error_type"] == "Validation"


def test_embed_all_needs_an_embedding_model(duo, scorers):
    """Per-token vectors come from embedding models only: a cross-encoder
    named, or a server of cross-encoders only, is a 400 (TEI: 424)."""
    named = duo.post("/embed_all", {"model": "tiny-bert-reranker", "inputs": "x"})
    assert named.status_code == 400, named.text
    assert "an embedding model" in named.json()["error"]
    none = scorers.post("/embed_all", {"inputs": "x"})
    assert none.status_code == 400, none.text
    # The embedding model next to the reranker answers by default.
    ok = duo.post("/embed_all", {"inputs": "hello world"})
    assert ok.status_code == 200 and np.array(ok.json()).shape == (1, 4, 384)


# ------------------------------------------------------- tokenize, decode


def test_tokenize_and_decode(server, duo):
    toks = server.post("/tokenize", {"inputs": "Hello world"}).json()
    # Each token's text is the slice of the input it covers (the vocabulary is lowercase).
    assert [t["text"] for t in toks[0]] == ["[CLS]", "Hello", "world", "[SEP]"]
    assert [t["special"] for t in toks[0]] == [True, False, False, True]
    assert (toks[0][1]["start"], toks[0][1]["stop"]) == (0, 5)
    ids = [t["id"] for t in toks[0]]
    assert ids == [101, 7592, 2088, 102]
    plain = server.post("/tokenize", {"inputs": ["a b", "c"], "add_special_tokens": False}).json()
    assert [len(x) for x in plain] == [2, 1]
    assert server.post("/decode", {"ids": ids}).json() == ["hello world"]
    assert server.post("/decode", {"ids": [ids, ids], "skip_special_tokens": False}).json() == [
        "[CLS] hello world [SEP]"
    ] * 2
    assert server.post("/decode", {"ids": [10 ** 6]}).status_code == 400
    assert duo.post("/tokenize", {"model": "tiny-bert-reranker", "inputs": "x"}).status_code == 200
    assert duo.post("/tokenize", {"model": "nope", "inputs": "x"}).status_code == 404


def test_raw_logits_and_vllms_field_names(duo):
    """Raw logits where a client asks in its API's words (TEI's `raw_scores`
    on its own body, Infinity's on the documents body, vLLM's
    `use_activation: false`), and vLLM's newer score field names."""
    query, docs = "capital of france", ["Paris is in France.", "Pizza.", "The Seine flows through Paris."]
    tei = {x["index"]: x["score"] for x in duo.post("/rerank", {"query": query, "texts": docs}).json()}
    raw = {x["index"]: x["score"] for x in duo.post("/rerank", {"query": query, "texts": docs,
                                                                 "raw_scores": True}).json()}
    assert all(abs(1 / (1 + np.exp(-raw[i])) - tei[i]) < 1e-5 for i in tei), (raw, tei)
    assert any(abs(raw[i] - tei[i]) > 1e-3 for i in tei)

    def cohere(path, **extra):
        r = duo.post(path, {"query": query, "documents": docs, **extra})
        assert r.status_code == 200, r.text
        return {x["index"]: x["relevance_score"] for x in r.json()["results"]}

    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        assert cohere(path) == pytest.approx(tei, abs=1e-6), path
        assert cohere(path, raw_scores=True) == pytest.approx(raw, abs=1e-5), path
        assert cohere(path, use_activation=False) == pytest.approx(raw, abs=1e-5), path
        assert cohere(path, use_activation=True) == pytest.approx(tei, abs=1e-6), path

    def scores(body):
        r = duo.post("/v1/score", body)
        assert r.status_code == 200, r.text
        return [d["score"] for d in r.json()["data"]]

    want = [tei[i] for i in range(3)]
    assert scores({"text_1": query, "text_2": docs}) == pytest.approx(want, abs=1e-6)
    for first, second in (("queries", "documents"), ("queries", "items"), ("data_1", "data_2")):
        assert scores({first: query, second: docs}) == pytest.approx(want, abs=1e-6), (first, second)
    assert scores({"queries": query, "documents": docs, "use_activation": False}) == \
        pytest.approx([raw[i] for i in range(3)], abs=1e-5)
    both = duo.post("/v1/score", {"text_1": query, "queries": query, "text_2": docs})
    assert both.status_code == 400 and "duplicate field" in both.json()["error"]["message"], both.text
