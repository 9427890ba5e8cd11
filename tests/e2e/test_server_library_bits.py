"""The server's vectors are the Python library's to the last bit: the real
binary against ``mlx_embed.load(folder)`` in this process, on the golden
texts, for models of each pooling kind (mean on the host's native path,
last token, CLS, mean in MLX, a Dense head), normalized or not, cut to
``dimensions``, answered from the cache, one text per request or many,
in any order, concurrently, and as OpenAI's base64. Both normalize with
``mlx_embed_core::l2_normalize`` (the library through the extension:
``pooling.unit_rows``), after the cache and ``dimensions``
(docs/architecture.md). ``scripts/server_library_bits.py`` prints the
same comparison as counts of differing floats and ulps."""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from harness import FIXTURES, start_server

# None: the default model (mean pooling on the host, the native encoder).
MODELS = [None, "tiny-qwen3", "tiny-modernbert", "tiny-xlm-roberta", "tiny-gemma3", "tiny-gemma2", "tiny-t5"]
# On the CPU's native path (the default) every model's passes are
# batch-invariant: a text's vector is the same bits alone, in any batch, in
# any order (docs/architecture.md, "Same bits"). On a GPU the server matches
# the library pass for pass.
CUT = 16


def _rows(answer: list) -> np.ndarray:
    return np.asarray(answer, dtype=np.float32)


def _same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape, what
    differ = int((got != want).sum())
    assert differ == 0, f"{what}: {differ} of {want.size} floats differ from the library's"


@pytest.mark.parametrize("folder", MODELS)
def test_server_answers_the_librarys_bits(tmp_path, golden, folder):
    import mlx_embed
    from mlx_embed import pooling

    texts = [t for t in golden[0] if t]  # the API refuses an empty text
    lib = mlx_embed.load(str(FIXTURES / folder)) if folder else mlx_embed.load()
    unit, raw = lib.embed(texts), lib.embed(texts, normalize=False)
    args = ("--model", str(FIXTURES / folder)) if folder else ()
    srv = start_server(tmp_path, *args, "--no-warmup")
    try:

        def native(inputs, **fields):
            r = srv.post("/api/v1/embed", {"texts": inputs, **fields})
            assert r.status_code == 200, r.text
            return r.json()

        def tei(inputs, **fields):
            r = srv.post("/embed", {"inputs": inputs, **fields})
            assert r.status_code == 200, r.text
            return _rows(r.json())

        def openai(inputs, **fields):
            r = srv.post("/v1/embeddings", {"input": inputs, **fields})
            assert r.status_code == 200, r.text
            data = sorted(r.json()["data"], key=lambda d: d["index"])
            if fields.get("encoding_format") == "base64":
                return np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in data])
            return _rows([d["embedding"] for d in data])

        _same(_rows(native(texts)["embeddings"]), unit, "normalized")
        again = native(texts)
        assert again["usage"]["cache_hits"] == len(texts), again["usage"]
        _same(_rows(again["embeddings"]), unit, "normalized, from the cache")
        _same(tei(texts, normalize=False), raw, "normalize false (from the cache)")
        _same(openai(texts, encoding_format="base64"), unit, "OpenAI base64")
        _same(openai(texts, dimensions=CUT), pooling.unit_rows(raw[:, :CUT]), f"dimensions {CUT}")
        _same(openai(texts, dimensions=CUT, normalize=False), raw[:, :CUT], f"dimensions {CUT}, normalize false")

        # Batch composition, computed afresh (a server without the cache):
        # each text alone against the library's one-text calls (the same
        # passes); on the CPU, against the one call too, and so are the texts
        # reversed in one request and single-text requests at once, which the
        # collector batches as they come.
        srv.stop()
        srv = start_server(tmp_path, *args, "--no-warmup", "--no-cache")
        alone = np.concatenate([tei([t]) for t in texts])
        _same(alone, np.concatenate([lib.embed([t]) for t in texts]), "one text per request and call")
        raw_alone = np.concatenate([tei([t], normalize=False) for t in texts])
        _same(raw_alone, np.concatenate([lib.embed([t], normalize=False) for t in texts]), "one raw text each")
        if mlx_embed.device.is_cpu():
            _same(alone, unit, "one text per request, against the library's one call")
            _same(raw_alone, raw, "one raw text per request, against the library's one call")
            _same(tei(texts[::-1])[::-1], unit, "reversed in one request")
            with ThreadPoolExecutor(8) as pool:
                together = np.concatenate(list(pool.map(lambda t: tei([t]), texts)))
            _same(together, unit, "single-text requests at once")
        assert srv.stop() == 0, srv.log()[-3000:]
    finally:
        srv.stop()


def test_multi_vector_rows_are_the_librarys(tmp_path):
    """ColBERT rows: normalized by the server (unpooled) or by the engine
    before PyLate's pooling (pool_factor), both through l2_normalize."""
    import mlx_embed

    folder = FIXTURES / "tiny-colbert"
    texts = ["Rivers flow into the sea.", "what is the capital of france?", "Bread is baked in ovens, daily."]
    lib = mlx_embed.load(str(folder))
    srv = start_server(tmp_path, "--model", str(folder), "--no-warmup")
    try:
        for fields, kwargs in [
            ({}, {}),
            ({"input_type": "query"}, {"is_query": True}),
            ({"pool_factor": 2, "protected_tokens": 1}, {"pool_factor": 2, "protected_tokens": 1}),
        ]:
            r = srv.post("/v1/multi-vector", {"input": texts, **fields})
            assert r.status_code == 200, r.text
            want = lib.embed_multi_vector(texts, **kwargs)
            for d, w in zip(r.json()["data"], want):
                _same(_rows(d["embeddings"]), w, f"multi-vector {fields}")
        assert srv.stop() == 0, srv.log()[-3000:]
    finally:
        srv.stop()


def test_scores_are_the_librarys(tmp_path, golden):
    """A reranker's sigmoid and a classifier's softmax: the server's
    ``mlx_embed_core::activate``, which the library calls too (``scoring.activate``)."""
    import mlx_embed

    texts = [t for t in golden[0] if t]
    classifier, reranker = FIXTURES / "tiny-bert-classifier", FIXTURES / "tiny-bert-reranker"
    srv = start_server(tmp_path, "--model", str(classifier), "--rerank-model", str(reranker), "--no-warmup")
    try:
        query = "what flows into the sea?"
        r = srv.post("/rerank", {"query": query, "texts": texts})
        assert r.status_code == 200, r.text
        got = np.zeros(len(texts), np.float32)
        for hit in r.json():
            got[hit["index"]] = hit["score"]
        _same(got, mlx_embed.load(str(reranker)).score([(query, t) for t in texts])[:, 0], "rerank scores")
        if mlx_embed.device.is_cpu():
            # One document per request: the same bits as in the one call.
            alone = np.zeros(len(texts), np.float32)
            for i, t in enumerate(texts):
                r = srv.post("/rerank", {"query": query, "texts": [t]})
                assert r.status_code == 200, r.text
                alone[i] = r.json()[0]["score"]
            _same(alone, got, "rerank scores, one document per request")
        lib = mlx_embed.load(str(classifier))
        r = srv.post("/predict", {"inputs": [[t] for t in texts]})
        assert r.status_code == 200, r.text
        got = _rows([[{p["label"]: p["score"] for p in row}[label] for label in lib.labels] for row in r.json()])
        _same(got, lib.predict(texts), "classifier scores")
        assert srv.stop() == 0, srv.log()[-3000:]
    finally:
        srv.stop()
