"""add_bos_token / add_eos_token against tokenizer.json's template, checked
against sentence-transformers 6.2 (transformers 5) ids in
tests/fixtures/special-flags/cases.json (README there says how they were made).

In tokenizer_config.json the flags change nothing: transformers 5 drops them
whenever the folder has a tokenizer.json, so the template there runs, which
is what the engine reads. Passed by sentence-transformers
(sentence_bert_config.json's tokenizer_args / processor_kwargs) they are kept,
and then some tokenizer classes rebuild the template from them and others do
not: a folder whose flags there disagree with its template ran tokenizer.json's
specials silently (mistral-tokenizer-args-eos-only: sentence-transformers
drops the <s>), and is now refused."""

import importlib.util
import json

import mlx_embed
import pytest
from conftest import FIXTURES, ROOT

CASES = json.loads((FIXTURES / "special-flags" / "cases.json").read_text())
_spec = importlib.util.spec_from_file_location(
    "make_special_flags", ROOT / "scripts" / "fixtures" / "make_special_flags.py")
_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_script)


def _build(case, tmp_path):
    return _script.build((case["name"], case["fixture"], case["tokenizer_config"],
                          case["sentence_bert_config"], case["template"], case["expect"]), tmp_path)


def test_the_cases_are_the_scripts():
    """cases.json was made from the script's cases as they are now."""
    assert [c["name"] for c in CASES["cases"]] == [c[0] for c in _script.CASES]
    assert [c["expect"] for c in CASES["cases"]] == [c[5] for c in _script.CASES]


@pytest.mark.parametrize("case", CASES["cases"], ids=lambda c: c["name"])
def test_special_flags_as_sentence_transformers(case, tmp_path):
    folder = _build(case, tmp_path)
    texts = CASES["texts"]
    plain = mlx_embed.load(FIXTURES / case["fixture"]).encode(texts)[0]
    if case["expect"] == "refused":
        # sentence-transformers runs other specials than tokenizer.json's.
        assert case["ids"] != plain
        with pytest.raises(ValueError, match="transformers rebuilds the template from these flags"):
            mlx_embed.load(folder)
        return
    ids = mlx_embed.load(folder).encode(texts)[0]
    if case["expect"] == "eos_appended":
        # The template has no </s>; Mistral's decoder rule appends it
        # (models/mistral.py EMBEDDING_DEFAULTS), whatever the flags say.
        assert ids == [row + [2] for row in case["ids"]]
    else:
        assert ids == case["ids"]


def test_processor_kwargs_are_ignored_under_tokenizer_args(tmp_path):
    """sentence-transformers renames tokenizer_args over processor_kwargs, so
    the latter's truncation_side was read where it never applies."""
    case = {"name": "both", "fixture": "tiny-mpnet", "tokenizer_config": {}, "template": None,
            "expect": "same", "sentence_bert_config": {"processor_kwargs": {"truncation_side": "left"},
                                                       "tokenizer_args": {"padding_side": "left"}}}
    assert mlx_embed.load(_build(case, tmp_path)).truncation_side == "right"


def test_a_flag_for_a_token_no_file_names_is_refused(tmp_path):
    """tiny-t5 names no bos_token: transformers would take the tokenizer
    class's default, which is not guessed."""
    case = {"name": "t5-bos", "fixture": "tiny-t5", "tokenizer_config": {}, "template": None,
            "expect": "refused", "sentence_bert_config": {"tokenizer_args": {"add_bos_token": True}}}
    with pytest.raises(ValueError, match="add_bos_token is set but no file names the bos_token"):
        mlx_embed.load(_build(case, tmp_path))
