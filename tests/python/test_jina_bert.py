"""JinaBERT (``model_type: "bert"`` with ALiBi) in both its layer layouts:
tiny-jina-bert / tiny-jina-reranker (jina-bert-v2-qk-post-norm, references
from its remote code) and tiny-jina-v2 / tiny-jina-reranker-v1
(jina-bert-implementation, references from transformers' BERT with its GLU
and ALiBi put in, cross-checked against an independent port). How each was
made: tests/fixtures/tiny-jina-*/README.md, scripts/fixtures/make_jina.py and
make_jina_v2.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

import mlx_embed
from conftest import (
    FIXTURES, assert_pairs_match_tokenizer, assert_parity, assert_reranker_matches, copy_fixture, load_fixture,
)
from mlx_embed.models import jina_bert

MAX_LEN = 128
EMBEDDER = "tiny-jina-bert"
RERANKER = FIXTURES / "tiny-jina-reranker"
# embedder fixture -> the layout its config names and its layer class
LAYOUTS = {
    "tiny-jina-bert": (jina_bert.QK_POST_NORM, jina_bert.QkPostNormLayer),
    "tiny-jina-v2": (jina_bert.IMPLEMENTATION, jina_bert.PostNormLayer),
}
EMBEDDERS = pytest.mark.parametrize("embedder", sorted(LAYOUTS))


def _ref(name: str, embedder: str = EMBEDDER) -> np.ndarray:
    return np.load(FIXTURES / embedder / name)


@EMBEDDERS
def test_matches_reference(embedder, golden_texts):
    model = load_fixture(embedder)
    # model_type "bert", but the ALiBi encoder (bert.py would refuse
    # position_embedding_type "alibi"), in the layout config.json names.
    assert isinstance(model.model, jina_bert.Model)
    layout, layer = LAYOUTS[embedder]
    assert model.model.args.layout == layout
    assert all(type(x) is layer for x in model.model.layers) and len(model.model.layers) == 2
    assert (model.model_type, model.pooling, model.dim, model.max_length) == ("bert", "mean", 48, MAX_LEN)
    assert model.context.path == "native"
    assert_parity(model.embed(golden_texts), _ref("reference_mean_normalized.npy", embedder))


@EMBEDDERS
@pytest.mark.parametrize("fast_ops", ["mlx", "exact"])
def test_other_op_paths_match_reference(embedder, fast_ops, golden_texts):
    """The MLX paths (what runs on Metal / CUDA) give the same vectors as the
    native CPU kernels."""
    model = load_fixture(embedder, fast_ops=fast_ops)
    assert model.context.path == fast_ops
    assert_parity(model.embed(golden_texts), _ref("reference_mean_normalized.npy", embedder))


@EMBEDDERS
def test_bfloat16(embedder, golden_texts):
    """bfloat16 stays close to the fp32 reference, the ALiBi table made on
    the thread running the pass (two workers). Measured min cosine 0.99996."""
    model = load_fixture(embedder, dtype="bfloat16", workers=2)
    got = model.embed(golden_texts)
    cos = (got * _ref("reference_mean_normalized.npy", embedder)).sum(axis=1)
    assert got.dtype == np.float32 and cos.min() >= 0.999


def test_batch_equals_single_and_max_length(golden_texts):
    """Right padding leaves the ALiBi distances between real tokens as they
    are, so a padded batch gives each text's own vector; some texts are cut
    at the folder's 128 tokens."""
    model = load_fixture(EMBEDDER)
    got = model.embed(golden_texts)
    counts = model.count_tokens(golden_texts, prompt="")
    assert min(counts) <= 3 and counts.count(MAX_LEN) >= 4 and max(counts) == MAX_LEN
    single = np.concatenate([model.embed([t]) for t in golden_texts])
    assert np.abs(got - single).max() <= 1e-6


@EMBEDDERS
def test_long_inputs_match_reference(embedder):
    """Inputs of 800 to 1024 tokens (max_length raised to 1024 at load):
    ALiBi distances far past the fixture's usual 128, where a wrong slope or
    an asymmetric bias is furthest off."""
    texts = json.loads((FIXTURES / embedder / "long_texts.json").read_text())
    model = load_fixture(embedder, max_length=1024)
    counts = model.count_tokens(texts)
    assert min(counts) >= 800 and max(counts) == 1024
    assert_parity(model.embed(texts), _ref("reference_long_mean_normalized.npy", embedder))


@EMBEDDERS
@pytest.mark.parametrize("fast_ops", ["native", "mlx"])
def test_long_inputs_in_query_blocks(embedder, fast_ops, monkeypatch):
    """Long inputs' attention on the MLX path in blocks of 64 query rows,
    each block's ALiBi rows made in the graph, no [heads, L, L] table; on
    the native path no blocks at all (the streaming kernel holds no scores,
    the bias computed in its key tiles): the same vectors."""
    from mlx_embed import ops

    blocks, rows = [], []
    real_blocks, real_rows = ops.query_blocks, jina_bert.alibi_rows
    monkeypatch.setattr(ops, "query_blocks", lambda q, keys: blocks.append(real_blocks(q, keys)) or blocks[-1])
    monkeypatch.setattr(jina_bert, "alibi_rows", lambda *a: rows.append(a[1:]) or real_rows(*a))
    monkeypatch.setattr(ops, "SCORES_BLOCK_BYTES", 6 * 4 * 1024 * 64)
    texts = json.loads((FIXTURES / embedder / "long_texts.json").read_text())
    model = mlx_embed.load(FIXTURES / embedder, max_length=1024, fast_ops=fast_ops)
    assert_parity(model.embed(texts), _ref("reference_long_mean_normalized.npy", embedder))
    if fast_ops == "native":
        assert blocks == [] and rows == []
        return
    # Each of the 2 layers of a 1024-token pass: 16 blocks of 64 rows.
    assert [(0, 64), (960, 1024)] == [blocks[0][0], blocks[0][-1]] and len(blocks[0]) == 16
    assert len(rows) == sum(len(b) for b in blocks)


def test_alibi_slopes_are_the_references():
    """Slopes for 1 to 16 heads equal the reference's (read from its bias
    tensor), non-powers of two (6 here, 12 in jina-embeddings-v2-base)
    included; the bias is -slope * |i - j|, symmetric."""
    ref = json.loads((FIXTURES / EMBEDDER / "reference_alibi_slopes.json").read_text())
    for n, slopes in ref.items():
        np.testing.assert_allclose(jina_bert.alibi_slopes(int(n)), slopes, rtol=1e-7, atol=0)
    # The 6-head set is not the power-of-two formula's 2^(-8/6 (h+1)).
    assert abs(jina_bert.alibi_slopes(6)[4] - 2 ** (-8 / 6 * 5)) > 0.05
    bias = jina_bert.alibi_bias(6, 5)
    assert bias.shape == (6, 5, 5) and np.array_equal(bias, bias.transpose(0, 2, 1))
    assert bias[1, 0, 3] == pytest.approx(-3 * ref["6"][1]) and bias[1, 2, 2] == 0


@EMBEDDERS
def test_reglu_matches_reference(embedder, golden_texts, tmp_path):
    """feed_forward_type "reglu" on the same weights: ReLU on the gate half."""
    model = mlx_embed.load(copy_fixture(embedder, tmp_path / "reglu", feed_forward_type="reglu"))
    assert_parity(model.embed(golden_texts), _ref("reference_reglu_mean_normalized.npy", embedder))


@EMBEDDERS
def test_masked_lm_prefix_and_fused_names(embedder, golden_texts, tmp_path):
    """JinaBertForMaskedLM checkpoints (jina-embeddings-v2's `architectures`)
    keep the encoder under "bert." with an MLM head beside it: same vectors."""
    import mlx.core as mx

    d = copy_fixture(embedder, tmp_path / "mlm", architectures=["JinaBertForMaskedLM"])
    w = mx.load(str(d / "model.safetensors"))
    out = {"bert." + k: v for k, v in w.items()}
    out["cls.predictions.bias"] = mx.zeros((10,))
    mx.save_safetensors(str(d / "model.safetensors"), out)
    assert np.array_equal(mlx_embed.load(d).embed(golden_texts), load_fixture(embedder).embed(golden_texts))


@EMBEDDERS
def test_weights_decide_when_config_names_no_layout(embedder, golden_texts, tmp_path):
    """A folder whose config.json names neither remote code (auto_map and
    _name_or_path dropped, as conversions do): the weight names pick the
    layout, same vectors."""
    d = copy_fixture(embedder, tmp_path / "bare", auto_map=None, _name_or_path=None)
    model = mlx_embed.load(d)
    layout, layer = LAYOUTS[embedder]
    assert model.model.args.layout == layout and type(model.model.layers[0]) is layer
    assert np.array_equal(model.embed(golden_texts), load_fixture(embedder).embed(golden_texts))


def test_plain_bert_still_goes_to_bert():
    """Only ALiBi configs are routed here: an absolute-position BERT keeps
    bert.py (and bert.py still names what it does not do)."""
    from mlx_embed import loading
    from mlx_embed.models import bert

    assert loading.architecture("bert", {"position_embedding_type": "absolute"}) is bert
    assert loading.architecture("bert") is bert
    assert loading.architecture("bert", {"position_embedding_type": "alibi"}) is jina_bert
    with pytest.raises(ValueError, match="position_embedding_type"):
        bert.ModelArgs.from_dict({"position_embedding_type": "relative_key"})


@pytest.mark.parametrize(
    "edit, match",
    [
        ({"feed_forward_type": "original"}, "feed_forward_type='original'"),
        ({"feed_forward_type": "swiglu"}, "feed_forward_type='swiglu'"),
        ({"_name_or_path": "jinaai/jina-bert-implementation"}, "names both"),
    ],
)
def test_unsupported_variants_are_named(edit, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        mlx_embed.load(copy_fixture(EMBEDDER, tmp_path / "m", **edit))


@pytest.mark.parametrize("embedder, other", [("tiny-jina-bert", "tiny-jina-v2"), ("tiny-jina-v2", "tiny-jina-bert")])
def test_config_and_weights_of_different_layouts_are_refused(embedder, other, tmp_path):
    """config.json naming one layout over the other's weights is an error
    that names both, not a load with missing or unused weights."""
    import shutil

    d = copy_fixture(embedder, tmp_path / "mixed")
    shutil.copy(FIXTURES / other / "model.safetensors", d / "model.safetensors")
    with pytest.raises(ValueError, match=f"names {LAYOUTS[embedder][0]}, but the weights are in {LAYOUTS[other][0]}"):
        mlx_embed.load(d)


# ------------------------------------------------------------------ reranker


@pytest.mark.parametrize("reranker", ["tiny-jina-reranker", "tiny-jina-reranker-v1"])
def test_reranker_matches_reference(reranker):
    """jina-reranker-v1 style: BERT's pooler (dense + tanh on [CLS]) and
    classifier on the ALiBi encoder (either layout); [CLS] q [SEP] d [SEP]
    with types 0/1."""
    folder = FIXTURES / reranker
    model = load_fixture(reranker)
    assert (model.kind, model.labels, model.model_type, model.dim) == ("reranker", ["LABEL_0"], "bert", 1)
    layout = jina_bert.IMPLEMENTATION if reranker.endswith("-v1") else jina_bert.QK_POST_NORM
    assert model.model.encoder.args.layout == layout
    pair = model.spec().tokenizer.pair
    assert (pair.prefix_ids, pair.middle_ids, pair.suffix_ids) == ([2], [3], [3])
    assert (pair.first_type_id, pair.second_type_id) == (0, 1)
    assert_reranker_matches(model, folder)


def test_reranker_pairs_are_truncated_like_the_tokenizer():
    model = load_fixture(RERANKER)
    assert_pairs_match_tokenizer(model, RERANKER, MAX_LEN)
    assert model.encode_pairs([["a", "b"]])[1] is not None


def test_reranker_orders_documents():
    model = load_fixture(RERANKER)
    pairs = json.loads((RERANKER / "pairs.json").read_text())
    query = pairs[0][0]
    docs = [p[1] for p in pairs[:12]]
    scores = model.score([(query, d) for d in docs])[:, 0]
    ranked = model.rerank(query, docs, top_n=5)
    assert [i for i, _ in ranked] == sorted(range(len(docs)), key=lambda i: -scores[i])[:5]
    # Its encoder alone when asked (test_classifier_encoders.py).
    assert mlx_embed.load(RERANKER, kind="embedding").kind == "embedding"
