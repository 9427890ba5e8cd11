"""Cross-encoders against their transformers / sentence-transformers references.

Fixtures (tests/fixtures/tiny-*-reranker, tiny-bert-classifier) and how their
references were made: each folder's README and
scripts/fixtures/make_cross_encoders.py.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from tokenizers import Tokenizer

import mlx_embed
from mlx_embed.errors import InvalidInput
from conftest import assert_pairs_match_tokenizer, assert_reranker_matches, copy_fixture
from mlx_embed.pairs import truncate_pair_lengths

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
BERT_RERANKER = os.path.join(FIXTURES, "tiny-bert-reranker")
BERT_CLASSIFIER = os.path.join(FIXTURES, "tiny-bert-classifier")
QWEN3_RERANKER = os.path.join(FIXTURES, "tiny-qwen3-reranker")
XLMR_RERANKER = os.path.join(FIXTURES, "tiny-xlmr-reranker")
DEBERTA_RERANKER = os.path.join(FIXTURES, "tiny-deberta-v3-reranker")
DEBERTA_NLI = os.path.join(FIXTURES, "tiny-deberta-v2-nli")
MODERNBERT_RERANKER = os.path.join(FIXTURES, "tiny-modernbert-reranker")
DISTILBERT_CLASSIFIER = os.path.join(FIXTURES, "tiny-distilbert-classifier")
CAMEMBERT_RERANKER = os.path.join(FIXTURES, "tiny-camembert-reranker")
MPNET_RERANKER = os.path.join(FIXTURES, "tiny-mpnet-reranker")
ELECTRA_RERANKER = os.path.join(FIXTURES, "tiny-electra-reranker")
EUROBERT_SEQ_CLS = os.path.join(FIXTURES, "tiny-eurobert-seq-cls")
EUROBERT_LABELS = ["contradiction", "entailment", "neutral"]
QWEN3_ST6 = os.path.join(FIXTURES, "tiny-qwen3-reranker-st6")
QWEN3_SEQ_CLS = os.path.join(FIXTURES, "tiny-qwen3-seq-cls")
# transformers' generic decoder head on the other decoders: fixture -> the
# pair's prefix/middle/suffix ids, the model's max_length and how many
# fixture pairs it cuts (each README).
DECODER_SEQ_CLS = {
    "tiny-qwen2-seq-cls": (([], [], []), 256, 8),
    # Mistral-7B's "<s> A <s> B"; max_length its sliding window (128), not
    # the tokenizer's 256.
    "tiny-mistral-seq-cls": (([1], [1], []), 128, 8),
    # Gemma's "<bos> A <bos> B".
    "tiny-gemma2-seq-cls": (([2], [2], []), 256, 6),
    # Llama 3's "<|begin_of_text|> A <|begin_of_text|> B" (llama3 RoPE scaling).
    "tiny-llama-seq-cls": (([800], [800], []), 256, 8),
}
GOLDEN_TEXTS = os.path.join(FIXTURES, "golden", "minilm_texts.json")


def _json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _tokenizer(folder) -> Tokenizer:
    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return tok


_MODELS: dict = {}


def _model(folder, **kwargs):
    key = (folder, tuple(sorted(kwargs.items())))
    if key not in _MODELS:
        _MODELS[key] = mlx_embed.load(folder, **kwargs)
    return _MODELS[key]


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


@pytest.mark.parametrize("folder", [BERT_RERANKER, BERT_CLASSIFIER, XLMR_RERANKER, ELECTRA_RERANKER])
@pytest.mark.parametrize("direction", ["right", "left"])
def test_bert_pair_ids_match_tokenizers(folder, direction):
    """Pair ids and token types equal the tokenizers library's own pair
    encoding with longest_first truncation, on every fixture pair."""
    model = _model(folder)
    pairs = _json(os.path.join(folder, "pairs.json"))
    ids, types, before = model.encode_pairs(pairs, truncation_direction=direction)
    ref = _tokenizer(folder)
    ref.enable_truncation(128, strategy="longest_first", direction=direction)
    full = _tokenizer(folder)
    truncated = 0
    for i, (q, d) in enumerate(pairs):
        e = ref.encode(q, d)
        assert ids[i] == e.ids, i
        if types is None:  # XLM-RoBERTa: one token type, none sent
            assert set(e.type_ids) == {0}, i
        else:
            assert types[i] == e.type_ids, i
        assert before[i] == len(full.encode(q, d).ids), i
        truncated += before[i] > 128
    assert truncated >= 5  # the fixture exercises truncation


def test_kinds_and_specs():
    r, c, q = _model(BERT_RERANKER), _model(BERT_CLASSIFIER), _model(QWEN3_RERANKER)
    assert (r.kind, r.labels, r.dim) == ("reranker", ["LABEL_0"], 1)
    assert (c.kind, c.labels, c.dim) == ("classifier", ["negative", "neutral", "positive"], 3)
    assert (q.kind, q.labels, q.dim) == ("reranker", ["score"], 1)
    spec = r.spec()
    assert (spec.kind, spec.labels, spec.dim, spec.pooling) == ("reranker", ["LABEL_0"], 1, "none")
    p = spec.tokenizer.pair
    assert (p.prefix_ids, p.middle_ids, p.suffix_ids) == ([101], [102], [102])
    assert (p.first_type_id, p.second_type_id, p.template) == (0, 1, None)
    p = q.spec().tokenizer.pair
    # From the folder's chat template: the prompt cut at its added tokens.
    assert p.template == "user\n<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
    tok = _tokenizer(QWEN3_RERANKER)
    assert tok.decode(p.prefix_ids, skip_special_tokens=False).startswith("<|im_start|>system\nJudge")
    assert tok.decode(p.suffix_ids, skip_special_tokens=False) == (
        "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    # The embedding model next to them is unchanged.
    e = _model(os.path.join(FIXTURES, "tiny-qwen3"))
    assert (e.kind, e.labels, e.spec().kind) == ("embedding", [], "embedding")


def test_bert_reranker_matches_reference():
    # One call: the scheduler cuts it into padded sub-batches of mixed lengths.
    assert_reranker_matches(_model(BERT_RERANKER), BERT_RERANKER)


def test_xlmr_reranker_matches_reference():
    """bge-reranker style: RoBERTa head on <s>, positions from padding_idx + 1,
    <s> q </s></s> d </s>, no token types."""
    model = _model(XLMR_RERANKER)
    assert (model.kind, model.labels, model.model_type) == ("reranker", ["LABEL_0"], "xlm-roberta")
    pair = model.spec().tokenizer.pair
    assert (pair.prefix_ids, pair.middle_ids, pair.suffix_ids) == ([0], [2, 2], [2])
    assert (pair.first_type_id, pair.second_type_id) == (0, 0)
    assert_reranker_matches(model, XLMR_RERANKER)


def test_bert_reranker_needs_token_types():
    """Feeding type 0 everywhere gives clearly different logits: the fixture
    would catch a model that ignores the second segment's type."""
    model = _model(BERT_RERANKER)
    pairs = _json(os.path.join(BERT_RERANKER, "pairs.json"))[:8]
    ids, types, _ = model.encode_pairs(pairs)
    with_types = np.frombuffer(model.embed_ids(ids, types).vectors, dtype="<f4")
    without = np.frombuffer(model.embed_ids(ids).vectors, dtype="<f4")
    np.testing.assert_allclose(with_types, model.score(pairs, raw_scores=True)[:, 0], atol=1e-6)
    assert np.abs(with_types - without).max() > 1e-2


def test_rerank_orders_and_cuts():
    model = _model(BERT_RERANKER)
    pairs = _json(os.path.join(BERT_RERANKER, "pairs.json"))
    query = pairs[0][0]
    docs = [p[1] for p in pairs[:12]]
    scores = model.score([(query, d) for d in docs])[:, 0]
    ranked = model.rerank(query, docs)
    assert [i for i, _ in ranked] == sorted(range(len(docs)), key=lambda i: -scores[i])
    assert [s for _, s in ranked] == pytest.approx(sorted(scores, reverse=True), abs=1e-6)
    assert model.rerank(query, docs, top_n=3) == ranked[:3]
    raw = model.rerank(query, docs, raw_scores=True)
    assert [i for i, _ in raw] == [i for i, _ in ranked]
    with pytest.raises(InvalidInput, match="top_n"):
        model.rerank(query, docs, top_n=0)
    with pytest.raises(InvalidInput, match="not a reranker"):
        _model(BERT_CLASSIFIER).rerank(query, docs)
    with pytest.raises(TypeError, match="top_n must be a whole number, got 1.5"):
        model.rerank(query, docs, top_n=1.5)
    # The errors name the caller's own arguments (they named an internal `pairs`).
    with pytest.raises(TypeError, match="query must be a str, got NoneType"):
        model.rerank(None, docs)
    with pytest.raises(TypeError, match=r"documents\[1\] must be a str, got int"):
        model.rerank(query, ["a", 1])
    assert model.rerank(query, tuple(docs)) == ranked


def test_predict_refuses_what_is_not_a_list_of_texts_or_pairs():
    """``predict("ab")`` once scored "a" and "b" (a str is a sequence of
    characters); ``predict([1, 2])`` failed inside with "no len()"."""
    for path in (BERT_RERANKER, BERT_CLASSIFIER):
        model = _model(path)
        with pytest.raises(TypeError, match="inputs must be a list of texts or of \\(text, text\\) pairs, got str"):
            model.predict("ab")
        with pytest.raises(TypeError, match="inputs must be a list of texts or of \\(text, text\\) pairs"):
            model.predict([1, 2])
        with pytest.raises(TypeError, match="pairs"):
            model.predict([("a", "b", "c")])
    assert _model(BERT_CLASSIFIER).predict([("a", "b")]).shape == (1, 3)
    with pytest.raises(InvalidInput, match="is an embedding model, not a reranker"):
        mlx_embed.load().rerank("q", ["a"])
    reranker = _model(BERT_RERANKER)
    for call in (lambda: reranker.score([("q", "d")], raw_scores="no"),
                 lambda: reranker.predict([("q", "d")], truncate=None),
                 lambda: reranker.rerank("q", ["d"], raw_scores=1)):
        with pytest.raises(TypeError, match=r"(raw_scores|truncate) must be True or False, got"):
            call()


def test_bert_classifier_matches_reference():
    model = _model(BERT_CLASSIFIER)
    texts = _json(GOLDEN_TEXTS)
    ref = np.load(os.path.join(BERT_CLASSIFIER, "reference_text_logits.npy"))
    _assert_logits(model.predict(texts, raw_scores=True), ref)
    probs = model.predict(texts)
    e = np.exp(ref.astype(np.float64) - ref.max(axis=1, keepdims=True))
    assert np.abs(probs - e / e.sum(axis=1, keepdims=True)).max() <= 1e-5
    pairs = _json(os.path.join(BERT_CLASSIFIER, "pairs.json"))
    _assert_logits(
        model.predict(pairs, raw_scores=True),
        np.load(os.path.join(BERT_CLASSIFIER, "reference_pair_logits.npy")),
    )


def test_a_multi_label_classifier_scores_each_label_by_a_sigmoid(tmp_path):
    """config.json's problem_type multi_label_classification: independent
    labels, a sigmoid each, as transformers' text-classification pipeline
    scores them (its values below: transformers 5.24, pipeline(top_k=None),
    on this copy of the fixture, as scripts/fixtures/make_cross_encoders.py
    prints them)."""
    folder = copy_fixture("tiny-bert-classifier", tmp_path / "ml", problem_type="multi_label_classification")
    model = mlx_embed.load(str(folder))
    assert model.spec().multi_label and not _model(BERT_CLASSIFIER).spec().multi_label
    texts = ["I love this", "terrible", "the weather is fine today"]
    pipeline = np.array([
        [0.001631, 0.114224, 0.833630],
        [0.008765, 0.624707, 0.696207],
        [0.014571, 0.112457, 0.558742],
    ])
    assert model.labels == ["negative", "neutral", "positive"]
    probs = model.predict(texts)
    assert np.abs(probs - pipeline).max() <= 2e-6
    logits = model.predict(texts, raw_scores=True).astype(np.float64)
    assert np.abs(probs - 1 / (1 + np.exp(-logits))).max() <= 1e-6
    # Pairs too; a single-label classifier of the same weights still shares one softmax.
    pairs = _json(os.path.join(BERT_CLASSIFIER, "pairs.json"))
    assert (model.predict(pairs).sum(axis=1) > 1.001).any()
    single = _model(BERT_CLASSIFIER).predict(texts)
    assert np.abs(single.sum(axis=1) - 1).max() <= 1e-5


@pytest.mark.parametrize("folder", [MODERNBERT_RERANKER, DISTILBERT_CLASSIFIER])
def test_pairs_without_token_types_match_tokenizers(folder):
    """ModernBERT and DistilBERT have no token-type table: pairs are the
    tokenizer's own ids (longest_first at 128) and carry no types, though
    the tokenizer marks the second segment 1."""
    model = _model(folder)
    encs = assert_pairs_match_tokenizer(model, folder)
    assert model.encode_pairs([["a", "b"]])[1] is None
    p = model.spec().tokenizer.pair
    assert (p.first_type_id, p.second_type_id) == (0, 0)
    assert 1 in encs[0].type_ids


def test_modernbert_reranker_matches_reference():
    """gte-reranker-modernbert style: the classification head (dense, GELU,
    LayerNorm without bias, classifier) on the mean of the real tokens' last
    hidden states (`classifier_pooling: "mean"`), [CLS] q [SEP] d [SEP]."""
    model = _model(MODERNBERT_RERANKER)
    assert (model.kind, model.labels, model.model_type, model.dim) == ("reranker", ["LABEL_0"], "modernbert", 1)
    assert model.model.head.mean_pooling
    assert_reranker_matches(model, MODERNBERT_RERANKER)


def test_modernbert_reranker_cls_pooling(tmp_path):
    """The same weights with `classifier_pooling: "cls"`: [CLS] into the
    head, transformers' other branch (up to 5 units away from the mean's)."""
    import shutil

    d = tmp_path / "cls"
    shutil.copytree(MODERNBERT_RERANKER, d)
    cfg = _json(d / "config.json")
    cfg["classifier_pooling"] = "cls"
    (d / "config.json").write_text(json.dumps(cfg))
    model = mlx_embed.load(str(d))
    assert not model.model.head.mean_pooling
    pairs = _json(os.path.join(MODERNBERT_RERANKER, "pairs.json"))
    ref = np.load(os.path.join(MODERNBERT_RERANKER, "reference_pair_logits_cls.npy"))
    _assert_logits(model.score(pairs, raw_scores=True), ref)
    assert np.abs(ref - np.load(os.path.join(MODERNBERT_RERANKER, "reference_pair_logits.npy"))).max() > 1
    cfg["classifier_pooling"] = "max"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="classifier_pooling='max'"):
        mlx_embed.load(str(d))


def test_distilbert_classifier_matches_reference():
    """distilbert-sst-2 style: classifier(relu(pre_classifier([CLS]))) over
    two labels; texts and pairs, softmax probabilities; no token types."""
    model = _model(DISTILBERT_CLASSIFIER)
    assert (model.kind, model.labels, model.model_type, model.dim) == (
        "classifier", ["NEGATIVE", "POSITIVE"], "distilbert", 2)
    texts = _json(GOLDEN_TEXTS)
    ref = np.load(os.path.join(DISTILBERT_CLASSIFIER, "reference_text_logits.npy"))
    _assert_logits(model.predict(texts, raw_scores=True), ref)
    e = np.exp(ref.astype(np.float64) - ref.max(axis=1, keepdims=True))
    assert np.abs(model.predict(texts) - e / e.sum(axis=1, keepdims=True)).max() <= 1e-5
    # Both labels win often (the generator centres the head: 20 / 20 texts,
    # 18 / 25 pairs), so a swapped label order fails on most inputs.
    assert np.bincount(ref.argmax(axis=1), minlength=2).tolist() == [20, 20]
    pairs = _json(os.path.join(DISTILBERT_CLASSIFIER, "pairs.json"))
    pair_ref = np.load(os.path.join(DISTILBERT_CLASSIFIER, "reference_pair_logits.npy"))
    _assert_logits(model.predict(pairs, raw_scores=True), pair_ref)
    assert np.bincount(pair_ref.argmax(axis=1), minlength=2).tolist() == [18, 25]
    ids, _, _ = model.encode_pairs(pairs[:2])
    with pytest.raises(InvalidInput, match="type"):
        model.embed_ids(ids, [[1] * len(x) for x in ids])


def test_qwen3_reranker_matches_reference():
    model = _model(QWEN3_RERANKER)
    pairs = _json(os.path.join(QWEN3_RERANKER, "pairs.json"))
    ids, types, before = model.encode_pairs(pairs)
    suffix = model.spec().tokenizer.pair.suffix_ids
    assert types is None
    assert all(len(x) <= 256 for x in ids) and sum(b > 256 for b in before) >= 5
    # Every row ends with the prompt's suffix, truncated or not.
    assert all(x[-len(suffix) :] == suffix for x in ids)
    _assert_logits(
        model.score(pairs, raw_scores=True),
        np.load(os.path.join(QWEN3_RERANKER, "reference_pair_logits.npy")),
    )
    ref = np.load(os.path.join(QWEN3_RERANKER, "reference_pair_scores.npy"))
    assert np.abs(model.score(pairs)[:, 0] - ref).max() <= 1e-5
    assert ref.max() - ref.min() > 0.5


def test_qwen3_reranker_one_worker_equals_two():
    pairs = _json(os.path.join(QWEN3_RERANKER, "pairs.json"))
    one = _model(QWEN3_RERANKER, workers=1).score(pairs, raw_scores=True)
    two = _model(QWEN3_RERANKER, workers=2).score(pairs, raw_scores=True)
    np.testing.assert_allclose(one, two, rtol=0, atol=1e-5)


def test_qwen3_reranker_untied_head_equals_tied(tmp_path):
    """A checkpoint with its own lm_head (Qwen3-Reranker-4B/8B) scores with
    that head's yes/no rows: the fixture's tied table saved as lm_head gives
    the same logits, and the full head is dropped after loading."""
    import mlx.core as mx

    folder = tmp_path / "Qwen3-Reranker-untied"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes(open(os.path.join(QWEN3_RERANKER, name), "rb").read())
    config = _json(os.path.join(QWEN3_RERANKER, "config.json"))
    config["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(config))
    weights = mx.load(os.path.join(QWEN3_RERANKER, "model.safetensors"))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    untied = mlx_embed.load(str(folder))
    assert untied.kind == "reranker"
    assert "lm_head" not in untied.model
    pairs = _json(os.path.join(QWEN3_RERANKER, "pairs.json"))[:6]
    np.testing.assert_allclose(
        untied.score(pairs, raw_scores=True), _model(QWEN3_RERANKER).score(pairs, raw_scores=True),
        rtol=0, atol=1e-6,
    )


def test_qwen3_reranker_instruction_and_braces():
    model = _model(QWEN3_RERANKER)
    tok = _tokenizer(QWEN3_RERANKER)
    (a,), _, _ = model.encode_pairs([("q", "d")])
    (b,), _, _ = model.encode_pairs([("q", "d")], instruction="Find code")
    assert a != b
    assert "<Instruct>: Find code\n<Query>: q\n<Document>: d" in tok.decode(b, skip_special_tokens=False)
    # Braces in a query are text, not template fields.
    (c,), _, _ = model.encode_pairs([("{document}", "d")])
    assert "<Query>: {document}\n<Document>: d" in tok.decode(c, skip_special_tokens=False)
    with pytest.raises(InvalidInput, match="pairs, not single texts"):
        model.predict(["just a text"])


@pytest.mark.parametrize("folder", [QWEN3_RERANKER, QWEN3_ST6])
def test_template_reranker_instruction_must_leave_a_document_room(folder):
    """An instruction whose empty pair (instruction + the prompt's own
    text) takes the whole room left every document cut away whole, all
    scored alike: refused, both cut directions; one with room runs, and a
    long query beside it is the query's matter."""
    model = _model(folder)
    room = model.max_length - len(model.pair_encoder.spec.prefix_ids)
    if model.pair_encoder.spec.suffix_text is None:
        room -= len(model.pair_encoder.spec.suffix_ids)
    long = "find " * model.max_length
    for direction in ("right", "left"):
        with pytest.raises(InvalidInput, match=rf"leaves the documents no room within max_length "
                                               rf"{model.max_length} \(with the reranker's prompt it takes \d+ of the "
                                               rf"{room} tokens"):
            model.encode_pairs([("q", "d")], instruction=long, truncation_direction=direction)
        model.encode_pairs([("topic " * 400, "d")], instruction="find " * 20, truncation_direction=direction)
    # The model's own instruction is never refused.
    model.encode_pairs([("", "")])


def test_qwen3_reranker_cut_from_the_left_keeps_the_query():
    """Left truncation of a template pair cut the pair text's start: the
    instruction and the query went first, so every long document scored the
    same whatever the query. Now the document gives up its start."""
    model = _model(QWEN3_RERANKER)
    tok = _tokenizer(QWEN3_RERANKER)
    doc = " ".join(f"w{i}" for i in range(2000)) + " Paris"
    (ids,), _, before = model.encode_pairs([("capital of france", doc)], truncation_direction="left")
    assert len(ids) == model.max_length < before[0]
    text = tok.decode(ids, skip_special_tokens=False)
    assert "<Instruct>: Given a web search query" in text and "<Query>: capital of france\n<Document>:" in text
    assert "w0 " not in text and "w1999 Paris<|im_end|>" in text
    scores = model.score([("capital of france", doc), ("best pizza in town", doc)],
                         truncation_direction="left", raw_scores=True)[:, 0]
    assert scores[0] != scores[1]
    # A pair that fits is the same either way.
    short = [("q", "a short document")]
    assert model.encode_pairs(short, truncation_direction="left")[0] == model.encode_pairs(short)[0]


def test_kind_resolution(tmp_path):
    """Qwen3 is a reranker when asked or when named like one; a classifier
    folder loads as an embedding model when asked (its encoder:
    test_classifier_encoders.py); an embedding folder has no reranker head."""
    assert _model(os.path.join(FIXTURES, "tiny-qwen3"), kind="reranker").kind == "reranker"
    assert _model(QWEN3_RERANKER, kind="embedding").kind == "embedding"
    assert mlx_embed.load(BERT_RERANKER, kind="embedding").kind == "embedding"
    with pytest.raises(ValueError, match="3-label classifier"):
        mlx_embed.load(BERT_CLASSIFIER, kind="reranker")
    with pytest.raises(ValueError, match="no reranker head"):
        mlx_embed.load(None, kind="reranker")
    with pytest.raises(ValueError, match="kind must be one of"):
        mlx_embed.load(BERT_RERANKER, kind="scorer")


def test_bad_input():
    model = _model(BERT_RERANKER)
    with pytest.raises(InvalidInput, match="truncation_direction"):
        model.score([("a", "b")], truncation_direction="middle")
    with pytest.raises(InvalidInput, match="pair 0 has 2"):
        model.score([("word " * 100, "word " * 100)], truncate=False)
    with pytest.raises(TypeError, match=r"pairs\[1\]"):
        model.score([("a", "b"), ("only one",)])
    with pytest.raises(InvalidInput, match="embedding model"):
        _model(os.path.join(FIXTURES, "tiny-qwen3")).score([("a", "b")])
    with pytest.raises(InvalidInput, match="use predict"):
        model.embed(["a"])


# ------------------------------------------------------------ DeBERTa-v2 / v3


def test_deberta_log_buckets_match_transformers():
    """DeBERTa's log buckets equal transformers' make_log_bucket_position on
    distances -1023..1023, for the fixture's (16, 64), v3's (256, 512) and
    four more settings: every ceil boundary lands on the same side."""
    from mlx_embed.models.deberta_v2 import log_bucket_positions

    tables = np.load(os.path.join(DEBERTA_RERANKER, "reference_log_buckets.npz"))
    rel = np.arange(-1023, 1024)
    assert len(tables.files) == 6
    for key in tables.files:
        buckets, max_position = (int(x[1:]) for x in key.split("_"))
        np.testing.assert_array_equal(log_bucket_positions(rel, buckets, max_position), tables[key], err_msg=key)
        # The table really is log-spaced past buckets // 2 (so a linear
        # bucket function would fail it).
        assert tables[key].max() < 1023


def test_deberta_v3_reranker_matches_reference():
    """mxbai-rerank / DeBERTa-v3 style: log-bucketed relative positions,
    c2p + p2c with shared keys, no absolute positions, ContextPooler + GELU,
    [CLS] q [SEP] d [SEP]."""
    model = _model(DEBERTA_RERANKER)
    assert (model.kind, model.labels, model.model_type, model.max_length) == (
        "reranker", ["LABEL_0"], "deberta-v2", 128)
    pair = model.spec().tokenizer.pair
    assert (pair.prefix_ids, pair.middle_ids, pair.suffix_ids) == ([1], [2], [2])
    # The tokenizer marks the second segment 1; a model without a token-type
    # table (type_vocab_size 0) is sent none.
    assert set(_tokenizer(DEBERTA_RERANKER).encode("a", "b").type_ids) == {0, 1}
    assert (pair.first_type_id, pair.second_type_id) == (0, 0)
    assert_reranker_matches(model, DEBERTA_RERANKER, alone=(0, 3, 35, 40, 41, 42))


@pytest.mark.parametrize("folder", [DEBERTA_RERANKER, DEBERTA_NLI])
@pytest.mark.parametrize("direction", ["right", "left"])
def test_deberta_pair_ids_match_tokenizers(folder, direction):
    """Pair ids equal the tokenizers library's longest_first encoding; type
    ids go only to the model with a token-type table (the NLI fixture's)."""
    model = _model(folder)
    pairs = _json(os.path.join(folder, "pairs.json"))
    ids, types, before = model.encode_pairs(pairs, truncation_direction=direction)
    ref = _tokenizer(folder)
    ref.enable_truncation(128, strategy="longest_first", direction=direction)
    with_table = _json(os.path.join(folder, "config.json"))["type_vocab_size"] > 0
    assert (types is not None) == with_table
    for i, (q, d) in enumerate(pairs):
        e = ref.encode(q, d)
        assert ids[i] == e.ids, i
        if with_table:
            assert types[i] == e.type_ids, i
    assert sum(b > 128 for b in before) >= 5


def test_deberta_v2_nli_matches_reference():
    """The v2 switches v3 leaves off (absolute positions, token types,
    separate position projections, unbucketed distances clamped at
    max_relative_positions, embed_proj, the ConvLayer, "p2c|c2p" as a
    string, a tanh pooler), as a 3-label NLI classifier (nli-deberta-v3 style)."""
    model = _model(DEBERTA_NLI)
    assert (model.kind, model.labels) == ("classifier", ["contradiction", "entailment", "neutral"])
    pairs = _json(os.path.join(DEBERTA_NLI, "pairs.json"))
    ref = np.load(os.path.join(DEBERTA_NLI, "reference_pair_logits.npy"))
    _assert_logits(model.predict(pairs, raw_scores=True), ref)
    e = np.exp(ref.astype(np.float64) - ref.max(axis=1, keepdims=True))
    assert np.abs(model.predict(pairs) - e / e.sum(axis=1, keepdims=True)).max() <= 1e-5
    texts = _json(GOLDEN_TEXTS)
    _assert_logits(model.predict(texts, raw_scores=True),
                   np.load(os.path.join(DEBERTA_NLI, "reference_text_logits.npy")))
    # Its token types count: all zeros gives clearly different logits.
    ids, types, _ = model.encode_pairs(pairs[:8])
    with_types = np.frombuffer(model.embed_ids(ids, types).vectors, dtype="<f4").reshape(8, 3)
    without = np.frombuffer(model.embed_ids(ids).vectors, dtype="<f4").reshape(8, 3)
    _assert_logits(with_types, ref[:8])
    assert np.abs(with_types - without).max() > 1e-2
    # Three labels: not a reranker.
    with pytest.raises(ValueError, match="3-label classifier"):
        mlx_embed.load(DEBERTA_NLI, kind="reranker")


@pytest.mark.parametrize("folder", [DEBERTA_RERANKER, DEBERTA_NLI])
def test_deberta_bare_encoder_embeds(folder, tmp_path):
    """The same weights under architectures ["DebertaV2Model"] are an
    embedding model (mean pooling) matching transformers' DebertaV2Model."""
    for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        (tmp_path / name).write_bytes(open(os.path.join(folder, name), "rb").read())
    config = _json(os.path.join(folder, "config.json"))
    config["architectures"] = ["DebertaV2Model"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = mlx_embed.load(str(tmp_path))
    assert (model.kind, model.pooling, model.dim) == ("embedding", "mean", 64)
    texts = _json(GOLDEN_TEXTS)
    keep = [i for i, t in enumerate(texts) if t.strip()]
    got = np.asarray(model.embed([texts[i] for i in keep]))
    ref = np.load(os.path.join(folder, "reference_text_mean.npy"))[keep]
    assert (got * ref).sum(axis=1).min() >= 0.99999
    assert np.abs(got - ref).max() <= 1e-5


def _mutate_no(term):
    def apply(encoder):
        for layer in encoder.layers:
            setattr(layer.attention, term, False)
    return apply


def _mutate_scale(encoder):
    for layer in encoder.layers:
        layer.attention.scale = layer.attention.head_dim ** 0.5


def _mutate_unshared(encoder):
    # Position keys through the query projection and vice versa.
    for layer in encoder.layers:
        a = layer.attention
        a.share_att_key, a.pos_key_proj, a.pos_query_proj = False, a.query_proj, a.key_proj


@pytest.mark.parametrize(
    "mutate",
    [
        _mutate_no("p2c"),
        _mutate_no("c2p"),
        _mutate_scale,
        _mutate_unshared,
        lambda encoder: encoder.pop("rel_norm"),
        "linear buckets",
    ],
    ids=["no-p2c", "no-c2p", "scale-sqrt-d", "keys-swapped", "no-rel-layernorm", "linear-buckets"],
)
def test_deberta_reranker_fixture_catches(mutate, monkeypatch):
    """Each DeBERTa mistake the fixture is meant to catch moves some logit
    by far more than the parity tolerance."""
    from mlx_embed.models import deberta_v2

    model = mlx_embed.load(DEBERTA_RERANKER)
    if mutate == "linear buckets":
        monkeypatch.setattr(deberta_v2, "log_bucket_positions", lambda rel, b, m: np.asarray(rel))
    else:
        mutate(model.model.encoder)
    deberta_v2._relative_index.cache_clear()
    try:
        logits = model.score(_json(os.path.join(DEBERTA_RERANKER, "pairs.json")), raw_scores=True)
    finally:
        deberta_v2._relative_index.cache_clear()
    ref = np.load(os.path.join(DEBERTA_RERANKER, "reference_pair_logits.npy"))
    assert np.abs(logits - ref).max() > 0.5


def _mutate_no_conv(encoder):
    encoder.pop("conv")


def _mutate_pos_swapped(encoder):
    for layer in encoder.layers:
        a = layer.attention
        a.pos_key_proj, a.pos_query_proj = a.pos_query_proj, a.pos_key_proj


def _mutate_shared(encoder):
    for layer in encoder.layers:
        layer.attention.share_att_key = True


@pytest.mark.parametrize(
    "mutate", [_mutate_no_conv, _mutate_pos_swapped, _mutate_shared, "unmasked embeddings"],
    ids=["no-conv", "pos-projections-swapped", "shared-projections", "unmasked-embeddings"],
)
def test_deberta_nli_fixture_catches(mutate, monkeypatch):
    """The v2 switches: each mistake moves the batched logits well past tolerance."""
    import mlx.core as mx
    from mlx_embed.models import deberta_v2

    model = mlx_embed.load(DEBERTA_NLI)
    if mutate == "unmasked embeddings":
        # Padding rows left as they come out of the LayerNorm: the
        # convolution then reads them next to the last real tokens.
        embed = deberta_v2.Embeddings.__call__
        monkeypatch.setattr(deberta_v2.Embeddings, "__call__",
                            lambda self, ids, mask, types: embed(self, ids, mx.ones_like(mask), types))
    else:
        mutate(model.model.encoder)
    logits = model.score(_json(os.path.join(DEBERTA_NLI, "pairs.json")), raw_scores=True)
    ref = np.load(os.path.join(DEBERTA_NLI, "reference_pair_logits.npy"))
    assert np.abs(logits - ref).max() > 0.1


@pytest.mark.parametrize(
    "change,message",
    [
        ({"pos_att_type": ["c2p", "p2p"]}, "pos_att_type"),
        ({"norm_rel_ebd": "batch_norm"}, "norm_rel_ebd"),
        ({"conv_kernel_size": 4}, "conv_kernel_size"),
        ({"conv_kernel_size": 3, "conv_act": "mish"}, "conv_act"),
        ({"hidden_act": "silu"}, "hidden_act"),
        ({"pooler_hidden_act": "softplus"}, "pooler_hidden_act"),
        ({"attention_head_size": 32}, "attention_head_size"),
        ({"pooler_hidden_size": 32}, "pooler_hidden_size"),
    ],
)
def test_deberta_refuses_what_it_does_not_implement(change, message, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        (tmp_path / name).write_bytes(open(os.path.join(DEBERTA_RERANKER, name), "rb").read())
    config = {**_json(os.path.join(DEBERTA_RERANKER, "config.json")), **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        mlx_embed.load(str(tmp_path))


# -------------------------------------------------- RoBERTa-headed encoders


@pytest.mark.parametrize("folder", ["tiny-camembert-reranker", "tiny-mpnet-reranker"])
def test_camembert_and_mpnet_rerankers_match_reference(folder):
    """CamemBERT and MPNet cross-encoders: RoBERTa's head on <s>; they had
    loaded as embedding models with their head dropped (MPNet) or failed
    on the head's weights (CamemBERT)."""
    model = _model(os.path.join(FIXTURES, folder))
    assert (model.kind, model.labels) == ("reranker", ["LABEL_0"])
    assert_pairs_match_tokenizer(model, folder)
    assert_reranker_matches(model, folder)


# ------------------------------------------------------------------ ELECTRA


@pytest.mark.parametrize("fast_ops", ["native", "mlx", "exact"])
def test_electra_reranker_matches_reference(fast_ops):
    """ELECTRA cross-encoders (ms-marco-electra-base) were refused by name.
    The fixture's embeddings are narrower than its encoder (16 -> 32 through
    embeddings_project, after the embedding LayerNorm), its head is
    out_proj(gelu(dense([CLS]))) and its pairs carry token types."""
    model = _model(ELECTRA_RERANKER, fast_ops=fast_ops)
    assert model.context.path == fast_ops
    assert (model.kind, model.labels, model.dim) == ("reranker", ["LABEL_0"], 1)
    assert model.encode_pairs([("q", "d")])[1] == [[0, 0, 0, 1, 1]]
    assert_pairs_match_tokenizer(model, "tiny-electra-reranker")
    logits = assert_reranker_matches(model, "tiny-electra-reranker")
    print(f"max |diff| {np.abs(logits - np.load(os.path.join(ELECTRA_RERANKER, 'reference_pair_logits.npy'))).max():.2e}")


def test_electra_of_one_width_has_no_projection():
    """transformers builds embeddings_project only where embedding_size and
    hidden_size differ (the base and large models have none): neither do we,
    or a strict load of their checkpoints would miss its weights."""
    from mlx_embed.models import electra

    sizes = dict(hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=1)
    same = electra.Model(electra.ModelArgs(embedding_size=32, **sizes))
    narrow = electra.Model(electra.ModelArgs(embedding_size=16, **sizes))
    assert "embeddings_project" not in same and "embeddings_project" in narrow
    assert same.embeddings.word_embeddings.weight.shape == (30522, 32)
    assert narrow.embeddings.norm.weight.shape == (16,)


@pytest.mark.parametrize("act", ["tanh", "gelu_approx"])
def test_electra_head_activation_is_told_apart(act, monkeypatch):
    """RoBERTa's tanh where ELECTRA has GELU, or the tanh-approximate GELU
    for transformers' exact one, fails the references (README: off by 4.6
    and 1.7e-3)."""
    import mlx.core as mx
    import mlx.nn as nn

    from mlx_embed.models import sequence_classification

    fn = {"tanh": mx.tanh, "gelu_approx": nn.gelu_approx}[act]
    monkeypatch.setattr(sequence_classification.ElectraHead, "__call__",
                        lambda self, first: self.out_proj(fn(self.dense(first))))
    model = mlx_embed.load(ELECTRA_RERANKER)
    logits = model.score(_json(os.path.join(ELECTRA_RERANKER, "pairs.json")), raw_scores=True)
    ref = np.load(os.path.join(ELECTRA_RERANKER, "reference_pair_logits.npy"))
    assert np.abs(logits - ref).max() > 1e-3


def test_unsupported_classifiers_are_refused(tmp_path):
    """A *ForSequenceClassification the engine has no head for is refused
    by name instead of loading as an embedding model without its head."""
    albert = copy_fixture("tiny-bert-reranker", tmp_path / "albert",
                          architectures=["AlbertForSequenceClassification"])
    with pytest.raises(ValueError, match=r"AlbertForSequenceClassification is not a supported "
                                         r"cross-encoder or classifier \(supported: Bert"):
        mlx_embed.load(str(albert))
    qwen2 = copy_fixture("tiny-qwen2", tmp_path / "qwen2-seq-cls",
                         architectures=["Qwen2ForSequenceClassification"])
    for name in ("modules.json", "1_Pooling"):
        path = qwen2 / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    # A supported architecture named over a backbone without its head (a
    # Qwen2Model renamed): refused by the weight it lacks, not scored by a
    # random row as transformers would initialize one.
    with pytest.raises(ValueError, match=r"Qwen2ForSequenceClassification: the checkpoint has no "
                                         r"score.weight \(a classification head config.json names"):
        mlx_embed.load(str(qwen2))


def test_a_pair_type_the_model_has_no_row_for_is_refused_at_load(tmp_path):
    """type_vocab_size 1 beside a tokenizer that marks the document 1:
    every pair would fail (transformers too), so the load says so."""
    import mlx.core as mx

    folder = copy_fixture("tiny-bert-reranker", tmp_path / "one-type", type_vocab_size=1)
    weights = mx.load(str(folder / "model.safetensors"))
    name = next(k for k in weights if k.endswith("token_type_embeddings.weight"))
    weights[name] = weights[name][:1]
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    with pytest.raises(ValueError, match="token types 0 and 1, but config.json's type_vocab_size is 1"):
        mlx_embed.load(str(folder))


# ------------------------- a Qwen3 reranker as sentence-transformers 6 saves it


def _st6_copy(tmp_path, name="my-finetune", **score):
    """The ST 6 fixture under a name that does not say "reranker", its
    LogitScore config edited."""
    folder = tmp_path / name
    shutil.copytree(QWEN3_ST6, folder)
    if score:
        path = folder / "1_LogitScore" / "config.json"
        cfg = json.loads(path.read_text())
        cfg.update(score)
        path.write_text(json.dumps(cfg))
    return str(folder)


def test_qwen3_reranker_saved_by_st6_scores_with_its_own_tokens_and_prompt(tmp_path):
    """The folder's LogitScore tokens (not yes/no) and its chat template's
    prompt (another system line, a code-search instruction) are what
    sentence-transformers scores with; the model card's were used before,
    scores off by up to 10. A LogitScore makes the folder a reranker
    whatever it is called."""
    model = mlx_embed.load(_st6_copy(tmp_path))
    assert model.kind == "reranker"
    pairs = _json(os.path.join(QWEN3_ST6, "pairs.json"))
    assert len(pairs) >= 30
    _assert_logits(model.score(pairs, raw_scores=True),
                   np.load(os.path.join(QWEN3_ST6, "reference_pair_logits.npy")))
    _assert_logits(model.score(pairs, raw_scores=True, instruction="Find the passage that answers the question"),
                   np.load(os.path.join(QWEN3_ST6, "reference_instruction_logits.npy")))
    pair = model.spec().tokenizer.pair
    assert pair.default_instruction == "Given a code search query, retrieve code snippets that implement it"
    assert pair.template == "user\n<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
    tok = _tokenizer(QWEN3_ST6)
    assert tok.decode(pair.prefix_ids, skip_special_tokens=False) == (
        "<|im_start|>system\nJudge whether the Document answers the Query under the Instruct. "
        'Answer only "yes" or "no".<|im_end|>\n<|im_start|>')
    assert tok.decode(pair.suffix_ids, skip_special_tokens=False) == (
        "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_qwen3_st6_ids_are_cross_encoders_for_every_pair(tmp_path):
    """sentence-transformers 6's CrossEncoder ids for all 43 shared pairs, the
    8 over the 256-token limit included (the render cut, its tail written
    back over the end), with the default and an explicit instruction."""
    refs = _json(os.path.join(QWEN3_ST6, "reference_input_ids.json"))
    model = mlx_embed.load(_st6_copy(tmp_path))
    pairs = [tuple(p) for p in refs["pairs"]]
    assert len(pairs) == 43
    for key, instruction in (("default", None), ("instruction", "Find the passage that answers the question")):
        ids, _, before = model.encode_pairs(pairs, instruction=instruction)
        for k, (got, want) in enumerate(zip(ids, refs[key])):
            assert got == want, (key, k)
        assert sum(n > model.max_length for n in before) == 8


def test_qwen3_st6_true_token_alone_and_bad_ids(tmp_path):
    """false_token_id null: the true token's logit alone is the score."""
    pairs = _json(os.path.join(QWEN3_ST6, "pairs.json"))
    alone = mlx_embed.load(_st6_copy(tmp_path, "true-only", false_token_id=None))
    _assert_logits(alone.score(pairs, raw_scores=True),
                   np.load(os.path.join(QWEN3_ST6, "reference_true_logits.npy")))
    with pytest.raises(ValueError, match=r"score token id 99999 is outside the vocabulary \(0\.\.1201\)"):
        mlx_embed.load(_st6_copy(tmp_path, "far", true_token_id=99999))
    with pytest.raises(ValueError, match="true_token_id must be a token id"):
        mlx_embed.load(_st6_copy(tmp_path, "missing", true_token_id=None))


def test_a_logit_score_folder_on_another_decoder_is_refused(tmp_path):
    folder = tmp_path / "mistral-logit-score"
    shutil.copytree(os.path.join(FIXTURES, "tiny-mistral"), folder)
    shutil.copytree(os.path.join(QWEN3_ST6, "1_LogitScore"), folder / "1_LogitScore")
    shutil.copy(os.path.join(QWEN3_ST6, "modules.json"), folder / "modules.json")
    with pytest.raises(ValueError, match="LogitScore reranker on model_type 'mistral'; yes/no "
                                         "rerankers are supported on qwen3, qwen2"):
        mlx_embed.load(str(folder))


MARKED_PAIR = (
    "<|im_start|>system\nJudge.<|im_end|>\n<|im_start|>user\n"
    "{% if instruction is defined %}<Instruct>: {{ instruction }}\n{% endif %}"
    "<Query>: {{ (messages | selectattr('role', 'eq', 'query') | first).content }}\n"
    "<Document>: {{ (messages | selectattr('role', 'eq', 'document') | first).content }}"
    "<|im_end|>\n<|im_start|>assistant\n"
)
ADDED = ["<|im_start|>", "<|im_end|>"]


def test_chat_templates_that_do_not_carry_a_pair():
    """Qwen's own chat template (no query/document roles) keeps the card's
    prompt; one that renders a single role is refused; an instruction
    written only when given makes a prompt without one."""
    from mlx_embed.reranker_prompt import pair_prompt

    chatml = ("{% for m in messages %}{% if m.role in ['user', 'assistant'] %}<|im_start|>{{ m.role }}\n"
              "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}")
    assert pair_prompt(chatml, ADDED, {}) is None
    assert pair_prompt("{{ raise_exception('No user query found in messages.') }}", ADDED, {}) is None
    assert pair_prompt("{% generation %}x{% endgeneration %}", ADDED, {}) is None
    query_only = "<|im_start|>user\n{{ (messages | selectattr('role', 'eq', 'query') | first).content }}"
    with pytest.raises(ValueError, match="the query 1 and the document 0 times"):
        pair_prompt(query_only, ADDED, {})
    parts = pair_prompt(MARKED_PAIR, ADDED, {})
    assert parts == {
        "prefix": "<|im_start|>system\nJudge.<|im_end|>\n<|im_start|>",
        "template": "user\n<Query>: {query}\n<Document>: {document}",
        # Jinja drops a template's last newline, as in transformers.
        "suffix": "<|im_end|>\n<|im_start|>assistant",
        "default_instruction": None,
    }
    literal = MARKED_PAIR.replace("<Query>: ", "<Query>: {query} ")
    with pytest.raises(ValueError, match="literal"):
        pair_prompt(literal, ADDED, {})


def test_a_prompt_without_an_instruction_refuses_one(tmp_path):
    folder = _st6_copy(tmp_path, "no-instruction")
    with open(os.path.join(folder, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(MARKED_PAIR)
    model = mlx_embed.load(folder)
    (ids,), _, _ = model.encode_pairs([("q", "d")])
    assert _tokenizer(QWEN3_ST6).decode(ids, skip_special_tokens=False) == (
        "<|im_start|>system\nJudge.<|im_end|>\n<|im_start|>user\n<Query>: q\n<Document>: d"
        "<|im_end|>\n<|im_start|>assistant")
    with pytest.raises(InvalidInput, match="takes no instruction"):
        model.score([("q", "d")], instruction="x")


TAILED = (
    "<|im_start|>system\nJudge.<|im_end|>\n<|im_start|>user\n\n"
    "<Query>: {{ (messages | selectattr('role', 'eq', 'query') | first).content }}\n"
    "<Document>: {{ (messages | selectattr('role', 'eq', 'document') | first).content }}\n"
    "Is the document relevant?<|im_end|>\n<|im_start|>assistant\n\n"
)


def test_a_template_pair_has_its_whole_renders_ids_and_keeps_its_tail(tmp_path):
    """A blank line after the role ("user\\n\\n") was cut between the prefix
    and the pair text, so "\\n" + "\\n" replaced the whole render's "\\n\\n"
    token; text after the document ("Is the document relevant?") was cut
    away with a long document's end, where sentence-transformers keeps it."""
    folder = _st6_copy(tmp_path, "tailed")
    with open(os.path.join(folder, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(TAILED)
    model = mlx_embed.load(folder)
    tok = _tokenizer(QWEN3_ST6)

    def render(q, d):  # Jinja drops the template's last newline
        return TAILED[:-1].replace(
            "{{ (messages | selectattr('role', 'eq', 'query') | first).content }}", q).replace(
            "{{ (messages | selectattr('role', 'eq', 'document') | first).content }}", d)

    pairs = [("q", "d"), ("what is the capital of france", "Paris is the capital."), ("\nhi", " x ")]
    ids, _, _ = model.encode_pairs(pairs)
    for got, (q, d) in zip(ids, pairs):
        assert got == tok.encode(render(q, d), add_special_tokens=False).ids, (q, d)
    (cut,), _, before = model.encode_pairs([("q", "word " * 400)])
    tail = tok.encode("\nIs the document relevant?<|im_end|>\n<|im_start|>assistant\n",
                      add_special_tokens=False).ids
    assert len(cut) == model.max_length < before[0]
    assert cut[-len(tail):] == tail


# ------------------- Qwen3ForSequenceClassification (Qwen3-Reranker-*-seq-cls)


def test_qwen3_seq_cls_matches_reference():
    """tiny-qwen3-reranker converted as Qwen3-Reranker-*-seq-cls are (score =
    lm_head[yes] - lm_head[no]): its pair is the tokenizer's pair encoding,
    query ids then document ids with no special token and no EOS, cut
    longest-first (8 pairs are), and the score is read at the last token,
    as transformers and sentence-transformers' CrossEncoder do."""
    model = _model(QWEN3_SEQ_CLS)
    assert (model.kind, model.labels, model.dim) == ("reranker", ["LABEL_0"], 1)
    p = model.spec().tokenizer.pair
    assert (p.prefix_ids, p.middle_ids, p.suffix_ids, p.template) == ([], [], [], None)
    assert_pairs_match_tokenizer(model, "tiny-qwen3-seq-cls", max_len=256)
    assert_reranker_matches(model, "tiny-qwen3-seq-cls")


def test_qwen3_seq_cls_scores_the_last_token_that_is_not_the_pad_id(tmp_path):
    """transformers scores the rightmost token that is not pad_token_id: a
    text that ends with the pad token's text (<|endoftext|>, the pad id) is
    scored before it, one that holds it inside at its last token."""
    pairs = _json(os.path.join(QWEN3_SEQ_CLS, "pad_pairs.json"))
    ref = np.load(os.path.join(QWEN3_SEQ_CLS, "reference_pad_logits.npy"))
    model = _model(QWEN3_SEQ_CLS)
    _assert_logits(model.score(pairs, raw_scores=True), ref)
    for i, pair in enumerate(pairs):
        _assert_logits(model.score([pair], raw_scores=True), ref[i : i + 1])
    # The fixture tells the rule from the last real token's: without a pad
    # id (transformers then takes the last position) the pairs that end
    # with it score otherwise, the others the same.
    folder = copy_fixture("tiny-qwen3-seq-cls", tmp_path / "no-pad-id", pad_token_id=None)
    last = mlx_embed.load(str(folder)).score(pairs, raw_scores=True)
    assert np.abs(last[[0, 2]] - ref[[0, 2]]).min() > 0.1
    _assert_logits(last[[1, 4]], ref[[1, 4]])


@pytest.mark.parametrize("name", ["tiny-qwen3-seq-cls", *DECODER_SEQ_CLS])
def test_decoder_seq_cls_as_a_three_label_classifier(tmp_path, name):
    """The same backbone with three score rows (num_labels 3, id2label):
    a classifier whose logits are transformers' own, a cut pair's too."""
    import mlx.core as mx

    src = os.path.join(FIXTURES, name)
    labels = ["negative", "neutral", "positive"]
    folder = copy_fixture(name, tmp_path / "classifier", num_labels=3,
                          id2label={str(i): v for i, v in enumerate(labels)},
                          label2id={v: i for i, v in enumerate(labels)})
    weights = mx.load(str(folder / "model.safetensors"))
    weights["score.weight"] = mx.array(np.load(os.path.join(src, "classifier_score.npy")))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    model = mlx_embed.load(str(folder))
    assert (model.kind, model.labels, model.dim) == ("classifier", labels, 3)
    pairs = _json(os.path.join(src, "pairs.json"))
    ref = np.load(os.path.join(src, "reference_classifier_logits.npy"))
    # A row's three logits share one hidden state, so float32's error scales
    # with the row's largest logit (~10), not with each: 1e-5 of that
    # (transformers' own float32 is 3.6e-6 of it on tiny-qwen2-seq-cls, and
    # 1 of its 129 logits misses rtol 1e-5 + atol 1e-5). 1.1e-5 for
    # tiny-qwen2-seq-cls's pair 36, the most sensitive: 0.89 of 1e-5 with
    # OpenBLAS's sums, 1.08 with the native kernel's (k order, the CPU's
    # default path: batch-invariant), 1.05-1.16 with the reference BLAS.
    for got, want in ((model.predict(pairs, raw_scores=True), ref),
                      # Pair 41: the over-long query, both sides cut.
                      (model.predict([pairs[41]], raw_scores=True), ref[41:42])):
        assert got.shape == want.shape
        bound = 1.1e-5 * np.maximum(1.0, np.abs(want).max(axis=1))
        assert (np.abs(got - want).max(axis=1) <= bound).all(), np.abs(got - want).max(axis=1) / bound
    with pytest.raises(ValueError, match="3-label classifier; a reranker has one label"):
        mlx_embed.load(str(folder), kind="reranker")


def _card_template() -> str:
    return _json(os.path.join(QWEN3_RERANKER, "tokenizer_config.json"))["chat_template"]


def test_qwen3_seq_cls_writes_a_pair_into_a_chat_template_with_its_roles(tmp_path):
    """sentence-transformers 6.2 renders a cross-encoder's pair through the
    folder's chat template where it renders the query and document roles
    (the card's prompt here: the scores are then tiny-qwen3-reranker's);
    a folder it saved pins the text modality and never renders; a template
    without the roles (Qwen3's own) leaves the tokenizer's pair encoding."""
    folder = tmp_path / "templated"
    shutil.copytree(QWEN3_SEQ_CLS, folder)
    (folder / "chat_template.jinja").write_text(_card_template())
    model = mlx_embed.load(str(folder))
    assert model.spec().tokenizer.pair.template == (
        "user\n<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
    )
    pairs = _json(os.path.join(QWEN3_SEQ_CLS, "template_pairs.json"))
    _assert_logits(model.score(pairs, raw_scores=True),
                   np.load(os.path.join(QWEN3_SEQ_CLS, "reference_template_logits.npy")))

    plain = np.load(os.path.join(QWEN3_SEQ_CLS, "reference_pair_logits.npy"))
    all_pairs = _json(os.path.join(QWEN3_SEQ_CLS, "pairs.json"))
    for name in os.listdir(os.path.join(QWEN3_SEQ_CLS, "st6-saved")):
        shutil.copy(os.path.join(QWEN3_SEQ_CLS, "st6-saved", name), folder / name)
    saved = mlx_embed.load(str(folder))
    assert saved.kind == "reranker" and saved.spec().tokenizer.pair.template is None
    _assert_logits(saved.score(all_pairs, raw_scores=True), plain)

    roleless = tmp_path / "roleless"
    shutil.copytree(QWEN3_SEQ_CLS, roleless)
    (roleless / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
        "{% endif %}{% endfor %}"
    )
    model = mlx_embed.load(str(roleless))
    assert model.spec().tokenizer.pair.template is None
    _assert_logits(model.score(all_pairs[:8], raw_scores=True), plain[:8])


def test_a_cross_encoder_reads_its_modality_only_where_sentence_transformers_saved_it(tmp_path):
    """sentence-transformers 6.2 reads sentence_bert_config.json only beside
    a modules.json: there a missing modality_config is text only (a folder
    saved before chat messages), so the pair takes the tokenizer's pair
    encoding; without modules.json the file is not read and the template's
    roles decide."""
    plain = np.load(os.path.join(QWEN3_SEQ_CLS, "reference_pair_logits.npy"))
    pairs = _json(os.path.join(QWEN3_SEQ_CLS, "pairs.json"))[:8]
    old_save = tmp_path / "saved-without-modality"
    shutil.copytree(QWEN3_SEQ_CLS, old_save)
    (old_save / "chat_template.jinja").write_text(_card_template())
    shutil.copy(os.path.join(QWEN3_SEQ_CLS, "st6-saved", "modules.json"), old_save / "modules.json")
    (old_save / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 256, "transformer_task": "sequence-classification"}))
    model = mlx_embed.load(str(old_save))
    assert model.spec().tokenizer.pair.template is None
    _assert_logits(model.score(pairs, raw_scores=True), plain[:8])

    stray = tmp_path / "stray-config"
    shutil.copytree(QWEN3_SEQ_CLS, stray)
    (stray / "chat_template.jinja").write_text(_card_template())
    shutil.copy(os.path.join(QWEN3_SEQ_CLS, "st6-saved", "sentence_bert_config.json"),
                stray / "sentence_bert_config.json")
    model = mlx_embed.load(str(stray))
    assert model.spec().tokenizer.pair.template is not None
    _assert_logits(model.score(_json(os.path.join(QWEN3_SEQ_CLS, "template_pairs.json")), raw_scores=True),
                   np.load(os.path.join(QWEN3_SEQ_CLS, "reference_template_logits.npy")))


def test_qwen3_seq_cls_as_an_embedding_model_drops_the_score():
    model = mlx_embed.load(QWEN3_SEQ_CLS, kind="embedding")
    assert (model.kind, model.dim) == ("embedding", 64)
    assert model.embed(["a text"]).shape == (1, 64)


# ------- Qwen2 / Mistral / Gemma 2 / Llama *ForSequenceClassification (transformers' generic decoder head)


@pytest.mark.parametrize("name", DECODER_SEQ_CLS)
def test_decoder_seq_cls_matches_reference(name):
    """Each decoder's pair is its tokenizer's pair encoding (Qwen's adds
    nothing, Mistral's and Gemma's a BOS before each text, no EOS), cut
    longest-first at the model's limit, and the score is read where
    transformers reads it; one batch and pairs alone agree."""
    (prefix, middle, suffix), max_length, cut = DECODER_SEQ_CLS[name]
    model = _model(os.path.join(FIXTURES, name))
    assert (model.kind, model.labels, model.dim, model.max_length) == ("reranker", ["LABEL_0"], 1, max_length)
    p = model.spec().tokenizer.pair
    assert (p.prefix_ids, p.middle_ids, p.suffix_ids, p.template) == (prefix, middle, suffix, None)
    assert_pairs_match_tokenizer(model, name, max_len=max_length, cut=cut)
    assert_reranker_matches(model, name)


@pytest.mark.parametrize("name", ["tiny-qwen2-seq-cls", "tiny-gemma2-seq-cls", "tiny-llama-seq-cls"])
def test_decoder_seq_cls_scores_the_last_token_that_is_not_the_pad_id(tmp_path, name):
    """As for Qwen3: the rightmost token that is not pad_token_id (Qwen2's
    <|endoftext|>, Gemma's <pad>, Llama 3.1's <|finetune_right_pad_id|>) is scored, in a batch and alone; without
    a pad id the last token is, which the fixture's pairs tell apart."""
    src = os.path.join(FIXTURES, name)
    pairs = _json(os.path.join(src, "pad_pairs.json"))
    ref = np.load(os.path.join(src, "reference_pad_logits.npy"))
    model = _model(src)
    _assert_logits(model.score(pairs, raw_scores=True), ref)
    for i, pair in enumerate(pairs):
        _assert_logits(model.score([pair], raw_scores=True), ref[i : i + 1])
    folder = copy_fixture(name, tmp_path / "no-pad-id", pad_token_id=None)
    last = mlx_embed.load(str(folder)).score(pairs, raw_scores=True)
    assert np.abs(last[[0, 2]] - ref[[0, 2]]).min() > 0.1
    _assert_logits(last[[1, 4]], ref[[1, 4]])


def test_mistral_seq_cls_without_a_pad_id_scores_each_row_at_its_last_token(tmp_path):
    """Mistral's config has pad_token_id null (and its tokenizer no pad
    token): transformers then scores position -1 and refuses batches of
    more than one. The engine scores each padded row at its last real
    token, which is that pair alone, whatever the token (</s>, <unk>)."""
    src = os.path.join(FIXTURES, "tiny-mistral-seq-cls")
    assert _json(os.path.join(src, "config.json"))["pad_token_id"] is None
    pairs = _json(os.path.join(src, "pad_pairs.json"))
    ref = np.load(os.path.join(src, "reference_pad_logits.npy"))
    model = _model(src)
    _assert_logits(model.score(pairs, raw_scores=True), ref)
    _assert_logits(model.score(pairs[:1], raw_scores=True), ref[:1])
    # With </s> as the pad id (as some Mistral reward models set it) the
    # pairs that end with it are scored before it.
    eos_pad = mlx_embed.load(str(copy_fixture("tiny-mistral-seq-cls", tmp_path / "eos-pad", pad_token_id=2)))
    moved = eos_pad.score(pairs, raw_scores=True)
    assert np.abs(moved[[0, 3]] - ref[[0, 3]]).min() > 0.1
    _assert_logits(moved[[2]], ref[[2]])


def test_mistral_seq_cls_is_cut_at_its_sliding_window(tmp_path):
    """Inside sliding_window tokens Mistral's attention is full causal
    attention (models/mistral.py): the classifier's max_length is the
    window (128), below the tokenizer's 256, and a longer one is refused;
    with no window the tokenizer's limit holds."""
    src = os.path.join(FIXTURES, "tiny-mistral-seq-cls")
    assert _json(os.path.join(src, "config.json"))["sliding_window"] == 128
    assert _json(os.path.join(src, "tokenizer_config.json"))["model_max_length"] == 256
    model = _model(src)
    pairs = _json(os.path.join(src, "pairs.json"))
    ids, _, before = model.encode_pairs(pairs)
    assert max(len(i) for i in ids) == 128 and max(before) > 256
    with pytest.raises(ValueError, match="max_length 200 > the 128 positions"):
        mlx_embed.load(src, max_length=200)
    full = mlx_embed.load(str(copy_fixture("tiny-mistral-seq-cls", tmp_path / "no-window", sliding_window=None)))
    assert full.max_length == 256


def test_gemma2_seq_cls_score_is_not_soft_capped(tmp_path):
    """transformers applies final_logit_softcapping (30) to Gemma2ForCausalLM's
    LM head only: Gemma2ForSequenceClassification's score is raw. The
    fixture's logits are wide enough for 30 * tanh(x / 30) to show, and a
    config without the cap scores the same."""
    src = os.path.join(FIXTURES, "tiny-gemma2-seq-cls")
    cfg = _json(os.path.join(src, "config.json"))
    assert (cfg["final_logit_softcapping"], cfg["attn_logit_softcapping"]) == (30.0, 4.0)
    ref = np.load(os.path.join(src, "reference_pair_logits.npy"))
    assert np.abs(30.0 * np.tanh(ref / 30.0) - ref).max() > 0.2
    pairs = _json(os.path.join(src, "pairs.json"))
    uncapped = mlx_embed.load(str(copy_fixture("tiny-gemma2-seq-cls", tmp_path / "no-cap",
                                               final_logit_softcapping=None)))
    _assert_logits(uncapped.score(pairs, raw_scores=True), ref)


def test_qwen2_seq_cls_is_a_classifier_before_a_reranker_name_or_a_roleless_template(tmp_path):
    """A Qwen2ForSequenceClassification folder named like mxbai-rerank v2
    (vLLM's conversions keep the name) is scored by its score row, not as
    the "1"/"0" decoder reranker; Qwen2.5's chat template, which renders
    neither the query nor the document role, leaves the tokenizer's pair
    encoding."""
    src = os.path.join(FIXTURES, "tiny-qwen2-seq-cls")
    folder = tmp_path / "mxbai-rerank-base-v2-seq-cls"
    shutil.copytree(src, folder)
    tc = _json(os.path.join(FIXTURES, "tiny-mxbai-rerank-v2", "tokenizer_config.json"))
    (folder / "chat_template.jinja").write_text(tc["chat_template"])
    model = mlx_embed.load(str(folder))
    assert (model.kind, model.labels, model.spec().tokenizer.pair.template) == ("reranker", ["LABEL_0"], None)
    pairs = _json(os.path.join(src, "pairs.json"))[:8]
    _assert_logits(model.score(pairs, raw_scores=True), np.load(os.path.join(src, "reference_pair_logits.npy"))[:8])


@pytest.mark.parametrize("name", ["tiny-qwen3-seq-cls", *DECODER_SEQ_CLS])
def test_decoder_seq_cls_whose_labels_do_not_fit_the_score_is_refused(tmp_path, name):
    """num_labels 3 over a one-row score: refused at load, naming the
    weight, both shapes and where the label count came from."""
    hidden = _json(os.path.join(FIXTURES, name, "config.json"))["hidden_size"]
    folder = copy_fixture(name, tmp_path / "bad", num_labels=3, id2label=None, label2id=None)
    arch = _json(os.path.join(FIXTURES, name, "config.json"))["architectures"][0]
    with pytest.raises(ValueError, match=(
            rf"{arch}: the checkpoint's score.weight has shape \(1, {hidden}\), config.json's layout wants "
            rf"\(3, {hidden}\) \(3 label\(s\) from num_labels/id2label")):
        mlx_embed.load(str(folder))


@pytest.mark.parametrize("name", DECODER_SEQ_CLS)
def test_decoder_seq_cls_as_an_embedding_model_drops_the_score(name):
    hidden = _json(os.path.join(FIXTURES, name, "config.json"))["hidden_size"]
    model = mlx_embed.load(os.path.join(FIXTURES, name), kind="embedding")
    assert (model.kind, model.dim) == ("embedding", hidden)
    assert model.embed(["a text"]).shape == (1, hidden)


def test_eurobert_seq_cls_matches_reference():
    """EuroBertForSequenceClassification (late pooling: the head on every
    token, its logits averaged over the real ones): pairs as the tokenizer's
    pair template writes them (BOS q EOS BOS d EOS, longest_first at 256, no
    token types), texts alone, raw logits and the softmax; each pair alone
    scores as in the batch."""
    model = _model(EUROBERT_SEQ_CLS)
    assert (model.kind, model.labels, model.model_type, model.dim) == (
        "classifier", EUROBERT_LABELS, "eurobert", 3)
    assert model.model.head.pooling == "late"
    encs = assert_pairs_match_tokenizer(model, EUROBERT_SEQ_CLS, max_len=256, cut=8)
    assert all(e.ids[0] == 800 and e.ids[-1] == 801 and e.ids.count(800) == 2 for e in encs)
    assert model.encode_pairs([["a", "b"]])[1] is None
    pairs = _json(os.path.join(EUROBERT_SEQ_CLS, "pairs.json"))
    ref = np.load(os.path.join(EUROBERT_SEQ_CLS, "reference_pair_logits.npy"))
    got = model.predict(pairs, raw_scores=True)
    _assert_logits(got, ref)
    for i in (0, 3, 35, 40, 41):
        assert np.abs(model.predict([pairs[i]], raw_scores=True)[0] - got[i]).max() <= 1e-5
    texts = _json(GOLDEN_TEXTS)
    text_ref = np.load(os.path.join(EUROBERT_SEQ_CLS, "reference_text_logits.npy"))
    _assert_logits(model.predict(texts, raw_scores=True), text_ref)
    e = np.exp(text_ref.astype(np.float64) - text_ref.max(axis=1, keepdims=True))
    assert np.abs(model.predict(texts) - e / e.sum(axis=1, keepdims=True)).max() <= 1e-5


@pytest.mark.parametrize("pooling", ["bos", "mean"])
def test_eurobert_seq_cls_other_poolings(pooling, tmp_path):
    """The same weights with classifier_pooling bos / mean: transformers'
    other branches (up to several units from late's)."""
    d = copy_fixture("tiny-eurobert-seq-cls", tmp_path / pooling, classifier_pooling=pooling)
    model = mlx_embed.load(str(d))
    assert model.model.head.pooling == pooling
    pairs = _json(os.path.join(EUROBERT_SEQ_CLS, "pairs.json"))
    ref = np.load(os.path.join(EUROBERT_SEQ_CLS, f"reference_pair_logits_{pooling}.npy"))
    _assert_logits(model.predict(pairs, raw_scores=True), ref)
    assert np.abs(ref - np.load(os.path.join(EUROBERT_SEQ_CLS, "reference_pair_logits.npy"))).max() > 1


def test_eurobert_seq_cls_pooling_keys(tmp_path):
    """transformers 5 reads classifier_pooling only: where it is set, the
    remote code's clf_pooling beside it is not read; a folder with only
    clf_pooling, set to another pooling than late (what transformers would
    run), is refused by name, as is a pooling transformers does not have.
    The remote code's older head name (out_proj) is a head the checkpoint
    lacks."""
    both = copy_fixture("tiny-eurobert-seq-cls", tmp_path / "both", clf_pooling="bos")
    assert mlx_embed.load(str(both)).model.head.pooling == "late"
    legacy = copy_fixture("tiny-eurobert-seq-cls", tmp_path / "legacy", classifier_pooling=None, clf_pooling="bos")
    with pytest.raises(ValueError, match="clf_pooling='bos'.*no classifier_pooling"):
        mlx_embed.load(str(legacy))
    late = copy_fixture("tiny-eurobert-seq-cls", tmp_path / "late", classifier_pooling=None)
    assert mlx_embed.load(str(late)).model.head.pooling == "late"
    bad = copy_fixture("tiny-eurobert-seq-cls", tmp_path / "max", classifier_pooling="max")
    with pytest.raises(ValueError, match="classifier_pooling='max' is not supported"):
        mlx_embed.load(str(bad))
    import mlx.core as mx

    old = copy_fixture("tiny-eurobert-seq-cls", tmp_path / "out_proj")
    w = mx.load(str(old / "model.safetensors"))
    for suffix in ("weight", "bias"):
        w[f"out_proj.{suffix}"] = w.pop(f"classifier.{suffix}")
    mx.save_safetensors(str(old / "model.safetensors"), w)
    with pytest.raises(ValueError, match="has no classifier.bias, classifier.weight"):
        mlx_embed.load(str(old))


def test_eurobert_seq_cls_encoder_embeds_as_tiny_eurobert():
    """The classifier folder loaded as an embedder (kind="embedding"): its
    encoder without the head, mean-pooled, is tiny-eurobert's (the same
    backbone)."""
    texts = _json(GOLDEN_TEXTS)
    model = mlx_embed.load(EUROBERT_SEQ_CLS, kind="embedding", max_length=128)
    assert (model.kind, model.pooling) == ("embedding", "mean")
    ref = np.load(os.path.join(FIXTURES, "tiny-eurobert", "reference_mean_normalized.npy"))
    assert np.abs(model.embed(texts) - ref).max() <= 1e-5
