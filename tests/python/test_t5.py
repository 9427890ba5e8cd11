"""T5 encoders (gtr-t5, sentence-t5, INSTRUCTOR) against sentence-transformers'
references: tests/fixtures/tiny-t5 (gated-gelu, Dense) and tiny-t5-relu
(relu, a whole T5ForConditionalGeneration checkpoint); their READMEs say how
they were made."""

from __future__ import annotations

import json
import shutil

import mlx.nn as nn
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import mlx_embed
from conftest import FIXTURES, assert_parity, copy_fixture, load_fixture

FOLDERS = ("tiny-t5", "tiny-t5-relu")
SEQ_LEN = 256


def _ref(folder: str, name: str = "reference_mean_normalized.npy") -> np.ndarray:
    return np.load(FIXTURES / folder / name)


def _long(folder: str) -> list[str]:
    return json.loads((FIXTURES / folder / "long_texts.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("folder", FOLDERS)
def test_matches_reference_batched_and_one_at_a_time(folder, golden_texts):
    model = load_fixture(folder)
    assert (model.model_type, model.pooling, model.dim, model.max_length) == ("t5", "mean", 64, SEQ_LEN)
    got = model.embed(golden_texts)
    assert_parity(got, _ref(folder))
    single = np.concatenate([model.embed([t]) for t in golden_texts])
    assert_parity(single, _ref(folder))
    assert np.abs(got - single).max() <= 1e-6
    # T5's tokenizer appends </s> and nothing else: the empty text is one token.
    counts = model.count_tokens(golden_texts, prompt="")
    assert min(counts) == 1 and max(counts) == SEQ_LEN


@pytest.mark.parametrize("folder", FOLDERS)
def test_long_inputs_past_max_distance(folder, golden_texts):
    """Inputs of 180 to 538 tokens (the last cut at 256): distances past
    relative_attention_max_distance 128 take the last buckets; alone and in a
    batch with short texts."""
    model = load_fixture(folder)
    longs = _long(folder)
    counts = model.count_tokens(longs, prompt="")
    assert min(counts) > 128 and max(counts) == SEQ_LEN
    ref = _ref(folder, "reference_long_normalized.npy")
    assert_parity(model.embed(longs), ref)
    mixed = model.embed(golden_texts[:5] + longs)
    assert_parity(mixed[5:], ref)
    assert_parity(mixed[:5], _ref(folder)[:5])


@pytest.mark.parametrize("fast_ops", ["native", "mlx", "exact"])
def test_every_cpu_path(fast_ops, golden_texts):
    model = mlx_embed.load(FIXTURES / "tiny-t5", fast_ops=fast_ops)
    assert_parity(model.embed(golden_texts + _long("tiny-t5")),
                  np.concatenate([_ref("tiny-t5"), _ref("tiny-t5", "reference_long_normalized.npy")]))


@pytest.mark.parametrize("options", [{"packed_rows": True}, {"fused_attention": True, "fast_ops": "exact"}])
def test_packed_rows_and_fused_attention(options, golden_texts):
    model = mlx_embed.load(FIXTURES / "tiny-t5", **options)
    assert_parity(model.embed(golden_texts + _long("tiny-t5")),
                  np.concatenate([_ref("tiny-t5"), _ref("tiny-t5", "reference_long_normalized.npy")]))


def test_attention_in_query_blocks(golden_texts, monkeypatch, query_block_counts):
    """Long-input attention in blocks of query rows, each block's position
    bias made for its rows."""
    from mlx_embed import ops

    monkeypatch.setattr(ops, "SCORES_BLOCK_BYTES", 16 * 4 * 4 * SEQ_LEN)
    model = mlx_embed.load(FIXTURES / "tiny-t5")
    assert_parity(model.embed(_long("tiny-t5")), _ref("tiny-t5", "reference_long_normalized.npy"))
    assert max(query_block_counts) >= 8


def test_whole_seq2seq_checkpoint_loads_the_same(tmp_path, golden_texts):
    """tiny-t5-relu's model.safetensors is a whole T5ForConditionalGeneration
    (decoder.*, lm_head, the tied tables under every name): sanitize keeps
    the encoder. The same encoder saved as T5EncoderModel would save it
    (shared + encoder.* only) gives the same vectors."""
    names = load_file(str(FIXTURES / "tiny-t5-relu" / "model.safetensors"))
    assert any(n.startswith("decoder.") for n in names) and "lm_head.weight" in names
    assert "encoder.embed_tokens.weight" in names
    full = load_fixture("tiny-t5-relu")
    enc = copy_fixture("tiny-t5-relu", tmp_path / "enc")
    kept = {n: w for n, w in names.items() if n == "shared.weight" or
            (n.startswith("encoder.") and n != "encoder.embed_tokens.weight")}
    save_file(kept, str(enc / "model.safetensors"), metadata={"format": "pt"})
    bare = mlx_embed.load(enc)
    assert bare.parameter_count == full.parameter_count
    assert np.array_equal(bare.embed(golden_texts), full.embed(golden_texts))
    # An encoder-only save whose table is only under encoder.embed_tokens.
    only = copy_fixture("tiny-t5-relu", tmp_path / "only")
    moved = dict(kept)
    moved["encoder.embed_tokens.weight"] = moved.pop("shared.weight")
    save_file(moved, str(only / "model.safetensors"), metadata={"format": "pt"})
    assert np.array_equal(mlx_embed.load(only).embed(golden_texts), full.embed(golden_texts))


@pytest.mark.parametrize("folder", FOLDERS)
def test_bfloat16_runs_close(folder, golden_texts):
    texts = golden_texts + _long(folder)
    ref = np.concatenate([_ref(folder), _ref(folder, "reference_long_normalized.npy")])
    got = mlx_embed.load(FIXTURES / folder, dtype="bfloat16").embed(texts)
    assert got.dtype == np.float32 and np.isfinite(got).all()
    cos = (got * ref).sum(axis=1)
    print(f"bfloat16 min cosine {cos.min():.6f}")
    assert cos.min() >= 0.999


def test_float16_and_quantized(golden_texts):
    ref = _ref("tiny-t5")
    half = mlx_embed.load(FIXTURES / "tiny-t5", dtype="float16").embed(golden_texts)
    assert (half * ref).sum(axis=1).min() >= 0.999
    q = mlx_embed.load(FIXTURES / "tiny-t5", quantize=8, group_size=32)
    assert q.quantization == 8
    got = q.embed(golden_texts)
    cos = (got * ref).sum(axis=1)
    print(f"8-bit min cosine {cos.min():.6f}")
    assert cos.min() >= 0.99
    # The relative position table stays float (tiny, read by every layer).
    assert not isinstance(q.model.relative_attention_bias, nn.QuantizedEmbedding)
    assert isinstance(q.model.shared, nn.QuantizedEmbedding)


def test_truncation_directions():
    """A long input cut from the right keeps its first 255 pieces, from the
    left its last 255, and </s> either way; each embeds as those ids do."""
    from tokenizers import Tokenizer

    model = load_fixture("tiny-t5")
    text = _long("tiny-t5")[2]
    tok = Tokenizer.from_file(str(FIXTURES / "tiny-t5" / "tokenizer.json"))
    tok.no_truncation()
    full = tok.encode(text).ids
    assert len(full) > SEQ_LEN and full[-1] == 1
    for direction, want in (("right", full[: SEQ_LEN - 1] + [1]), ("left", full[-SEQ_LEN:])):
        ids = model.encode([text], truncation_direction=direction)[0][0]
        assert ids == want, direction
        got = model.embed([text], truncation_direction=direction)
        vec = np.frombuffer(model.embed_ids([want]).vectors, dtype="<f4").reshape(1, -1)
        vec = vec / np.linalg.norm(vec)
        assert np.abs(got - vec).max() <= 1e-6, direction
    assert (model.embed([text]) * model.embed([text], truncation_direction="left")).sum() < 0.999


def test_max_length_rules(tmp_path):
    """The folder's max_seq_length (tiny-t5: 256), else the tokenizer's
    model_max_length (tiny-t5-relu: 256), else 512; an explicit max_length
    may go past 512 (no position table) up to 8192."""
    assert load_fixture("tiny-t5").max_length == SEQ_LEN
    assert load_fixture("tiny-t5-relu").max_length == SEQ_LEN
    bare = tmp_path / "bare"
    shutil.copytree(FIXTURES / "tiny-t5-relu", bare)
    tc = json.loads((bare / "tokenizer_config.json").read_text())
    tc.pop("model_max_length")
    (bare / "tokenizer_config.json").write_text(json.dumps(tc))
    assert mlx_embed.load(bare).max_length == 512
    assert mlx_embed.load(bare, max_length=2048).max_length == 2048
    with pytest.raises(ValueError, match="8192 positions"):
        mlx_embed.load(bare, max_length=8193)


def test_mt5_and_config_checks(tmp_path, golden_texts):
    """model_type mt5 is the same network (MT5Config's defaults where the
    config says nothing); unsupported feed-forwards are refused by name."""
    mt5 = copy_fixture("tiny-t5", tmp_path / "mt5", model_type="mt5")
    model = mlx_embed.load(mt5)
    assert model.model_type == "mt5"
    assert_parity(model.embed(golden_texts), _ref("tiny-t5"))
    from mlx_embed.models import t5

    args = t5.ModelArgs.from_dict({"model_type": "mt5"})
    assert (args.vocab_size, args.d_ff, args.num_layers, args.num_heads, args.feed_forward_proj) == (
        250112, 1024, 8, 6, "gated-gelu")
    assert t5.ModelArgs.from_dict({"model_type": "t5"}).feed_forward_proj == "relu"
    assert t5.ModelArgs(feed_forward_proj="gated-gelu").activation == "gelu_new"
    assert t5.ModelArgs(feed_forward_proj="gelu").activation == "gelu"
    assert t5.ModelArgs(feed_forward_proj="gated-silu").gated
    for bad in ("gated-tanh", "relu-gated", "swish-gelu"):
        with pytest.raises(ValueError, match="feed_forward_proj"):
            t5.ModelArgs(feed_forward_proj=bad)


def test_relative_position_buckets():
    """T5's bidirectional buckets, spot values: exact below 8, log-spaced to
    128, the last bucket past it; keys after the query in the upper half."""
    from mlx_embed.models import relative_position_buckets

    rel = np.array([0, 1, 7, 8, 11, 12, 16, 127, 128, 5000, -1, -7, -8, -127, -128, -5000])
    got = relative_position_buckets(rel, 32, 128).tolist()
    assert got == [0, 17, 23, 24, 24, 25, 26, 31, 31, 31, 1, 7, 8, 15, 15, 15]


def test_instructor_folder(tmp_path, golden_texts):
    """An hkunlp/instructor-* folder (InstructorEmbedding.INSTRUCTOR_Transformer
    first) loads as its T5 encoder: without an instruction the vectors are the
    plain pipeline's; an instruction is a prompt the pooling leaves out, as
    the InstructorEmbedding library does (checked against
    sentence-transformers in test_prompt_pooling.py)."""
    folder = copy_fixture("tiny-t5", tmp_path / "instructor")
    mods = json.loads((folder / "modules.json").read_text())
    mods[0]["type"] = "InstructorEmbedding.INSTRUCTOR_Transformer"
    (folder / "modules.json").write_text(json.dumps(mods))
    model = mlx_embed.load(folder)
    assert model.include_prompt is False
    assert_parity(model.embed(golden_texts), _ref("tiny-t5"))
    instruction = "Represent the Science title: "
    with_prompt = model.embed(golden_texts[5:8], prompt=instruction)
    raw = model.embed([instruction + t for t in golden_texts[5:8]])
    assert np.abs(with_prompt - raw).max() > 1e-2
