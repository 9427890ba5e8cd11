"""API contract: shapes, errors, counts and the server-facing embed_raw."""

import json

import numpy as np
import pytest

import mlx_embed
from conftest import TINY_QWEN3


def test_model_attributes(minilm):
    assert minilm.dim == 384
    assert minilm.max_length == 256  # sentence_bert_config.json, not tokenizer.json's 128
    assert minilm.name == "all-MiniLM-L6-v2"
    assert minilm.model_type == "bert"


def test_empty_list(minilm, qwen):
    assert minilm.embed([]).shape == (0, 384)
    assert qwen.embed([]).shape == (0, 64)
    assert minilm.embed([]).dtype == np.float32
    b, counts, before, padded = minilm.embed_raw([])
    assert (b, counts, before, padded) == (b"", [], [], 0)


def test_empty_string_embeds(minilm, golden_texts, golden_mean):
    assert golden_texts[3] == ""
    vec, counts = minilm.embed_with_counts([""])
    assert counts == [2]  # [CLS][SEP]
    assert np.abs(vec[0] - golden_mean[3]).max() <= 1e-5


def test_non_string_raises_type_error(minilm):
    with pytest.raises(TypeError, match=r"texts\[1\]"):
        minilm.embed(["ok", 3])
    with pytest.raises(TypeError):
        minilm.embed("a bare string")
    with pytest.raises(TypeError):
        minilm.embed([None])


def test_truncate_false_names_index_and_count(minilm, golden_texts):
    long_text = golden_texts[35]
    n = minilm.embed_raw([long_text])[2][0]
    assert n > 256
    with pytest.raises(ValueError) as e:
        minilm.embed(["short", long_text], truncate=False)
    msg = str(e.value)
    assert "text 1" in msg and str(n) in msg and "256" in msg
    # Truncation on (the default) just cuts it.
    vec, counts = minilm.embed_with_counts(["short", long_text])
    assert counts[1] == 256 and vec.shape == (2, 384)


def test_rows_in_input_order_with_counts(minilm, golden_texts):
    texts = golden_texts[::-1]
    vec, counts = minilm.embed_with_counts(texts)
    ref, ref_counts = minilm.embed_with_counts(golden_texts)
    assert np.abs(vec - ref[::-1]).max() <= 1e-6
    assert counts == ref_counts[::-1]
    assert all(2 <= c <= 256 for c in counts)


def test_embed_raw_matches_embed(minilm, golden_texts):
    raw, counts, before, padded = minilm.embed_raw(golden_texts)
    arr = np.frombuffer(raw, dtype="<f4").reshape(len(golden_texts), minilm.dim)
    ref, ref_counts = minilm.embed_with_counts(golden_texts, normalize=False)
    assert np.abs(arr - ref).max() <= 1e-6
    assert counts == ref_counts
    # Unnormalized: MiniLM mean vectors are nowhere near unit length.
    assert not np.allclose(np.linalg.norm(arr, axis=1), 1.0, atol=1e-3)
    # Counts before truncation exceed max_length exactly for the long rows.
    for c, b in zip(counts, before):
        assert (c == b) if b <= 256 else (c == 256)
    assert max(before) > 256
    # Padded work is at least the real tokens and at most one budget per row.
    assert sum(counts) <= padded <= len(counts) * minilm._bucket(max(counts))


def test_token_id_input_equals_text(minilm):
    text = "The quick brown fox jumps over the lazy dog."
    ids = minilm.tokenizer.encode_contents([text])[0]
    raw, counts, before, _ = minilm.embed_raw([text, ids, []])
    arr = np.frombuffer(raw, dtype="<f4").reshape(3, -1)
    assert np.abs(arr[0] - arr[1]).max() <= 1e-6
    assert counts[0] == counts[1] == len(ids) + 2
    assert before[0] == before[1]
    empty = minilm.embed([""], normalize=False)
    # Unnormalized vectors have |x| up to ~1, so allow float32 round-off.
    assert np.abs(arr[2] - empty[0]).max() <= 1e-5
    assert counts[2] == 2


def test_token_id_input_truncates(minilm):
    raw, counts, before, _ = minilm.embed_raw([[1000] * 400])
    assert counts == [256] and before == [402]


def test_token_id_validation(minilm):
    with pytest.raises(ValueError, match="input 1"):
        minilm.embed_raw(["ok", [101, 30522]])
    with pytest.raises(ValueError, match="input 0"):
        minilm.embed_raw([[-1]])
    with pytest.raises(TypeError, match="input 0"):
        minilm.embed_raw([[1.5]])
    with pytest.raises(TypeError, match="input 2"):
        minilm.embed_raw(["a", [5], 7])


def test_qwen3_token_ids_and_counts(qwen, golden_texts):
    text = golden_texts[0]
    ids = qwen.tokenizer.encode_contents([text])[0]
    raw, counts, _, _ = qwen.embed_raw([text, ids])
    arr = np.frombuffer(raw, dtype="<f4").reshape(2, -1)
    assert np.abs(arr[0] - arr[1]).max() <= 1e-6
    assert counts == [len(ids) + 2] * 2  # its BERT tokenizer adds [CLS] ... [SEP]


def test_qwen3_instruction(qwen):
    q = "what is the capital of France?"
    prefixed = "Instruct: find the answer\nQuery: " + q
    a = qwen.embed([q], instruction="find the answer")
    b = qwen.embed([prefixed])
    assert np.abs(a - b).max() <= 1e-6
    assert np.abs(a - qwen.embed([q])).max() > 1e-3


def test_instruction_rejected_for_bert(minilm):
    with pytest.raises(ValueError, match="qwen3"):
        minilm.embed(["x"], instruction="y")


def test_info(minilm, qwen):
    info = minilm.info()
    assert set(info) >= {
        "name", "dim", "max_length", "dtype", "pooling", "model_type", "blas",
        "blas_gflops", "preferred_batch_tokens", "quantization",
    }
    assert info["dim"] == 384 and info["max_length"] == 256
    assert info["elementwise_ops"] in ("native (avx2+fma)", "native (generic)")
    assert info["workers"] == minilm.workers
    assert info["dtype"] == "float32" and info["pooling"] == "mean"
    assert info["model_type"] == "bert" and info["quantization"] is None
    assert isinstance(info["preferred_batch_tokens"], int) and info["preferred_batch_tokens"] >= 256
    assert qwen.info()["pooling"] == "last"
    json.dumps(info)  # the Rust side reads it as plain data


def test_sub_batches_respect_token_budget(minilm):
    lengths = np.array([5, 300, 7, 250, 3, 120, 120, 9])
    minilm_budget = minilm.batch_tokens
    batches = minilm._plan(lengths)
    seen = sorted(i for b in batches for i in b)
    assert seen == list(range(len(lengths)))
    for b in batches:
        if len(b) > 1:
            assert lengths[b].max() * len(b) <= minilm_budget
    # Shortest first: a long text never pads the short ones.
    assert set(batches[0]) >= {0, 2, 4, 7}


def test_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError) as e:
        mlx_embed.load(tmp_path)
    assert "gpt2" in str(e.value) and "bert" in str(e.value) and "qwen3" in str(e.value)


def test_fault_hook(monkeypatch, golden_texts):
    monkeypatch.setenv("MLX_EMBED_TEST_FAULT", "@@boom@@")
    m = mlx_embed.load(TINY_QWEN3)
    with pytest.raises(RuntimeError, match="injected test fault on input 1"):
        m.embed_raw(["fine", "x @@boom@@ y"])
    with pytest.raises(RuntimeError, match="injected test fault on input 0"):
        m.embed(["@@boom@@"])
    assert m.embed(["fine"]).shape == (1, 64)


def test_fault_hook_off_by_default(qwen):
    assert qwen._fault_marker is None
