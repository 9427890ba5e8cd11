"""PyTorch checkpoints (pytorch_model.bin) read without torch.

The fixtures were written by real torch / transformers / sentence-transformers
(scripts/fixtures/make_torch_bin.py; each folder's README says how); nothing
here imports torch.
"""

import builtins
import io
import logging
import os
import pickle
import shutil
import zipfile
from collections import OrderedDict

import mlx.core as mx
import mlx_embed
import numpy as np
import pytest
from conftest import FIXTURES, assert_parity, load_fixture
from mlx_embed import loading, torch_weights

BIN = FIXTURES / "tiny-mpnet-bin"
TWIN = FIXTURES / "tiny-mpnet"
DENSE = FIXTURES / "tiny-mpnet-dense-bin"
CASES = FIXTURES / "torch-bin-cases"
# tiny-mpnet-bin's files other than its weights and references.
FOLDER_FILES = ("config.json", "config_sentence_transformers.json", "modules.json", "sentence_bert_config.json",
                "tokenizer.json", "tokenizer_config.json", "1_Pooling", "2_Normalize")


def _folder_without_weights(dst):
    for name in FOLDER_FILES:
        src = BIN / name
        if src.is_dir():
            shutil.copytree(src, dst / name)
        else:
            shutil.copy(src, dst / name)
    return dst


def _as_numpy(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)) if a.dtype == mx.bfloat16 else np.array(a)


def _torch_zip(path, pkl: bytes, storages=None, byteorder="little", prefix="archive"):
    """A zip laid out as torch.save writes one."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{prefix}/data.pkl", pkl)
        if byteorder is not None:
            z.writestr(f"{prefix}/byteorder", byteorder)
        for key, data in (storages or {}).items():
            z.writestr(f"{prefix}/data/{key}", data)
        z.writestr(f"{prefix}/version", "3\n")
    return path


def _rewritten(src, dst, replace: dict):
    """A copy of the zip ``src`` with some entries' bytes replaced."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, replace.get(info.filename, zin.read(info.filename)))
    return dst


# --------------------------------------------------------- a model folder


def test_bin_folder_matches_reference_and_its_safetensors_twin(golden_texts):
    """tiny-mpnet's model saved by transformers' save_pretrained(...,
    safe_serialization=False): the same tensors key for key as the
    safetensors twin, the sentence-transformers reference, and the twin's
    embeddings bit for bit."""
    weights = torch_weights.load(BIN / "pytorch_model.bin")
    twin_weights = mx.load(str(TWIN / "model.safetensors"))
    assert sorted(weights) == sorted(twin_weights)
    for k, v in twin_weights.items():
        assert weights[k].dtype == v.dtype and weights[k].shape == v.shape
        assert mx.array_equal(weights[k], v).item(), k

    model = load_fixture("tiny-mpnet-bin")
    assert (model.model_type, model.pooling, model.dim, model.max_length) == ("mpnet", "mean", 64, 128)
    got = model.embed(golden_texts)
    assert_parity(got, np.load(BIN / "reference_mean_normalized.npy"))
    assert np.array_equal(got, load_fixture("tiny-mpnet").embed(golden_texts))


def test_sharded_bin_with_index(tmp_path, golden_texts, caplog):
    """save_pretrained(max_shard_size="200KB"): three shards and
    pytorch_model.bin.index.json load to the same model."""
    _folder_without_weights(tmp_path)
    for f in (BIN / "sharded").iterdir():
        shutil.copy(f, tmp_path / f.name)
    assert len(list(tmp_path.glob("pytorch_model-*.bin"))) == 3
    with caplog.at_level(logging.INFO, logger="mlx_embed"):
        model = mlx_embed.load(tmp_path)
    assert "3 PyTorch zip checkpoint (read without torch) file(s)" in caplog.text
    assert np.array_equal(model.embed(golden_texts), load_fixture("tiny-mpnet-bin").embed(golden_texts))


def test_sharded_index_naming_a_missing_shard(tmp_path):
    _folder_without_weights(tmp_path)
    shutil.copy(BIN / "sharded" / "pytorch_model.bin.index.json", tmp_path)
    with pytest.raises(FileNotFoundError, match="lists shards that are not there"):
        loading.load_weights(str(tmp_path))


def test_fp16_bin(tmp_path, golden_texts):
    """A float16 save: the tensors come back float16, equal to the fp32
    twin's rounded to float16, and the model run in float32 matches
    sentence-transformers on the same float16 weights upcast."""
    _folder_without_weights(tmp_path)
    shutil.copy(BIN / "fp16" / "pytorch_model.bin", tmp_path / "pytorch_model.bin")
    weights, file_format = loading.load_weights(str(tmp_path))
    assert file_format == "pytorch"
    twin = mx.load(str(TWIN / "model.safetensors"))
    assert sorted(weights) == sorted(twin)
    for k, v in twin.items():
        assert weights[k].dtype == mx.float16
        assert mx.array_equal(weights[k], v.astype(mx.float16)).item(), k
    model = mlx_embed.load(tmp_path)
    # What Ollama's /api/show reports as the model's format.
    assert model.spec().weights_format == "pytorch"
    assert_parity(model.embed(golden_texts), np.load(BIN / "reference_fp16_weights_normalized.npy"))


def test_safetensors_win_over_bin(tmp_path, caplog):
    """With both, the safetensors are read and the .bin is never opened."""
    _folder_without_weights(tmp_path)
    shutil.copy(TWIN / "model.safetensors", tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with caplog.at_level(logging.INFO, logger="mlx_embed"):
        weights, file_format = loading.load_weights(str(tmp_path))
    assert "1 safetensors file(s): model.safetensors" in caplog.text
    assert len(weights) == 39 and file_format == "safetensors"


def test_folder_without_weights_names_both_formats(tmp_path):
    _folder_without_weights(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"neither \*\.safetensors nor pytorch_model\.bin"):
        mlx_embed.load(tmp_path)


# ------------------------------------------------- sentence-transformers Dense


def test_dense_saved_only_as_bin_matches_sentence_transformers(golden_texts):
    """Transformer (safetensors) -> mean -> Dense 64->32 tanh -> Dense 32->48
    without bias -> Normalize, both Dense layers only pytorch_model.bin."""
    assert not list(DENSE.glob("*_Dense/model.safetensors"))
    model = load_fixture("tiny-mpnet-dense-bin")
    assert model.dim == 48
    dense = model.scheduler.head.dense
    assert [(d.weight.shape, d.bias is None, d.activation) for d in dense] == [
        ((32, 64), False, "Tanh"), ((48, 32), True, "Identity")]
    w = torch_weights.load(DENSE / "2_Dense" / "pytorch_model.bin")
    assert mx.array_equal(dense[0].weight, w["linear.weight"]).item()
    assert mx.array_equal(dense[0].bias, w["linear.bias"]).item()
    assert_parity(model.embed(golden_texts), np.load(DENSE / "reference_normalized.npy"))


def test_dense_without_weights_names_both_formats(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(DENSE, d)
    os.remove(d / "3_Dense" / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="3_Dense: Dense weights in neither model.safetensors nor "
                                                "pytorch_model.bin"):
        mlx_embed.load(d)


# ------------------------------------------------------ tensors of every kind


def test_views_shared_storage_and_dtypes():
    """cases.bin (torch.save of a state dict): views with offsets and
    strides (transposed, a row, strided columns, expanded with stride 0),
    one tensor under two names, an nn.Parameter, a 0-d and an empty tensor,
    and every dtype; each equal to what torch held (expected.npz)."""
    got = torch_weights.load(CASES / "cases.bin")
    expected = np.load(CASES / "expected.npz", allow_pickle=False)
    assert sorted(got) == sorted(expected.files)
    dtypes = {
        "fp16": mx.float16, "fp16_t": mx.float16, "bf16": mx.bfloat16, "bf16_t": mx.bfloat16,
        "f64": mx.float32, "i64": mx.int64, "i32": mx.int32, "i16": mx.int16, "i8": mx.int8,
        "u8": mx.uint8, "flags": mx.bool_,
    }
    for name in expected.files:
        a, want = got[name], expected[name]
        assert a.dtype == dtypes.get(name, mx.float32), name
        assert a.shape == want.shape, name
        if name == "f64":
            assert np.array_equal(np.array(a), want.astype(np.float32))
        else:
            assert np.array_equal(_as_numpy(a), want), name
    assert got["scalar"].shape == () and got["scalar"].item() == 2.5
    # Views of one storage read back as what they view.
    base = np.array(got["base"])
    assert np.array_equal(np.array(got["transposed"]), base.T)
    assert np.array_equal(np.array(got["row"]), base[1])
    assert np.array_equal(np.array(got["cols"]), base[:, 1:4:2])
    assert np.array_equal(np.array(got["tied_a"]), np.array(got["tied_b"]))
    assert np.array_equal(_as_numpy(got["bf16_t"]), _as_numpy(got["bf16"]).T)
    assert abs(got["bf16"]).max().item() > 100  # really bfloat16's range, not bits read as floats


def _u(text: str) -> bytes:
    """Pickle BINUNICODE."""
    data = text.encode()
    return b"X" + len(data).to_bytes(4, "little") + data


def _ints_tuple(values) -> bytes:
    return b"(" + b"".join(b"J" + int(v).to_bytes(4, "little", signed=True) for v in values) + b"t"


def _state_dict_pickle(entries: dict) -> bytes:
    """A state dict pickle written opcode by opcode, as torch.save writes
    one (no torch needed): name -> (storage class, key, numel, offset, size,
    stride)."""
    out = b"\x80\x02ccollections\nOrderedDict\n)R"
    for name, (storage, key, numel, offset, size, stride) in entries.items():
        out += _u(name) + b"ctorch._utils\n_rebuild_tensor_v2\n("
        out += b"(" + _u("storage") + b"ctorch\n" + storage.encode() + b"\n" + _u(key) + _u("cpu")
        out += b"J" + numel.to_bytes(4, "little") + b"tQ"
        out += b"J" + offset.to_bytes(4, "little") + _ints_tuple(size) + _ints_tuple(stride)
        out += b"\x89ccollections\nOrderedDict\n)RtRs"
    return out + b"."


def test_hand_built_state_dict(tmp_path):
    """The same layout written without torch: a strided view at an offset,
    and a second tensor on the same storage."""
    storage = np.arange(12, dtype="<f4")
    pkl = _state_dict_pickle({
        "view": ("FloatStorage", "0", 12, 1, (2, 3), (1, 4)),
        "all": ("FloatStorage", "0", 12, 0, (3, 4), (4, 1)),
    })
    got = torch_weights.load(_torch_zip(tmp_path / "h.bin", pkl, {"0": storage.tobytes()}))
    assert list(got) == ["view", "all"]
    want = np.lib.stride_tricks.as_strided(storage[1:], (2, 3), (4, 16))
    assert np.array_equal(np.array(got["view"]), want)
    assert np.array_equal(np.array(got["all"]), storage.reshape(3, 4))


def test_views_outside_their_storage_are_refused(tmp_path):
    storage = np.zeros(12, dtype="<f4").tobytes()
    past = _state_dict_pickle({"w": ("FloatStorage", "0", 12, 2, (3, 4), (4, 1))})
    with pytest.raises(ValueError, match="reaches past its storage of 12 elements"):
        torch_weights.load(_torch_zip(tmp_path / "past.bin", past, {"0": storage}))
    # Zero strides over a tiny storage asking for 10^12 elements.
    bomb = _state_dict_pickle({"w": ("FloatStorage", "0", 12, 0, (10**6, 10**6), (0, 0))})
    with pytest.raises(ValueError, match="has more elements than its storage of 12"):
        torch_weights.load(_torch_zip(tmp_path / "bomb.bin", bomb, {"0": storage}))
    missing = _state_dict_pickle({"w": ("FloatStorage", "7", 12, 0, (12,), (1,))})
    with pytest.raises(ValueError, match="'archive/data/7' is missing"):
        torch_weights.load(_torch_zip(tmp_path / "missing.bin", missing, {"0": storage}))


def test_big_endian_is_refused(tmp_path):
    path = _rewritten(CASES / "cases.bin", tmp_path / "big.bin", {"cases/byteorder": b"big"})
    with pytest.raises(ValueError, match="big-endian.*only little-endian"):
        torch_weights.load(path)


def test_storage_shorter_than_its_tensors_is_refused(tmp_path):
    path = _rewritten(CASES / "cases.bin", tmp_path / "short.bin", {"cases/data/0": b"\0" * 8})
    with pytest.raises(ValueError, match="storage 'cases/data/0' holds 8 bytes"):
        torch_weights.load(path)


# --------------------------------------------------------------- refused


def test_legacy_format_is_refused():
    """torch.save(..., _use_new_zipfile_serialization=False): torch < 1.6's format."""
    with pytest.raises(ValueError, match=r"legacy \(torch < 1\.6\) serialization format.*convert it to safetensors"):
        torch_weights.load(CASES / "legacy.bin")


def test_legacy_bin_in_a_folder_is_refused(tmp_path):
    _folder_without_weights(tmp_path)
    shutil.copy(CASES / "legacy.bin", tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="legacy"):
        mlx_embed.load(tmp_path)


def test_torchscript_is_refused():
    with pytest.raises(ValueError, match=r"TorchScript archive \(torch.jit.save\).*safetensors"):
        torch_weights.load(CASES / "scripted.pt")


def test_not_a_checkpoint_is_refused(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"\x00" * 100)
    with pytest.raises(ValueError, match="not a PyTorch checkpoint"):
        torch_weights.load(tmp_path / "x.bin")
    with zipfile.ZipFile(tmp_path / "y.bin", "w") as z:
        z.writestr("readme.txt", "hello")
    with pytest.raises(ValueError, match="not a torch.save archive"):
        torch_weights.load(tmp_path / "y.bin")


class _System:
    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


class _Exec:
    def __init__(self, code):
        self.code = code

    def __reduce__(self):
        return (builtins.exec, (self.code,))


def test_malicious_pickles_are_refused_before_they_run(tmp_path):
    """data.pkl calling os.system or builtins.exec (at the top or inside a
    state dict) is refused by name, and its side effect does not happen."""
    marker = tmp_path / "pwned"
    code = f"open({str(marker)!r}, 'w').close()"
    # The payload is live: an ordinary unpickler runs it.
    live = tmp_path / "live"
    pickle.loads(pickle.dumps(_Exec(f"open({str(live)!r}, 'w').close()")))
    assert live.exists()

    payloads = {
        "system": (pickle.dumps(_System(f"touch {marker}"), protocol=2), r"(posix|nt|os)\.system"),
        "exec": (pickle.dumps(_Exec(code), protocol=4), r"builtins\.exec"),
        "exec in a state dict": (
            pickle.dumps(OrderedDict([("w", _Exec(code))]), protocol=2), r"(__builtin__|builtins)\.exec"),
        "eval by GLOBAL opcode": (
            b"\x80\x02cbuiltins\neval\nX" + len(code).to_bytes(4, "little") + code.encode() + b"\x85R.",
            r"builtins\.eval"),
    }
    for label, (pkl, name) in payloads.items():
        path = _torch_zip(tmp_path / f"{label.replace(' ', '_')}.bin", pkl)
        with pytest.raises(ValueError, match=rf"refusing to unpickle {name}: only a state dict of tensors"):
            torch_weights.load(path)
        assert not marker.exists(), label

    # And through a model folder, as the loader meets it.
    (tmp_path / "model").mkdir()
    folder = _folder_without_weights(tmp_path / "model")
    _torch_zip(folder / "pytorch_model.bin", payloads["exec"][0])
    with pytest.raises(ValueError, match="refusing to unpickle builtins.exec"):
        mlx_embed.load(folder)
    assert not marker.exists()


def test_allowed_names_cannot_be_misused(tmp_path):
    """Names that are allowed resolve to inert stand-ins: a storage type
    called as a function, or a rebuild given something other than a storage
    record, is an error, not a call into torch."""
    calls = {
        "storage called": b"\x80\x02ctorch\nFloatStorage\n)R.",
        "rebuild of a non-storage": b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n(K\x01K\x00)))\x89}tR.",
    }
    for label, pkl in calls.items():
        path = _torch_zip(tmp_path / f"{label.replace(' ', '_')}.bin", pkl)
        with pytest.raises(ValueError):
            torch_weights.load(path)
    # A persistent id other than a storage record.
    pkl = b"\x80\x02X\x04\x00\x00\x00evil" + b"Q."
    with pytest.raises(ValueError, match="unexpected persistent id"):
        torch_weights.load(_torch_zip(tmp_path / "pid.bin", pkl))


def test_unsupported_storage_type_is_named(tmp_path):
    pkl = b"\x80\x02ctorch\nComplexFloatStorage\n."
    with pytest.raises(ValueError, match="storage type torch.ComplexFloatStorage is not supported"):
        torch_weights.load(_torch_zip(tmp_path / "c.bin", pkl))


def test_unpickler_is_a_restricted_pickle_unpickler():
    assert issubclass(torch_weights._StateDictUnpickler, pickle.Unpickler)
    u = torch_weights._StateDictUnpickler(io.BytesIO(b""), "x")
    with pytest.raises(ValueError, match="refusing to unpickle subprocess.Popen"):
        u.find_class("subprocess", "Popen")
    assert u.find_class("collections", "OrderedDict") is OrderedDict


def _one_tensor_pickle(after_tensor: bytes = b"") -> bytes:
    """A state dict of one float tensor "w" (4 elements of storage "0"), with
    ``after_tensor`` run on the tensor before it goes into the dict."""
    out = b"\x80\x02ccollections\nOrderedDict\n)R" + _u("w") + b"ctorch._utils\n_rebuild_tensor_v2\n("
    out += b"(" + _u("storage") + b"ctorch\nFloatStorage\n" + _u("0") + _u("cpu") + b"J\x04\x00\x00\x00tQ"
    out += b"J\x00\x00\x00\x00" + _ints_tuple((4,)) + _ints_tuple((1,))
    out += b"\x89ccollections\nOrderedDict\n)RtR" + after_tensor
    return out + b"s."


def _set_state(key: str, value: bytes) -> bytes:
    """Pickle: BUILD on the top of the stack with {key: value}."""
    return b"}" + _u(key) + value + b"sb"


def test_the_pickle_cannot_rewrite_what_was_checked(tmp_path):
    """BUILD writes an object's __dict__ past a frozen dataclass: a file could
    set a tensor's offset or stride negative after the rebuild checked them
    (as_strided then read outside the storage, or crashed the process), or
    turn the shared FloatStorage into HalfStorage for every later load."""
    storage = {"0": np.arange(4, dtype="<f4").tobytes()}
    negative = b"J" + (-4).to_bytes(4, "little", signed=True)
    for label, attack in (("offset", _set_state("offset", negative)),
                          ("stride", _set_state("stride", b"(" + negative + b"t"))):
        path = _torch_zip(tmp_path / f"{label}.bin", _one_tensor_pickle(attack), storage)
        with pytest.raises(ValueError, match="the pickle sets the state of a TensorRef"):
            torch_weights.load(path)
    poison = b"\x80\x02ctorch\nFloatStorage\n" + _set_state("name", _u("HalfStorage")) + b"."
    with pytest.raises(ValueError, match="the pickle sets the state of a StorageType"):
        torch_weights.load(_torch_zip(tmp_path / "poison.bin", poison))
    defaults = b"\x80\x02ctorch._utils\n_rebuild_parameter\nN" + b"}" + _u("__defaults__") + _ints_tuple((1, 2))
    with pytest.raises(ValueError, match="the pickle sets the state of a Call"):
        torch_weights.load(_torch_zip(tmp_path / "defaults.bin", defaults + b"s\x86b."))
    # Nothing leaked into the next load.
    got = torch_weights.load(_torch_zip(tmp_path / "clean.bin", _one_tensor_pickle(), storage))
    assert got["w"].dtype == mx.float32
    assert np.array(got["w"]).tolist() == [0.0, 1.0, 2.0, 3.0]


def test_hostile_archives_cost_no_memory_and_name_the_file(tmp_path):
    """A compressed entry could unpack to gigabytes (torch.save never
    compresses); a pickle's self-referencing lists, ten levels deep, printed
    as gigabytes in an error message; keys 1 and "1" merged."""
    storage = np.arange(4, dtype="<f4").tobytes()
    bomb = tmp_path / "bomb.bin"
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data.pkl", _one_tensor_pickle())
        z.writestr("archive/data/0", storage)
    with pytest.raises(ValueError, match=rf"{bomb}: 'archive/data.pkl' is compressed"):
        torch_weights.load(bomb)

    # Ten references to one list, nine levels deep: a few hundred bytes of
    # pickle (the memo shares each level), 10^9 elements in its full repr.
    value: list = [None] * 10
    for _ in range(9):
        value = [value] * 10
    persistent_id = pickle.dumps(value, protocol=2)[2:-1]
    pkl = b"\x80\x02ccollections\nOrderedDict\n)R" + _u("w") + persistent_id + b"Qs."
    path = _torch_zip(tmp_path / "laughs.bin", pkl)
    assert path.stat().st_size < 2000
    with pytest.raises(ValueError, match=rf"{path}: unexpected persistent id") as refused:
        torch_weights.load(path)
    assert len(str(refused.value)) < 1000

    keys = _one_tensor_pickle().replace(_u("w"), b"J\x01\x00\x00\x00", 1)
    with pytest.raises(ValueError, match="entry 1 is not named by a string"):
        torch_weights.load(_torch_zip(tmp_path / "keys.bin", keys, {"0": storage}))
