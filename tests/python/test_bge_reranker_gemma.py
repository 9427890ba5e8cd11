"""bge-reranker-v2-gemma (a Gemma 1 GemmaForCausalLM scored by logit("Yes")),
as FlagEmbedding's FlagLLMReranker scores BAAI/bge-reranker-v2-gemma.

References: tests/fixtures/tiny-bge-reranker-v2-gemma (its README):
FlagEmbedding's own input ids and float64 transformers logits on them, at its
max_length 128 (the fixture's engine default) and 512 (its default), for 47
pairs, 8 of them cut at each length."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from tokenizers import Tokenizer

import mlx_embed
from mlx_embed.errors import InputTooLong, InvalidInput
from mlx_embed.models import decoder_reranker, gemma

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
GEMMA = os.path.join(FIXTURES, "tiny-bge-reranker-v2-gemma")
QWEN3_ST6 = os.path.join(FIXTURES, "tiny-qwen3-reranker-st6")
# The \n + prompt after the document: FlagEmbedding's input reaches its
# max_length plus twice these (module docstring of decoder_reranker).
SUFFIX = 54


def _json(name):
    with open(os.path.join(GEMMA, name), encoding="utf-8") as f:
        return json.load(f)


_MODELS: dict = {}


def _model(folder=GEMMA, **kwargs):
    key = (folder, tuple(sorted(kwargs.items())))
    if key not in _MODELS:
        _MODELS[key] = mlx_embed.load(folder, **kwargs)
    return _MODELS[key]


def _pairs():
    return [tuple(p) for p in _json("pairs.json")]


def _tok():
    return Tokenizer.from_file(os.path.join(GEMMA, "tokenizer.json"))


def _assert_logits(got, ref):
    # float32 against float64: 2.2e-5 at most measured (FlagEmbedding's own
    # float32 is 2.2e-5 off too), on logits within +-4.7.
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4)


@pytest.mark.parametrize("library_max_length", [128, 512])
def test_ids_and_logits_are_flagembeddings(library_max_length):
    model = (_model() if library_max_length == 128
             else _model(max_length=library_max_length + 2 * SUFFIX))
    assert model.kind == "reranker" and model.labels == ["score"]
    assert model.max_length == library_max_length + 2 * SUFFIX
    pairs = _pairs()
    ids, types, before = model.encode_pairs(pairs)
    assert types is None
    assert ids == _json("reference_input_ids.json")[str(library_max_length)]
    cut = _json("truncated_pairs.json")[str(library_max_length)]
    assert len(cut) == 8 and [k for k, (row, b) in enumerate(zip(ids, before)) if len(row) < b] == cut
    name = "reference_pair_logits.npy" if library_max_length == 128 else "reference_pair_logits_512.npy"
    logits = np.load(os.path.join(GEMMA, name))
    assert logits.dtype == np.float64 and logits.max() - logits.min() > 5
    _assert_logits(model.score(pairs, raw_scores=True), logits)
    if library_max_length == 128:
        # /rerank's default: the sigmoid (FlagEmbedding's normalize=True).
        scores = np.load(os.path.join(GEMMA, "reference_pair_scores.npy"))
        assert np.abs(model.score(pairs)[:, 0] - scores).max() <= 2.5e-5  # sigmoid' <= 1/4
        # Batched as one pair at a time (float32 apart: 2.3e-5 measured,
        # each within 2.2e-5 of float64).
        one = np.array([model.score([p], raw_scores=True)[0, 0] for p in pairs[:12]])
        np.testing.assert_allclose(model.score(pairs[:12], raw_scores=True)[:, 0], one, rtol=0, atol=5e-5)


@pytest.mark.parametrize("option", [{"packed_rows": True}, {"joined_linears": True}, {"workers": 2}])
def test_engine_paths_score_alike(option):
    _assert_logits(_model(**option).score(_pairs(), raw_scores=True),
                   np.load(os.path.join(GEMMA, "reference_pair_logits.npy")))


def test_the_prompt_around_the_pair():
    model = _model()
    tok = _tok()
    pair = model.spec().tokenizer.pair
    assert pair.template is None and pair.query_share == (3, 4)
    assert pair.query_prompt == "A: " and pair.document_prompt == "B: "
    assert pair.prefix_ids == [tok.token_to_id("<bos>")] == [2]
    assert tok.decode(pair.middle_ids) == "\n"
    assert tok.decode(pair.suffix_ids) == "\n" + decoder_reranker.BGE_GEMMA_PROMPT
    assert len(pair.suffix_ids) == SUFFIX and pair.uncounted == 2 * SUFFIX
    # logit("Yes") alone: no false token.
    assert (model.model._yes_id, model.model._no_id) == (tok.token_to_id("Yes"), None)
    # A lone text has no meaning for it; an instruction replaces the prompt.
    with pytest.raises(InvalidInput, match="pairs, not single texts"):
        model.predict(["just a text"])
    assert pair.instruction_suffix_ids == pair.middle_ids and pair.suffix_uncounted == 2


def test_the_cut_is_flagembeddings():
    """At max_length L (128 here): "A: q" keeps L * 3 // 4 tokens, "B: d"
    L, and [bos] q \\n d then L + the suffix (the document's end goes)."""
    model, tok = _model(), _tok()
    pair = model.spec().tokenizer.pair
    long_query, long_document = _pairs()[40][0], _pairs()[-1][1]
    query = tok.encode("A: " + long_query, add_special_tokens=False).ids
    document = tok.encode("B: " + long_document, add_special_tokens=False).ids
    assert len(query) > 96 and len(document) > 128

    def inner(q, d):
        (ids,), _, _ = model.encode_pairs([(q, d)])
        assert ids[:1] == pair.prefix_ids and ids[len(ids) - SUFFIX:] == pair.suffix_ids
        return ids[1:len(ids) - SUFFIX]

    # A long query beside a short document: 96 tokens, the document whole.
    got = inner(long_query, "a short document")
    assert got[:96] == query[:96] and got[96:97] == pair.middle_ids
    assert tok.decode(got[97:]) == "B: a short document"
    # A long document beside a short query: 128 tokens (not what the budget leaves).
    got = inner("q", long_document)
    assert got[-128:] == document[:128] and len(got) == len(tok.encode("A: q", add_special_tokens=False).ids) + 1 + 128
    # Both long: the document gets 128 + 53 - 1 - 96 (L + prompt - bos - query).
    got = inner(long_query, long_document)
    assert got[:96] == query[:96] and got[97:] == document[:128 + (SUFFIX - 1) - 1 - 96]
    assert 1 + len(got) + SUFFIX == model.max_length
    with pytest.raises(InvalidInput, match="pair 0 has"):
        model.score([(long_query, "d")], truncate=False)


def _copy(tmp_path, name, parent=None):
    dst = (parent or tmp_path) / name
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(GEMMA, dst)
    return dst


def test_recognized_by_name_or_kind(tmp_path):
    refs = _json("reference_input_ids.json")["128"][:6]
    pairs = _pairs()[:6]
    # Named as published, with a chat template that writes a pair and a
    # LogitScore: FlagEmbedding reads neither, nor does the engine here.
    named = _copy(tmp_path, "bge-reranker-v2-gemma")
    shutil.copy(os.path.join(QWEN3_ST6, "chat_template.jinja"), named / "chat_template.jinja")
    shutil.copytree(os.path.join(QWEN3_ST6, "1_LogitScore"), named / "1_LogitScore")
    shutil.copy(os.path.join(QWEN3_ST6, "modules.json"), named / "modules.json")
    model = mlx_embed.load(str(named))
    assert model.kind == "reranker" and model.encode_pairs(pairs)[0] == refs
    # The Hugging Face cache's layout.
    cached = _copy(tmp_path, "snapshots/0123abc", tmp_path / "hub" / "models--BAAI--bge-reranker-v2-gemma")
    assert mlx_embed.load(str(cached)).encode_pairs(pairs)[0] == refs
    # Another Gemma causal LM is an embedding model unless asked for a
    # reranker; asked, it takes Gemma's card.
    other = _copy(tmp_path, "gemma-2b")
    assert mlx_embed.load(str(other)).kind == "embedding"
    model = mlx_embed.load(str(other), kind="reranker")
    assert model.kind == "reranker" and model.encode_pairs(pairs)[0] == refs


@pytest.mark.parametrize("name,named", [
    ("bge-reranker-v2-gemma", True), ("BAAI--bge-reranker-v2-gemma-mlx", True),
    ("bge-reranker-v2-m3", False), ("bge-reranker-v2.5-gemma2-lightweight", False),
    ("tiny-bge-reranker-v2-gemma", True),
])
def test_bge_gemma_names(name, named):
    assert (decoder_reranker.named_card("gemma", f"/models/{name}") is not None) is named
    assert decoder_reranker.named_card("qwen2", f"/models/{name}") is None


def test_as_an_embedding_model_the_backbone_is_the_rerankers():
    """Loaded as an embedding model, a Gemma folder pools its last token:
    that vector (unnormalized) times the "Yes" row of the tied table is the
    reranker's reference logit."""
    model = _model(kind="embedding")
    assert model.kind == "embedding" and model.pooling == "last"
    ids = _json("reference_input_ids.json")["128"][:8]
    vecs = np.frombuffer(model.embed_ids(ids).vectors, dtype="<f4").reshape(len(ids), -1).astype(np.float64)
    reranker = _model()
    yes = np.asarray(reranker.model.score_rows[0], dtype=np.float64)
    _assert_logits(vecs @ yes, np.load(os.path.join(GEMMA, "reference_pair_logits.npy"))[:8, 0])


@pytest.mark.parametrize("change,message", [
    ({"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
    ({"hidden_activation": None, "hidden_act": "silu"}, "hidden_activation='silu'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
])
def test_config_refusals(change, message):
    with open(os.path.join(GEMMA, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg.update(change)
    with pytest.raises(ValueError, match=message):
        gemma.ModelArgs.from_dict(cfg)


def test_config_readings():
    with open(os.path.join(GEMMA, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    # The published "gelu" is the tanh GELU (transformers 4 and 5 alike).
    for change in ({}, {"hidden_activation": None}, {"hidden_activation": None, "hidden_act": "gelu"}):
        args = gemma.ModelArgs.from_dict({**cfg, **change})
        assert (args.head_dim, args.num_key_value_heads, args.tie_word_embeddings) == (32, 1, True)
    # transformers 5's rope_parameters.
    rope = {k: v for k, v in cfg.items() if k not in ("rope_theta", "rope_scaling")}
    rope["rope_parameters"] = {"rope_type": "default", "rope_theta": 500.0}
    assert gemma.ModelArgs.from_dict(rope).rope_theta == 500.0


def test_a_folder_stating_no_limit_is_cut_at_flagembeddings_default(tmp_path):
    """bge-reranker-v2-gemma's tokenizer states no limit: the engine then
    cuts where FlagEmbedding does by default (its max_length 512, here 512 +
    twice the suffix counting every token), not at the generic 8192; a
    limit the caller or the folder states is kept."""
    folder = _copy(tmp_path, "bge-reranker-v2-gemma")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    del cfg["model_max_length"]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    model = mlx_embed.load(str(folder))
    assert model.max_length == 512 + 2 * SUFFIX == model.spec().max_length
    assert model.encode_pairs(_pairs())[0] == _json("reference_input_ids.json")["512"]
    assert mlx_embed.load(str(folder), max_length=300).max_length == 300
    assert _model().max_length == 128 + 2 * SUFFIX  # the fixture's tokenizer_config.json
    # Another Gemma folder's own chat template prompt has no library default.
    other = _copy(tmp_path, "gemma-2b")
    (other / "tokenizer_config.json").write_text(json.dumps(cfg))
    shutil.copy(os.path.join(QWEN3_ST6, "chat_template.jinja"), other / "chat_template.jinja")
    templated = mlx_embed.load(str(other), kind="reranker")
    assert templated.spec().tokenizer.pair.template is not None and templated.max_length == 8192


def test_truncate_false_keeps_a_pair_within_the_limit_whole():
    """FlagEmbedding's own cut shortens a passage over its max_length (128)
    even where the pair fits the model's 236 tokens; ``truncate=False``
    asks for no cut: such a pair runs whole (it was cut, silently), and one
    over 236 is refused."""
    model = _model()
    words = ["alpha", "river", "stone", "quick", "zebra", "moon", "paper", "light", "green", "table"]
    document = " ".join(words[(7 * i) % 10] + words[(3 * i) % 10] for i in range(30))
    pair = [("what is it", document)]
    cut, _, before = model.encode_pairs(pair)
    assert before[0] <= model.max_length and len(cut[0]) < before[0]  # the library's cut
    whole, _, same = model.encode_pairs(pair, truncate=False)
    assert same == before and len(whole[0]) == before[0]
    tok = _tok()
    assert whole[0] == ([2] + tok.encode("A: what is it", add_special_tokens=False).ids + [260]
                        + tok.encode("B: " + document, add_special_tokens=False).ids
                        + model.spec().tokenizer.pair.suffix_ids)
    assert model.score(pair, truncate=False)[0, 0] != model.score(pair)[0, 0]
    with pytest.raises(InputTooLong):
        model.score([("what is it", document * 3)], truncate=False)


# FlagEmbedding's prompt= (a call's instruction): fixture's prompts.json.
PROMPTS = _json("prompts.json")


@pytest.mark.parametrize("engine_max_length", PROMPTS["engine_max_lengths"])
@pytest.mark.parametrize("name", list(PROMPTS["prompts"]))
def test_an_instruction_is_flagembeddings_prompt(name, engine_max_length):
    """The instruction replaces the prompt after the last "\\n", encoded
    alone, and counts twice against the engine's max_length as the default
    did: the ids FlagEmbedding's compute_score(prompt=...) gives at
    max_length = engine's - 2 x (1 + its tokens), and float64 logits."""
    model = _model() if engine_max_length == 236 else _model(max_length=engine_max_length)
    assert model.max_length == engine_max_length
    k = list(PROMPTS["engine_max_lengths"]).index(engine_max_length)
    instruction, pairs = PROMPTS["prompts"][name], _pairs()
    ids, _, before = model.encode_pairs(pairs, instruction=instruction)
    assert ids == _json("reference_prompt_input_ids.json")[name][str(engine_max_length)]
    assert max(map(len, ids)) <= engine_max_length
    assert [i for i, (row, b) in enumerate(zip(ids, before)) if len(row) < b] == \
        PROMPTS["truncated"][name][str(engine_max_length)]
    tail = _tok().encode(instruction, add_special_tokens=False).ids
    assert all(row[len(row) - len(tail) - 1:] == [_tok().token_to_id("\n")] + tail for row in ids)
    logits = np.load(os.path.join(GEMMA, "reference_prompt_logits.npy"))
    assert logits.dtype == np.float64 and logits.shape == (3, 2, len(pairs))
    ref = logits[list(PROMPTS["prompts"]).index(name), k]
    got = model.score(pairs, raw_scores=True, instruction=instruction)[:, 0]
    # 1.4e-5 .. 2.5e-5 measured (the empty prompt's logits sit near -60:
    # the Yes row was centred for the default prompt's states).
    _assert_logits(got, ref)
    # rerank() takes it too, best first.
    same = [k for k, (q, _) in enumerate(pairs) if q == pairs[0][0]][:8]
    ranked = model.rerank(pairs[0][0], [pairs[k][1] for k in same], raw_scores=True, instruction=instruction)
    _assert_logits([s for _, s in sorted(ranked)], ref[same])


def test_the_cut_moves_with_the_prompt():
    """A longer prompt leaves the pair less of the same max_length (the
    long one: 70 tokens, FlagEmbedding's count 94 instead of 128), a
    shorter one more; None is the default prompt, "" a prompt of no tokens
    (as in FlagEmbedding, where only None takes the default)."""
    model = _model()
    lib = PROMPTS["library_max_lengths"]
    assert lib["long"][0] < 128 < lib["short"][0] < lib["empty"][0] == 236 - 2
    # The joint cut (pair 46): the pair keeps 94 + 70 - 1 tokens beside the
    # long prompt, 128 + 53 - 1 beside the default one, 182 + 26 - 1 beside
    # the short one.
    for name, n in (("long", 94 + 70 - 1), ("short", 182 + 26 - 1)):
        row = _json("reference_prompt_input_ids.json")[name]["236"][46]
        tokens = len(_tok().encode(PROMPTS["prompts"][name], add_special_tokens=False).ids)
        assert len(row) - 1 - tokens == n + 2  # [bos] q \n d, then \n + prompt
    assert len(_json("reference_input_ids.json")["128"][46]) - SUFFIX == 128 + 53 - 1 + 2
    pairs = _pairs()
    default = model.encode_pairs(pairs)[0]
    assert model.encode_pairs(pairs, instruction=None)[0] == default
    assert model.encode_pairs(pairs, instruction=decoder_reranker.BGE_GEMMA_PROMPT)[0] == default
    empty = model.encode_pairs(pairs[:3], instruction="")[0]
    assert all(row[-1] == _tok().token_to_id("\n") for row in empty)
    # truncate=False: refused exactly when the whole input is over
    # max_length, which the prompt's tokens are part of.
    long = PROMPTS["prompts"]["long"]
    suffix = 1 + len(_tok().encode(long, add_special_tokens=False).ids)
    room = model.max_length - 1 - 1 - suffix  # [bos], "\n", "\n" + prompt
    head = len(_tok().encode("A: q", add_special_tokens=False).ids)
    words = " ".join(f"w{i}" for i in range(400))
    doc_ids = _tok().encode("B: " + words, add_special_tokens=False).ids
    fits = _tok().decode(doc_ids[: room - head])[3:]
    n = len(_tok().encode("B: " + fits, add_special_tokens=False).ids)
    for extra, ok in ((0, True), (1, False)):
        document = fits
        while len(_tok().encode("B: " + document, add_special_tokens=False).ids) < n + extra:
            document += " w"
        total = 1 + head + 1 + len(_tok().encode("B: " + document, add_special_tokens=False).ids) + suffix
        if ok:
            assert total <= model.max_length
            (row,), _, _ = model.encode_pairs([("q", document)], instruction=long, truncate=False)
            assert len(row) == total
        else:
            assert total > model.max_length
            with pytest.raises(InputTooLong):
                model.score([("q", document)], instruction=long, truncate=False)
    # A prompt that leaves the pair nothing is refused by name.
    with pytest.raises(InvalidInput, match="instruction leaves the pair no room"):
        model.score([("q", "d")], instruction=" ".join(["Yes"] * 120))


def test_an_instruction_elsewhere_is_still_refused():
    """A segment reranker without an instruction slot (a BERT
    cross-encoder's pairs) still refuses one."""
    from mlx_embed.pairs import segment_prompts
    from mlx_embed.spec import PairSpec

    with pytest.raises(InvalidInput, match="instructions"):
        segment_prompts(PairSpec(prefix_ids=[1], middle_ids=[2], suffix_ids=[2]), "Find code")
