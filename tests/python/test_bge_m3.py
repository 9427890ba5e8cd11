"""BGE-M3: the dense vector and the lexical weights (``sparse_linear.pt``)
against FlagEmbedding's ``BGEM3FlagModel``.

The fixture (tests/fixtures/tiny-bge-m3) and how its references were made:
its README and scripts/fixtures/make_bge_m3.py. Every engine path (pipelined,
one worker, shape buckets, many small passes, packed rows) must give the same
entries; a folder without the head, or with a malformed one, is refused with
a message that names the file. The ``.pt`` files written here are built
without torch, opcode by opcode, as test_torch_weights.py builds its own.
"""

from __future__ import annotations

import json
import shutil
import zipfile

import mlx.core as mx
import numpy as np
import pytest
from conftest import FIXTURES, assert_parity, load_fixture

import mlx_embed
from mlx_embed import lexical, torch_weights
from mlx_embed.errors import InvalidInput

BGE_M3 = FIXTURES / "tiny-bge-m3"
PLAIN = "tiny-xlm-roberta"  # the same encoder, no sparse head
TOTAL_ENTRIES = 730
# The tokenizer's <s>, <pad>, </s>, <unk>: never weighed.
SKIPPED = frozenset({0, 1, 2, 3})
TOL = 1e-5


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return json.loads((BGE_M3 / "reference_texts.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def reference() -> list[dict[int, float]]:
    raw = json.loads((BGE_M3 / "reference_lexical_weights.json").read_text())
    return [{int(k): float(v) for k, v in row.items()} for row in raw]


@pytest.fixture(scope="module")
def model():
    return load_fixture("tiny-bge-m3")


def _check_entries(got: list, reference: list) -> int:
    """Per text: exactly the reference's ids, increasing, int32, each weight
    float32 within TOL of the reference's. Returns the total entry count."""
    assert len(got) == len(reference)
    total = 0
    for i, ((ids, weights), want) in enumerate(zip(got, reference)):
        assert ids.dtype == np.int32 and weights.dtype == np.float32, i
        assert ids.shape == weights.shape == (len(want),), (i, ids, sorted(want))
        assert np.all(np.diff(ids) > 0), (i, ids)
        assert ids.tolist() == sorted(want), i
        expected = np.array([want[k] for k in ids.tolist()], dtype=np.float32)
        assert np.abs(weights - expected).max(initial=0.0) <= TOL, i
        assert np.all(weights > 0) and not SKIPPED & set(ids.tolist()), i
        total += len(ids)
    return total


def _split(res) -> list[tuple[np.ndarray, np.ndarray]]:
    """An ``embed_ids(output="sparse")`` result as (ids int32, weights) per input."""
    pairs = np.frombuffer(res.vectors, dtype="<f4").reshape(-1, 2)
    assert len(pairs) == sum(res.rows)
    bounds = np.cumsum([0, *res.rows])
    return [(pairs[a:b, 0].astype(np.int32), pairs[a:b, 1].copy()) for a, b in zip(bounds[:-1], bounds[1:])]


# ------------------------------------------------------------ references


def test_dense_matches_flagembedding(model, texts):
    assert (model.model_type, model.pooling, model.dim, model.max_length) == ("xlm-roberta", "cls", 64, 128)
    assert len(texts) == 43
    assert_parity(model.embed(texts), np.load(BGE_M3 / "reference_dense_normalized.npy"))


def test_embed_sparse_matches_flagembedding(model, texts, reference):
    got = model.embed_sparse(texts)
    assert _check_entries(got, reference) == TOTAL_ENTRIES
    empty = texts.index("")
    assert len(got[empty][0]) == 0 and got[empty][1].dtype == np.float32
    assert [len(ids) for ids, _ in got].count(0) == 1
    # The repeated-word texts: ids repeat in them, each weighed once (one
    # entry per distinct id, its largest weight: the reference's).
    ids, _ = model.encode(texts[-3:])
    for row, (entry_ids, _) in zip(ids, got[-3:]):
        content = [t for t in row if t not in SKIPPED]
        assert 0 < len(entry_ids) <= len(set(content)) < len(content)
        assert set(entry_ids.tolist()) <= set(content)
        assert any(content.count(t) > 1 for t in entry_ids.tolist())


def test_embed_ids_sparse_gives_the_same_entries(model, texts, reference):
    ids, _ = model.encode(texts)
    res = model.embed_ids(ids, output="sparse")
    assert res.rows == [len(r) for r in reference]
    assert isinstance(res.vectors, bytes) and len(res.vectors) == 8 * TOTAL_ENTRIES
    assert res.padded_tokens >= sum(len(r) for r in ids)
    got = _split(res)
    assert _check_entries(got, reference) == TOTAL_ENTRIES
    # The same numbers embed_sparse returns, bit for bit.
    for (a_ids, a_w), (b_ids, b_w) in zip(got, model.embed_sparse(texts)):
        assert np.array_equal(a_ids, b_ids) and np.array_equal(a_w, b_w)
    # submit_ids in two steps, a pooled call queued between.
    sparse = model.submit_ids(ids, output="sparse")
    pooled = model.submit_ids(ids)
    dense = np.frombuffer(pooled.result().vectors, dtype="<f4").reshape(len(ids), 64)
    assert np.array_equal(dense, model.embed(texts, normalize=False))
    again = sparse.result()
    assert again.rows == res.rows and again.vectors == res.vectors


def test_sparse_from_the_hidden_states(model, texts):
    """relu(h @ W.T + b) per token of ``embed_tokens``, with the head's own
    tensors, skipped ids and zeros dropped, each id's largest weight: what
    embed_sparse returns (not only on the reference's side)."""
    head = torch_weights.load(BGE_M3 / lexical.FILE)
    w = np.array(head["weight"], dtype=np.float32)
    b = np.array(head["bias"], dtype=np.float32)
    assert w.shape == (1, 64) and b.shape == (1,)
    ids, _ = model.encode(texts)
    states = model.embed_tokens(texts)
    got = model.embed_sparse(texts)
    for i, (row, h) in enumerate(zip(ids, states)):
        weights = np.maximum(h @ w.T + b, 0)[:, 0]
        best: dict[int, float] = {}
        for t, x in zip(row, weights):
            if t not in SKIPPED and x > 0:
                best[t] = max(best.get(t, 0.0), float(x))
        assert got[i][0].tolist() == sorted(best), i
        assert np.abs(got[i][1] - np.array([best[t] for t in sorted(best)])).max(initial=0.0) <= 1e-6, i


def test_embed_sparse_takes_embeds_keywords(model, texts):
    """truncate_to cuts as embed's does: the entries of the cut ids."""
    cut, _ = model.encode(texts, truncate_to=8)
    assert max(len(r) for r in cut) == 8
    want = _split(model.embed_ids(cut, output="sparse"))
    got = model.embed_sparse(texts, truncate_to=8)
    for (a_ids, a_w), (b_ids, b_w) in zip(got, want):
        assert np.array_equal(a_ids, b_ids) and np.array_equal(a_w, b_w)
    assert sum(len(i) for i, _ in got) < TOTAL_ENTRIES
    # Only the ids of the cut input are weighed.
    for (ids, _), row in zip(got, cut):
        assert set(ids.tolist()) <= set(row) - SKIPPED


def test_empty_calls(model):
    res = model.embed_ids([], output="sparse")
    assert res.rows == [] and res.vectors == b""
    assert model.embed_sparse([]) == []


# ------------------------------------------------------------ engine paths

ENGINE_PATHS = {
    "pipeline": dict(pipeline=True),
    "one-worker": dict(workers=1),
    "four-workers": dict(workers=4),
    "shape-buckets": dict(shape_buckets=True),
    "small-passes": dict(batch_tokens=64),
    "small-pipelined": dict(batch_tokens=64, pipeline=True, workers=1),
    "mlx-ops": dict(fast_ops="mlx", workers=1),
    "packed-rows": dict(fast_ops="exact", packed_rows=True, workers=1, batch_tokens=8192),
}


@pytest.mark.parametrize("settings", list(ENGINE_PATHS.values()), ids=list(ENGINE_PATHS))
def test_engine_paths_give_the_same_results(settings, texts, reference, monkeypatch):
    from mlx_embed import ops

    packed = []
    init = ops.PackedRows.__init__

    def spy(self, mask):
        init(self, mask)
        packed.append(self.rows)

    monkeypatch.setattr(ops.PackedRows, "__init__", spy)
    model = mlx_embed.load(BGE_M3, **settings)
    assert model.lexical is not None
    for k, v in settings.items():
        if k == "pipeline":
            assert model.scheduler.pipeline is v
        elif k == "shape_buckets":
            assert model.scheduler.shape_buckets is v
        elif k in ("workers", "batch_tokens"):
            assert getattr(model, k) == v
    ids, _ = model.encode(texts)
    passes = len(model.scheduler.plan(np.array([len(r) for r in ids])))
    if settings.get("batch_tokens") == 64:
        # A call cut into many passes (the 128-token inputs one each).
        assert passes >= 15
    elif settings.get("workers") == 4:
        # Shared among the MLX workers (Scheduler._run_parallel).
        assert passes >= 4 and not model.scheduler.pipeline
    assert_parity(model.embed(texts), np.load(BGE_M3 / "reference_dense_normalized.npy"))
    assert _check_entries(model.embed_sparse(texts), reference) == TOTAL_ENTRIES
    # Packed passes ran where asked for, and only there.
    assert bool(packed) == bool(settings.get("packed_rows"))
    res = model.embed_ids(ids, output="sparse")
    assert res.rows == [len(r) for r in reference] and len(res.vectors) == 8 * TOTAL_ENTRIES
    assert _check_entries(_split(res), reference) == TOTAL_ENTRIES
    # Two calls in flight (pipelined: the second queued before the first is read).
    first = model.submit_ids(ids[:20], output="sparse")
    second = model.submit_ids(ids[20:], output="sparse")
    both = _split(first.result()) + _split(second.result())
    assert _check_entries(both, reference) == TOTAL_ENTRIES


def test_float16_model_keeps_a_float32_head(texts, reference):
    """In float16 the head still runs in float32 (the states cast up): the
    weights within 1e-2 of the reference's, and an id on one side only where
    its weight is within rounding of zero."""
    half = mlx_embed.load(BGE_M3, dtype="float16")
    assert half.lexical.linear.weight.dtype == mx.float32
    got = half.embed_sparse(texts)
    differ = 0
    for (ids, weights), want in zip(got, reference):
        mine = dict(zip(ids.tolist(), weights.tolist()))
        assert np.all(np.diff(ids) > 0) and weights.dtype == np.float32
        for k in set(mine) | set(want):
            if k in mine and k in want:
                assert abs(mine[k] - want[k]) <= 1e-2, k
            else:
                differ += 1
                assert max(mine.get(k, 0.0), want.get(k, 0.0)) <= 1e-2, k
    assert differ <= 3


# ------------------------------------------------------------ refusals


def test_no_head_refuses_sparse_output(texts):
    plain = load_fixture(PLAIN)
    assert plain.lexical is None
    ids, _ = plain.encode(texts[:3])
    with pytest.raises(InvalidInput, match="sparse_linear.pt"):
        plain.embed_ids(ids, output="sparse")
    with pytest.raises(InvalidInput, match="sparse_linear.pt"):
        plain.submit_ids(ids, output="sparse")
    with pytest.raises(InvalidInput, match="no sparse output"):
        plain.embed_sparse(texts[:3])


def test_bad_calls_are_invalid_input(model, texts):
    with pytest.raises(InvalidInput, match="no normalize"):
        model.embed_sparse(texts, normalize=True)
    with pytest.raises(InvalidInput, match="no normalize"):
        model.embed_sparse(texts, normalize=False)
    ids, _ = model.encode(texts[:2])
    # The scheduler's per-token output is no output of the engine's.
    with pytest.raises(InvalidInput, match="output must be one of pooled, tokens, sparse"):
        model.embed_ids(ids, output="token_weights")
    with pytest.raises(InvalidInput):
        model.embed_ids([[0, model.vocab_size + 5, 2]], output="sparse")


# A state dict pickle written opcode by opcode, as torch.save writes one (no
# torch needed): test_torch_weights.py's helpers.


def _u(text: str) -> bytes:
    data = text.encode()
    return b"X" + len(data).to_bytes(4, "little") + data


def _ints_tuple(values) -> bytes:
    return b"(" + b"".join(b"J" + int(v).to_bytes(4, "little", signed=True) for v in values) + b"t"


def _write_state_dict(path, tensors: dict) -> None:
    """``torch.save`` of float32 tensors, written without torch."""
    pkl = b"\x80\x02ccollections\nOrderedDict\n)R"
    storages = {}
    for key, (name, value) in enumerate(tensors.items()):
        value = np.ascontiguousarray(value, dtype="<f4")
        stride = [int(s) // 4 for s in value.strides]
        pkl += _u(name) + b"ctorch._utils\n_rebuild_tensor_v2\n("
        pkl += b"(" + _u("storage") + b"ctorch\nFloatStorage\n" + _u(str(key)) + _u("cpu")
        pkl += b"J" + value.size.to_bytes(4, "little") + b"tQ"
        pkl += b"J" + (0).to_bytes(4, "little") + _ints_tuple(value.shape) + _ints_tuple(stride)
        pkl += b"\x89ccollections\nOrderedDict\n)RtRs"
        storages[str(key)] = value.tobytes()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("sparse_linear/data.pkl", pkl + b".")
        z.writestr("sparse_linear/byteorder", "little")
        for key, data in storages.items():
            z.writestr(f"sparse_linear/data/{key}", data)
        z.writestr("sparse_linear/version", "3\n")


def _head() -> tuple[np.ndarray, np.ndarray]:
    head = torch_weights.load(BGE_M3 / lexical.FILE)
    return np.array(head["weight"], dtype=np.float32), np.array(head["bias"], dtype=np.float32)


def _folder_with_head(tmp_path, name: str, tensors: dict):
    dst = tmp_path / name
    shutil.copytree(BGE_M3, dst)
    _write_state_dict(dst / lexical.FILE, tensors)
    return dst


def test_hand_written_head_is_the_fixtures(tmp_path, model, texts):
    """The writer above gives the fixture's head back: same tensors, same
    entries (so the refusals below come from the content alone)."""
    w, b = _head()
    folder = _folder_with_head(tmp_path, "same", {"weight": w, "bias": b})
    back = torch_weights.load(folder / lexical.FILE)
    assert np.array_equal(np.array(back["weight"]), w) and np.array_equal(np.array(back["bias"]), b)
    copy = mlx_embed.load(folder)
    for (a_ids, a_w), (b_ids, b_w) in zip(copy.embed_sparse(texts), model.embed_sparse(texts)):
        assert np.array_equal(a_ids, b_ids) and np.array_equal(a_w, b_w)


def test_head_without_bias_is_a_zero_bias(tmp_path, texts):
    w, b = _head()
    no_bias = mlx_embed.load(_folder_with_head(tmp_path, "no-bias", {"weight": w}))
    zero_bias = mlx_embed.load(_folder_with_head(tmp_path, "zero-bias", {"weight": w, "bias": np.zeros(1)}))
    got, want = no_bias.embed_sparse(texts), zero_bias.embed_sparse(texts)
    assert sum(len(i) for i, _ in want) > 0
    for (a_ids, a_w), (b_ids, b_w) in zip(got, want):
        assert np.array_equal(a_ids, b_ids) and np.abs(a_w - b_w).max(initial=0.0) <= 1e-6


WIDE = "a sparse head over this model's 64-wide states"
STATE_DICT = r"a Linear\(hidden, 1\) state dict \(weight, bias\); got "


@pytest.mark.parametrize(
    "case,match",
    [
        pytest.param("wide-weight", r"weight \(1, 32\), bias \(1,\); " + WIDE, id="wide-weight"),
        pytest.param("two-outputs", r"weight \(2, 64\), bias \(2,\); " + WIDE, id="two-outputs"),
        pytest.param("long-bias", r"weight \(1, 64\), bias \(3,\); " + WIDE, id="long-bias"),
        pytest.param("extra-key", STATE_DICT + r"\['bias', 'scale', 'weight'\]", id="extra-key"),
        pytest.param("no-weight", STATE_DICT + r"\['bias'\]", id="no-weight"),
    ],
)
def test_malformed_head_is_refused(tmp_path, case, match):
    w, b = _head()
    tensors = {
        "wide-weight": {"weight": w[:, :32], "bias": b},
        "two-outputs": {"weight": np.concatenate([w, w]), "bias": np.concatenate([b, b])},
        "long-bias": {"weight": w, "bias": np.zeros(3)},
        "extra-key": {"weight": w, "bias": b, "scale": np.ones(1)},
        "no-weight": {"bias": b},
    }[case]
    folder = _folder_with_head(tmp_path, case, tensors)
    with pytest.raises(ValueError, match=match) as err:
        mlx_embed.load(folder)
    assert str(folder / lexical.FILE) in str(err.value)


def test_vocabulary_over_the_exact_float32_ids_is_refused(monkeypatch):
    """Ids cross the seam as float32: a vocabulary of 2^24 or more is refused
    (MAX_VOCAB lowered below the fixture's vocabulary to see it)."""
    assert lexical.MAX_VOCAB == 1 << 24
    monkeypatch.setattr(lexical, "MAX_VOCAB", 100)
    with pytest.raises(ValueError, match="lexical weights need a vocabulary under 100 tokens, got"):
        mlx_embed.load(BGE_M3)


# ------------------------------------------------------------ lexical.entries


def test_entries_keep_each_ids_largest_weight():
    ids = [0, 7, 5, 7, 9, 5, 2, 7]
    weights = np.array([0.9, 0.2, 0.4, 0.8, 0.0, 0.1, 0.5, 0.3], dtype=np.float32)
    got_ids, got_w = lexical.entries(weights, ids, frozenset({0, 2}))
    assert got_ids.dtype == np.int64 and got_w.dtype == np.float32
    assert got_ids.tolist() == [5, 7]  # 0, 2 skipped, 9's weight is 0
    assert got_w.tolist() == [np.float32(0.4), np.float32(0.8)]


def test_entries_drop_non_positive_weights_and_sort():
    ids = [40, 3, 17, 3, 8]
    weights = np.array([[0.25], [-1.0], [0.5], [0.75], [-0.0]], dtype=np.float32)  # [L, 1], as the head gives
    got_ids, got_w = lexical.entries(weights, ids, frozenset())
    assert got_ids.tolist() == [3, 17, 40]
    assert got_w.tolist() == [0.75, 0.5, 0.25]
    # Nothing left: empty arrays.
    none_ids, none_w = lexical.entries(np.zeros(3, dtype=np.float32), [4, 5, 6], frozenset())
    assert none_ids.shape == none_w.shape == (0,)
    # Padding rows past the ids are ignored.
    pad_ids, pad_w = lexical.entries(np.array([0.5, 0.6, 9.0], dtype=np.float32), [11, 12], frozenset())
    assert pad_ids.tolist() == [11, 12] and pad_w.tolist() == [np.float32(0.5), np.float32(0.6)]


def test_entries_ties_and_all_skipped():
    got_ids, got_w = lexical.entries(np.array([0.5, 0.5], dtype=np.float32), [6, 6], frozenset())
    assert got_ids.tolist() == [6] and got_w.tolist() == [0.5]
    got_ids, _ = lexical.entries(np.array([1.0, 2.0], dtype=np.float32), [0, 2], SKIPPED)
    assert got_ids.size == 0


# ------------------------------------------------------------ skipped ids


def test_skipped_ids_from_tokenizer_config(model):
    assert model.lexical.skipped_ids == SKIPPED
    assert lexical._skipped_ids(str(BGE_M3), model.tokenizer.token_id, [99]) == set(SKIPPED)


def test_skipped_ids_rules(tmp_path):
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "[X]": 50}
    # No tokenizer files naming any: the defaults.
    assert lexical._skipped_ids(str(tmp_path), vocab.get, [7, 8]) == {7, 8}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "mask_token": "[X]"}))
    assert lexical._skipped_ids(str(tmp_path), vocab.get, (7,)) == {7}
    # Named ones, an AddedToken dict's content, an unknown token left out.
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "cls_token": "<s>", "eos_token": {"content": "</s>", "special": True}, "pad_token": "<nowhere>",
        "unk_token": None, "mask_token": "[X]",
    }))
    assert lexical._skipped_ids(str(tmp_path), vocab.get, [7]) == {0, 2}
    # special_tokens_map.json over tokenizer_config.json.
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"cls_token": "[X]", "unk_token": "<unk>"}))
    assert lexical._skipped_ids(str(tmp_path), vocab.get, [7]) == {50, 2, 3}


def test_skipped_ids_take_the_tokenizer_class_defaults_for_tokens_not_named(tmp_path):
    """transformers fills the tokens a folder does not name with its class's
    defaults, and FlagEmbedding skips those too (a probe: with cls and unk
    left out of tokenizer_config.json, ids 0 and 3 came back weighed)."""
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "[CLS]": 10, "[PAD]": 11, "[UNK]": 12, "[SEP]": 13}
    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(json.dumps({"tokenizer_class": "XLMRobertaTokenizerFast", "eos_token": "</s>",
                               "pad_token": "<pad>"}))
    assert lexical._skipped_ids(str(tmp_path), vocab.get, [7]) == {0, 1, 2, 3}
    # Named ones still win over the defaults.
    cfg.write_text(json.dumps({"tokenizer_class": "XLMRobertaTokenizer", "unk_token": "[UNK]"}))
    assert lexical._skipped_ids(str(tmp_path), vocab.get, [7]) == {0, 1, 2, 12}
    # BERT's classes have no eos token: [SEP] stays.
    cfg.write_text(json.dumps({"tokenizer_class": "BertTokenizerFast"}))
    assert lexical._skipped_ids(str(tmp_path), vocab.get, [7]) == {10, 11, 12}
    # No class named: config.json's model_type says which.
    cfg.write_text(json.dumps({}))
    assert lexical._skipped_ids(str(tmp_path), vocab.get, [7], "xlm-roberta") == {0, 1, 2, 3}
    assert lexical._skipped_ids(str(tmp_path), vocab.get, [7], "qwen3") == {7}


def test_a_folder_naming_fewer_specials_skips_the_same_ids(tmp_path):
    """End to end: the fixture with cls and unk left out of its
    tokenizer_config.json weighs the same ids as the fixture."""
    folder = tmp_path / "fewer-named"
    shutil.copytree(BGE_M3, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    del cfg["cls_token"], cfg["unk_token"]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    fewer = mlx_embed.load(folder)
    assert fewer.lexical.skipped_ids == SKIPPED
    texts = ["日本語のテキストです", "the cat and the dog"]
    for (a_ids, a_w), (b_ids, b_w) in zip(fewer.embed_sparse(texts), load_fixture(BGE_M3).embed_sparse(texts)):
        assert a_ids.tolist() == b_ids.tolist() and np.array_equal(a_w, b_w)


def test_an_unreadable_head_says_what_the_file_must_be(tmp_path):
    folder = tmp_path / "empty-head"
    shutil.copytree(BGE_M3, folder)
    (folder / lexical.FILE).write_bytes(b"")
    with pytest.raises(ValueError) as err:
        mlx_embed.load(folder)
    message = str(err.value)
    assert "safetensors" not in message, message
    assert message.startswith(f"{folder / lexical.FILE} is not a PyTorch checkpoint"), message
    assert message.endswith(
        "; BGE-M3's sparse head must be torch.save(sparse_linear.state_dict()) of a Linear(hidden, 1), "
        f"or leave {lexical.FILE} out of the folder to serve the dense vectors alone"
    ), message


# ------------------------------------------------------------ what the model says of itself


def test_spec_and_info_say_lexical_weights(model):
    plain = load_fixture(PLAIN)
    assert model.spec().lexical_weights is True
    assert plain.spec().lexical_weights is False
    assert model.info()["lexical_weights"] is True and plain.info()["lexical_weights"] is False
    assert model._details()["lexical_weights"] == "true"
    assert "lexical_weights" not in plain._details()
    assert model.spec().sparse is False and model.sparse is False
    assert model.spec().dim == 64
