"""ColBERT (PyLate's multi-vector models) against PyLate's own ``encode``.

The fixture (tests/fixtures/tiny-colbert) and how its references were made:
its README and scripts/fixtures/make_colbert.py. Per input, the ids PyLate
ran (the [unused0]/[unused1] prefix after [CLS], the cut at query_length /
document_length, a query's [MASK] expansion) and the rows it kept (every
query row; a document's rows less its punctuation) must match exactly, and
every row within cosine 0.99999 of PyLate's float64 one, on every engine path.
"""

from __future__ import annotations

import functools
import json
import shutil

import numpy as np
import pytest
from conftest import FIXTURES, load_fixture

import mlx.core as mx

import mlx_embed
from mlx_embed.errors import InvalidInput

COLBERT = FIXTURES / "tiny-colbert"
# Every ColBERT fixture: PyLate's layout, and a Stanford checkpoint
# (HF_ColBERT, artifact.metadata; tests/fixtures/tiny-colbert-stanford).
FIXTURE_NAMES = ["tiny-colbert", "tiny-colbert-stanford", "tiny-modern-colbert"]
MIN_COS = 0.99999
MAX_DIFF = 1e-5
TEXTS = {"query": "queries", "document": "documents"}


@functools.cache
def _texts(name: str) -> dict:
    return json.loads((FIXTURES / name / "texts.json").read_text(encoding="utf-8"))


@functools.cache
def _reference(name: str) -> dict:
    return dict(np.load(FIXTURES / name / "reference.npz"))


@pytest.fixture(scope="module")
def texts() -> dict:
    return _texts("tiny-colbert")


@pytest.fixture(scope="module")
def reference() -> dict:
    return _reference("tiny-colbert")


def _split(flat: np.ndarray, counts) -> list:
    return np.split(flat, np.cumsum(counts)[:-1])


def _ids(reference, side) -> list[list[int]]:
    return [x.tolist() for x in _split(reference[f"{side}_ids"], reference[f"{side}_lengths"])]


def _check(got: list, reference: dict, side: str) -> float:
    want = _split(reference[f"{side}_vectors"], reference[f"{side}_rows"])
    assert [len(g) for g in got] == [len(w) for w in want]
    worst = 1.0
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == np.float32 and g.shape == w.shape, i
        cos = (g * w).sum(1) / np.linalg.norm(g, axis=1) / np.linalg.norm(w, axis=1)
        assert cos.min() >= MIN_COS, (side, i, cos.min())
        assert np.abs(g - w).max() <= MAX_DIFF, (side, i)
        worst = min(worst, float(cos.min()))
    return worst


@pytest.mark.parametrize("name", FIXTURE_NAMES)
@pytest.mark.parametrize("side", ["query", "document"])
def test_ids_are_pylates(side, name):
    model = load_fixture(name)
    got = model.encode_multi_vector(_texts(name)[TEXTS[side]], is_query=side == "query")
    assert got == _ids(_reference(name), side)


def test_what_the_references_cover(reference):
    """The cases the fixture exists for are in it: a query cut with no
    expansion left, queries padded with [MASK] (id 6), a document cut at 40
    tokens, documents losing their punctuation rows."""
    q = _ids(reference, "query")
    assert all(len(r) == 16 and r[:2] == [4, 1] for r in q)
    assert any(6 not in r for r in q) and sum(r[-1] == 6 for r in q) >= 5
    d = _ids(reference, "document")
    assert all(r[:2] == [4, 2] and r[-1] == 5 for r in d)
    assert max(len(r) for r in d) == 40
    kept = reference["document_rows"].tolist()
    assert sum(kept) < sum(len(r) for r in d) and min(kept) == 3


@pytest.mark.parametrize("name", FIXTURE_NAMES)
@pytest.mark.parametrize("side", ["query", "document"])
def test_vectors_match_pylate(side, name):
    model = load_fixture(name)
    reference, texts = _reference(name), _texts(name)[TEXTS[side]]
    got = model.embed_multi_vector(texts, is_query=side == "query")
    worst = _check(got, reference, side)
    print(f"{name} {side}: lowest per-token cosine {worst:.9f}")
    # One at a time: the same rows as batched.
    alone = [model.embed_multi_vector([t], is_query=side == "query")[0] for t in texts]
    _check(alone, reference, side)


ENGINE_PATHS = {
    "pipeline": dict(pipeline=True),
    "four-workers": dict(workers=4, batch_tokens=64),
    "shape-buckets": dict(shape_buckets=True),
    "small-passes": dict(batch_tokens=64),
    "mlx-ops": dict(fast_ops="mlx", workers=1),
    "exact": dict(fast_ops="exact", workers=1),
    "packed-rows": dict(fast_ops="exact", packed_rows=True, workers=1, batch_tokens=8192),
}


@pytest.mark.parametrize("name", FIXTURE_NAMES)
@pytest.mark.parametrize("settings", list(ENGINE_PATHS.values()), ids=list(ENGINE_PATHS))
def test_engine_paths(settings, name):
    """``embed_ids`` with the reference ids: unnormalized rows that normalize
    to PyLate's, the kept counts as ``rows``, on every path (packed rows
    included: a query's expansion rows are computed though not attended to)."""
    model = mlx_embed.load(FIXTURES / name, **settings)
    reference = _reference(name)
    for side in ("query", "document"):
        ids = _ids(reference, side)
        res = model.embed_ids(ids, output=f"multi_vector_{side}")
        assert res.rows == reference[f"{side}_rows"].tolist()
        flat = np.frombuffer(res.vectors, dtype="<f4").reshape(-1, model.dim)
        flat = flat / np.linalg.norm(flat, axis=1, keepdims=True)
        _check(_split(flat, res.rows), reference, side)


def test_spec_says_what_crosses_the_seam():
    model = load_fixture("tiny-colbert")
    spec = model.spec()
    assert spec.multi_vector and spec.dim == 16 and spec.max_length == 40
    assert (spec.tokenizer.query.insert_ids, spec.tokenizer.query.max_length, spec.tokenizer.query.expand_id) == (
        [1], 16, 6)
    assert (spec.tokenizer.document.insert_ids, spec.tokenizer.document.max_length,
            spec.tokenizer.document.expand_id) == ([2], 40, None)
    # A model of another kind has neither mode.
    plain = load_fixture("tiny-bert-reranker").spec()
    assert not plain.multi_vector and plain.tokenizer.query is None and plain.tokenizer.document is None


def test_refusals():
    model = load_fixture("tiny-colbert")
    ids = model.encode_multi_vector(["hello"])
    with pytest.raises(InvalidInput, match="ColBERT model: it gives one vector per token"):
        model.embed_ids(ids)
    with pytest.raises(InvalidInput, match="ColBERT model"):
        model.embed(["hello"])
    other = load_fixture("tiny-bert-reranker")
    with pytest.raises(InvalidInput, match="not a multi-vector model"):
        other.embed_ids([[101, 102]], output="multi_vector_query")
    # None alone means the folder's side: an empty direction is refused here
    # as encode() refuses it (it ran on the folder's side).
    with pytest.raises(InvalidInput, match="truncation_direction must be 'right' or 'left', got ''"):
        model.encode_multi_vector(["hello"], truncation_direction="")


def _variant(tmp_path, **changes):
    folder = tmp_path / "colbert"
    shutil.copytree(COLBERT, folder)
    cfg_path = folder / "config_sentence_transformers.json"
    cfg = json.loads(cfg_path.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    cfg_path.write_text(json.dumps(cfg))
    return folder


def test_settings_pylate_defaults_and_switches(tmp_path):
    """No expansion: a query keeps only its own tokens; attend_to_expansion:
    the [MASK] tokens are keys too (other vectors, the same ids); an unknown
    prefix token is refused (PyLate would add an untrained one)."""
    model = load_fixture("tiny-colbert")
    base = model.embed_multi_vector(["what is it"], is_query=True)[0]
    flat = mlx_embed.load(_variant(tmp_path, do_query_expansion=False))
    ids = flat.encode_multi_vector(["what is it"], is_query=True)[0]
    assert ids[:2] == [4, 1] and ids[-1] == 5 and 6 not in ids
    got = flat.embed_multi_vector(["what is it"], is_query=True)[0]
    assert got.shape[0] == len(ids)
    np.testing.assert_allclose(got, base[: len(ids)], atol=1e-6)
    shutil.rmtree(tmp_path / "colbert")
    attends = mlx_embed.load(_variant(tmp_path, attend_to_expansion_tokens=True))
    other = attends.embed_multi_vector(["what is it"], is_query=True)[0]
    assert other.shape == base.shape and np.abs(other - base).max() > 1e-3
    shutil.rmtree(tmp_path / "colbert")
    with pytest.raises(ValueError, match="query prefix '\\[Q\\] ' is not a token"):
        mlx_embed.load(_variant(tmp_path, query_prefix=None))


STANFORD = FIXTURES / "tiny-colbert-stanford"


def test_stanford_checkpoint_is_read_as_pylate_reads_it():
    """colbert-ir's layout (config.json's HF_ColBERT, ``linear.weight`` beside
    the BERT weights, no sentence-transformers file): the projection is that
    weight, the prefixes [unused0] / [unused1] (ids 1 and 2), the lengths
    artifact.metadata's query_maxlen 12 and doc_maxlen 32, the query expanded
    with [MASK] (6) and the punctuation left out of a document."""
    model = load_fixture("tiny-colbert-stanford")
    spec = model.spec()
    assert spec.multi_vector and spec.dim == 16 and spec.max_length == 32
    q, d = spec.tokenizer.query, spec.tokenizer.document
    assert (q.insert_ids, q.max_length, q.expand_id) == ([1], 12, 6)
    assert (d.insert_ids, d.max_length, d.expand_id) == ([2], 32, None)
    reference = _reference("tiny-colbert-stanford")
    assert all(len(r) == 12 and r[:2] == [4, 1] for r in _ids(reference, "query"))
    docs = _ids(reference, "document")
    assert all(r[:2] == [4, 2] and r[-1] == 5 for r in docs) and max(len(r) for r in docs) == 32
    assert sum(reference["document_rows"]) < sum(len(r) for r in docs)
    # Its expansion is not attended to (attend_to_mask_tokens false).
    assert reference["query_attended"].sum() < len(reference["query_attended"])
    with pytest.raises(InvalidInput, match="ColBERT model"):
        model.embed(["hello"])


def _stanford_copy(tmp_path, metadata=..., **files):
    folder = tmp_path / "stanford"
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(STANFORD, folder)
    meta_path = folder / "artifact.metadata"
    if metadata is None:
        meta_path.unlink()
    elif metadata is not ...:
        meta = json.loads(meta_path.read_text())
        meta.update(metadata)
        meta_path.write_text(json.dumps(meta))
    for name, content in files.items():
        (folder / name).write_text(json.dumps(content))
    return folder


@pytest.mark.parametrize("variant", ["attend", "bare"])
def test_stanford_metadata_decides(tmp_path, variant):
    """PyLate's own references for two more folders: artifact.metadata with
    attend_to_mask_tokens true (the [MASK] rows are keys: other vectors, the
    same ids), and no artifact.metadata (PyLate's lengths 32 / 180, the
    Stanford prefixes kept)."""
    folder = _stanford_copy(tmp_path, {"attend_to_mask_tokens": True} if variant == "attend" else None)
    model = mlx_embed.load(folder)
    reference, queries = _reference("tiny-colbert-stanford"), _texts("tiny-colbert-stanford")["queries"]
    side = f"{variant}_query"
    assert model.encode_multi_vector(queries, is_query=True) == _ids(reference, side)
    _check(model.embed_multi_vector(queries, is_query=True), reference, side)
    if variant == "bare":
        assert model.spec().tokenizer.document.max_length == 180 and model.spec().max_length == 180


def test_stanford_modules_json_settings_come_first(tmp_path):
    """With a modules.json naming the Transformer alone, PyLate also reads
    config_sentence_transformers.json, whose keys win over artifact.metadata's."""
    folder = _stanford_copy(
        tmp_path,
        **{"modules.json": [{"idx": 0, "name": "0", "path": "",
                             "type": "sentence_transformers.models.Transformer"}],
           "config_sentence_transformers.json": {"query_length": 10}},
    )
    model = mlx_embed.load(folder)
    assert model.spec().tokenizer.query.max_length == 10 and model.spec().tokenizer.document.max_length == 32
    reference = _reference("tiny-colbert-stanford")
    # The same ids cut two tokens earlier (the first query is cut, not expanded).
    got = model.encode_multi_vector(["how do I reset my password"], is_query=True)[0]
    want = _ids(reference, "query")[0]
    assert got == want[:9] + [5]


def test_stanford_refusals(tmp_path):
    with pytest.raises(ValueError, match="artifact.metadata: query_maxlen must be a positive integer"):
        mlx_embed.load(_stanford_copy(tmp_path, {"query_maxlen": "12"}))
    with pytest.raises(ValueError, match="artifact.metadata: attend_to_mask_tokens must be true or false"):
        mlx_embed.load(_stanford_copy(tmp_path, {"attend_to_mask_tokens": "no"}))
    with pytest.raises(ValueError, match="document_length 300 is over the model's 256 positions"):
        mlx_embed.load(_stanford_copy(tmp_path, {"doc_maxlen": 300}))
    with pytest.raises(ValueError, match="query prefix '\\[Q\\]' is not a token"):
        mlx_embed.load(_stanford_copy(tmp_path, {"query_token_id": "[Q]"}))
    folder = _stanford_copy(tmp_path)
    weights = mx.load(str(folder / "model.safetensors"))
    del weights["linear.weight"]
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    with pytest.raises(ValueError, match="HF_ColBERT checkpoint without its 'linear.weight'"):
        mlx_embed.load(folder)


def test_truncate_false_holds_a_text_to_its_modes_length():
    """``truncate=False`` refuses a text over the mode's length (query_length
    16 / document_length 40, the specials and the prefix counted, the
    expansion not), not over the model's longest input (40): PyLate always
    cuts a query to 16, so a 21-token query fits the model but not the query."""
    from mlx_embed.errors import InputTooLong

    model = load_fixture("tiny-colbert")
    text = "what is the capital of france? and of spain? and of italy?"
    assert len(model.encode_multi_vector([text], is_query=False)[0]) == 21
    with pytest.raises(InputTooLong, match="text 1 has 21 tokens, more than query_length=16"):
        model.embed_multi_vector(["a", text], is_query=True, truncate=False)
    # As a document those 21 tokens fit document_length 40.
    got = model.embed_multi_vector([text], is_query=False, truncate=False)[0]
    np.testing.assert_array_equal(got, model.embed_multi_vector([text], is_query=False)[0])
    # Every shorter query: refused exactly when the cut would drop a token.
    words = text.split()
    seen = set()
    for n in range(1, len(words) + 1):
        part = " ".join(words[:n])
        cut = model.encode_multi_vector([part], is_query=True)[0]
        untruncated = len(model.encode_multi_vector([part], is_query=False)[0])
        seen.add(untruncated <= 16)
        if untruncated <= 16:
            assert model.encode_multi_vector([part], is_query=True, truncate=False)[0] == cut
        else:
            with pytest.raises(InputTooLong, match=f"has {untruncated} tokens, more than query_length=16"):
                model.encode_multi_vector([part], is_query=True, truncate=False)
    assert seen == {True, False}
    with pytest.raises(InputTooLong, match="text 0 has 4[1-9] tokens, more than document_length=40"):
        model.encode_multi_vector(["the quick brown fox jumps over the lazy dog " * 2], truncate=False)
    with pytest.raises(TypeError, match="truncate must be True or False"):
        model.encode_multi_vector(["a"], truncate="no")


def test_modern_colbert_is_read_as_pylate_reads_it():
    """GTE-ModernColBERT-v1's layout on ModernBERT: the prefixes are the
    tokens PyLate added ("[Q] " 705, "[D] " 706), lengths 32 / 300, the
    expansion [MASK] (704) with no do_query_expansion key (PyLate's default),
    no model_type key (the PyLate Dense says ColBERT)."""
    model = load_fixture("tiny-modern-colbert")
    spec = model.spec()
    assert spec.multi_vector and spec.dim == 16 and spec.max_length == 300
    q, d = spec.tokenizer.query, spec.tokenizer.document
    assert (q.insert_ids, q.max_length, q.expand_id) == ([705], 32, 704)
    assert (d.insert_ids, d.max_length, d.expand_id) == ([706], 300, None)
    reference = _reference("tiny-modern-colbert")
    queries, docs = _ids(reference, "query"), _ids(reference, "document")
    assert all(len(r) == 32 and r[:2] == [701, 705] for r in queries)
    # Two queries cut with no expansion left; a literal "[Q] " in a text is the token.
    assert sum(704 not in r for r in queries) == 2 and queries[-1][:3] == [701, 705, 705]
    assert all(r[:2] == [701, 706] and r[-1] == 702 for r in docs) and max(len(r) for r in docs) == 300
    # Expansion rows that no local window reaches a real key from (the
    # query's rows past its tokens + 8): computed all the same.
    assert reference["query_attended"].sum() < 32 * len(queries)


POOLED = ["pool2_protect1", "pool3_protect1", "pool2_protect0"]


def _pool_args(key: str) -> dict:
    factor, protected = key.removeprefix("pool").split("_protect")
    return {"pool_factor": int(factor), "protected_tokens": int(protected)}


@pytest.mark.parametrize("name", ["tiny-colbert", "tiny-modern-colbert"])
@pytest.mark.parametrize("key", POOLED)
def test_pool_factor_clusters_as_pylate_does(name, key):
    """PyLate's hierarchical pooling (``encode(..., pool_factor=k)``, its
    references in pooled.npz): on PyLate's own unpooled float64 rows the
    same clusters in the same order, to rounding; on the engine's rows the
    same row counts and every pooled row within cosine 0.99999."""
    from mlx_embed.multi_vector import pool_rows

    pooled = dict(np.load(FIXTURES / name / "pooled.npz"))
    want = _split(pooled[f"{key}_vectors"], pooled[f"{key}_rows"])
    args = _pool_args(key)
    reference = _reference(name)
    unpooled = _split(reference["document_vectors"], reference["document_rows"])
    same_input = [pool_rows(r, args["pool_factor"], args["protected_tokens"]) for r in unpooled]
    for got, w in zip(same_input, want):
        assert got.shape == w.shape and np.abs(got - w).max() < 1e-12
    model = load_fixture(name)
    got = model.embed_multi_vector(_texts(name)["documents"], **args)
    worst = _check(got, {"document_vectors": pooled[f"{key}_vectors"], "document_rows": pooled[f"{key}_rows"]},
                   "document")
    print(f"{name} {key}: lowest per-row cosine {worst:.9f}")
    # Fewer rows than unpooled, the protected first row as it was.
    assert sum(len(g) for g in got) < len(reference["document_vectors"])
    plain = model.embed_multi_vector(_texts(name)["documents"])
    if args["protected_tokens"]:
        assert all(np.array_equal(g[0], p[0]) for g, p in zip(got, plain))


def test_pool_factor_ties_and_refusals():
    """Equal rows (a rounding under 0 apart, where scipy refuses and PyLate
    fails) pool as 0 apart; a query is never pooled (PyLate); the factors
    are checked."""
    from mlx_embed.multi_vector import pool_rows

    rng = np.random.default_rng(0)
    rows = rng.standard_normal((5, 16)).astype(np.float32)
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    doubled = np.concatenate([rows, rows])
    got = pool_rows(doubled, 2, 0)
    # Each row and its copy are one cluster: the five rows, numbered as the
    # merges leave them (scipy's order), each once.
    assert got.shape == (5, 16)
    assert sorted(np.argmax(got @ rows.T, axis=1).tolist()) == [0, 1, 2, 3, 4]
    np.testing.assert_allclose(np.sort(got @ rows.T, axis=1)[:, -1], 1.0, atol=1e-6)
    # Nothing to pool: as it was.
    assert pool_rows(rows[:2], 2, 1) is not None and pool_rows(rows[:2], 2, 1).shape == (2, 16)
    model = load_fixture("tiny-colbert")
    q = model.embed_multi_vector(["what is it"], is_query=True, pool_factor=4)[0]
    assert q.shape == (16, 16)
    for bad in ({"pool_factor": 0}, {"pool_factor": 1.5}, {"pool_factor": True}, {"protected_tokens": -1}):
        with pytest.raises(InvalidInput, match="must be a whole number"):
            model.embed_multi_vector(["a"], **bad)


def test_pooling_crosses_the_seam_per_input():
    """``embed_ids(..., pool_factor=[...], protected_tokens=[...])`` (the
    server's one crossing per batch): each input pooled by its own factor,
    its rows normalized first, the unpooled ones answered raw, as alone."""
    from mlx_embed.multi_vector import DOCUMENT

    model = load_fixture("tiny-colbert")
    texts = [t for t in _texts("tiny-colbert")["documents"] if t]
    ids = model.encode_multi_vector(texts)
    factors = [(1, 1), (2, 1), (3, 0), (1, 0), (2, 0), (4, 1), (2, 1)][: len(ids)]
    res = model.embed_ids(ids, output=DOCUMENT, pool_factor=[f for f, _ in factors],
                          protected_tokens=[p for _, p in factors])
    flat = np.frombuffer(res.vectors, dtype="<f4").reshape(-1, model.dim)
    got = np.split(flat, np.cumsum(res.rows)[:-1])
    for text, row, (factor, protected) in zip(texts, got, factors):
        if factor > 1:
            want = model.embed_multi_vector([text], pool_factor=factor, protected_tokens=protected)[0]
        else:
            want = model.embed_multi_vector([text], normalize=False)[0]
        assert row.shape == want.shape
        assert np.abs(row - want).max() <= 1e-6
    # A call with no input pooled is the plain call.
    plain = model.embed_ids(ids, output=DOCUMENT, pool_factor=[1] * len(ids), protected_tokens=[1] * len(ids))
    assert plain.rows == model.embed_ids(ids, output=DOCUMENT).rows
    for bad, words in (
        ({"pool_factor": [2] * len(ids)}, "go together"),
        ({"pool_factor": [2], "protected_tokens": [1]}, f"1 pool_factor entries for {len(ids)} inputs"),
        ({"pool_factor": [0] * len(ids), "protected_tokens": [1] * len(ids)}, "at least 1"),
        ({"pool_factor": [2] * len(ids), "protected_tokens": [-1] * len(ids)}, "at least 0"),
    ):
        with pytest.raises(InvalidInput, match=words):
            model.embed_ids(ids, output=DOCUMENT, **bad)
    with pytest.raises(InvalidInput, match="PyLate pools documents only"):
        model.embed_ids(model.encode_multi_vector(["a"], is_query=True), output="multi_vector_query",
                        pool_factor=[2], protected_tokens=[1])
