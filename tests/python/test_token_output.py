"""Per-token output (``embed_ids(..., output="tokens")``, the server's TEI
``/embed_all``): the last hidden state of every token, no pooling, no head."""

import os

import mlx_embed
import numpy as np
import pytest
from mlx_embed.errors import InvalidInput
from mlx_embed.spec import EmbedResult

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")


def _split(result: EmbedResult, width: int) -> list[np.ndarray]:
    flat = np.frombuffer(result.vectors, dtype="<f4").reshape(-1, width)
    assert flat.shape[0] == sum(result.rows)
    return np.split(flat, np.cumsum(result.rows)[:-1])


def _pooled(model, ids) -> np.ndarray:
    r = model.embed_ids(ids)
    assert r.rows == [1] * len(ids)
    return np.frombuffer(r.vectors, dtype="<f4").reshape(len(ids), model.dim)


def test_minilm_token_rows_mean_pool_to_the_pooled_vector(minilm, golden_texts, cos):
    ids, _ = minilm.encode(golden_texts)
    r = minilm.embed_ids(ids, output="tokens")
    # One row per token the model ran, special tokens included.
    assert r.rows == [len(x) for x in ids]
    rows = _split(r, 384)
    means = np.stack([x.mean(axis=0) for x in rows])
    pooled = _pooled(minilm, ids)
    assert np.abs(means - pooled).max() <= 1e-5
    assert cos(means, pooled).min() >= 0.99999
    # Not pooled, not normalized: token rows differ from each other.
    assert np.abs(rows[0][0] - rows[0][1]).max() > 0.01
    assert abs(float(np.linalg.norm(rows[0][0])) - 1.0) > 0.01


def test_last_token_pooling_is_the_last_row(qwen, golden_texts):
    ids, _ = qwen.encode(golden_texts[:12])
    r = qwen.embed_ids(ids, output="tokens")
    assert r.rows == [len(x) for x in ids]
    last = np.stack([x[-1] for x in _split(r, qwen.dim)])
    assert np.abs(last - _pooled(qwen, ids)).max() <= 1e-5


@pytest.mark.parametrize("pipeline,workers", [(True, 1), (False, 2), (False, 1)])
def test_every_scheduling_path_gives_the_same_rows(golden_texts, pipeline, workers):
    """Many small sub-batches, planned out of input order, on each path
    (pipelined, parallel workers, one caller) give one unsplit pass's rows."""
    whole = mlx_embed.load(fast_ops="exact", pipeline=False, workers=1, batch_tokens=1 << 20)
    cut = mlx_embed.load(fast_ops="exact", pipeline=pipeline, workers=workers, batch_tokens=300)
    ids, _ = whole.encode(golden_texts)
    assert len(cut.scheduler.plan(np.array([len(x) for x in ids]))) > 5
    want = whole.embed_ids(ids, output="tokens")
    got = cut.embed_ids(ids, output="tokens")
    assert got.rows == want.rows == [len(x) for x in ids]
    a = np.frombuffer(got.vectors, "<f4")
    b = np.frombuffer(want.vectors, "<f4")
    assert a.shape == b.shape and np.abs(a - b).max() <= 1e-5


def test_embed_tokens_per_text(minilm):
    texts = ["hello world", "a somewhat longer second text for the model"]
    got = minilm.embed_tokens(texts)
    counts = minilm.count_tokens(texts)
    assert [x.shape for x in got] == [(n, 384) for n in counts]
    ids, _ = minilm.encode(texts)
    assert np.abs(got[1].mean(axis=0) - _pooled(minilm, ids)[1]).max() <= 1e-5
    # One list per text, so none for none (np.split of nothing is one piece).
    assert minilm.embed_tokens([]) == []


def test_empty_call_and_bad_requests(minilm):
    assert minilm.embed_ids([], output="tokens") == EmbedResult(b"", 0, [])
    with pytest.raises(InvalidInput, match="output must be one of pooled, tokens"):
        minilm.embed_ids([[101, 102]], output="hidden")
    with pytest.raises(InvalidInput, match="max_length"):
        minilm.embed_ids([[101] * 300], output="tokens")


def test_scorers_have_no_token_output():
    reranker = mlx_embed.load(os.path.join(FIXTURES, "tiny-bert-reranker"))
    assert reranker.kind == "reranker"
    with pytest.raises(InvalidInput, match="per-token vectors come from embedding models"):
        reranker.embed_ids([[101, 102]], output="tokens")
    # Its pooled output (the logits) is unchanged.
    assert reranker.embed_ids([[101, 102]]).rows == [1]
