"""Alibaba GTE (``model_type: "new"``) against references computed by its
published remote code (Alibaba-NLP/new-impl); how each fixture was made:
tests/fixtures/tiny-gte-*/README.md and scripts/fixtures/make_gte.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

import mlx_embed
from conftest import (
    FIXTURES, MAX_DIFF, assert_pairs_match_tokenizer, assert_parity, assert_reranker_matches, copy_fixture, load_fixture,
)
from mlx_embed.models import gte_new

MAX_LEN = 128
EMBEDDERS = ("tiny-gte-en", "tiny-gte-multilingual")
RERANKER = FIXTURES / "tiny-gte-reranker"
# The positions reference_rope_cos_sin.npy holds (make_gte.py ROPE_ROWS).
ROPE_ROWS = [0, 1, 2, 17, 127, 511, 1000, 4095, 8191]


def _ref(folder: str, name: str) -> np.ndarray:
    return np.load(FIXTURES / folder / name)


@pytest.mark.parametrize("folder", EMBEDDERS)
def test_matches_reference(folder, golden_texts):
    model = load_fixture(folder)
    assert (model.model_type, model.pooling, model.dim, model.max_length) == ("new", "cls", 64, MAX_LEN)
    assert model.context.path == "native"
    assert_parity(model.embed(golden_texts), _ref(folder, "reference_cls_normalized.npy"))


@pytest.mark.parametrize("folder", EMBEDDERS)
@pytest.mark.parametrize("fast_ops", ["mlx", "exact"])
def test_other_op_paths_match_reference(folder, fast_ops, golden_texts):
    """The MLX paths (what runs on Metal / CUDA) give the same vectors as the
    native CPU kernels."""
    model = load_fixture(folder, fast_ops=fast_ops)
    assert model.context.path == fast_ops
    assert_parity(model.embed(golden_texts), _ref(folder, "reference_cls_normalized.npy"))


@pytest.mark.parametrize("folder", EMBEDDERS)
def test_bfloat16(folder, golden_texts):
    """bfloat16 (what a Mac or a GPU serves) stays close to the fp32
    reference; the RoPE tables are cast on the thread running the pass (two
    workers here), where a cached lazy array from another thread's stream
    failed to evaluate. Measured min cosine 0.9997 (en) and 0.9998."""
    model = load_fixture(folder, dtype="bfloat16", workers=2)
    got = model.embed(golden_texts)
    cos = (got * _ref(folder, "reference_cls_normalized.npy")).sum(axis=1)
    assert got.dtype == np.float32 and cos.min() >= 0.999


@pytest.mark.parametrize("folder", EMBEDDERS)
def test_batch_equals_single_and_max_length(folder, golden_texts):
    model = load_fixture(folder)
    got = model.embed(golden_texts)
    counts = model.count_tokens(golden_texts, prompt="")
    assert min(counts) <= 3 and counts.count(MAX_LEN) >= 4 and max(counts) == MAX_LEN
    single = np.concatenate([model.embed([t]) for t in golden_texts])
    assert np.abs(got - single).max() <= 1e-6


@pytest.mark.parametrize("folder", EMBEDDERS)
def test_mean_pooling_override(folder, golden_texts):
    assert_parity(load_fixture(folder, pooling="mean").embed(golden_texts), _ref(folder, "reference_mean_normalized.npy"))


@pytest.mark.parametrize("folder", EMBEDDERS)
def test_rope_table_is_the_references(folder):
    """Our cos/sin (fixed NTK: factor 2 and 8 here) equal the reference's own
    cache at positions up to 8191, where a wrong base is furthest off."""
    args = load_fixture(folder).model.args
    cos, sin = gte_new.rope_table(args, ROPE_ROWS[-1] + 1)
    ref = _ref(folder, "reference_rope_cos_sin.npy")
    assert np.abs(cos[ROPE_ROWS] - ref[0]).max() <= 2e-7
    assert np.abs(sin[ROPE_ROWS] - ref[1]).max() <= 2e-7
    # Plain RoPE with the same base differs by far: the scaling is applied.
    plain = gte_new.ModelArgs.from_dict({**json.loads((FIXTURES / folder / "config.json").read_text()),
                                         "rope_scaling": None})
    assert np.abs(gte_new.rope_table(plain, 1000)[0][999] - ref[0][6]).max() > 0.1


@pytest.mark.parametrize("folder", EMBEDDERS)
def test_long_inputs_match_reference(folder):
    """Inputs of 800 to 1024 tokens (max_length raised to 1024 at load):
    positions far past the fixture's usual 128."""
    texts = json.loads((FIXTURES / folder / "long_texts.json").read_text())
    model = load_fixture(folder, max_length=1024)
    counts = model.count_tokens(texts)
    assert min(counts) >= 800 and max(counts) == 1024
    assert_parity(model.embed(texts), _ref(folder, "reference_long_cls_normalized.npy"))


@pytest.mark.parametrize("folder", EMBEDDERS)
def test_logn_attention_scale(folder, golden_texts, tmp_path):
    """logn_attention_scale: queries times log(length) / log(8192) per row;
    batched rows of different lengths each keep their own scale."""
    model = mlx_embed.load(copy_fixture(folder, tmp_path / "logn", logn_attention_scale=True))
    ref = _ref(folder, "reference_logn_cls_normalized.npy")
    assert_parity(model.embed(golden_texts), ref)
    single = np.concatenate([model.embed([t]) for t in golden_texts])
    assert np.abs(single - ref).max() <= MAX_DIFF
    # With clip1 every length under 8192 scales by max(log_8192(n), 1) = 1:
    # the plain model.
    clipped = mlx_embed.load(copy_fixture(folder, tmp_path / "clip", logn_attention_scale=True, logn_attention_clip1=True))
    assert_parity(clipped.embed(golden_texts), _ref(folder, "reference_cls_normalized.npy"))


def test_unpacked_qkv_checkpoint(golden_texts, tmp_path):
    """pack_qkv: false checkpoints store q_proj / k_proj / v_proj; the packed
    projection is their concatenation, so the vectors are the same bits."""
    import mlx.core as mx

    d = copy_fixture("tiny-gte-en", tmp_path / "split", pack_qkv=False)
    w = mx.load(str(d / "model.safetensors"))
    out = {}
    for k, v in w.items():
        if ".qkv_proj." in k:
            for part, t in zip("qkv", mx.split(v, 3, axis=0)):
                out[k.replace("qkv_proj", f"{part}_proj")] = t
        else:
            out["new." + k] = v  # and the NewForMaskedLM prefix
    mx.save_safetensors(str(d / "model.safetensors"), out)
    assert np.array_equal(mlx_embed.load(d).embed(golden_texts), load_fixture("tiny-gte-en").embed(golden_texts))


def test_gte_model_type_and_transformers5_config(golden_texts, tmp_path):
    """model_type "gte" (TEI's other name for this network) is the same
    network, and so is a config re-saved by transformers 5
    (rope_parameters instead of rope_scaling / rope_theta)."""
    want = load_fixture("tiny-gte-en").embed(golden_texts)
    a = mlx_embed.load(copy_fixture("tiny-gte-en", tmp_path / "gte", model_type="gte"))
    assert a.model_type == "gte" and np.array_equal(a.embed(golden_texts), want)
    b = mlx_embed.load(copy_fixture("tiny-gte-en", tmp_path / "t5", rope_scaling=None, rope_theta=None, rope_parameters={
        "factor": 2.0, "rope_theta": 500000.0, "rope_type": "ntk", "type": "ntk"}))
    assert np.array_equal(b.embed(golden_texts), want)


def test_left_truncation_keeps_the_last_tokens(golden_texts):
    model = load_fixture("tiny-gte-en")
    long = golden_texts[34]
    left, before = model.encode([long], truncation_direction="left", prompt="")
    tok = model.tokenizer
    content = tok.encode_contents([long])[0]
    assert before[0] > MAX_LEN and len(left[0]) == MAX_LEN
    assert left[0] == tok.prefix + content[-tok.max_content:] + tok.suffix
    v_left = model.embed([long], truncation_direction="left", prompt="")
    got = np.frombuffer(model.embed_ids([left[0]]).vectors, dtype="<f4").reshape(1, -1)
    assert np.allclose(v_left, got / np.linalg.norm(got), atol=1e-6)
    assert np.abs(v_left - model.embed([long])).max() > 1e-2


@pytest.mark.parametrize(
    "edit, match",
    [
        ({"position_embedding_type": "absolute"}, "position_embedding_type"),
        ({"layer_norm_type": "rms_norm"}, "layer_norm_type"),
        ({"hidden_act": "relu"}, "hidden_act"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
        ({"rope_scaling": {"type": "ntk", "factor": 2.0, "mixed_b": 0.5}}, "mixed_b"),
        ({"rope_scaling": {"type": "ntk", "factor": 0.5}}, "factor >= 1"),
    ],
)
def test_unsupported_variants_are_named(edit, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        mlx_embed.load(copy_fixture("tiny-gte-en", tmp_path / "m", **edit))


# ------------------------------------------------------------------ reranker


def test_reranker_matches_reference():
    """gte-multilingual-reranker-base style: NewPooler (dense + tanh on <s>),
    classifier; <s> q </s></s> d </s>, one token type (none sent)."""
    model = load_fixture(RERANKER)
    assert (model.kind, model.labels, model.model_type, model.dim) == ("reranker", ["LABEL_0"], "new", 1)
    pair = model.spec().tokenizer.pair
    assert (pair.prefix_ids, pair.middle_ids, pair.suffix_ids) == ([0], [2, 2], [2])
    assert (pair.first_type_id, pair.second_type_id) == (0, 0)
    assert_reranker_matches(model, RERANKER)


def test_reranker_pairs_are_truncated_like_the_tokenizer():
    model = load_fixture(RERANKER)
    assert_pairs_match_tokenizer(model, RERANKER, MAX_LEN)
    assert model.encode_pairs([["a", "b"]])[1] is None


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
