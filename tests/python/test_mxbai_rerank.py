"""mxbai-rerank v2 (Qwen2 scored by logit("1") - logit("0")), as the
mxbai-rerank library scores mixedbread-ai/mxbai-rerank-base/large-v2.

References: tests/fixtures/tiny-mxbai-rerank-v2 (its README): the library's
own input ids and its scores in float64, for the shared reranker pairs (8 cut
at the library's max_length 128) and two whose query would merge with the
separator if the pair were tokenized as one text."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from tokenizers import Tokenizer

import mlx_embed
from mlx_embed.errors import InvalidInput
from mlx_embed.models import decoder_reranker
from mlx_embed.pairs import query_first_lengths

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
MXBAI = os.path.join(FIXTURES, "tiny-mxbai-rerank-v2")
QWEN3_ST6 = os.path.join(FIXTURES, "tiny-qwen3-reranker-st6")
QWEN2_ST6 = os.path.join(FIXTURES, "tiny-qwen2-reranker-st6")
INSTRUCTION = "Find the passage that answers the question"
# The library's max_length in the fixture (the pair's tokens) and the
# prompt's own tokens around it: the engine's max_length counts both.
LIBRARY_MAX_LENGTH = 128


def _json(name, folder=MXBAI):
    with open(os.path.join(folder, name), encoding="utf-8") as f:
        return json.load(f)


_MODELS: dict = {}


def _model(folder=MXBAI, **kwargs):
    key = (folder, tuple(sorted(kwargs.items())))
    if key not in _MODELS:
        _MODELS[key] = mlx_embed.load(folder, **kwargs)
    return _MODELS[key]


def _pairs():
    return [tuple(p) for p in _json("pairs.json")]


def _assert_logits(got, ref):
    # float32 against the library's float64: 1.9e-5 at most measured on
    # logits within +-4 (the library's own float32 is 8.5e-6 off), under
    # the neighbours' 1e-5 + 1e-5 relative on a real model's logits of ~10.
    np.testing.assert_allclose(got, ref, rtol=0, atol=5e-5)


def test_scores_and_ids_are_the_librarys():
    model = _model()
    assert model.kind == "reranker" and model.labels == ["score"]
    pairs = _pairs()
    refs = _json("reference_input_ids.json")
    ids, types, before = model.encode_pairs(pairs)
    assert types is None
    assert ids == refs["default"]
    cut = _json("truncated_pairs.json")
    assert len(cut) == 8 and [k for k, b in enumerate(before) if b > model.max_length] == cut
    assert model.encode_pairs(pairs, instruction=INSTRUCTION)[0] == refs["instruction"]
    logits = np.load(os.path.join(MXBAI, "reference_pair_logits.npy"))
    _assert_logits(model.score(pairs, raw_scores=True), logits)
    _assert_logits(model.score(pairs, raw_scores=True, instruction=INSTRUCTION),
                   np.load(os.path.join(MXBAI, "reference_instruction_logits.npy")))
    scores = np.load(os.path.join(MXBAI, "reference_pair_scores.npy"))
    assert np.abs(model.score(pairs)[:, 0] - scores).max() <= 1.25e-5  # sigmoid' <= 1/4
    assert logits.max() - logits.min() > 5
    # Batched as one pair at a time.
    one = np.array([model.score([p], raw_scores=True)[0, 0] for p in pairs[:12]])
    np.testing.assert_allclose(model.score(pairs[:12], raw_scores=True)[:, 0], one, rtol=0, atol=1e-5)


@pytest.mark.parametrize("option", [{"packed_rows": True}, {"joined_linears": True}, {"workers": 2}])
def test_engine_paths_score_alike(option):
    """The decoder's packed feed-forward, joined projections and two workers
    run through the reranker's backbone as through the embedder's."""
    pairs = _pairs()
    _assert_logits(_model(**option).score(pairs, raw_scores=True),
                   np.load(os.path.join(MXBAI, "reference_pair_logits.npy")))


def test_query_and_document_are_encoded_apart():
    """The library encodes "query: q", "\\n" and "document: d" on their
    own: a query ending in ":" or ")" would merge with the newline in one
    text. The fixture's last two pairs are such queries."""
    model = _model()
    tok = Tokenizer.from_file(os.path.join(MXBAI, "tokenizer.json"))
    pair = model.spec().tokenizer.pair
    for q, d in _pairs()[-2:]:
        (ids,), _, _ = model.encode_pairs([(q, d)])
        whole = tok.encode(f"query: {q}\ndocument: {d}", add_special_tokens=False).ids
        inner = ids[len(pair.prefix_ids): len(ids) - len(pair.suffix_ids)]
        assert inner != whole
        assert tok.decode(inner) == f"query: {q}\ndocument: {d}"


def test_the_prompt_around_the_pair():
    model = _model()
    tok = Tokenizer.from_file(os.path.join(MXBAI, "tokenizer.json"))
    pair = model.spec().tokenizer.pair
    assert pair.template is None and pair.query_share == (3, 4)
    assert tok.decode(pair.prefix_ids, skip_special_tokens=False) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
        "<|im_end|>\n<|im_start|>user\n")
    assert tok.decode(pair.suffix_ids, skip_special_tokens=False) == (
        "\n" + decoder_reranker.MXBAI_TASK + "<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(pair.middle_ids) == "\n"
    # The engine's max_length counts the prompt: the library's 128 + the rest.
    assert model.max_length == LIBRARY_MAX_LENGTH + len(pair.prefix_ids) + len(pair.suffix_ids)
    # The score tokens are "1" and "0" (ids 16 and 15 here, as in Qwen2's vocabulary).
    assert (model.model._yes_id, model.model._no_id) == (16, 15)


def test_instructions():
    model = _model()
    tok = Tokenizer.from_file(os.path.join(MXBAI, "tokenizer.json"))
    (plain,), _, _ = model.encode_pairs([("q", "d")])
    (given,), _, _ = model.encode_pairs([("q", "d")], instruction="Find code")
    assert "user\ninstruction: Find code\nquery: q\ndocument: d\n" in tok.decode(given, skip_special_tokens=False)
    # An empty instruction is none, as the library reads it.
    assert model.encode_pairs([("q", "d")], instruction="")[0] == [plain]
    # Braces are text.
    (braces,), _, _ = model.encode_pairs([("{document}", "{query}")])
    assert "query: {document}\ndocument: {query}\n" in tok.decode(braces, skip_special_tokens=False)
    # A lone text has no meaning for it.
    with pytest.raises(InvalidInput, match="pairs, not single texts"):
        model.predict(["just a text"])


@pytest.mark.parametrize("n1,n2,budget,want", [
    (10, 500, 127, (10, 117)),    # a short query: the document takes the rest
    (300, 500, 127, (96, 31)),    # a long one keeps 128 * 3 // 4 = 96
    (300, 5, 127, (96, 5)),       # ... even beside a short document (not longest_first)
    (5, 5, 127, (5, 5)),
    (100, 0, 3, (3, 0)),
])
def test_query_first_lengths(n1, n2, budget, want):
    assert query_first_lengths(n1, n2, budget, budget + 1, (3, 4)) == want


def test_a_long_query_keeps_three_quarters():
    model = _model()
    pairs = _pairs()
    pair = model.spec().tokenizer.pair
    tok = Tokenizer.from_file(os.path.join(MXBAI, "tokenizer.json"))
    long_query = pairs[-5][0]
    (ids,), _, _ = model.encode_pairs([(long_query, "a short document")])
    inner = ids[len(pair.prefix_ids): len(ids) - len(pair.suffix_ids)]
    query = tok.encode("query: " + long_query, add_special_tokens=False).ids
    assert len(query) > 96
    # The query's first 128 * 3 // 4 tokens, the separator, the document whole.
    assert inner[:96] == query[:96] and inner[96:97] == pair.middle_ids
    assert tok.decode(inner[97:]) == "document: a short document"
    # A long document beside it gets what is left: 128 - 96 - 1.
    (ids,), _, _ = model.encode_pairs([(long_query, "word " * 500)])
    assert len(ids) == model.max_length
    with pytest.raises(InvalidInput, match="pair 0 has"):
        model.score([(long_query, "d")], truncate=False)


def _copy(tmp_path, name, parent=None):
    dst = (parent or tmp_path) / name
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(MXBAI, dst)
    return dst


def test_recognized_by_name_kind_or_logit_score(tmp_path):
    refs = _json("reference_input_ids.json")["default"][:6]
    pairs = _pairs()[:6]
    # Named as published, with a chat template that writes a pair and a
    # LogitScore: the library reads neither, nor does the engine here.
    named = _copy(tmp_path, "mxbai-rerank-base-v2")
    shutil.copy(os.path.join(QWEN3_ST6, "chat_template.jinja"), named / "chat_template.jinja")
    shutil.copytree(os.path.join(QWEN3_ST6, "1_LogitScore"), named / "1_LogitScore")
    shutil.copy(os.path.join(QWEN3_ST6, "modules.json"), named / "modules.json")
    model = mlx_embed.load(str(named))
    assert model.kind == "reranker" and model.encode_pairs(pairs)[0] == refs
    # The Hugging Face cache's layout.
    cached = _copy(tmp_path, "snapshots/0123abc", tmp_path / "hub" / "models--mixedbread-ai--mxbai-rerank-large-v2")
    model = mlx_embed.load(str(cached))
    assert model.kind == "reranker" and model.encode_pairs(pairs)[0] == refs
    # Any other Qwen2 causal LM is an embedding model unless asked for a
    # reranker; asked, it is scored as mxbai-rerank v2 (Qwen2's card).
    other = _copy(tmp_path, "qwen2-chat")
    assert mlx_embed.load(str(other)).kind == "embedding"
    model = mlx_embed.load(str(other), kind="reranker")
    assert model.kind == "reranker" and model.encode_pairs(pairs)[0] == refs
    # gte-Qwen2 (Qwen2Model, sentence-transformers pooling) stays an embedder.
    assert _model(os.path.join(FIXTURES, "tiny-qwen2")).kind == "embedding"


@pytest.mark.parametrize("name,named", [
    ("mxbai-rerank-base-v2", True), ("mxbai-rerank-large-v2", True), ("MXBAI-RERANK-LARGE-V2-mlx-8bit", True),
    ("mxbai-rerank-large-v1", False), ("mxbai-embed-large-v1", False), ("tiny-mxbai-rerank-v2", False),
])
def test_mxbai_v2_names(name, named):
    assert (decoder_reranker.named_card("qwen2", f"/models/{name}") is not None) is named


def test_a_logit_score_qwen2_folder_scores_with_its_tokens(tmp_path):
    """A Qwen2 folder with sentence-transformers 6's LogitScore (not named
    as mxbai v2) is a reranker whatever its name, scored by its tokens; its
    chat template (Qwen2.5's, which writes no pair) leaves the card's prompt."""
    folder = _copy(tmp_path, "my-finetune")
    shutil.copy(os.path.join(QWEN3_ST6, "modules.json"), folder / "modules.json")
    # A Transformer that takes chat messages, as sentence-transformers 6
    # saves a decoder CrossEncoder (text only is another rule: below).
    shutil.copy(os.path.join(QWEN2_ST6, "sentence_bert_config.json"), folder / "sentence_bert_config.json")
    (folder / "1_LogitScore").mkdir()
    (folder / "1_LogitScore" / "config.json").write_text(json.dumps(
        {"true_token_id": 16, "false_token_id": None, "module_input_name": "causal_logits"}))
    model = mlx_embed.load(str(folder))
    assert model.kind == "reranker"
    pairs = _pairs()[:6]
    assert model.encode_pairs(pairs)[0] == _json("reference_input_ids.json")["default"][:6]
    diff = _model().score(pairs, raw_scores=True)
    alone = model.score(pairs, raw_scores=True)
    assert np.abs(alone - diff).max() > 0.1  # logit["1"] alone, not minus logit["0"]


def _st6_refs():
    return [tuple(p) for p in _json("pairs.json", QWEN2_ST6)], _json("reference_input_ids.json", QWEN2_ST6)


def test_a_qwen2_folder_saved_by_st6_scores_as_cross_encoder():
    """sentence-transformers 6's Qwen2 CrossEncoder folder (LogitScore "1"/"0",
    a chat template writing mxbai's prompt from the query/document roles):
    its ids are CrossEncoder's for every pair. The rendered prompt is one
    text there, so a document ending in ")" merges with the "\\n" that starts
    the template's tail (pairs 24 and 45 got other ids while the engine
    encoded the tail apart, pair 24 scored 3.1 off); at or over the limit
    (pairs 34-41, and 46-47, a document ending in ")" at and just over it)
    the render is cut and the tail's ids, "\\n" apart, written back over its
    end."""
    model = _model(QWEN2_ST6)
    assert model.kind == "reranker"
    pair = model.spec().tokenizer.pair
    assert pair.template == "user\nquery: {query}\ndocument: {document}" and pair.query_share is None
    # The template writes an instruction only when given one: it takes none.
    assert pair.default_instruction is None
    assert pair.suffix_text == ("\n" + decoder_reranker.MXBAI_TASK + "<|im_end|>\n<|im_start|>assistant\n")
    pairs, refs = _st6_refs()
    assert len(pairs) == 48
    ids, types, before = model.encode_pairs(pairs)
    assert types is None
    for k, (got, want) in enumerate(zip(ids, refs["message"])):
        assert got == want, k
    assert [k for k, n in enumerate(before) if n >= model.max_length] == [34, 35, 36, 37, 38, 39, 40, 41, 46, 47]
    assert before[45] == len(ids[45]) == model.max_length - 1
    assert pairs[24][1].endswith(")") and pairs[46][1].endswith(")")
    _assert_logits(model.score(pairs, raw_scores=True),
                   np.load(os.path.join(QWEN2_ST6, "reference_pair_logits.npy")))


def test_a_text_only_logit_score_folder_takes_the_tokenizers_pair(tmp_path):
    """A LogitScore folder whose Transformer is text only (sentence_bert_config
    .json's modality_config without "message", or without modality_config:
    saved before chat messages) is not rendered through its chat template by
    sentence-transformers 6: its pair is tokenizer(query, document), cut
    longest_first, with no prompt. Its chat template was rendered here."""
    pairs, refs = _st6_refs()
    for name, edit in (("pinned", lambda c: {**c, "modality_config": {"text": c["modality_config"]["text"]}}),
                       ("older", lambda c: {k: v for k, v in c.items() if k != "modality_config"})):
        folder = tmp_path / name
        shutil.copytree(QWEN2_ST6, folder)
        cfg = json.loads((folder / "sentence_bert_config.json").read_text())
        (folder / "sentence_bert_config.json").write_text(json.dumps(edit(cfg)))
        model = mlx_embed.load(str(folder))
        assert model.kind == "reranker"
        ids, types, _ = model.encode_pairs(pairs)
        assert types is None  # Qwen's tokenizer types the document 1; a decoder reads none
        for k, (got, want) in enumerate(zip(ids, refs["text"])):
            assert got == want, (name, k)
        _assert_logits(model.score(pairs, raw_scores=True),
                       np.load(os.path.join(QWEN2_ST6, "reference_text_pair_logits.npy")))
        # Still a reranker of pairs: CrossEncoder.predict refuses a lone text too.
        assert model.spec().tokenizer.pair.pairs_only
        with pytest.raises(InvalidInput, match="scores \\(query, document\\) pairs, not single texts"):
            model.predict(["just a text"])


def test_truncate_false_keeps_a_pair_within_the_limit_whole():
    """The library's query-first cut keeps a query to 3/4 of its
    max_length even where the pair fits the model's 320 tokens;
    ``truncate=False`` asks for no cut: such a pair runs whole (its query
    was cut, silently)."""
    model = _model()
    words = ["alpha", "river", "stone", "quick", "zebra", "moon", "paper", "light", "green", "table"]
    query = " ".join(words[(7 * i) % 10] + words[(3 * i) % 10] for i in range(17))
    pair = [(query, "a cat")]
    cut, _, before = model.encode_pairs(pair)
    assert before[0] <= model.max_length and len(cut[0]) < before[0]
    whole, _, same = model.encode_pairs(pair, truncate=False)
    assert same == before and len(whole[0]) == before[0]
    assert model.score(pair, truncate=False)[0, 0] != model.score(pair)[0, 0]
