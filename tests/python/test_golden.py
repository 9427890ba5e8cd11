"""Numerical parity with sentence-transformers / transformers references."""

import numpy as np
import pytest

MIN_COS = 0.99999
MAX_DIFF = 1e-5


def _report(name, got, ref, cos):
    c = cos(got, ref)
    d = np.abs(got - ref).max()
    print(f"\n{name}: min cosine {c.min():.8f}, max |diff| {d:.2e}")
    return c.min(), d


def test_mean_pooling_matches_golden(minilm, golden_texts, golden_mean, cos):
    assert minilm.pooling == "mean"
    got = minilm.embed(golden_texts)
    assert got.shape == (40, 384) and got.dtype == np.float32
    c, d = _report("minilm mean", got, golden_mean, cos)
    assert c >= MIN_COS
    assert d <= MAX_DIFF


def test_cls_pooling_matches_golden(minilm_cls, golden_texts, golden_cls, cos):
    assert minilm_cls.pooling == "cls"
    got = minilm_cls.embed(golden_texts)
    c, d = _report("minilm cls", got, golden_cls, cos)
    assert c >= MIN_COS
    assert d <= MAX_DIFF


@pytest.mark.parametrize("model_fixture", ["minilm", "qwen"])
def test_one_at_a_time_equals_batch(model_fixture, golden_texts, request):
    model = request.getfixturevalue(model_fixture)
    batch = model.embed(golden_texts)
    single = np.concatenate([model.embed([t]) for t in golden_texts])
    assert np.abs(batch - single).max() <= 1e-6


def test_golden_edge_rows(minilm, golden_texts):
    got = minilm.embed(golden_texts)
    # "" and whitespace both tokenize to [CLS][SEP]; 35/36 differ only after
    # token 256, so truncation makes them equal.
    assert np.abs(got[3] - got[4]).max() <= 1e-6
    assert np.abs(got[35] - got[36]).max() <= 1e-6


def test_qwen3_last_token_matches_reference(qwen, golden_texts, qwen_reference, cos):
    assert qwen.pooling == "last" and qwen.dim == 64
    got = qwen.embed(golden_texts)  # batched, right padded
    c, d = _report("tiny-qwen3 last-token", got, qwen_reference, cos)
    assert c >= MIN_COS
    assert d <= MAX_DIFF


def test_parallel_workers_equal_serial(minilm, golden_texts):
    import mlx_embed

    assert minilm.workers == 2 or minilm.workers == 1
    serial = mlx_embed.load(workers=1, batch_tokens=minilm.batch_tokens)
    a = serial.embed(golden_texts)
    b = minilm.embed(golden_texts)
    assert np.abs(a - b).max() <= 1e-6
