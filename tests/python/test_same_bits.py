"""One L2 normalization and one scoring for the server and the library:
``pooling.unit_rows`` runs the server's ``l2_normalize`` and
``scoring.activate`` its ``mlx_embed_core::activate`` (through the extension); the
NumPy fallbacks repeat that arithmetic, and every library path that
normalizes goes through ``unit_rows`` (tests/e2e/test_server_library_bits.py
holds the server to the same bits)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import load_fixture

import mlx_embed
from mlx_embed import ops, pooling


def _rows(width: int, n: int = 33, seed: int = 0) -> np.ndarray:
    """Rows of mixed magnitudes (a few large components among small ones)."""
    rng = np.random.default_rng(seed + width)
    x = rng.standard_normal((n, width)).astype(np.float32)
    x[:, ::5] *= 1e3
    return x


def _nearest_unit(x: np.ndarray) -> np.ndarray:
    """The float64 quotients by the float64 norm, each rounded once."""
    wide = x.astype(np.float64)
    norm = np.maximum(np.sqrt((wide * wide).sum(axis=-1, keepdims=True)), 1e-12)
    return (wide / norm).astype(np.float32)


@pytest.mark.parametrize("width", [1, 7, 8, 9, 17, 64, 384, 1024, 4097])
def test_fallback_is_the_extension_bit_for_bit(width):
    # `make build` builds the extension with it: a stale one is a failure, not a skip.
    assert hasattr(ops._native, "unit_rows_"), "the extension predates unit_rows_: rebuild it (make build)"
    x = _rows(width)
    native = pooling.unit_rows(x)
    assert native.dtype == np.float32 and native.shape == x.shape
    assert np.array_equal(native, pooling._unit_rows_like_native(x))
    # Each component the float32 nearest its exact value (ties aside: none here).
    assert np.array_equal(native, _nearest_unit(x))


def test_without_the_extension_the_same_bits(monkeypatch):
    x = _rows(384)
    want = pooling.unit_rows(x)
    monkeypatch.setattr(ops, "_native", None)
    assert np.array_equal(pooling.unit_rows(x), want)


def test_unit_rows_copies_and_takes_any_layout():
    x = _rows(48)
    before = x.copy()
    got = pooling.unit_rows(x)
    assert np.array_equal(x, before), "the input was written"
    assert np.array_equal(pooling.unit_rows(np.asfortranarray(x)), got)
    assert np.array_equal(pooling.unit_rows(mx.array(x)), got)
    assert np.array_equal(pooling.unit_rows(x.astype(np.float64)), got)
    # Any leading shape; an empty one stays empty.
    assert np.array_equal(pooling.unit_rows(x.reshape(3, 11, 48)), got.reshape(3, 11, 48))
    assert pooling.unit_rows(np.zeros((0, 48), np.float32)).shape == (0, 48)
    # A zero row stays zero (eps 1e-12, as sentence-transformers).
    assert not pooling.unit_rows(np.zeros((2, 5), np.float32)).any()


def test_a_row_with_a_nan_or_an_infinity_is_left_as_the_others_leave_it(monkeypatch):
    """A NaN component makes the whole row NaN, as sentence-transformers'
    clamp_min, NumPy's maximum and MLX leave it (and the fallback here);
    an infinite one NaN there and zero elsewhere; huge finite components
    do not overflow (float64 squares). Before: the extension's norm took
    ``f64::max(NaN, 1e-12)`` = 1e-12, answering [nan, 1e12, 2e12]."""
    x = np.array(
        [[np.nan, 1.0, 2.0], [np.inf, 1.0, 0.0], [-np.inf, np.inf, 1.0], [3e38, 3e38, 1.0], [0.0, 0.0, 0.0]],
        np.float32,
    )
    with np.errstate(invalid="ignore"):
        got = pooling.unit_rows(x)
        assert np.isnan(got[0]).all(), got[0]
        assert np.isnan(got[1, 0]) and np.array_equal(got[1, 1:], [0.0, 0.0]), got[1]
        assert np.isnan(got[2, :2]).all() and got[2, 2] == 0.0, got[2]
        assert np.array_equal(got[3], _nearest_unit(x[3:4])[0]) and abs(got[3, 0] - 0.70710677) < 1e-7
        assert not got[4].any()
        monkeypatch.setattr(ops, "_native", None)
        np.testing.assert_array_equal(pooling.unit_rows(x), got)


@pytest.mark.parametrize("multi_label", [False, True])
def test_scores_at_extreme_logits_are_the_fallbacks(multi_label, monkeypatch):
    """Logits of +-1e4 (a saturated classifier) and NaN: no overflow into a
    wrong score, and the extension's scores are NumPy's fallback's."""
    from mlx_embed import scoring

    logits = np.array(
        [[1e4, -1e4, 0.0], [-1e4, -1e4, -1e4], [1e4, 1e4, 1e4], [np.nan, 1.0, 2.0], [np.inf, 1.0, 0.0]],
        np.float32,
    )
    got = scoring.activate(logits, multi_label)
    if multi_label:
        np.testing.assert_array_equal(got[0], [1.0, 0.0, 0.5])
        assert np.isnan(got[3, 0]) and not np.isnan(got[3, 1:]).any()
    else:
        np.testing.assert_array_equal(got[0], [1.0, 0.0, 0.0])
        np.testing.assert_array_equal(got[1], np.full(3, np.float32(1 / 3)))
        np.testing.assert_array_equal(got[2], np.full(3, np.float32(1 / 3)))
        assert np.isnan(got[3]).all()
    one = scoring.activate(np.array([[1e4], [-1e4], [np.nan]], np.float32))
    assert one[0, 0] == 1.0 and one[1, 0] == 0.0 and np.isnan(one[2, 0])
    monkeypatch.setattr(ops, "_native", None)
    with np.errstate(over="ignore", invalid="ignore"):
        np.testing.assert_array_equal(scoring.activate(logits, multi_label), got)


@pytest.mark.parametrize("settings", [{}, {"fast_ops": "mlx"}, {"pipeline": True}])
def test_embed_normalizes_with_unit_rows(minilm, golden_texts, settings):
    """Whatever path the passes take (host pooling, MLX pooling, pipelined),
    a normalized vector is unit_rows of the raw one, to the last bit."""
    model = mlx_embed.load(**settings) if settings else minilm
    raw = model.embed(golden_texts, normalize=False)
    assert np.array_equal(model.embed(golden_texts), pooling.unit_rows(raw))


def test_multi_vector_rows_normalize_with_unit_rows(golden_texts):
    colbert = load_fixture("tiny-colbert")
    texts = golden_texts[:6]
    raw = colbert.embed_multi_vector(texts, normalize=False)
    unit = colbert.embed_multi_vector(texts)
    for r, u in zip(raw, unit):
        assert np.array_equal(u, pooling.unit_rows(r))


@pytest.mark.parametrize("labels,multi_label", [(1, False), (3, False), (9, False), (4, True)])
def test_scores_are_the_servers_and_the_fallback_rounds_alike(labels, multi_label, monkeypatch):
    """``scoring.activate`` is the server's ``mlx_embed_core::activate`` (float64,
    each score rounded once); NumPy's arithmetic without the extension
    gives the same floats here."""
    from mlx_embed import scoring

    logits = (np.random.default_rng(labels).standard_normal((200, labels)) * 4).astype(np.float32)
    got = scoring.activate(logits, multi_label)
    assert got.dtype == np.float32 and got.shape == logits.shape
    x = logits.astype(np.float64)
    if labels == 1 or multi_label:
        want = 1.0 / (1.0 + np.exp(-x))
    else:
        e = np.exp(x - x.max(axis=1, keepdims=True))
        want = e / e.sum(axis=1, keepdims=True)
    assert np.abs(got - want).max() <= 6e-8
    monkeypatch.setattr(ops, "_native", None)
    assert np.array_equal(scoring.activate(logits, multi_label), got)
