"""API contract of the Python library: shapes, errors, counts, prompts, truncation."""

import json

import mlx_embed
import numpy as np
import pytest
from mlx_embed.errors import InvalidInput


def test_model_attributes(minilm):
    assert minilm.dim == 384
    assert minilm.max_length == 256  # sentence_bert_config.json, not tokenizer.json's 128
    assert minilm.name == "all-MiniLM-L6-v2"
    assert minilm.model_type == "bert"


def test_empty_list(minilm, qwen):
    assert minilm.embed([]).shape == (0, 384)
    assert qwen.embed([]).shape == (0, 64)
    assert minilm.embed([]).dtype == np.float32
    assert minilm.encode([]) == ([], [])


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
    with pytest.raises(TypeError, match=r"texts\[1\] must be str, got int"):
        minilm.embed(np.array(["ok", 3], dtype=object))


def test_an_array_of_strings_embeds_as_its_list(minilm, golden_texts):
    """sentence-transformers' encode takes a NumPy array of strings."""
    texts = [t for t in golden_texts[:6] if t]
    np.testing.assert_array_equal(minilm.embed(np.array(texts)), minilm.embed(texts))


def test_a_lone_surrogate_is_refused_naming_the_text(minilm):
    with pytest.raises(InvalidInput, match=r"texts\[1\] is not text: a lone surrogate at position 2"):
        minilm.embed(["fine", "ab\ud800cd"])


def test_truncate_false_names_index_and_count(minilm, golden_texts):
    long_text = golden_texts[35]
    n = minilm.encode([long_text])[1][0]
    assert n > 256
    with pytest.raises(InvalidInput) as e:
        minilm.embed(["short", long_text], truncate=False)
    msg = str(e.value)
    assert "text 1" in msg and str(n) in msg and "256" in msg
    # Truncation on (the default) just cuts it.
    vec, counts = minilm.embed_with_counts(["short", long_text])
    assert counts[1] == 256 and vec.shape == (2, 384)


def test_left_truncation_keeps_the_end(minilm, golden_texts):
    long_text = golden_texts[35]
    content = minilm.tokenizer.encode_contents([long_text])[0]
    assert len(content) > 254
    (right,), _ = minilm.encode([long_text])
    (left,), _ = minilm.encode([long_text], truncation_direction="left")
    assert right == [101] + content[:254] + [102]
    assert left == [101] + content[-254:] + [102]
    a = minilm.embed([long_text], truncation_direction="left")
    b = np.frombuffer(minilm.embed_ids([left]).vectors, "<f4")
    assert np.abs(a[0] - b / np.linalg.norm(b)).max() <= 1e-6
    assert np.abs(a - minilm.embed([long_text])).max() > 1e-3
    with pytest.raises(InvalidInput, match="truncation_direction"):
        minilm.embed(["x"], truncation_direction="middle")


def test_truncate_to_cuts_shorter_than_the_model(minilm, golden_texts):
    """``truncate_to`` cuts at that many tokens, specials included, on either
    side, as the server's per-request cut does; over the maximum it is the
    maximum; too short for [CLS] and [SEP] or not a count it is refused."""
    long_text = golden_texts[35]
    content = minilm.tokenizer.encode_contents([long_text])[0]
    (right,), (before,) = minilm.encode([long_text], truncate_to=10)
    assert right == [101] + content[:8] + [102] and before == len(content) + 2
    (left,), _ = minilm.encode([long_text], truncate_to=10, truncation_direction="left")
    assert left == [101] + content[-8:] + [102]
    vec, counts = minilm.embed_with_counts([long_text, "short"], truncate_to=10)
    assert counts == [10, 3]
    b = np.frombuffer(minilm.embed_ids([right]).vectors, "<f4")
    assert np.abs(vec[0] - b / np.linalg.norm(b)).max() <= 1e-6
    assert minilm.encode([long_text], truncate_to=100_000) == minilm.encode([long_text])
    assert minilm.encode([long_text], truncate_to=np.int64(10))[0] == [right]
    with pytest.raises(InvalidInput, match="text 0 has .* more than truncate_to=10"):
        minilm.embed([long_text], truncate_to=10, truncate=False)
    assert minilm.count_tokens(["short"], truncate_to=3, truncate=False) == [3]
    with pytest.raises(InvalidInput, match="leaves no room for text"):
        minilm.embed(["short"], truncate_to=2)
    for bad in (0, -1, 2.5, True, "10"):
        with pytest.raises(InvalidInput, match="truncate_to must be"):
            minilm.embed(["short"], truncate_to=bad)


def test_rows_in_input_order_with_counts(minilm, golden_texts):
    texts = golden_texts[::-1]
    vec, counts = minilm.embed_with_counts(texts)
    ref, ref_counts = minilm.embed_with_counts(golden_texts)
    assert np.abs(vec - ref[::-1]).max() <= 1e-6
    assert counts == ref_counts[::-1]
    assert all(2 <= c <= 256 for c in counts)


def test_count_tokens_matches_encode(minilm, golden_texts):
    ids, before = minilm.encode(golden_texts)
    assert minilm.count_tokens(golden_texts) == [len(x) for x in ids]
    for x, b in zip(ids, before):
        assert len(x) == min(b, 256)


def test_qwen3_instruction(qwen):
    q = "what is the capital of France?"
    prefixed = "Instruct: find the answer\nQuery:" + q
    a = qwen.embed([q], instruction="find the answer")
    b = qwen.embed([prefixed])
    assert np.abs(a - b).max() <= 1e-6
    assert np.abs(a - qwen.embed([q])).max() > 1e-3
    assert np.abs(a - qwen.embed([q], prompt="Instruct: find the answer\nQuery:")).max() <= 1e-6


def test_instruction_rejected_for_bert(minilm):
    with pytest.raises(ValueError, match="instruction prefixes are not defined for bert"):
        minilm.embed(["x"], instruction="y")


def test_info(minilm, qwen):
    info = minilm.info()
    assert set(info) >= {
        "name", "dim", "max_length", "dtype", "pooling", "model_type", "blas",
        "blas_gflops", "device_batch_tokens", "quantization", "device", "memory",
    }
    assert info["dim"] == 384 and info["max_length"] == 256
    assert info["elementwise_ops"] in ("native (avx512f)", "native (avx2+fma)", "native (generic)")
    assert info["workers"] == minilm.workers
    assert info["dtype"] == "float32" and info["pooling"] == "mean"
    assert info["model_type"] == "bert" and info["quantization"] is None
    assert info["device"].startswith("cpu")
    assert info["device_batch_tokens"] == 256
    assert qwen.info()["pooling"] == "last"
    json.dumps(info)  # plain data


def test_sub_batches_respect_token_budget(minilm):
    lengths = np.array([5, 300, 7, 250, 3, 120, 120, 9])
    budget = minilm.batch_tokens
    batches = minilm.scheduler.plan(lengths)
    seen = sorted(i for b in batches for i in b)
    assert seen == list(range(len(lengths)))
    for b in batches:
        if len(b) > 1:
            assert lengths[b].max() * len(b) <= budget
    # Shortest first: a long text never pads the short ones.
    assert set(batches[0]) >= {0, 2, 4, 7}


def test_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError) as e:
        mlx_embed.load(tmp_path)
    assert "gpt2" in str(e.value) and "bert" in str(e.value) and "qwen3" in str(e.value)


def test_a_bad_model_folder_is_named_with_what_is_wrong(tmp_path):
    """A missing folder said "has no config.json"; a config.json or
    tokenizer.json that does not parse failed without the file's name."""
    import shutil

    from conftest import ROOT

    with pytest.raises(FileNotFoundError, match=f"^{tmp_path / 'nope'} does not exist$"):
        mlx_embed.load(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileNotFoundError, match=f"^{tmp_path / 'file'} is not a folder$"):
        mlx_embed.load(tmp_path / "file")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "bert",')
    with pytest.raises(ValueError, match=f"^{broken / 'config.json'} is not valid JSON: "):
        mlx_embed.load(broken)
    folder = tmp_path / "bert"
    shutil.copytree(ROOT / "tests" / "fixtures" / "tiny-mpnet", folder)
    (folder / "tokenizer.json").write_text('{"x": 1}')
    with pytest.raises(ValueError, match=f"^{folder / 'tokenizer.json'} cannot be read as a tokenizer: "):
        mlx_embed.load(folder)


def test_what_a_sentence_transformers_user_types_is_answered(minilm):
    """Names and habits from sentence-transformers: setting `max_seq_length`
    was taken silently and cut nothing; a lone string, an instruction on a
    model without a template and a call's cut get messages that say so."""
    assert minilm.max_seq_length == minilm.max_length == 256
    with pytest.raises(AttributeError, match=r"load\(\.\.\., max_length=N\)"):
        minilm.max_seq_length = 128
    assert minilm.max_length == 256
    with pytest.raises(TypeError, match=r"one text: \[text\]"):
        minilm.embed("hello")
    for method in ("embed", "embed_tokens"):
        with pytest.raises(TypeError, match=rf"{method}\(\) got an unexpected keyword argument 'batch_size'"):
            getattr(minilm, method)(["a"], batch_size=4)
    with pytest.raises(InvalidInput, match="instruction prefixes are not defined"):
        minilm.embed(["a"], instruction="x")
    with pytest.raises(InvalidInput, match=r"more than truncate_to=8 "):
        minilm.embed(["word " * 20], truncate=False, truncate_to=8)
    with pytest.raises(InvalidInput, match=r"more than max_length=256 "):
        minilm.embed(["word " * 300], truncate=False)
