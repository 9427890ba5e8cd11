"""Folders with only the slow BERT WordPiece tokenizer files (vocab.txt, no
tokenizer.json): the tokenizer.json we convert from them against transformers'
ids, the cache it is written to, and whole models loading from such folders.

Fixtures: tests/fixtures/slow-wordpiece (README.md there;
scripts/fixtures/make_slow_wordpiece.py). Every variant uses the default
model's (all-MiniLM-L6-v2's, 30522 entries) vocab.txt, copied in here.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

import mlx_embed
from mlx_embed import slow_tokenizers
from mlx_embed.loading import default_model_path, load_checkpoint
from conftest import FIXTURES, assert_parity, assert_reranker_matches

SLOW = FIXTURES / "slow-wordpiece"
CORPUS = json.loads((SLOW / "texts.json").read_text(encoding="utf-8"))
VARIANTS = sorted(p.name for p in (SLOW / "variants").iterdir())
# Where transformers' slow tokenizer itself differs from its converted fast
# one: without basic tokenization it splits on whitespace only and keeps case,
# while the conversion keeps BERT's pre-tokenizer; never_split words stay whole
# in the slow one only (we follow the conversion).
SLOW_DIFFERS = {"no-basic-tokenize", "never-split"}


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """Each test converts into a cache of its own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


def _variant(name: str, dst: Path) -> Path:
    shutil.copytree(SLOW / "variants" / name, dst)
    shutil.copy(Path(default_model_path()) / "vocab.txt", dst / "vocab.txt")
    return dst


def _converted(folder: Path, model_type="bert") -> Tokenizer:
    path = slow_tokenizers.tokenizer_file(str(folder), model_type)
    assert not str(path).startswith(str(folder))
    return Tokenizer.from_file(path)


def test_variants_cover_what_they_claim():
    assert set(VARIANTS) == {
        "added-tokens", "added-tokens-legacy", "cased", "cased-strip-accents", "distilbert", "electra",
        "never-split", "no-basic-tokenize", "no-chinese-chars", "no-class", "uncased", "uncased-keep-accents",
    }
    assert len(CORPUS["texts"]) == 33 and len(CORPUS["pairs"]) == 7


@pytest.mark.parametrize("name", VARIANTS)
def test_converted_ids_match_transformers(name, tmp_path):
    """Every text and pair of the corpus gets exactly the ids (and the pairs
    the type ids) of transformers' BertTokenizerFast converted from the same
    slow files, and, but for SLOW_DIFFERS, of the slow BertTokenizer too."""
    ref = json.loads((SLOW / "references" / f"{name}.json").read_text())
    tok = _converted(_variant(name, tmp_path / name))
    got = [e.ids for e in tok.encode_batch(CORPUS["texts"])]
    assert got == ref["fast"]
    pairs = tok.encode_batch([tuple(p) for p in CORPUS["pairs"]])
    assert [e.ids for e in pairs] == ref["pairs_fast"]
    assert [e.type_ids for e in pairs] == ref["pairs_fast_types"]
    if name not in SLOW_DIFFERS:
        assert got == ref["slow"] and [e.ids for e in pairs] == ref["pairs_slow"]
        assert [e.type_ids for e in pairs] == ref["pairs_slow_types"]
    else:
        assert got != ref["slow"]


def test_references_exercise_the_settings():
    """The variants' references differ where their settings should matter,
    so matching them checks each setting (not one shared tokenization)."""
    fast = {n: json.loads((SLOW / "references" / f"{n}.json").read_text())["fast"] for n in VARIANTS}
    texts = CORPUS["texts"]
    unk = 100
    for other in ("cased", "uncased-keep-accents", "cased-strip-accents", "no-chinese-chars", "added-tokens"):
        assert fast[other] != fast["uncased"], other
    assert fast["uncased-keep-accents"] != fast["cased-strip-accents"]
    for same in ("distilbert", "electra", "no-class", "never-split"):  # never_split: see SLOW_DIFFERS
        assert fast[same] == fast["uncased"], same
    assert fast["added-tokens-legacy"] == fast["added-tokens"]
    # Words past 100 characters are the unknown token; specials in the text
    # stay themselves; the added special [ENT] gets the id after the vocab.
    assert fast["uncased"][texts.index("a" * 150)] == [101, unk, 102]
    assert fast["uncased"][texts.index("x" * 100 + " " + "y" * 101)][-2] == unk
    assert fast["uncased"][texts.index("[CLS] inside [SEP] text [MASK] and [PAD] [UNK]")][:4] == [101, 101, 2503, 102]
    assert 30522 in fast["added-tokens"][texts.index("an [ENT] entity [ENT]x")]


def test_converted_minilm_is_its_own_tokenizer_json(tmp_path):
    """all-MiniLM-L6-v2's slow files convert to its shipped tokenizer.json,
    all but the truncation and padding baked into that one."""
    src = Path(default_model_path())
    folder = tmp_path / "minilm"
    folder.mkdir()
    for name in ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(src / name, folder)
    ours = json.loads(Path(slow_tokenizers.tokenizer_file(str(folder), "bert")).read_text())
    theirs = json.loads((src / "tokenizer.json").read_text())
    assert theirs["truncation"] and theirs["padding"]
    theirs.update(truncation=None, padding=None)
    assert ours == theirs


def test_own_tokenizer_json_wins(tmp_path):
    folder = _variant("uncased", tmp_path / "m")
    (folder / "tokenizer.json").write_text("{}")
    assert slow_tokenizers.tokenizer_file(str(folder), "bert") == str(folder / "tokenizer.json")
    assert not (tmp_path / "xdg-cache").exists()


def test_cache_file_is_reused_and_keyed_by_content(tmp_path, caplog):
    folder = _variant("uncased", tmp_path / "m")
    with caplog.at_level(logging.INFO, logger="mlx_embed"):
        first = slow_tokenizers.tokenizer_file(str(folder), "bert")
    assert first.startswith(str(tmp_path / "xdg-cache" / "mlx-embed" / "tokenizers") + os.sep)
    assert f"converted from vocab.txt: {first}" in caplog.text
    assert os.listdir(os.path.dirname(first)) == ["tokenizer.json"]  # no temp file left
    inode = os.stat(first).st_ino
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mlx_embed"):
        assert slow_tokenizers.tokenizer_file(str(folder), "bert") == first
    # Read, not written again (a new file would be a new inode).
    assert "(cached)" in caplog.text and os.stat(first).st_ino == inode
    # Another copy of the same files shares the file; changed settings do not.
    other = _variant("uncased", tmp_path / "m2")
    assert slow_tokenizers.tokenizer_file(str(other), "bert") == first
    tc = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps(dict(tc, do_lower_case=False)))
    changed = slow_tokenizers.tokenizer_file(str(other), "bert")
    assert changed != first
    assert json.loads(Path(changed).read_text())["normalizer"]["lowercase"] is False


def test_the_cache_keeps_the_most_recently_used(tmp_path, monkeypatch):
    """At most MAX_CACHED converted tokenizers stay; the least recently used
    (a hit counts as a use) go when another is written."""
    monkeypatch.setattr(slow_tokenizers, "MAX_CACHED", 2)
    folders = []
    for i, lower in enumerate((True, False, True)):
        folder = _variant("uncased", tmp_path / f"m{i}")
        tc = json.loads((folder / "tokenizer_config.json").read_text())
        # Three different sources: the setting and a marker token.
        (folder / "tokenizer_config.json").write_text(json.dumps(dict(tc, do_lower_case=lower, model_max_length=100 + i)))
        folders.append(folder)
    first = slow_tokenizers.tokenizer_file(str(folders[0]), "bert")
    os.utime(first, ns=(1, 1))
    second = slow_tokenizers.tokenizer_file(str(folders[1]), "bert")
    os.utime(second, ns=(2, 2))
    # The first is used again: the second is now the least recently used.
    assert slow_tokenizers.tokenizer_file(str(folders[0]), "bert") == first
    third = slow_tokenizers.tokenizer_file(str(folders[2]), "bert")
    assert len({first, second, third}) == 3
    assert os.path.isfile(first) and os.path.isfile(third) and not os.path.exists(os.path.dirname(second))
    # Gone is only unconverted: asked for again, it is converted anew.
    assert slow_tokenizers.tokenizer_file(str(folders[1]), "bert") == second and os.path.isfile(second)


def test_read_only_folder_and_unwritable_cache(tmp_path, monkeypatch):
    """The model folder is never written; a cache that cannot be made falls
    back on the temp folder."""
    folder = _variant("cased", tmp_path / "m")
    before = sorted(os.listdir(folder))
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    monkeypatch.setattr(slow_tokenizers, "_temp_root", lambda: str(tmp_path / "tmp-root"))
    path = slow_tokenizers.tokenizer_file(str(folder), "bert")
    assert path.startswith(str(tmp_path / "tmp-root") + os.sep)
    assert sorted(os.listdir(folder)) == before
    ref = json.loads((SLOW / "references" / "cased.json").read_text())
    assert [e.ids for e in Tokenizer.from_file(path).encode_batch(CORPUS["texts"])] == ref["fast"]


@pytest.mark.parametrize(("files", "config", "model_type", "says"), [
    ({"spiece.model": b"x"}, {"tokenizer_class": "T5Tokenizer"}, "t5",
     r"has no tokenizer.json \(it has spiece.model; tokenizer_config.json names T5Tokenizer\)"),
    ({"sentencepiece.bpe.model": b"x"}, None, "xlm-roberta",
     r"has no tokenizer.json \(it has sentencepiece.bpe.model\)"),
    ({"vocab.json": b"{}", "merges.txt": b""}, {"tokenizer_class": "RobertaTokenizer"}, "roberta",
     r"has no tokenizer.json \(it has vocab.json \+ merges.txt; tokenizer_config.json names RobertaTokenizer\)"),
    ({"vocab.txt": b"[PAD]\n"}, {"tokenizer_class": "MPNetTokenizer"}, "mpnet",
     r"has no tokenizer.json \(it has vocab.txt; tokenizer_config.json names MPNetTokenizer\)"),
    ({"vocab.txt": b"[PAD]\n"}, None, "mpnet",
     r"\(it has vocab.txt; tokenizer_config.json names no tokenizer class and model_type is 'mpnet'\)"),
    ({}, None, "bert", r"has no tokenizer.json \(nor any slow tokenizer files\)"),
])
def test_other_tokenizers_are_refused(tmp_path, files, config, model_type, says):
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match=says) as e:
        slow_tokenizers.tokenizer_file(str(tmp_path), model_type)
    assert "builds it itself only from a BERT WordPiece vocab.txt (BertTokenizer, " in str(e.value)


def test_model_type_fallback_needs_bert(tmp_path):
    folder = _variant("no-class", tmp_path / "m")
    assert slow_tokenizers.tokenizer_file(str(folder), "distilbert")
    with pytest.raises(FileNotFoundError, match="model_type is 'mpnet'"):
        slow_tokenizers.tokenizer_file(str(folder), "mpnet")


def test_mpnet_folder_without_tokenizer_json_is_refused(tmp_path):
    folder = tmp_path / "mpnet"
    shutil.copytree(FIXTURES / "tiny-mpnet", folder)
    (folder / "tokenizer.json").unlink()
    (folder / "vocab.txt").write_text("[PAD]\n")
    with pytest.raises(FileNotFoundError, match=r"has no tokenizer.json \(it has vocab.txt"):
        load_checkpoint(str(folder))


def _without_tokenizer_json(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    (dst / "tokenizer.json").unlink()
    return dst


def test_minilm_from_vocab_txt_embeds_as_with_tokenizer_json(tmp_path, golden_texts, golden_mean, minilm):
    folder = _without_tokenizer_json(Path(default_model_path()), tmp_path / "minilm")
    model = mlx_embed.load(str(folder))
    assert model.max_length == minilm.max_length == 256
    assert model.encode(golden_texts) == minilm.encode(golden_texts)
    got = model.embed(golden_texts)
    np.testing.assert_array_equal(got, minilm.embed(golden_texts))
    assert_parity(got, golden_mean)


def test_reranker_from_vocab_txt_scores_as_with_tokenizer_json(tmp_path):
    folder = _without_tokenizer_json(FIXTURES / "tiny-bert-reranker", tmp_path / "tiny-bert-reranker")
    model = mlx_embed.load(str(folder))
    pairs = json.loads((folder / "pairs.json").read_text())
    assert model.encode_pairs(pairs) == mlx_embed.load(str(FIXTURES / "tiny-bert-reranker")).encode_pairs(pairs)
    assert_reranker_matches(model, "tiny-bert-reranker")
