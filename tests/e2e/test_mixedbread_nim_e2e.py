"""Mixedbread's `encoding_format` on /v1/embeddings and NVIDIA NIM's
/v1/ranking, end to end: the real server binary serving all-MiniLM-L6-v2
next to the tiny BERT reranker, driven over HTTP and with the official
clients (the `mixedbread` SDK, langchain-nvidia-ai-endpoints' NVIDIARerank,
both in the test extra).

Every form is checked against another route's answer for the same texts:
the float vector (sentence-transformers' reference), Cohere's /v2/embed byte
forms (the one quantizer), and /rerank's raw scores."""

from __future__ import annotations

import base64
import warnings

import numpy as np
import pytest

from harness import FIXTURES, cosine_rows, non_empty_golden, start_server

EMBEDDER = "all-MiniLM-L6-v2"
RERANKER = "tiny-bert-reranker"
INTEGER_FORMS = ("int8", "uint8", "binary", "ubinary")


@pytest.fixture(scope="module")
def duo(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("mxbai-nim"), "--rerank-model", str(FIXTURES / RERANKER))
    yield srv
    assert srv.stop() == 0, srv.log()[-4000:]


def _embeddings(srv, texts, **fields):
    resp = srv.post("/v1/embeddings", {"model": EMBEDDER, "input": texts, **fields})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _cohere_forms(srv, texts):
    resp = srv.post("/v2/embed", {"model": EMBEDDER, "texts": texts, "embedding_types": ["float", *INTEGER_FORMS]})
    assert resp.status_code == 200, resp.text
    return resp.json()["embeddings"]


# ---------------------------------------------------------------- Mixedbread


def test_openai_float_and_base64_answers_are_unchanged(duo, golden):
    """OpenAI's two formats keep OpenAI's answer: no Mixedbread fields, the
    same keys, and base64 the little-endian float32 bytes of the floats."""
    texts, ref, _ = non_empty_golden(golden, 3)
    plain = _embeddings(duo, texts)
    floats = _embeddings(duo, texts, encoding_format="float")
    b64 = _embeddings(duo, texts, encoding_format="base64")
    for answer in (plain, floats, b64):
        assert list(answer) == ["object", "data", "model", "usage"], answer.keys()
        assert [list(d) for d in answer["data"]] == [["object", "index", "embedding"]] * 3
        assert {d["object"] for d in answer["data"]} == {"embedding"}
    assert plain["data"] == floats["data"]
    f = np.asarray([d["embedding"] for d in floats["data"]], dtype=np.float32)
    assert cosine_rows(f, ref).min() >= 0.99999
    decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in b64["data"]])
    np.testing.assert_array_equal(decoded, f)


def test_each_mixedbread_format_over_http(duo, golden):
    texts, ref, _ = non_empty_golden(golden, 4)
    f = np.asarray([d["embedding"] for d in _embeddings(duo, texts)["data"]], dtype=np.float32)
    assert cosine_rows(f, ref).min() >= 0.99999
    cohere = _cohere_forms(duo, texts)
    np.testing.assert_array_equal(np.asarray(cohere["float"], dtype=np.float32), f)
    for form in INTEGER_FORMS:
        answer = _embeddings(duo, texts, encoding_format=form)
        # Mixedbread's own fields, after OpenAI's.
        assert (answer["normalized"], answer["encoding_format"], answer["dimensions"]) == (True, form, 384)
        got = [d["embedding"] for d in answer["data"]]
        assert got == cohere[form], form
        assert len(got[0]) == (48 if form.endswith("binary") else 384)
    # The integer forms are the float vector quantized.
    packed = np.packbits(f > 0, axis=1).astype(np.int64)
    np.testing.assert_array_equal(np.asarray(cohere["ubinary"]), packed)
    np.testing.assert_array_equal(np.asarray(cohere["int8"]), np.round(f * 127).astype(np.int64))

    half = _embeddings(duo, texts, encoding_format="float16")
    assert (half["encoding_format"], half["dimensions"]) == ("float16", 384)
    h = np.asarray([d["embedding"] for d in half["data"]], dtype=np.float64)
    # Each number is a float16 (read as one, unchanged), the float32's nearest.
    np.testing.assert_array_equal(h.astype(np.float16).astype(np.float64), h)
    np.testing.assert_array_equal(h.astype(np.float16), f.astype(np.float16))
    assert np.abs(h - f).max() <= 2.0**-12
    assert cosine_rows(h.astype(np.float32), ref).min() >= 0.99999


def test_a_list_of_formats_answers_an_object_per_vector(duo, golden):
    texts, _, _ = non_empty_golden(golden, 3)
    f = np.asarray([d["embedding"] for d in _embeddings(duo, texts)["data"]], dtype=np.float32)
    cohere = _cohere_forms(duo, texts)
    sent = ["ubinary", "float16", "base64", "int8", "float", "ubinary", "uint8", "binary"]
    answer = _embeddings(duo, texts, encoding_format=sent)
    assert (answer["normalized"], answer["encoding_format"], answer["dimensions"]) == (True, sent, 384)
    for i, d in enumerate(answer["data"]):
        assert (d["object"], d["index"]) == ("embedding_dict", i)
        e = d["embedding"]
        # Each format once, in the order sent.
        assert list(e) == ["ubinary", "float16", "base64", "int8", "float", "uint8", "binary"]
        for form in INTEGER_FORMS:
            assert e[form] == cohere[form][i], form
        np.testing.assert_array_equal(np.asarray(e["float"], dtype=np.float32), f[i])
        np.testing.assert_array_equal(np.frombuffer(base64.b64decode(e["base64"]), dtype="<f4"), f[i])
        np.testing.assert_array_equal(np.asarray(e["float16"]).astype(np.float16), f[i].astype(np.float16))


def test_disagreeing_fields_are_a_400_naming_both(duo):
    cases = [
        ({"encoding_format": "int8", "output_dtype": "binary"}, "output_dtype",
         "encoding_format int8 is output_dtype int8 and output_dtype is binary"),
        ({"encoding_format": "float16", "output_dtype": "uint8"}, "output_dtype",
         "encoding_format float16 is output_dtype float and output_dtype is uint8"),
        ({"encoding_format": "ubinary", "embedding_type": "binary"}, "embedding_type",
         "embedding_type binary is encoding_format float with output_dtype binary"),
        ({"encoding_format": ["float", "int8"], "output_dtype": "int8"}, "output_dtype",
         "send encoding_format without output_dtype"),
        ({"encoding_format": ["binary"], "embedding_type": "binary"}, "embedding_type",
         "send encoding_format without embedding_type"),
        ({"encoding_format": []}, "encoding_format", "encoding_format is an empty list"),
        ({"encoding_format": "int8", "normalized": False}, "encoding_format",
         "encoding_format int8, uint8, binary or ubinary quantizes the unit vector"),
        ({"encoding_format": ["float", "binary"], "normalized": False}, "encoding_format",
         "quantizes the unit vector"),
        ({"encoding_format": "float32"}, "encoding_format",
         "unknown variant `float32`, expected one of `float`, `float16`, `base64`, `int8`, `uint8`, "
         "`binary`, `ubinary`"),
        ({"encoding_format": ["float", "hex"]}, "encoding_format", "unknown variant `hex`"),
    ]
    for fields, param, needle in cases:
        resp = duo.post("/v1/embeddings", {"model": EMBEDDER, "input": ["a"], **fields})
        assert resp.status_code == 400, (fields, resp.text)
        err = resp.json()["error"]
        assert err["param"] == param and needle in err["message"], (fields, err)
    # Agreeing names are one request: the same answer.
    agreed = _embeddings(duo, ["bread"], encoding_format="binary", output_dtype="binary", embedding_type="binary")
    assert agreed["data"] == _embeddings(duo, ["bread"], encoding_format="binary")["data"]
    # float16 of a vector left unnormalized is floats: served.
    raw = _embeddings(duo, ["bread"], encoding_format="float16", normalized=False)
    assert raw["normalized"] is False
    assert abs(np.linalg.norm(raw["data"][0]["embedding"]) - 1.0) > 1e-3


def test_the_mixedbread_sdk(duo, golden):
    import mixedbread  # the test extra's
    texts, ref, _ = non_empty_golden(golden, 4)
    client = mixedbread.Mixedbread(api_key="unused", base_url=duo.url)
    res = client.embed(model=EMBEDDER, input=texts, normalized=True, encoding_format="float")
    f = np.asarray([d.embedding for d in res.data], dtype=np.float32)
    assert f.shape == (4, 384) and cosine_rows(f, ref).min() >= 0.99999
    cohere = _cohere_forms(duo, texts)
    res = client.embeddings.create(model=EMBEDDER, input=texts, encoding_format="ubinary")
    assert (res.normalized, res.encoding_format, res.dimensions) == (True, "ubinary", 384)
    assert [d.embedding for d in res.data] == cohere["ubinary"]
    res = client.embed(model=EMBEDDER, input=texts, encoding_format=["float", "int8", "binary", "base64"],
                       dimensions=128)
    assert res.dimensions == 128 and res.encoding_format == ["float", "int8", "binary", "base64"]
    for i, d in enumerate(res.data):
        assert d.object == "embedding_dict" and d.index == i
        cut = np.asarray(d.embedding.float, dtype=np.float32)
        assert cut.shape == (128,) and abs(np.linalg.norm(cut) - 1.0) <= 1e-5
        assert cosine_rows(cut[None], ref[i : i + 1, :128]).min() >= 0.99999
        np.testing.assert_array_equal(np.asarray(d.embedding.int8), np.round(cut * 127).astype(np.int64))
        np.testing.assert_array_equal(np.asarray(d.embedding.binary),
                                      np.packbits(cut > 0).astype(np.int64) - 128)
        np.testing.assert_array_equal(np.frombuffer(base64.b64decode(d.embedding.base64), dtype="<f4"), cut)


# ---------------------------------------------------------------- NVIDIA NIM


def _raw_scores(srv, query, texts, **fields):
    resp = srv.post("/rerank", {"model": RERANKER, "query": query, "texts": texts, "raw_scores": True, **fields})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _ranking(srv, query, texts, **fields):
    return srv.post("/v1/ranking", {"model": RERANKER, "query": {"text": query},
                                    "passages": [{"text": t} for t in texts], **fields})


def test_nim_ranking_is_reranks_raw_scores(duo, golden):
    texts, _, _ = non_empty_golden(golden, 8)
    query = texts[0]
    resp = _ranking(duo, query, texts[1:])
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert list(answer) == ["rankings", "usage"]
    got = [(r["index"], r["logit"]) for r in answer["rankings"]]
    want = [(r["index"], r["score"]) for r in _raw_scores(duo, query, texts[1:])]
    assert got == want and len(got) == 7
    logits = [logit for _, logit in got]
    assert logits == sorted(logits, reverse=True) and len(set(logits)) > 1
    assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] > 7
    # END is the same for pairs that fit.
    assert _ranking(duo, query, texts[1:], truncate="END").json()["rankings"] == answer["rankings"]


def test_nim_truncate_none_refuses_an_over_long_pair(duo):
    long = "bread " * 3000
    docs = ["short passage", long]
    refused = _ranking(duo, "a query", docs)  # NONE: NIM's default
    assert refused.status_code == 400, refused.text
    err = refused.json()["error"]
    assert err["code"] == "context_length_exceeded", err
    assert "set truncate to END" in err["message"] and "set truncate to true" not in err["message"], err
    assert refused.json() == _ranking(duo, "a query", docs, truncate="NONE").json()
    # The other NIM route says it in the same words (its NONE).
    embed = duo.post("/v1/embeddings", {"model": EMBEDDER, "input": [long], "truncate": "NONE"})
    assert embed.status_code == 400 and embed.json()["error"]["code"] == "context_length_exceeded"
    # END cuts it, as /rerank's default truncation does.
    cut = _ranking(duo, "a query", docs, truncate="END")
    assert cut.status_code == 200, cut.text
    got = [(r["index"], r["logit"]) for r in cut.json()["rankings"]]
    assert got == [(r["index"], r["score"]) for r in _raw_scores(duo, "a query", docs)]


def test_nim_ranking_bad_bodies(duo):
    for body, param, needle in [
        ({"query": {"text": "q"}, "passages": []}, "passages", "no passages to rank"),
        ({"query": "q", "passages": [{"text": "p"}]}, "query", "invalid type"),
        ({"query": {"text": "q"}, "passages": ["p"]}, "passages", "invalid type"),
        ({"query": {"text": "q"}, "passages": [{"text": "p"}], "truncate": "end"}, "truncate", "unknown variant"),
        ({"query": {"text": "q"}, "passages": [{"text": "p", "image": "data:image/png;base64,AA=="}]},
         "passages", "this server ranks text"),
    ]:
        resp = duo.post("/v1/ranking", {"model": RERANKER, **body})
        assert resp.status_code == 400, (body, resp.text)
        err = resp.json()["error"]
        assert err["param"] == param and needle in err["message"], (body, err)
    # The rerank routes' limits: more pairs than --max-inputs-per-request (2048) is a 413, as on /v1/rerank.
    many = {"model": RERANKER, "query": {"text": "q"}, "passages": [{"text": "x"}] * 2049}
    resp = duo.post("/v1/ranking", many)
    assert resp.status_code == 413, resp.text
    assert duo.post("/v1/rerank", {"model": RERANKER, "query": "q", "documents": ["x"] * 2049}).status_code == 413
    # An embedding model does not rank.
    resp = duo.post("/v1/ranking", {"model": EMBEDDER, "query": {"text": "q"}, "passages": [{"text": "p"}]})
    assert resp.status_code == 400, resp.text
    # Counted under its own route.
    metrics = duo.get("/metrics").text
    assert 'route="/v1/ranking"' in metrics


def test_langchain_nvidia_rerank(duo, golden):
    # The test extra's.
    import langchain_nvidia_ai_endpoints as reranking
    from langchain_core.documents import Document

    texts, _, _ = non_empty_golden(golden, 7)
    query, docs = texts[0], texts[1:]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ranker = reranking.NVIDIARerank(base_url=duo.url + "/v1", model=RERANKER, api_key="unused",
                                        top_n=len(docs), truncate="END", usage_telemetry_enabled=False)
    out = ranker.compress_documents(query=query, documents=[Document(page_content=d) for d in docs])
    want = _raw_scores(duo, query, docs)
    assert [d.page_content for d in out] == [docs[r["index"]] for r in want]
    assert [d.metadata["relevance_score"] for d in out] == [r["score"] for r in want]
    # Without model the client takes /v1/models' first entry, here the embedding model: a 400
    # saying what to serve (the README tells users to name the reranker).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unnamed = reranking.NVIDIARerank(base_url=duo.url + "/v1", api_key="unused", usage_telemetry_enabled=False)
    assert unnamed.model == duo.get("/v1/models").json()["data"][0]["id"] == EMBEDDER
    with pytest.raises(Exception, match=r"\[400\].*is an embedding model.*--rerank-model"):
        unnamed.compress_documents(query=query, documents=[Document(page_content=d) for d in docs])
