"""Jina's `late_chunking: true` on `/v1/embeddings`, end to end on the real
server binary (all-MiniLM-L6-v2, mean pooling): each chunk's vector is the one
`mlx_embed.load().embed_late_chunks(chunks)` gives, to the bit (that method is
held to an independent reference in tests/python/test_late_chunking.py), through
raw HTTP and the official `openai` client's `extra_body`; its refusals with
their status codes; concurrent late and plain requests each get their own."""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from harness import FIXTURES, start_server

DOCS = [
    ["Berlin is in Germany.", "It is the capital.", "More than three million people live there."],
    ["The cat sat on", "the mat and slept.", "It woke at noon."],
    ["One chunk alone."],
]


@pytest.fixture(scope="module")
def lib():
    import mlx_embed

    return mlx_embed.load()


def _vectors(resp) -> np.ndarray:
    assert resp.status_code == 200, resp.text[:500]
    data = resp.json()["data"]
    assert [d["index"] for d in data] == list(range(len(data)))
    return np.asarray([d["embedding"] for d in data], dtype=np.float32)


def _late(server, chunks, **extra):
    return server.post("/v1/embeddings", {"input": chunks, "late_chunking": True, **extra})


def test_vectors_are_the_library_s_to_the_bit(server, lib):
    from mlx_embed import pooling

    for chunks in DOCS:
        got = _vectors(_late(server, chunks))
        assert got.shape == (len(chunks), lib.dim)
        assert np.array_equal(got, lib.embed_late_chunks(chunks))
        raw = _vectors(_late(server, chunks, normalize=False))
        assert np.array_equal(raw, lib.embed_late_chunks(chunks, normalize=False))
        cut = _vectors(_late(server, chunks, dimensions=16))
        assert np.array_equal(cut, pooling.unit_rows(np.ascontiguousarray(raw[:, :16])))
    # Different from the chunks embedded alone: context from the others.
    plain = _vectors(server.post("/v1/embeddings", {"input": DOCS[0]}))
    assert np.abs(plain - _vectors(_late(server, DOCS[0]))).max() > 0.05
    # Jina's own field names on the same route.
    b64 = _late(server, DOCS[0], embedding_type="base64").json()["data"]
    got = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in b64])
    assert np.array_equal(got, lib.embed_late_chunks(DOCS[0]))


def test_openai_client_sends_it_with_extra_body(server, lib):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    resp = client.embeddings.create(input=DOCS[0], model="all-MiniLM-L6-v2", extra_body={"late_chunking": True})
    got = np.asarray([d.embedding for d in resp.data], dtype=np.float32)
    assert np.array_equal(got, lib.embed_late_chunks(DOCS[0]))
    assert resp.usage.prompt_tokens == len(lib.encode([" ".join(DOCS[0])])[0][0])


def test_refusals(server):
    cases = [
        ({"input": []}, 400, "input"),
        ({"input": ["a text", ""]}, 400, "input"),
        ({"input": ["a text", "   "]}, 400, "input"),
        ({"input": [[101, 7592, 102]]}, 400, "input"),
        # Over-long: 400 on this route, as OpenAI answers an over-long input.
        ({"input": ["word " * 200, "word " * 200]}, 400, "input"),
        ({"input": ["a", "b"], "dimensions": 0}, 400, "dimensions"),
    ]
    for body, status, param in cases:
        resp = server.post("/v1/embeddings", {**body, "late_chunking": True})
        assert resp.status_code == status, (body, resp.text)
        err = resp.json()["error"]
        assert err["param"] == param, (body, err)
    long = _late(server, ["word " * 200, "word " * 200]).json()["error"]
    assert long["code"] == "context_length_exceeded" and "late_chunking" in long["message"]


def test_a_model_that_does_not_mean_pool_is_refused(tmp_path):
    srv = start_server(tmp_path, "--model", str(FIXTURES / "tiny-modernbert"), "--no-warmup")
    try:
        resp = _late(srv, ["a", "b"])
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == "late_chunking" and "mean" in err["message"], err
        assert _vectors(srv.post("/v1/embeddings", {"input": ["a", "b"]})).shape[0] == 2
    finally:
        assert srv.stop() == 0


def test_concurrent_late_and_plain_requests_get_their_own(server, lib):
    want_late = [lib.embed_late_chunks(c) for c in DOCS]
    want_plain = [lib.embed(c) for c in DOCS]

    def call(k):
        chunks = DOCS[k % len(DOCS)]
        late = k % 2 == 0
        body = {"input": chunks, "late_chunking": late}
        return k, late, _vectors(server.post("/v1/embeddings", body))

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, range(24)))
    for k, late, got in results:
        want = (want_late if late else want_plain)[k % len(DOCS)]
        assert np.array_equal(got, want), (k, late)


def test_the_cache_neither_answers_nor_keeps_late_chunks(server, lib):
    """The embedding cache (on in the default server) holds one pooled vector
    per input: the same chunks cached by a plain request do not answer a
    late-chunked one, and a late-chunked request leaves the cache as it was."""
    chunks = ["A text the cache sees first.", "Its second chunk."]
    first = server.post("/v1/embeddings", {"input": chunks})
    assert _vectors(first).shape == (2, lib.dim)
    again = server.post("/v1/embeddings", {"input": chunks})
    assert again.json()["usage"]["cache_hits"] == 2, "the cache is off: the test would not see it"
    late = _late(server, chunks)
    assert late.json()["usage"]["cache_hits"] == 0
    assert np.array_equal(_vectors(late), lib.embed_late_chunks(chunks))
    plain = server.post("/v1/embeddings", {"input": chunks})
    assert plain.json()["usage"]["cache_hits"] == 2
    assert np.array_equal(_vectors(plain), _vectors(first))
    assert _late(server, chunks).json()["usage"]["cache_hits"] == 0


def test_a_prompt_is_read_with_the_chunks_and_belongs_to_none(nomic):
    """NomicBERT's default prompt (`search_document: `) and a named one run
    before the joined chunks, as in the library; a chunk that begins the text
    with a prompt of its own keeps it (no default added)."""
    import mlx_embed
    from harness import NOMIC

    lib = mlx_embed.load(str(NOMIC))
    chunks = DOCS[0]
    assert np.array_equal(_vectors(_late(nomic, chunks)), lib.embed_late_chunks(chunks))
    query = _vectors(_late(nomic, chunks, prompt_name="query"))
    assert np.array_equal(query, lib.embed_late_chunks(chunks, prompt_name="query"))
    assert np.abs(query - lib.embed_late_chunks(chunks)).max() > 1e-3
    written = ["search_query: " + chunks[0], *chunks[1:]]
    assert np.array_equal(_vectors(_late(nomic, written)), lib.embed_late_chunks(written))


# Multi-byte UTF-8 (accents, CJK, emoji), leading/trailing whitespace and
# newlines, special-token text inside a chunk, and pieces that merge across
# the joining space: the server's byte offsets and the library's character
# offsets give the same spans.
TRICKY = [
    ["Café crème à Paris.", "東京は日本の首都です。", "emoji 🙂🚀 ok", "naïve façade"],
    ["  leading spaces", "trailing spaces   ", "\nnew\nlines\n", "tab\there"],
    ["a [SEP] b", "<s> c </s>", "[CLS]", "d"],
    ["Germany.", "It", "is."],
]


# tiny-t5-relu: T5's SentencePiece Unigram without a Dense (tiny-t5's
# sentence-T5 Dense is refused: test_a_dense_after_the_pooling_is_refused).
@pytest.mark.parametrize("folder", ["tiny-embedding-gemma2", "tiny-eurobert", "tiny-xlm-roberta", "tiny-t5-relu"])
def test_tokenizers_of_every_kind_give_the_library_s_spans(tmp_path, folder):
    import mlx_embed
    from mlx_embed.errors import InvalidInput

    lib = mlx_embed.load(str(FIXTURES / folder))
    srv = start_server(tmp_path, "--model", str(FIXTURES / folder), "--no-warmup")
    try:
        for chunks in TRICKY:
            got = _vectors(_late(srv, chunks))
            assert np.array_equal(got, lib.embed_late_chunks(chunks)), (folder, chunks)
        # A chunk whose text is all in a piece that ends in the next one
        # (EmbeddingGemma's ".▁I"), or only whitespace where the tokenizer
        # drops it: a 400 where the library refuses it (a byte-level BPE
        # keeps the space: a vector, the same).
        for bad in (["Germany.", ".", "It"], ["a", " "]):
            resp = _late(srv, bad)
            try:
                want = lib.embed_late_chunks(bad)
            except InvalidInput as e:
                assert "chunk 1 has no tokens" in str(e)
                assert resp.status_code == 400, resp.text
                assert "input 1 has no tokens" in resp.json()["error"]["message"], resp.text
                continue
            assert np.array_equal(_vectors(resp), want), (folder, bad)
    finally:
        assert srv.stop() == 0


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def test_figures_count_the_chunks_the_client_sent(tmp_path, lib):
    """A late-chunked request counts as its chunks, as the same chunks sent
    without late_chunking count: TEI's te_embed_count/success, a batch in
    te_request_count, x-compute-characters the chunks' characters. Its
    tokens (usage, x-compute-tokens) are those the model ran: the joined
    text's, its special tokens once."""
    srv = start_server(tmp_path, "--no-warmup")
    try:
        chunks = DOCS[0]
        late = _late(srv, chunks)
        plain = srv.post("/v1/embeddings", {"input": chunks})
        assert late.status_code == plain.status_code == 200, (late.text, plain.text)
        joined_tokens = len(lib.encode([" ".join(chunks)])[0][0])
        alone_tokens = sum(len(ids) for ids in lib.encode(chunks)[0])
        # Two specials a text: the joined text has them once, not per chunk.
        assert alone_tokens == joined_tokens + 2 * (len(chunks) - 1), (alone_tokens, joined_tokens)
        assert late.json()["usage"] == {"prompt_tokens": joined_tokens, "total_tokens": joined_tokens, "cache_hits": 0}
        assert plain.json()["usage"]["prompt_tokens"] == alone_tokens
        chars = sum(len(c) for c in chunks)
        for resp, tokens in ((late, joined_tokens), (plain, alone_tokens)):
            assert resp.headers["x-compute-characters"] == str(chars)
            assert resp.headers["x-compute-tokens"] == str(tokens)
        metrics = srv.get("/metrics").text
        assert _metric(metrics, "te_embed_count") == 2 * len(chunks)
        assert _metric(metrics, "te_embed_success") == 2 * len(chunks)
        assert _metric(metrics, 'te_request_count{method="batch"}') == 2
        assert _metric(metrics, 'te_request_count{method="single"}') == 0
        # A late-chunked request refused before the model call counts as a
        # request of its chunks (a batch) that failed validation; its chunks
        # never reached the model, so no per-input family counts them (TEI's rule).
        assert _late(srv, ["a text", ""]).status_code == 400
        metrics = srv.get("/metrics").text
        assert _metric(metrics, 'te_request_count{method="batch"}') == 3
        assert _metric(metrics, 'te_request_failure{err="validation"}') == 1
        assert _metric(metrics, "te_embed_count") == 2 * len(chunks)
        assert _metric(metrics, "te_embed_success") == 2 * len(chunks)
    finally:
        assert srv.stop() == 0


def test_a_dense_after_the_pooling_is_refused(tmp_path):
    """sentence-T5's layout (mean pooling, then a 64 -> 64 Dense): no chunk
    mean runs through the Dense, so it is refused for that reason, before
    any model work; without late_chunking the same chunks are served. The
    library refuses it too (the rule is in both: this holds them together)."""
    import mlx_embed
    from mlx_embed.errors import InvalidInput

    lib = mlx_embed.load(str(FIXTURES / "tiny-t5"))
    name = lib.name
    assert (lib.spec().dense_layers, lib.spec().truncate_dim) == (1, None)
    with pytest.raises(InvalidInput, match="Dense"):
        lib.embed_late_chunks(["a", "b"])
    srv = start_server(tmp_path, "--model", str(FIXTURES / "tiny-t5"), "--no-warmup")
    try:
        # /info shows the typed fact among its details (as it did when the
        # engine sent it as one), and no cut.
        details = srv.get("/info").json()["details"]
        assert details["dense_layers"] == "1" and "truncate_dim" not in details
        resp = _late(srv, ["a", "b"])
        assert resp.status_code == 400, resp.text
        message = (
            f"late_chunking needs a model whose vector is the mean of its token states; {name} has 1 Dense "
            "layer(s) after its pooling, which no chunk mean runs through: embed the chunks without late_chunking"
        )
        assert resp.json() == {
            "error": {"message": message, "type": "invalid_request_error", "param": "late_chunking", "code": None},
            "detail": message,
        }
        # Refused before any model work: no batch ran (the plain request's does).
        assert _batches(srv) == 0
        assert _vectors(srv.post("/v1/embeddings", {"input": ["a", "b"]})).shape == (2, 64)
        assert _batches(srv) >= 1
    finally:
        assert srv.stop() == 0


def _batches(srv) -> float:
    lines = srv.get("/metrics").text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith("mlx_embed_batches_total"))


def test_a_model_s_truncate_dim_cuts_each_chunk(tmp_path):
    """A folder whose vectors are its mean cut to truncate_dim (Matryoshka;
    jina-embeddings-v3's config.json) is served: each chunk's mean cut as
    the model cuts its own, the library's vectors to the bit (held to a NumPy
    reference in tests/python/test_late_chunking.py), `dimensions` below it."""
    import json
    import shutil

    import mlx_embed
    from mlx_embed import pooling

    folder = tmp_path / "cut32"
    shutil.copytree(FIXTURES / "tiny-jina-v3", folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["truncate_dim"] = 32
    (folder / "config.json").write_text(json.dumps(cfg))
    for f in ("modules.json", "config_sentence_transformers.json"):
        (folder / f).unlink()
    shutil.rmtree(folder / "1_Pooling")
    lib = mlx_embed.load(str(folder))
    assert (lib.dim, lib.spec().truncate_dim, lib.spec().dense_layers) == (32, 32, 0)
    srv = start_server(tmp_path, "--model", str(folder), "--no-warmup")
    try:
        details = srv.get("/info").json()["details"]
        assert details["truncate_dim"] == "32" and "dense_layers" not in details
        chunks = ["Berlin ist die Hauptstadt.", "Café crème à Paris", "x"]
        for extra, want in (
            ({}, lib.embed_late_chunks(chunks)),
            ({"task": "retrieval.passage"}, lib.embed_late_chunks(chunks, task="retrieval.passage")),
            ({"prompt_name": "separation"}, lib.embed_late_chunks(chunks, task="separation")),
        ):
            got = _vectors(_late(srv, chunks, **extra))
            assert got.shape == (3, 32) and np.array_equal(got, want), extra
        raw = lib.embed_late_chunks(chunks, normalize=False)
        cut = _vectors(_late(srv, chunks, dimensions=16))
        assert np.array_equal(cut, pooling.unit_rows(np.ascontiguousarray(raw[:, :16])))
        resp = _late(srv, chunks, dimensions=64)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "dimensions", resp.text
    finally:
        assert srv.stop() == 0
