"""SPLADE sparse embeddings against sentence-transformers' SparseEncoder.

The fixture (tests/fixtures/tiny-splade) and how its references were made:
its README and scripts/fixtures/make_splade.py. References are the non-zero
entries of each golden text's vocabulary-wide vector (float64 torch, each text
alone); the engine pads and batches them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import mlx_embed
from mlx_embed import st_modules
from mlx_embed.errors import InvalidInput

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SPLADE = FIXTURES / "tiny-splade"
VOCAB = 3000
# Entries below this may be a rounding away from zero on one side only: a
# logit within float32 noise of 0 is kept by one implementation and cut by
# the other's relu. Everything above it must be present on both sides.
TINY = 1e-4


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return json.loads((FIXTURES / "golden" / "minilm_texts.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def splade():
    return mlx_embed.load(SPLADE)


def _reference(name: str) -> np.ndarray:
    ref = np.load(SPLADE / f"reference_{name}.npz")
    offsets, indices, values = ref["offsets"], ref["indices"], ref["values"]
    out = np.zeros((len(offsets) - 1, VOCAB), dtype=np.float32)
    for i in range(len(offsets) - 1):
        out[i, indices[offsets[i]: offsets[i + 1]]] = values[offsets[i]: offsets[i + 1]]
    return out


def _check(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-5 + 1e-5 * np.abs(want).max()
    norms = np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1)
    cos = (got * want).sum(axis=1) / norms
    assert cos.min() >= 0.99999
    # The same active vocabulary, up to a few entries within rounding of zero.
    differ = (got > 0) != (want > 0)
    assert differ.sum() <= got.shape[0]
    assert np.maximum(got, want)[differ].max(initial=0.0) < TINY


def _folder_with(tmp_path: Path, strategy: str, activation: str) -> Path:
    """The fixture with other SpladePooling settings, its files in the form
    sentence-transformers 6 writes (module paths, ``embedding_dimension``)."""
    dst = tmp_path / f"splade-{strategy}-{activation}"
    shutil.copytree(SPLADE, dst)
    cfg = dst / "1_SpladePooling" / "config.json"
    conf = json.loads(cfg.read_text())
    conf.update(pooling_strategy=strategy, activation_function=activation)
    conf["embedding_dimension"] = conf.pop("word_embedding_dimension")
    cfg.write_text(json.dumps(conf))
    modules = json.loads((dst / "modules.json").read_text())
    modules[0]["type"] = "sentence_transformers.sparse_encoder.modules.mlm_transformer.MLMTransformer"
    modules[1]["type"] = "sentence_transformers.sparse_encoder.modules.splade_pooling.SpladePooling"
    (dst / "modules.json").write_text(json.dumps(modules))
    return dst


def test_matches_sparse_encoder_with_max_pooling(splade, texts):
    assert splade.sparse and splade.dim == VOCAB and splade.pooling == "splade"
    got = splade.embed(texts, normalize=False)
    want = _reference("max")
    _check(got, want)
    nnz = (want > 0).sum(axis=1)
    # SPLADE-like sparsity: a few hundred active words per text, never all.
    assert 0 < nnz.min() and nnz.max() < VOCAB // 20


@pytest.mark.parametrize(
    "strategy,activation,ref", [("sum", "relu", "sum"), ("max", "log1p_relu", "log1p_relu")]
)
def test_pooling_strategy_and_activation_come_from_the_folder(
    tmp_path, texts, strategy, activation, ref
):
    model = mlx_embed.load(_folder_with(tmp_path, strategy, activation))
    _check(model.embed(texts, normalize=False), _reference(ref))
    # Each setting changes the vectors: the references are not all the same.
    assert np.abs(_reference(ref) - _reference("max")).max() > 0.01


def test_embed_sparse_lists_the_non_zero_entries(splade, texts):
    want = _reference("max")
    pairs = splade.embed_sparse(texts)
    assert len(pairs) == len(texts)
    dense = splade.embed(texts, normalize=False)
    for row, (idx, val) in zip(dense, pairs):
        assert idx.dtype == np.int32 and val.dtype == np.float32
        assert np.all(np.diff(idx) > 0) and np.all(val > 0)
        assert np.array_equal(idx, np.nonzero(row)[0])
        assert np.array_equal(val, row[idx])
    rebuilt = np.zeros_like(want)
    for i, (idx, val) in enumerate(pairs):
        rebuilt[i, idx] = val
    _check(rebuilt, want)
    with pytest.raises(InvalidInput, match="raw sparse weights"):
        splade.embed_sparse(texts[:1], normalize=True)


def test_padding_and_batching_do_not_leak(splade, texts):
    """Each text alone equals the text in a padded batch (padding is masked
    before the max: a relu of a pad row's logits would otherwise light up)."""
    batch = splade.embed(texts, normalize=False)
    for i in (0, 3, 17, len(texts) - 1):
        alone = splade.embed([texts[i]], normalize=False)[0]
        assert np.abs(alone - batch[i]).max() <= 1e-5


def test_logits_are_cut_into_bounded_chunks(monkeypatch, splade, texts):
    """Long passes compute the [rows, L, vocab] logits a few rows at a time;
    every chunk size gives the same vectors."""
    whole = splade.embed(texts, normalize=False)
    monkeypatch.setattr(st_modules, "_SPLADE_CHUNK_FLOATS", 1)  # one row per step
    # Not bit-equal: the BLAS blocks a matmul of 1 row and of 40 differently.
    assert np.abs(splade.embed(texts, normalize=False) - whole).max() <= 1e-5


def test_pooling_splade_on_a_bare_masked_lm_folder(tmp_path, texts):
    """TEI's --pooling splade: a BertForMaskedLM folder without
    sentence-transformers files gets max pooling of relu."""
    bare = tmp_path / "bare"
    shutil.copytree(SPLADE, bare)
    for extra in ("modules.json", "config_sentence_transformers.json"):
        (bare / extra).unlink()
    shutil.rmtree(bare / "1_SpladePooling")
    assert not st_modules.declares_splade(str(bare))
    dense = mlx_embed.load(bare)
    assert not dense.sparse and dense.pooling == "mean" and dense.dim == 32
    model = mlx_embed.load(bare, pooling="SPLADE")
    assert model.sparse and model.spec().sparse and model.spec().dim == VOCAB
    _check(model.embed(texts, normalize=False), _reference("max"))


def test_what_splade_cannot_be(tmp_path, minilm, texts):
    with pytest.raises(ValueError, match="SPLADE SparseEncoder"):
        mlx_embed.load(SPLADE, pooling="mean")
    with pytest.raises(ValueError, match="not a reranker"):
        mlx_embed.load(SPLADE, kind="reranker")
    # all-MiniLM-L6-v2 ships no masked-LM head.
    with pytest.raises(ValueError, match="masked-LM head"):
        mlx_embed.load(minilm.path, pooling="splade")
    with pytest.raises(ValueError, match="masked-LM checkpoint"):
        mlx_embed.load(FIXTURES / "tiny-qwen3", pooling="splade")
    assert not minilm.sparse and not minilm.spec().sparse
    with pytest.raises(InvalidInput, match="has no sparse output"):
        minilm.embed_sparse(texts[:1])


def test_per_token_rows_are_the_encoder_states(splade, texts):
    """/embed_all on a SPLADE model: the encoder's hidden states, not logits."""
    rows = splade.embed_tokens(texts[1:3])
    assert [r.shape[1] for r in rows] == [32, 32]


def test_gpu_defaults_give_the_same_vectors(splade, texts):
    """The GPU's path on this CPU: padded shape buckets (pad rows cut before
    the head), pipelined calls, two streams: the same vectors."""
    model = mlx_embed.load(SPLADE, shape_buckets=True, pipeline=True, streams=2)
    want = splade.embed(texts, normalize=False)
    got = model.embed(texts[:27], normalize=False)  # 27 rows pad to 32
    assert np.abs(got - want[:27]).max() <= 1e-5
    pending = [model.submit_ids([model.encode([t])[0][0] for t in texts[i : i + 5]])
               for i in range(0, 20, 5)]
    for k, p in enumerate(pending):
        res = p.result()
        vecs = np.frombuffer(res.vectors, dtype="<f4").reshape(-1, VOCAB)
        assert np.abs(vecs - want[5 * k : 5 * k + 5]).max() <= 1e-5


SPLADE_DISTILBERT = FIXTURES / "tiny-splade-distilbert"


def test_distilbert_masked_lm_splade(tmp_path, texts):
    """A DistilBertForMaskedLM SparseEncoder (opensearch v2-distill style:
    max of log1p(log1p(relu))), and the bare masked-LM folder with
    pooling="splade" (max of log1p(relu)), against the fixture's float64
    sentence-transformers references."""
    model = mlx_embed.load(SPLADE_DISTILBERT)
    assert model.sparse and model.model_type == "distilbert" and model.dim == 1200
    _check(model.embed(texts, normalize=False), np.load(SPLADE_DISTILBERT / "reference_log1p_relu.npy"))
    bare = tmp_path / "bare"
    shutil.copytree(SPLADE_DISTILBERT, bare)
    for extra in ("modules.json", "config_sentence_transformers.json"):
        (bare / extra).unlink()
    shutil.rmtree(bare / "1_SpladePooling")
    # Without pooling="splade" it is a dense DistilBERT embedder.
    assert not mlx_embed.load(bare).sparse
    relu = mlx_embed.load(bare, pooling="splade")
    _check(relu.embed(texts, normalize=False), np.load(SPLADE_DISTILBERT / "reference_max.npy"))


def test_distilbert_splade_needs_its_head(tmp_path):
    """An embedding-only DistilBERT (no vocab_transform / vocab_layer_norm /
    vocab_projector) cannot be SPLADE: refused by name."""
    with pytest.raises(ValueError, match="vocab_transform"):
        mlx_embed.load(FIXTURES / "tiny-distilbert", pooling="splade")
