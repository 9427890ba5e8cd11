"""Cross-encoders against their transformers / sentence-transformers references.

Fixtures (tests/fixtures/tiny-*-reranker, tiny-bert-classifier) and how their
references were made: each folder's README and
scripts/fixtures/make_cross_encoders.py.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from tokenizers import Tokenizer

import mlx_embed  # noqa: F401  (sets up BLAS before mlx.core is imported)
import mlx.core as mx

from mlx_embed.models import qwen3_reranker, sequence_classification
from mlx_embed.pairs import (
    PairEncoder,
    segments_spec,
    template_spec,
    truncate_pair_lengths,
)

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
BERT_RERANKER = os.path.join(FIXTURES, "tiny-bert-reranker")
BERT_CLASSIFIER = os.path.join(FIXTURES, "tiny-bert-classifier")
QWEN3_RERANKER = os.path.join(FIXTURES, "tiny-qwen3-reranker")


def _json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _tokenizer(folder) -> Tokenizer:
    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return tok


def _load(module, folder):
    config = _json(os.path.join(folder, "config.json"))
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = model.sanitize(mx.load(os.path.join(folder, "model.safetensors")))
    model.load_weights(list(weights.items()), strict=True)
    return model


def _run(model, ids, types=None) -> np.ndarray:
    """Right-padded batch through the model: logits [n, labels]."""
    n, width = len(ids), max(len(x) for x in ids)
    arr = np.zeros((n, width), np.int32)
    mask = np.zeros((n, width), np.int32)
    tarr = np.zeros((n, width), np.int32)
    for i, row in enumerate(ids):
        arr[i, : len(row)] = row
        mask[i, : len(row)] = 1
        if types is not None:
            tarr[i, : len(row)] = types[i]
    out = model(mx.array(arr), mx.array(mask), None if types is None else mx.array(tarr))
    return np.array(out.astype(mx.float32))


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-np.asarray(x, dtype=np.float64)))


def _assert_logits(got, ref):
    # rtol: the fixtures' heads amplify float32 rounding of the hidden state;
    # the logits reach ~10 (see the fixture READMEs).
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n1,n2,budget", [(a, b, c) for a in range(0, 9) for b in range(0, 9) for c in (1, 2, 5, 8)])
def test_longest_first_matches_tokenizers(n1, n2, budget):
    """Our longest_first lengths are exactly what the tokenizers library keeps."""
    tok = _tokenizer(BERT_RERANKER)
    a = " ".join(["a"] * n1)
    b = " ".join(["b"] * n2)
    tok.enable_truncation(budget + 3, strategy="longest_first")
    enc = tok.encode(a, b)
    kept = (enc.sequence_ids.count(0), enc.sequence_ids.count(1))
    assert truncate_pair_lengths(n1, n2, budget) == kept


@pytest.mark.parametrize("folder", [BERT_RERANKER, BERT_CLASSIFIER])
@pytest.mark.parametrize("direction", ["right", "left"])
def test_bert_pair_ids_match_tokenizers(folder, direction):
    """Pair ids and token types equal the tokenizers library's own pair
    encoding with longest_first truncation, on every fixture pair."""
    tok = _tokenizer(folder)
    enc = PairEncoder(tok, segments_spec(tok, type_ids=True), 128)
    pairs = _json(os.path.join(folder, "pairs.json"))
    ids, types, before = enc.encode(pairs, truncation_direction=direction)
    ref = _tokenizer(folder)
    ref.enable_truncation(128, strategy="longest_first", direction=direction)
    full = _tokenizer(folder)
    truncated = 0
    for i, (q, d) in enumerate(pairs):
        e = ref.encode(q, d)
        assert ids[i] == e.ids, i
        assert types[i] == e.type_ids, i
        assert before[i] == len(full.encode(q, d).ids), i
        truncated += before[i] > 128
    assert truncated >= 5  # the fixture exercises truncation


def test_bert_reranker_matches_reference():
    model = _load(sequence_classification, BERT_RERANKER)
    assert model.labels == ["LABEL_0"]
    tok = _tokenizer(BERT_RERANKER)
    enc = PairEncoder(tok, segments_spec(tok, type_ids=True), 128)
    pairs = _json(os.path.join(BERT_RERANKER, "pairs.json"))
    ids, types, _ = enc.encode(pairs)
    # Mixed batches (padding) of 8.
    got = np.concatenate([_run(model, ids[i : i + 8], types[i : i + 8]) for i in range(0, len(ids), 8)])
    _assert_logits(got, np.load(os.path.join(BERT_RERANKER, "reference_pair_logits.npy")))
    scores = _sigmoid(got[:, 0])
    ref_scores = np.load(os.path.join(BERT_RERANKER, "reference_pair_scores.npy"))
    assert np.abs(scores - ref_scores).max() <= 1e-5
    # The reference really depends on the document: scores spread out.
    assert ref_scores.max() - ref_scores.min() > 0.5


def test_bert_reranker_needs_token_types():
    """Feeding type 0 everywhere gives clearly different logits: the fixture
    would catch a model that ignores the second segment's type."""
    model = _load(sequence_classification, BERT_RERANKER)
    tok = _tokenizer(BERT_RERANKER)
    enc = PairEncoder(tok, segments_spec(tok, type_ids=True), 128)
    pairs = _json(os.path.join(BERT_RERANKER, "pairs.json"))[:8]
    ids, types, _ = enc.encode(pairs)
    with_types = _run(model, ids, types)
    without = _run(model, ids, [[0] * len(t) for t in types])
    assert np.abs(with_types - without).max() > 1e-2


def test_bert_classifier_matches_reference():
    model = _load(sequence_classification, BERT_CLASSIFIER)
    assert model.labels == ["negative", "neutral", "positive"]
    tok = _tokenizer(BERT_CLASSIFIER)
    # Single texts: [CLS] text [SEP], types 0.
    texts = _json(os.path.join(FIXTURES, "golden", "minilm_texts.json"))
    single = tok.encode("x", add_special_tokens=True).ids
    content = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    ids = [[single[0]] + c[:126] + [single[-1]] for c in content]
    got = np.concatenate([_run(model, ids[i : i + 8]) for i in range(0, len(ids), 8)])
    _assert_logits(got, np.load(os.path.join(BERT_CLASSIFIER, "reference_text_logits.npy")))
    enc = PairEncoder(tok, segments_spec(tok, type_ids=True), 128)
    pairs = _json(os.path.join(BERT_CLASSIFIER, "pairs.json"))
    pids, ptypes, _ = enc.encode(pairs)
    got = np.concatenate([_run(model, pids[i : i + 8], ptypes[i : i + 8]) for i in range(0, len(pids), 8)])
    _assert_logits(got, np.load(os.path.join(BERT_CLASSIFIER, "reference_pair_logits.npy")))


def _qwen_encoder(tok, max_length=256):
    d = qwen3_reranker.RERANKER_DEFAULTS
    spec = template_spec(
        tok, prefix=d.prefix, suffix=d.suffix, template=d.template, default_instruction=d.default_instruction
    )
    return PairEncoder(tok, spec, max_length)


def test_qwen3_reranker_matches_reference():
    model = _load(qwen3_reranker, QWEN3_RERANKER)
    tok = _tokenizer(QWEN3_RERANKER)
    model.bind_tokenizer(tok.token_to_id)
    enc = _qwen_encoder(tok)
    pairs = _json(os.path.join(QWEN3_RERANKER, "pairs.json"))
    ids, types, before = enc.encode(pairs)
    assert types is None
    assert all(len(x) <= 256 for x in ids) and sum(b > 256 for b in before) >= 5
    # Every row ends with the prompt's suffix, truncated or not.
    assert all(x[-len(enc.spec.suffix_ids) :] == enc.spec.suffix_ids for x in ids)
    got = np.concatenate([_run(model, ids[i : i + 8]) for i in range(0, len(ids), 8)])
    _assert_logits(got, np.load(os.path.join(QWEN3_RERANKER, "reference_pair_logits.npy")))
    scores = _sigmoid(got[:, 0])
    ref = np.load(os.path.join(QWEN3_RERANKER, "reference_pair_scores.npy"))
    assert np.abs(scores - ref).max() <= 1e-5
    assert ref.max() - ref.min() > 0.5


def test_qwen3_reranker_untied_head_equals_tied():
    """A checkpoint with its own lm_head (Qwen3-Reranker-4B/8B) scores with
    that head's yes/no rows: the fixture's tied table saved as lm_head gives
    the same logits, and the full head is dropped after binding."""
    config = _json(os.path.join(QWEN3_RERANKER, "config.json"))
    weights = mx.load(os.path.join(QWEN3_RERANKER, "model.safetensors"))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    config["tie_word_embeddings"] = False
    untied = qwen3_reranker.Model(qwen3_reranker.ModelArgs.from_dict(config))
    untied.load_weights(list(untied.sanitize(weights).items()), strict=True)
    tok = _tokenizer(QWEN3_RERANKER)
    untied.bind_tokenizer(tok.token_to_id)
    assert "lm_head" not in untied
    tied = _load(qwen3_reranker, QWEN3_RERANKER)
    tied.bind_tokenizer(tok.token_to_id)
    ids, _, _ = _qwen_encoder(tok).encode(_json(os.path.join(QWEN3_RERANKER, "pairs.json"))[:6])
    np.testing.assert_allclose(_run(untied, ids), _run(tied, ids), rtol=0, atol=1e-6)


def test_qwen3_reranker_instruction_changes_the_text():
    tok = _tokenizer(QWEN3_RERANKER)
    enc = _qwen_encoder(tok)
    (a,), _, _ = enc.encode([["q", "d"]])
    (b,), _, _ = enc.encode([["q", "d"]], instruction="Find code")
    assert a != b
    text = tok.decode(b, skip_special_tokens=False)
    assert "<Instruct>: Find code\n<Query>: q\n<Document>: d" in text
    # Braces in a query are text, not format fields.
    (c,), _, _ = enc.encode([["{document}", "d"]])
    assert "<Query>: {document}\n" in tok.decode(c, skip_special_tokens=False)


def test_pair_encoder_rejects_bad_direction():
    tok = _tokenizer(BERT_RERANKER)
    enc = PairEncoder(tok, segments_spec(tok, type_ids=True), 128)
    with pytest.raises(ValueError, match="truncation_direction"):
        enc.encode([["a", "b"]], truncation_direction="middle")
