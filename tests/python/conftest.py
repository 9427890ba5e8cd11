"""Shared fixtures: every model is loaded once per test session."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
GOLDEN = FIXTURES / "golden"
TINY_QWEN3 = FIXTURES / "tiny-qwen3"

# Until the package is installed (pyproject/maturin), import it from the tree.
if str(ROOT / "python") not in sys.path:
    sys.path.insert(0, str(ROOT / "python"))

import mlx_embed  # noqa: E402  (must come before anything imports mlx.core)


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


# Parity with a reference: what every architecture's fixture is held to.
MIN_COS = 0.99999
MAX_DIFF = 1e-5

_loaded: dict = {}


def load_fixture(folder, **kw):
    """``mlx_embed.load`` of a fixture folder (a name under tests/fixtures or
    a path), once per test session for the same options."""
    key = (str(folder), tuple(sorted(kw.items())))
    if key not in _loaded:
        _loaded[key] = mlx_embed.load(FIXTURES / folder, **kw)
    return _loaded[key]


def assert_parity(got: np.ndarray, ref: np.ndarray, normalized: bool = True) -> None:
    """float32 rows with cosine >= MIN_COS to the reference's and max |diff|
    <= MAX_DIFF (relative to the reference's scale when it is unnormalized:
    those are O(1..10) in size)."""
    assert got.shape == ref.shape and got.dtype == np.float32
    cos = _cos(got, ref)
    diff = np.abs(got - ref).max()
    print(f"min cosine {cos.min():.8f}, max |diff| {diff:.2e}")
    assert cos.min() >= MIN_COS
    assert diff <= MAX_DIFF * (1.0 if normalized else max(1.0, float(np.abs(ref).max())))


def assert_reranker_matches(model, folder, alone=(0, 3, 35, 40, 41)) -> np.ndarray:
    """A reranker fixture's pairs (``pairs.json``) scored in one call: raw
    logits to rtol 1e-5 + atol 1e-5 (they reach several units) and sigmoid
    scores to 1e-5 of the references, which spread; the pairs ``alone``
    (40, 41: the over-long query, both sides cut) score as in the batch.

    The absolute part grows past 1e-5 with the largest logit (2e-6 of it):
    a logit near zero carries the float32 rounding of a network whose other
    logits reach +-12, and that rounding follows the CPU's BLAS kernel (on
    an AMD Zen 4, tiny-mpnet-reranker's pair 25 is 1.9e-6 against -1.05e-5)."""
    folder = FIXTURES / folder
    pairs = json.loads((folder / "pairs.json").read_text())
    logits = model.score(pairs, raw_scores=True)
    ref_logits = np.load(folder / "reference_pair_logits.npy")
    atol = 2e-6 * max(5.0, float(np.abs(ref_logits).max()))
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=atol)
    ref = np.load(folder / "reference_pair_scores.npy")
    assert np.abs(model.score(pairs)[:, 0] - ref).max() <= 1e-5
    assert ref.max() - ref.min() > 0.5
    for i in alone:
        one = float(model.score([pairs[i]], raw_scores=True)[0, 0])
        assert abs(one - float(logits[i, 0])) <= 1e-5 * max(1.0, abs(float(logits[i, 0]))), i
    return logits


def assert_pairs_match_tokenizer(model, folder, max_len: int = 128, cut: int = 8) -> list:
    """A reranker fixture's pairs as the model encodes them: the ids, and
    the type ids when it sends any, are the tokenizers library's own pair
    encoding with longest_first truncation at ``max_len``, ``cut`` pairs
    being cut there. Returns the library's encodings."""
    from tokenizers import Tokenizer

    folder = FIXTURES / folder
    pairs = json.loads((folder / "pairs.json").read_text())
    ids, types, before = model.encode_pairs(pairs)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_len, strategy="longest_first")
    encs = tok.encode_batch([tuple(p) for p in pairs])
    assert ids == [e.ids for e in encs]
    if types is not None:
        assert types == [e.type_ids for e in encs]
    assert sum(n > max_len for n in before) == cut
    return encs


def copy_fixture(folder: str, dst, **edit):
    """The fixture copied to dst with config.json keys set (None: removed)."""
    shutil.copytree(FIXTURES / folder, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in edit.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="session")
def cos():
    return _cos


@pytest.fixture(scope="session")
def golden_texts() -> list[str]:
    return json.loads((GOLDEN / "minilm_texts.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def golden_mean() -> np.ndarray:
    return np.load(GOLDEN / "minilm_mean_normalized.npy")


@pytest.fixture(scope="session")
def golden_cls() -> np.ndarray:
    return np.load(GOLDEN / "minilm_cls_normalized.npy")


@pytest.fixture(scope="session")
def qwen_reference() -> np.ndarray:
    return np.load(TINY_QWEN3 / "reference_last_token_normalized.npy")


@pytest.fixture(scope="session")
def minilm():
    return mlx_embed.load()


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    from mlx_embed.loading import default_model_path

    return Path(default_model_path())


@pytest.fixture(scope="session")
def minilm_cls(tmp_path_factory, minilm_dir):
    """The bundled model with a 1_Pooling/config.json that selects CLS, so the
    real config-reading path is what picks the pooling."""
    d = tmp_path_factory.mktemp("minilm-cls")
    for item in minilm_dir.iterdir():
        if item.name != "1_Pooling":
            os.symlink(item, d / item.name)
    (d / "1_Pooling").mkdir()
    cfg = json.loads((minilm_dir / "1_Pooling" / "config.json").read_text())
    cfg.update(pooling_mode_cls_token=True, pooling_mode_mean_tokens=False)
    (d / "1_Pooling" / "config.json").write_text(json.dumps(cfg))
    return mlx_embed.load(d)


@pytest.fixture(scope="session")
def qwen():
    # The reference was made with 128-token truncation (see its README).
    return mlx_embed.load(TINY_QWEN3, max_length=128)


@pytest.fixture
def query_block_counts(monkeypatch) -> list:
    """How many query blocks each attention call took (``ops.query_blocks``)."""
    from mlx_embed import ops

    seen = []
    real = ops.query_blocks

    def spy(q, keys):
        blocks = real(q, keys)
        seen.append(len(blocks))
        return blocks

    monkeypatch.setattr(ops, "query_blocks", spy)
    return seen
