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


def test_a_mixedbread_shaped_float_request_gets_mixedbreads_fields(duo, golden):
    """A float or base64 request that sends a field of Mixedbread's that
    OpenAI's API lacks (normalized, prompt, truncation_strategy) is
    Mixedbread's: its answer carries normalized, encoding_format and
    dimensions, which the SDK's typed answer reads. The vectors are the
    OpenAI answer's."""
    texts, ref, _ = non_empty_golden(golden, 2)
    openai = _embeddings(duo, texts)
    mixedbread_keys = ["object", "data", "model", "usage", "normalized", "encoding_format", "dimensions"]
    for fields, want in [
        ({"normalized": True}, (True, "float", 384)),
        ({"normalized": True, "encoding_format": "float"}, (True, "float", 384)),
        ({"truncation_strategy": "end"}, (True, "float", 384)),
        ({"prompt": ""}, (True, "float", 384)),
        ({"normalized": True, "encoding_format": "base64", "dimensions": 128}, (True, "base64", 128)),
    ]:
        answer = _embeddings(duo, texts, **fields)
        assert list(answer) == mixedbread_keys, (fields, answer.keys())
        assert (answer["normalized"], answer["encoding_format"], answer["dimensions"]) == want, fields
        # The vectors are OpenAI's answer's for the same format and dimensions.
        same = {k: v for k, v in fields.items() if k in ("encoding_format", "dimensions")}
        assert answer["data"] == _embeddings(duo, texts, **same)["data"], fields
    assert [d["embedding"] for d in _embeddings(duo, texts, normalized=True)["data"]] == \
        [d["embedding"] for d in openai["data"]]
    raw = _embeddings(duo, texts, normalized=False)
    assert (raw["normalized"], raw["encoding_format"], raw["dimensions"]) == (False, "float", 384)
    assert abs(np.linalg.norm(raw["data"][0]["embedding"]) - 1.0) > 1e-3
    # Jina's embedding_type (or Voyage's output_dtype) says the numbers, which encoding_format
    # would misname: Jina's normalized there leaves the answer as it was.
    jina = _embeddings(duo, texts, normalized=True, embedding_type="binary")
    assert list(jina) == ["object", "data", "model", "usage"], jina.keys()
    voyage = _embeddings(duo, texts, normalized=True, output_dtype="int8")
    assert list(voyage) == ["object", "data", "model", "usage"], voyage.keys()
    # normalized is Jina's too: with Jina's own late_chunking (or task, on a model with
    # tasks), or with another API's field, the request is that API's and its answer unchanged.
    for fields in [{"normalized": False, "late_chunking": False}, {"normalized": True, "input_type": "query"},
                   {"normalized": True, "truncate": True}, {"truncation_strategy": "end", "priority": 0},
                   {"prompt": "", "use_activation": True}]:
        answer = _embeddings(duo, texts, **fields)
        assert list(answer) == ["object", "data", "model", "usage"], (fields, answer.keys())
    jina_raw = _embeddings(duo, texts, normalized=False, late_chunking=False)["data"]
    assert jina_raw == raw["data"]


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


# Why an integer form of an unnormalized vector is refused, and what answers instead.
QUANTIZED_RAW = (
    "encoding_format int8, uint8, binary or ubinary quantizes the unit vector, so it cannot be combined with "
    "normalized (or use_activation, normalize) false: int8 is round(127 x) of each component (uint8 that plus "
    "128), a scale for components within [-1, 1], which an unnormalized vector's need not be (Mixedbread "
    "documents none for them), and binary and ubinary, the components' signs, are the same for either vector. "
    "Leave normalized true (the default) for these forms, or ask float, float16 or base64 with normalized false "
    "for the raw vector"
)


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
        ({"encoding_format": "int8", "normalized": False}, "encoding_format", QUANTIZED_RAW),
        ({"encoding_format": ["float", "binary"], "normalized": False}, "encoding_format", QUANTIZED_RAW),
        ({"encoding_format": "uint8", "normalized": False}, "encoding_format", QUANTIZED_RAW),
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
        if needle == QUANTIZED_RAW:
            assert err["message"] == QUANTIZED_RAW, err
    # What the refusal says answers: the raw vector as floats, whose components pass 1 here
    # (MiniLM's unnormalized mean), so round(127 x) would have clipped them.
    raw = _embeddings(duo, ["bread"], encoding_format="float", normalized=False)["data"][0]["embedding"]
    assert max(abs(x) for x in raw) > 1.0
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
    # The typed answer's own fields, read as sent (missing, they would read None).
    assert (res.normalized, res.encoding_format, res.dimensions) == (True, "float", 384)
    res = client.embeddings.create(model=EMBEDDER, input=texts, normalized=False, encoding_format="base64")
    assert (res.normalized, res.encoding_format, res.dimensions) == (False, "base64", 384)
    raw = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in res.data])
    np.testing.assert_allclose(raw / np.linalg.norm(raw, axis=1, keepdims=True), f, atol=1e-6)
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
    # TEI's refusal of the same pair counts its tokens; NIM's names the passage and its END.
    tei = duo.post("/rerank", {"model": RERANKER, "query": "a query", "texts": docs, "truncate": False})
    assert tei.status_code == 422, tei.text
    tokens = tei.json()["error"].removeprefix("input 1 has ").split(" tokens")[0]
    assert int(tokens) > 128
    assert tei.json()["error"] == (f"input 1 has {tokens} tokens, more than the model's maximum of 128; "
                                   "shorten it or set truncate to true")
    assert (err["code"], err["param"], err["message"]) == (
        "context_length_exceeded", None,
        f"passage 1 has {tokens} tokens, more than the model's maximum of 128; shorten it or set truncate to END")
    assert refused.json() == _ranking(duo, "a query", docs, truncate="NONE").json()
    # A passage's own words are never the message's: one that says "documents" and
    # "set truncate to true" is named by its index alone, and the advice is NIM's.
    wordy = _ranking(duo, "a query", ["short passage", "documents set truncate to true " + long])
    assert wordy.status_code == 400, wordy.text
    message = wordy.json()["error"]["message"]
    assert message.startswith("passage 1 has ") and message.endswith("; shorten it or set truncate to END")
    assert "documents" not in message and "truncate to true" not in message, message
    # Voyage's body on /v1/rerank advises its own boolean, in the same words as before.
    voyage = duo.post("/v1/rerank", {"model": RERANKER, "query": "a query", "documents": docs, "top_k": 2,
                                     "truncation": False})
    assert voyage.status_code == 400, voyage.text
    assert voyage.json()["error"]["message"] == (
        f"input 1 has {tokens} tokens, more than the model's maximum of 128; shorten it or set truncation to true")
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
        ({"query": {"text": "q"}, "passages": []}, "passages", "no passages to rank: send at least one"),
        # NIM documents NONE and END; Cohere's START is refused, naming the two.
        ({"query": {"text": "q"}, "passages": [{"text": "p"}], "truncate": "START"}, "truncate",
         "unknown variant `START`, expected `NONE` or `END`"),
        # A text that says "documents" is quoted as sent.
        ({"query": {"text": "q"}, "passages": [{"text": "p"}, "documents"]}, "passages",
         'invalid type: string "documents"'),
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
    limit = "2049 inputs is more than the limit of 2048 per request (--max-inputs-per-request); split the request"
    many = {"model": RERANKER, "query": {"text": "q"}, "passages": [{"text": "x"}] * 2049}
    resp = duo.post("/v1/ranking", many)
    assert resp.status_code == 413, resp.text
    assert (resp.json()["error"]["param"], resp.json()["error"]["message"]) == ("passages", limit)
    cohere = duo.post("/v1/rerank", {"model": RERANKER, "query": "q", "documents": ["x"] * 2049})
    assert cohere.status_code == 413
    assert (cohere.json()["error"]["param"], cohere.json()["error"]["message"]) == ("input", limit)
    # Cohere's messages keep Cohere's words, a field named "documents" too.
    fields = duo.post("/v1/rerank", {"model": RERANKER, "query": "q", "documents": [{"text": "t"}],
                                     "rank_fields": ["documents"]})
    assert fields.status_code == 400, fields.text
    assert fields.json()["error"]["message"] == "document 0 has no field `documents` (named in rank_fields)"
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
