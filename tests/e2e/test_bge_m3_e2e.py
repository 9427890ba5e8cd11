"""BGE-M3 end to end on the real server binary: one model answers the dense
routes with its CLS vectors and ``/embed_sparse`` with its lexical weights,
against FlagEmbedding's references of the tiny-bge-m3 fixture
(tests/fixtures/tiny-bge-m3/README.md).

The server serves the BGE-M3 folder first and a SPLADE model second, so the
unnamed sparse route takes the first model able to answer it (BGE-M3), and
a named one the SPLADE model."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from harness import FIXTURES, start_server

BGE = FIXTURES / "tiny-bge-m3"
SPLADE = FIXTURES / "tiny-splade"
TEXTS = json.loads((BGE / "reference_texts.json").read_text(encoding="utf-8"))
DENSE = np.load(BGE / "reference_dense_normalized.npy")
LEXICAL = json.loads((BGE / "reference_lexical_weights.json").read_text(encoding="utf-8"))
# The server refuses an empty text (400); every other reference text runs.
KEPT = [i for i, t in enumerate(TEXTS) if t != ""]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("bge-m3"), "--model", str(BGE), "--model", str(SPLADE),
                       "--no-warmup")
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def _assert_lexical(entries: list, i: int) -> None:
    """One text's /embed_sparse entries against FlagEmbedding's weights."""
    idx = [e["index"] for e in entries]
    assert idx == sorted(set(idx)), f"text {i}: indices increasing, each once"
    got = {str(e["index"]): e["value"] for e in entries}
    want = LEXICAL[i]
    assert set(got) == set(want), f"text {i}: {sorted(set(got) ^ set(want))}"
    assert all(abs(got[k] - want[k]) <= 1e-5 for k in want), f"text {i}"


def test_sparse_route_answers_flagembedding_lexical_weights(server):
    texts = [TEXTS[i] for i in KEPT]
    r = server.post("/embed_sparse", {"inputs": texts})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert len(answer) == len(KEPT)
    for entries, i in zip(answer, KEPT):
        _assert_lexical(entries, i)
    assert sum(len(e) for e in answer) == sum(len(LEXICAL[i]) for i in KEPT) == 730
    # Named, the SPLADE model answers instead: vocabulary-wide SPLADE weights.
    r = server.post("/embed_sparse", {"model": "tiny-splade", "inputs": ["the cat"]})
    assert r.status_code == 200, r.text
    assert len(r.json()[0]) > len(LEXICAL[KEPT[0]]) or r.json()[0] != answer[0]


def test_dense_routes_answer_its_cls_vectors(server):
    texts = [TEXTS[i] for i in KEPT]
    r = server.post("/embed", {"inputs": texts})
    assert r.status_code == 200, r.text
    got = np.array(r.json(), dtype=np.float32)
    assert got.shape == (len(KEPT), 64)
    want = DENSE[KEPT]
    assert np.abs(got - want).max() <= 1e-5
    assert ((got * want).sum(axis=1)).min() >= 0.99999
    r = server.post("/v1/embeddings", {"model": "tiny-bge-m3", "input": texts[:3]})
    assert r.status_code == 200, r.text
    unit = np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)
    assert np.abs(unit - want[:3]).max() <= 1e-5


def test_info_names_the_lexical_weights(server):
    r = server.get("/info")
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["model"] == "tiny-bge-m3"
    assert info["lexical_weights"] is True and info["sparse"] is False
    assert info["details"]["lexical_weights"] == "true"
    by_name = {m["model"]: m for m in info["models"]}
    assert by_name["tiny-bge-m3"]["lexical_weights"] is True
    assert by_name["tiny-splade"]["lexical_weights"] is False
    assert by_name["tiny-splade"]["sparse"] is True


def test_concurrent_sparse_and_dense_callers_get_their_own_answers(server):
    """Sparse and dense requests never share a model call; each caller gets
    its own text's answer."""

    def call(k: int):
        i = KEPT[k % len(KEPT)]
        if k % 2:
            r = server.post("/embed_sparse", {"inputs": TEXTS[i]})
        else:
            r = server.post("/embed", {"inputs": TEXTS[i]})
        return k, i, r

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(call, range(64)))
    for k, i, r in results:
        assert r.status_code == 200, r.text
        if k % 2:
            _assert_lexical(r.json()[0], i)
        else:
            assert np.abs(np.array(r.json()[0], dtype=np.float32) - DENSE[i]).max() <= 1e-5


def test_sparse_route_refuses_what_it_cannot_do(server):
    r = server.post("/embed_sparse", {"inputs": [""]})
    assert r.status_code == 400, r.text
    r = server.post("/embed_sparse", {"inputs": "x " * 300, "truncate": False})
    assert r.status_code in (413, 422), r.text
    r = server.post("/embed_sparse", {"inputs": "x " * 300})
    assert r.status_code == 200, r.text
    assert len(r.json()[0]) >= 1
