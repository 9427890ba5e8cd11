"""`mlx-embed serve --model <folder>` for static embeddings: a
sentence-transformers StaticEmbedding folder (tiny-static) and a Model2Vec
folder (tiny-model2vec) answer their libraries' own vectors over HTTP, run
their tokenizers without special tokens, and report sensible /info."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from harness import FIXTURES, cosine_rows, start_server

# folder -> (tokenizer.json, served max length)
FOLDERS = {
    "tiny-static": ("0_StaticEmbedding/tokenizer.json", 8192),
    "tiny-model2vec": ("tokenizer.json", 512),
}
UNK = 1


@pytest.fixture(scope="module", params=sorted(FOLDERS))
def served(request, tmp_path_factory):
    folder = request.param
    command = [str(Path(sys.prefix) / "bin" / "mlx-embed"), "serve"]
    srv = start_server(tmp_path_factory.mktemp(folder), "--model", str(FIXTURES / folder), "--no-warmup",
                       command=command)
    yield folder, srv
    assert srv.stop() == 0, srv.log()[-3000:]


def _texts_and_reference(folder: str):
    texts = json.loads((FIXTURES / "golden" / "minilm_texts.json").read_text())
    reference = np.load(FIXTURES / folder / "reference_normalized.npy")
    # The API refuses an empty string (400); whitespace-only texts stay.
    keep = [i for i, t in enumerate(texts) if t != ""]
    return [texts[i] for i in keep], reference[keep]


def _check(got: np.ndarray, reference: np.ndarray) -> None:
    assert got.shape == reference.shape
    zero = np.abs(reference).max(axis=1) == 0
    # Texts with no tokens (whitespace only; only unknown words in Model2Vec)
    # are the zero vector, as in both libraries.
    assert zero.any() and not got[zero].any()
    c = cosine_rows(got[~zero], reference[~zero]).min()
    d = np.abs(got - reference).max()
    print(f"min cosine {c:.8f}, max |diff| {d:.2e}")
    assert c >= 0.99999 and d <= 1e-5


def _tokenizer(folder: str) -> Tokenizer:
    tok = Tokenizer.from_file(str(FIXTURES / folder / FOLDERS[folder][0]))
    tok.no_truncation()
    return tok


def test_openai_and_tei_routes_match_the_reference(served):
    folder, srv = served
    texts, reference = _texts_and_reference(folder)
    resp = srv.post("/v1/embeddings", {"input": texts, "model": folder})
    assert resp.status_code == 200, resp.text[:500]
    body = resp.json()
    got = np.asarray([d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])], dtype=np.float32)
    _check(got, reference)
    # Usage counts the tokens averaged: no specials (and, for Model2Vec,
    # neither the dropped unknown words nor what its truncation cut).
    encoded = [e.ids for e in _tokenizer(folder).encode_batch(texts, add_special_tokens=False)]
    if folder == "tiny-static":
        expected = sum(len(x) for x in encoded)
    else:
        cut = [t[: 512 * 4] for t in texts]
        encoded = [e.ids[:512] for e in _tokenizer(folder).encode_batch(cut, add_special_tokens=False)]
        expected = sum(len([t for t in x if t != UNK]) for x in encoded)
    assert body["usage"]["prompt_tokens"] == expected
    tei = srv.post("/embed", {"inputs": texts})
    assert tei.status_code == 200, tei.text[:500]
    _check(np.asarray(tei.json(), dtype=np.float32), reference)


def test_tokenize_shows_no_special_tokens(served):
    folder, srv = served
    text = "The quick brown fox, 東京."
    resp = srv.post("/tokenize", {"inputs": text, "add_special_tokens": True})
    assert resp.status_code == 200, resp.text
    tokens = resp.json()[0]
    assert not any(t["special"] for t in tokens)
    ids = _tokenizer(folder).encode(text, add_special_tokens=False).ids
    assert UNK in ids
    if folder == "tiny-model2vec":
        ids = [t for t in ids if t != UNK]
    assert [t["id"] for t in tokens] == ids


def test_info(served):
    folder, srv = served
    info = srv.get("/info").json()
    assert info["max_input_length"] == FOLDERS[folder][1], info
    assert info["model_type"] == {"embedding": {"pooling": "mean"}}, info
    # The static architecture's device pass budget, not the CPU's 256.
    assert info["details"]["device_batch_tokens"] == "8192", info
    vecs = srv.post("/embed", {"inputs": ["hello"]}).json()
    assert len(vecs[0]) == 64


def test_over_long_input_with_truncate_false_is_refused(served):
    folder, srv = served
    limit = FOLDERS[folder][1]
    text = "word " * (limit + 10)
    resp = srv.post("/embed", {"inputs": text, "truncate": False})
    assert resp.status_code == 422, resp.text
    assert str(limit) in resp.text
    # Truncated (the default), it answers.
    ok = srv.post("/embed", {"inputs": text})
    assert ok.status_code == 200 and len(ok.json()[0]) == 64


def test_matryoshka_dimensions(served):
    """`dimensions` keeps the first components and renormalizes:
    sentence-transformers' own `truncate_dim` output for tiny-static; for
    Model2Vec (no such option) its reference cut the same way."""
    folder, srv = served
    texts, reference = _texts_and_reference(folder)
    if folder == "tiny-static":
        golden = json.loads((FIXTURES / "golden" / "minilm_texts.json").read_text())
        ref = np.load(FIXTURES / folder / "reference_dim32_normalized.npy")[[i for i, t in enumerate(golden) if t]]
    else:
        cut = reference[:, :32]
        norms = np.linalg.norm(cut, axis=1, keepdims=True)
        ref = np.where(norms > 0, cut / np.maximum(norms, 1e-12), 0).astype(np.float32)
    resp = srv.post("/v1/embeddings", {"input": texts, "model": folder, "dimensions": 32})
    assert resp.status_code == 200, resp.text[:500]
    got = np.asarray([d["embedding"] for d in sorted(resp.json()["data"], key=lambda d: d["index"])],
                     dtype=np.float32)
    _check(got, ref)


def test_embed_all_gives_an_input_of_no_tokens_no_rows(served):
    """A blank text has no tokens on a static model: /embed (its zero
    vector) and /embed_all (no rows) answer it wherever it sits in the call,
    and alone, beside the rows of the texts that have tokens."""
    folder, srv = served
    hello = srv.post("/embed_all", {"inputs": ["hello"]})
    assert hello.status_code == 200, hello.text
    (hello_rows,) = hello.json()
    assert len(hello_rows) == 1 and len(hello_rows[0]) == 64
    for inputs in (["   "], ["   ", "hello"], ["hello", "   "], ["   ", "\t", "hello", "  "]):
        resp = srv.post("/embed_all", {"inputs": inputs})
        assert resp.status_code == 200, (inputs, resp.text)
        rows = resp.json()
        assert [len(r) for r in rows] == [0 if t.isspace() else 1 for t in inputs], (inputs, rows)
        for text, r in zip(inputs, rows):
            if not text.isspace():
                np.testing.assert_array_equal(np.asarray(r), np.asarray(hello_rows))
    pooled = srv.post("/embed", {"inputs": ["   ", "hello"], "normalize": False})
    assert pooled.status_code == 200, pooled.text
    assert not any(pooled.json()[0]) and any(pooled.json()[1])
