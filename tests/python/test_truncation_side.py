"""A folder's truncation side is the default cut, read where transformers
reads it: sentence-transformers' tokenizer_args, then tokenizer_config.json's
``truncation_side``, then the direction of the truncation baked into
tokenizer.json (transformers 5.24 sets ``truncation_side`` from it when the
config says none), else right; ``load(truncation_side=)`` is over all of
them. The expected ids are the ``tokenizers`` library's own left cut."""

from __future__ import annotations

import json
import shutil

import mlx_embed
import numpy as np
import pytest
from conftest import FIXTURES
from tokenizers import Tokenizer

LONG = "the start of it " + " ".join(f"word{i % 37} middle" for i in range(400)) + " and the very end"
TEXTS = [LONG, "a short one", "another " * 200 + "tail"]


def _copy(name: str, dest, *, config=None, baked: str | None = None):
    """Fixture ``name`` copied to ``dest``, with ``config`` merged into its
    tokenizer_config.json and, with ``baked``, a truncation of that
    direction written into its tokenizer.json (as MiniLM's has one)."""
    shutil.copytree(FIXTURES / name, dest)
    if config:
        cfg = json.loads((dest / "tokenizer_config.json").read_text())
        (dest / "tokenizer_config.json").write_text(json.dumps({**cfg, **config}))
    if baked:
        tok = json.loads((dest / "tokenizer.json").read_text())
        tok["truncation"] = {"direction": baked, "max_length": 16, "strategy": "LongestFirst", "stride": 0}
        (dest / "tokenizer.json").write_text(json.dumps(tok))
    return dest


def _reference_ids(folder, max_length: int, direction: str, texts) -> list[list[int]]:
    """What the tokenizers library cuts (transformers' fast tokenizers call it
    with the tokenizer's truncation_side)."""
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_length, direction=direction)
    return [e.ids for e in tok.encode_batch(texts)]


@pytest.fixture(scope="module")
def plain():
    return mlx_embed.load(FIXTURES / "tiny-mpnet")


def test_a_left_folder_cuts_as_the_tokenizers_library_does(tmp_path, plain):
    folder = _copy("tiny-mpnet", tmp_path / "left", config={"truncation_side": "left"})
    model = mlx_embed.load(folder)
    assert (model.truncation_side, model.spec().tokenizer.truncation_side) == ("left", "left")
    ids, before = model.encode(TEXTS)
    want = _reference_ids(folder, model.max_length, "left", TEXTS)
    assert ids == want
    assert [len(i) for i in ids] == [model.max_length, 5, model.max_length]
    assert before[0] > 800
    # The kept end: the text's last tokens, between its [CLS] and [SEP].
    full = _reference_ids(folder, 4096, "left", TEXTS)[0]
    assert ids[0][1:-1] == full[-(model.max_length - 1):-1]
    assert (ids[0][0], ids[0][-1]) == (full[0], full[-1])
    # A call that names a side still gets it.
    assert model.encode(TEXTS, truncation_direction="right")[0] == _reference_ids(
        folder, model.max_length, "right", TEXTS)

    got = model.embed(TEXTS)
    assert np.array_equal(got, plain.embed(TEXTS, truncation_direction="left"))
    assert np.array_equal(got, model.embed(TEXTS, truncation_direction="left"))
    right = model.embed(TEXTS, truncation_direction="right")
    assert np.array_equal(right, plain.embed(TEXTS))
    assert np.abs(got[0] - right[0]).max() > 1e-2
    assert np.array_equal(got[1], right[1])  # under the limit: no cut at all


def test_the_direction_baked_into_tokenizer_json_is_the_default(tmp_path, plain):
    """tokenizer.json's truncation (direction Left) with no truncation_side in
    tokenizer_config.json: transformers' tokenizer cuts on the left (its
    max_length of 16 is not the model's cut: only its side counts); a
    truncation_side in tokenizer_config.json wins over it."""
    baked = mlx_embed.load(_copy("tiny-mpnet", tmp_path / "baked", baked="Left"))
    assert baked.truncation_side == "left"
    assert baked.max_length == plain.max_length
    assert baked.encode(TEXTS)[0] == plain.encode(TEXTS, truncation_direction="left")[0]
    assert np.array_equal(baked.embed(TEXTS), plain.embed(TEXTS, truncation_direction="left"))
    stated = mlx_embed.load(
        _copy("tiny-mpnet", tmp_path / "stated", config={"truncation_side": "right"}, baked="Left"))
    assert stated.truncation_side == "right"
    assert stated.encode(TEXTS)[0] == plain.encode(TEXTS)[0]
    assert mlx_embed.load(_copy("tiny-mpnet", tmp_path / "right", baked="Right")).truncation_side == "right"


def test_load_truncation_side_is_over_the_folder(tmp_path, plain):
    folder = _copy("tiny-mpnet", tmp_path / "left", config={"truncation_side": "left"})
    model = mlx_embed.load(folder, truncation_side="right")
    assert (model.truncation_side, model.spec().tokenizer.truncation_side) == ("right", "right")
    assert model.encode(TEXTS)[0] == plain.encode(TEXTS)[0]
    assert mlx_embed.load(FIXTURES / "tiny-mpnet", truncation_side="left").truncation_side == "left"


def test_a_left_reranker_folder_cuts_pairs_longest_first_from_the_left(tmp_path):
    """sentence-transformers' CrossEncoder tokenizes a pair with
    truncation=True (longest_first) on the tokenizer's side: the longer text
    loses tokens from its start."""
    folder = _copy("tiny-bert-reranker", tmp_path / "left", config={"truncation_side": "left"})
    model = mlx_embed.load(folder)
    assert model.truncation_side == "left"
    pairs = [("what is at the end of it", LONG), ("short query", "short document")]
    ids, types, _ = model.encode_pairs(pairs)
    ref = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ref.no_padding()
    ref.enable_truncation(model.max_length, strategy="longest_first", direction="left")
    want = [ref.encode(q, d) for q, d in pairs]
    assert ids == [e.ids for e in want]
    assert types == [e.type_ids for e in want]
    assert len(ids[0]) == model.max_length
    right_ids = model.encode_pairs(pairs, truncation_direction="right")[0]
    assert right_ids[0] != ids[0] and right_ids[1] == ids[1]
    scores = model.score(pairs, raw_scores=True)
    assert np.array_equal(scores, model.score(pairs, truncation_direction="left", raw_scores=True))
    right = model.score(pairs, truncation_direction="right", raw_scores=True)
    assert scores[0] != right[0] and scores[1] == right[1]
