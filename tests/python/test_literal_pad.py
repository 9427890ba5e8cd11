"""A literal ``<pad>`` inside a text, on the models whose positions
transformers numbers from the ids (RoBERTa family, MPNet): the padding id
takes position ``padding_idx`` and does not advance the count. References:
tests/fixtures/literal-pad (sentence-transformers, one text per call;
scripts/fixtures/make_literal_pad.py)."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import FIXTURES, load_fixture

import mlx_embed
from mlx_embed import ops

CASES = json.loads((FIXTURES / "literal-pad" / "cases.json").read_text(encoding="utf-8"))
TEXTS = CASES["texts"]


def _assert_close(got: np.ndarray, want: np.ndarray) -> None:
    # Unit vectors (the camembert fixture's pipeline has no Normalize).
    want = want / np.linalg.norm(want, axis=1, keepdims=True)
    cos = (got * want).sum(axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cos.min() >= 0.99999, cos
    assert np.abs(got - want).max() <= 1e-5


@pytest.mark.parametrize("name", sorted(CASES["references"]))
def test_literal_pad_matches_sentence_transformers(name):
    model = load_fixture(FIXTURES / name)
    assert model.encode(TEXTS)[0] == CASES["ids"][name]
    want = np.array(CASES["references"][name], dtype=np.float32)
    # All at once (rows with and without inner pads share passes), and one by one.
    _assert_close(np.asarray(model.embed(TEXTS)), want)
    _assert_close(np.stack([np.asarray(model.embed([t]))[0] for t in TEXTS]), want)


@pytest.mark.parametrize("name", ["tiny-xlm-roberta", "tiny-mpnet"])
def test_literal_pad_on_mlx_ops_too(name):
    """The MLX path (not the CPU's native encoder) numbers them the same."""
    model = mlx_embed.load(FIXTURES / name, fast_ops="mlx")
    want = np.array(CASES["references"][name], dtype=np.float32)
    _assert_close(np.asarray(model.embed(TEXTS)), want)


def test_positions_from_ids():
    ids = mx.array(np.array([[0, 5, 1, 6, 2, 1, 1], [0, 5, 6, 2, 1, 1, 1]], dtype=np.int32))
    # Row 0 has a padding id before real tokens: transformers' numbering.
    got = ops.positions_from_ids(ids, 1)
    assert got.tolist() == [[2, 3, 1, 4, 5, 1, 1], [2, 3, 4, 5, 1, 1, 1]]
    # Padding only at the ends: the plain run is exact, so none.
    assert ops.positions_from_ids(ids[1:], 1) is None
