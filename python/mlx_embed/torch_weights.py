"""PyTorch checkpoints (``pytorch_model.bin``) read without torch.

``torch.save`` (torch >= 1.6) writes a zip archive: ``<name>/data.pkl``, a
pickle of the state dict in which every tensor refers to a storage by key,
and ``<name>/data/<key>``, each storage's raw bytes (``<name>/byteorder``
says their byte order, when it is there). This module reads that archive
into ``{name: mx.array}``, what ``mx.load`` gives for a safetensors file.

A pickle can call any importable function while it loads, so ``data.pkl``
is read by an unpickler that resolves only the few names a state dict of
tensors uses (``OrderedDict``, torch's tensor and parameter rebuild
functions, the typed storage classes, dtypes); any other name is refused
before anything runs. Those names resolve to functions of this module, not
torch's: rebuilding a tensor only records where its elements are, and the
bytes are read afterwards, bounds-checked, with NumPy.

Refused, with a message that says to convert to safetensors: the legacy
format of torch < 1.6 (a bare pickle stream), TorchScript archives,
big-endian storages, tensor types other than dense strided ones, and dtypes
without an MLX equivalent.
"""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import reprlib
import zipfile
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

CONVERT = (
    "convert it to safetensors (with torch: transformers' save_pretrained(..., safe_serialization=True), "
    "or safetensors.torch.save_file(torch.load(path), 'model.safetensors'))"
)

# torch's typed storage class names -> (NumPy dtype read, MLX dtype returned).
# bfloat16 has no NumPy dtype: its bits are read as uint16 and viewed in MLX.
# float64 comes back as float32, as mx.array makes NumPy's float64 (MLX's GPU
# backends have no float64).
STORAGES = {
    "DoubleStorage": (np.dtype("<f8"), mx.float32),
    "FloatStorage": (np.dtype("<f4"), mx.float32),
    "HalfStorage": (np.dtype("<f2"), mx.float16),
    "BFloat16Storage": (np.dtype("<u2"), mx.bfloat16),
    "LongStorage": (np.dtype("<i8"), mx.int64),
    "IntStorage": (np.dtype("<i4"), mx.int32),
    "ShortStorage": (np.dtype("<i2"), mx.int16),
    "CharStorage": (np.dtype("i1"), mx.int8),
    "ByteStorage": (np.dtype("u1"), mx.uint8),
    "BoolStorage": (np.dtype("?"), mx.bool_),
}

# torch dtype attributes a pickle may name (as values; they are never called).
DTYPES = (
    "float64", "double", "float32", "float", "float16", "half", "bfloat16",
    "int64", "long", "int32", "int", "int16", "short", "int8", "uint8", "bool",
)


# Bounded reprs for error messages: a pickle's values can be made to print
# as gigabytes (a list holding itself ten times, ten levels deep).
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 2, 60, 60
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 4


def _short(value: Any) -> str:
    return _SHORT.repr(value)


class _Sealed:
    """A stand-in the pickle gets: pickle's BUILD opcode writes an object's
    ``__dict__`` directly (a frozen dataclass does not stop it), which would
    let a file change a tensor's offset after it was checked, or a shared
    storage type for every later load. BUILD calls ``__setstate__`` instead
    where there is one."""

    def __setstate__(self, state):
        raise ValueError(f"the pickle sets the state of a {type(self).__name__.lstrip('_')}: {_short(state)}")


@dataclass(frozen=True)
class _StorageType(_Sealed):
    """Stands for ``torch.<name>Storage`` in the pickle."""

    name: str


@dataclass(frozen=True)
class _Dtype(_Sealed):
    """Stands for ``torch.<name>`` (a dtype) in the pickle."""

    name: str


@dataclass(frozen=True)
class _Storage(_Sealed):
    """A ``('storage', type, key, location, numel)`` record."""

    storage_type: _StorageType
    key: str
    numel: int


@dataclass(frozen=True)
class _TensorRef(_Sealed):
    """Where a tensor's elements are: its storage, offset, size and stride
    (in elements)."""

    storage: _Storage
    offset: int
    size: tuple
    stride: tuple


# Past any real tensor's dimension or offset (MLX's shapes are 32-bit).
_MAX_INDEX = (1 << 31) - 1


def _index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_INDEX


def _ints(value: Any, what: str) -> tuple:
    if not isinstance(value, (tuple, list)) or len(value) > 64 or not all(_index(v) for v in value):
        raise ValueError(f"tensor {what} {_short(value)} is not a tuple of integers in 0..2^31")
    return tuple(value)


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None,
                       metadata=None):
    if not isinstance(storage, _Storage):
        raise ValueError(f"a tensor's storage is a {type(storage).__name__}, not a storage record")
    if not _index(storage_offset):
        raise ValueError(f"tensor storage offset {_short(storage_offset)} is not an integer in 0..2^31")
    size, stride = _ints(size, "size"), _ints(stride, "stride")
    if len(size) != len(stride):
        raise ValueError(f"tensor size {size} and stride {stride} differ in length")
    return _TensorRef(storage, storage_offset, size, stride)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, state=None):
    # An nn.Parameter (a state dict saved with keep_vars=True): its tensor.
    if not isinstance(data, _TensorRef):
        raise ValueError(f"a parameter's data is a {type(data).__name__}, not a tensor")
    return data


class _Call(_Sealed):
    """A function of ours the pickle may call, sealed like the records: on a
    bare function BUILD would set its ``__defaults__`` for every later load."""

    def __init__(self, fn):
        self._fn = fn

    def __call__(self, *args):
        return self._fn(*args)


_ALLOWED = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _Call(_rebuild_tensor_v2),
    ("torch._utils", "_rebuild_parameter"): _Call(_rebuild_parameter),
    ("torch._utils", "_rebuild_parameter_with_state"): _Call(_rebuild_parameter),
}
# Shared by every load: sealed, so no file can change them for the next.
_ALLOWED.update({("torch", name): _StorageType(name) for name in STORAGES})
_ALLOWED.update({("torch", name): _Dtype(name) for name in DTYPES})

# What torch.save writes for tensors this module does not read: named, so the
# refusal says what the file holds rather than that it could run code.
_UNSUPPORTED = {
    "_rebuild_qtensor": "quantized tensors (torch.quantization)",
    "_rebuild_tensor_v3": "tensors of a dtype without a typed storage (float8, uint16/32/64)",
    "_rebuild_sparse_tensor": "sparse tensors",
    "_rebuild_wrapper_subclass": "tensor subclasses",
    "_rebuild_meta_tensor_no_storage": "meta tensors (no data)",
}


class _StateDictUnpickler(pickle.Unpickler):
    """Resolves only the names of :data:`_ALLOWED`; storages come back as
    :class:`_Storage` records."""

    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str):
        found = _ALLOWED.get((module, name))
        if found is None and module.startswith("torch") and name in _UNSUPPORTED:
            raise ValueError(f"{self.where} holds {_UNSUPPORTED[name]}, which are not read here; {CONVERT}")
        if found is None and module == "torch" and name.startswith("q") and name[1:].startswith(("int", "uint")):
            raise ValueError(f"{self.where} holds quantized tensors (torch.{name}), which are not read here; {CONVERT}")
        if found is None:
            if module == "torch" and name.endswith("Storage"):
                raise ValueError(
                    f"{self.where}: storage type torch.{name} is not supported "
                    f"(supported: {', '.join(sorted(STORAGES))}); {CONVERT}"
                )
            raise ValueError(
                f"{self.where}: refusing to unpickle {module}.{name}: only a state dict of tensors is "
                f"read (a pickle naming anything else could run code); {CONVERT}"
            )
        return found

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise ValueError(f"{self.where}: unexpected persistent id {_short(pid)}")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType):
            raise ValueError(f"{self.where}: a storage of type {_short(storage_type)} is not supported")
        if not isinstance(key, str) or not key or "/" in key or key in (".", ".."):
            raise ValueError(f"{self.where}: bad storage key {_short(key)}")
        if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
            raise ValueError(f"{self.where}: bad storage size {_short(numel)}")
        return _Storage(storage_type, key, numel)


# What ``torch.save`` wrote before 1.6 (and with _use_new_zipfile_serialization=False):
# a pickle of this magic number first, then the rest, all one stream.
_LEGACY_MAGIC = (0x1950A86A20F9469CFC6C).to_bytes(10, "little")


def _not_a_zip(path: str) -> ValueError:
    with open(path, "rb") as f:
        head = f.read(512)
    if head.startswith(b"\x80") and _LEGACY_MAGIC in head[:16]:
        return ValueError(
            f"{path} is in PyTorch's legacy (torch < 1.6) serialization format, which is not read "
            f"here; {CONVERT}"
        )
    if head[257:262] == b"ustar":  # torch's older still tar format
        return ValueError(f"{path} is in PyTorch's old tar serialization format, which is not read here; {CONVERT}")
    return ValueError(f"{path} is not a PyTorch checkpoint (torch.save's zip format); {CONVERT}")


def _prefix(names: list[str], path: str) -> str:
    """The archive's top folder (torch names it ``archive`` or after the file)."""
    pkls = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pkls) != 1:
        raise ValueError(f"{path}: a zip, but not a torch.save archive (no single <name>/data.pkl); {CONVERT}")
    prefix = pkls[0][: -len("data.pkl")]
    if any(n == prefix + "constants.pkl" or n.startswith(prefix + "code/") for n in names):
        raise ValueError(
            f"{path} is a TorchScript archive (torch.jit.save), not a state dict; save the model's "
            f"state_dict instead, or {CONVERT}"
        )
    return prefix


def _tensor(ref: _TensorRef, data: np.ndarray, name: str, path: str) -> mx.array:
    # Checked again where it counts: nothing between the rebuild and here may
    # have changed them (the records are sealed), but as_strided trusts them.
    if not (_index(ref.offset) and len(ref.size) == len(ref.stride)
            and all(_index(v) for v in (*ref.size, *ref.stride))):
        raise ValueError(f"{path}: tensor {name!r} has a bad size, stride or offset")
    count = math.prod(ref.size)
    np_dtype, mx_dtype = STORAGES[ref.storage.storage_type.name]
    if count == 0:
        flat = np.zeros(ref.size, dtype=np_dtype)
    elif count > data.size:
        # Only a view with zero strides (an expanded tensor) holds more
        # elements than its storage; a hostile file could ask for terabytes.
        raise ValueError(
            f"{path}: tensor {name!r} (size {ref.size}, stride {ref.stride}) has more elements than its "
            f"storage of {data.size}"
        )
    else:
        last = ref.offset + sum((n - 1) * s for n, s in zip(ref.size, ref.stride))
        if last >= data.size:
            raise ValueError(
                f"{path}: tensor {name!r} (size {ref.size}, stride {ref.stride}, offset {ref.offset}) "
                f"reaches past its storage of {data.size} elements"
            )
        view = np.lib.stride_tricks.as_strided(
            data[ref.offset:], shape=ref.size, strides=tuple(s * data.itemsize for s in ref.stride),
            writeable=False,
        )
        flat = np.array(view, order="C")  # a copy; ascontiguousarray would make a 0-d tensor 1-d
    if mx_dtype == mx.bfloat16:
        return mx.array(flat).view(mx.bfloat16)
    return mx.array(flat, dtype=mx_dtype)


def _read_entry(zf: zipfile.ZipFile, name: str, path: str, at_most: int) -> bytes:
    """An entry's bytes. torch.save stores every entry uncompressed; a
    compressed one could unpack to any size its header claims (a few KB
    to gigabytes), so it is refused, as is one larger than ``at_most``."""
    try:
        info = zf.getinfo(name)
    except KeyError:
        raise ValueError(f"{path}: {name!r} is missing from the archive") from None
    if info.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"{path}: {name!r} is compressed, which torch.save never writes; {CONVERT}")
    if info.file_size > at_most:
        raise ValueError(f"{path}: {name!r} holds {info.file_size} bytes, more than the {at_most} it can need")
    return zf.read(info)


# A state dict's pickle is names and small tuples: a few MB for the largest
# models (their tensors' bytes are elsewhere in the archive).
_MAX_PICKLE_BYTES = 256 << 20


def load(path: str | os.PathLike) -> dict[str, mx.array]:
    """The tensors of a ``torch.save`` zip checkpoint (a state dict), by
    name, as ``mx.load`` returns a safetensors file's. Contiguous or not,
    views of one storage (tied weights) are each returned in full. Every
    failure is a ValueError naming the file."""
    path = os.fspath(path)
    try:
        return _load(path)
    except ValueError as e:
        if path in str(e):
            raise
        raise ValueError(f"{path}: {e}") from None
    except (TypeError, OverflowError, IndexError, KeyError, AttributeError, EOFError,
            pickle.UnpicklingError, zipfile.BadZipFile, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read it as a state dict: {type(e).__name__}: {_short(str(e))}") from None


def _load(path: str) -> dict[str, mx.array]:
    if not zipfile.is_zipfile(path):
        raise _not_a_zip(path)
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        prefix = _prefix(names, path)
        if prefix + "byteorder" in names:
            order = _read_entry(zf, prefix + "byteorder", path, 64).decode("ascii", "replace").strip()
            if order != "little":
                raise ValueError(
                    f"{path}: its storages are {order}-endian (byteorder); only little-endian "
                    f"checkpoints are read; {CONVERT}"
                )
        try:
            pickled = _read_entry(zf, prefix + "data.pkl", path, _MAX_PICKLE_BYTES)
            state = _StateDictUnpickler(io.BytesIO(pickled), path).load()
        except ValueError:
            raise
        except Exception as e:  # a malformed pickle: name it, whatever broke
            raise ValueError(
                f"{path}: cannot read its data.pkl as a state dict: {type(e).__name__}: {_short(str(e))}"
            ) from None
        if not isinstance(state, dict):
            raise ValueError(f"{path}: holds a {type(state).__name__}, not a state dict; {CONVERT}")
        refs: dict[str, _TensorRef] = {}
        for name, value in state.items():
            if not isinstance(name, str):
                # 1 and "1" would both be "1": a state dict's names are strings.
                raise ValueError(f"{path}: entry {_short(name)} is not named by a string; {CONVERT}")
            if isinstance(value, _TensorRef):
                refs[name] = value
            elif isinstance(value, (dict, list, tuple)):
                raise ValueError(
                    f"{path}: entry {_short(name)} is a {type(value).__name__}, not a tensor: a training "
                    f"checkpoint rather than a model's state dict; {CONVERT}"
                )
            # Other values (numbers, strings, dtypes) are not weights.
        if not refs:
            raise ValueError(f"{path}: holds no tensors; {CONVERT}")

        by_storage: dict[str, list[tuple[str, _TensorRef]]] = {}
        for name, ref in refs.items():
            by_storage.setdefault(ref.storage.key, []).append((name, ref))
        out: dict[str, mx.array] = {}
        for key, group in by_storage.items():
            kinds = {ref.storage.storage_type for _, ref in group}
            if len(kinds) != 1:
                raise ValueError(f"{path}: storage {key!r} is read as {len(kinds)} different types")
            np_dtype, _ = STORAGES[group[0][1].storage.storage_type.name]
            entry = f"{prefix}data/{key}"
            numel = max(ref.storage.numel for _, ref in group)
            raw = _read_entry(zf, entry, path, numel * np_dtype.itemsize)
            if len(raw) < numel * np_dtype.itemsize:
                raise ValueError(
                    f"{path}: storage {entry!r} holds {len(raw)} bytes, {numel} {np_dtype} elements "
                    f"need {numel * np_dtype.itemsize}"
                )
            data = np.frombuffer(raw, dtype=np_dtype, count=len(raw) // np_dtype.itemsize)
            for name, ref in group:
                out[name] = _tensor(ref, data, name, path)
            del raw, data
    # Evaluated here, as the Dense loader does with mx.load's arrays: a lazy
    # bfloat16 view belongs to this thread's stream.
    mx.eval(list(out.values()))
    return {name: out[name] for name in refs}
