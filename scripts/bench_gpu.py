#!/usr/bin/env python3
"""The engine on a GPU, beside torch on the same weights and token ids.

For three model shapes with seeded random weights (MiniLM-L6, BERT-base,
Qwen3-0.6B) it reports:

* parity: the engine (fp32 and bf16) against fp32 transformers on the same
  ids (min cosine, max |diff|);
* texts/s for one call and for calls of 32 (back to back, and with the next
  call submitted before the previous is collected), in bf16 and fp32, beside
  torch fp16 (BERT shapes) / bf16 (Qwen3) at batch 32 and 256;
* one-text latency (fp32 and bf16, engine and torch fp32);
* MLX memory (active/cache/peak) and device memory over 2,000 calls of
  varied shapes (Qwen3 shape), sampled every 250 calls;
* ``--variants``: the cost of new pass shapes (with and without
  ``shape_buckets``), fused attention (``mx.fast.scaled_dot_product_attention``)
  against the matmul path on the BERT shapes, more device streams;
* ``--float16``: every shape in fp16, its rates and one-text latency, and its
  vectors against the engine's fp32 ones on the same ids (an fp16 overflow
  shows there);
* ``--packed-ab``: each shape on each pass's real tokens alone
  (``load(packed_rows=True)``: the BERT shapes' layers, Qwen3's
  feed-forward) against padded passes: one call,
  calls of 32 and of 64 random texts (a server batch's mix of lengths),
  rounds interleaved, and the two paths' vectors; ``--server-flags
  packed_rows`` (and ``packed_graphs_off``, with CUDA graphs off) runs the
  server with ``--packed-rows true``;
* ``--joined-ab``: the Qwen3 shape with its q/k/v and gate/up projections
  joined into one matmul each against apart (``load(joined_linears=)``);
* ``--sweep``: the device sub-batch budget (``batch_tokens``);
* ``--graph-ops``: one call and calls of 32 with MLX_MAX_OPS_PER_BUFFER at
  20 (MLX's CUDA default), 60 and 200 (kernels per CUDA graph), each in a
  child process;
* ``--mlx-env SETS``: one call, calls of 32, the pass profile and MLX's
  peak memory (one call, calls of 32; ``--batch-tokens`` reaches them) under MLX
  CUDA settings (``graphs_off``: kernels launched one by one, not recorded
  into CUDA graphs; ``cudnn_sdpa_off``: MLX's own attention kernels, not
  cuDNN's), each beside MLX's defaults in a child process; ``--server-flags``
  takes the same names, for the server in such a process;
* ``--small-calls``: calls of 32 under the defaults with the padding they
  carry, 2 and 4 model threads (an engine instance each), and one engine
  rotating consecutive calls over 2 and 4 streams;
* ``--server``: the Rust server itself on this machine, started as
  ``python -m mlx_embed serve`` (the extension hosts it, so the stable-ABI
  build from ``scripts/gpu-relay-prepare`` runs under any Python 3.11+):
  ``/info``'s device, then texts/s with one text per request at 64
  connections and 32 texts per request at 4, under the default flags,
  ``--streams 2`` and ``4``, ``--model-threads 2`` and ``4``, and batches of
  up to 256 texts, beside the engine's one call in this process;
  answers are checked against the engine's own vectors
  (``scripts/http_load.py`` is the client); where wrk is installed, each
  load again with wrk as the client for ``--wrk-seconds`` (the relay
  carries it), so what the Python client costs a round shows;
* ``--quantized``: Qwen3 shape bf16 vs 8-bit vs 4-bit quantized kernels,
  one call and two-text latency (the measured choice behind dequantizing
  pre-quantized checkpoints on CUDA).

Torch is optional: without it the peer and parity rows are left out.

    .venv/bin/python scripts/bench_gpu.py --variants --sweep --quantized --out results/
    .venv/bin/python scripts/bench_gpu.py --shapes minilm --sweep
    .venv/bin/python scripts/bench_gpu.py --dry-run                 # tiny shapes on the CPU (make test)

A device lease can be short, so the work can be split: ``--stage torch
--workdir W`` makes the checkpoints and the torch figures (no MLX needed),
``--stage engine --workdir W`` reuses them. ``--deadline S`` skips the
optional sections once S seconds have passed; results.json is rewritten
after every section, so a run cut short still leaves what it measured.

Token ids are generated (seeded, mixed lengths, ~64 tokens on average), not
tokenized text, so engine and peer see exactly the same input.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import http_load  # this script's neighbours in scripts/
import numpy as np
import replicas

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

# Imported in main() unless the stage is torch-only: mlx_embed first (it
# picks the CPU BLAS before mlx.core loads).
mlx_embed = None
mx = None

TOKENIZER = ROOT / "tests" / "fixtures" / "tiny-qwen3" / "tokenizer.json"
T0 = time.perf_counter()

_BERT = {
    "model_type": "bert", "vocab_size": 30522, "max_position_embeddings": 512,
    "type_vocab_size": 2, "hidden_act": "gelu", "layer_norm_eps": 1e-12, "pad_token_id": 0,
    "architectures": ["BertModel"],
}
_QWEN3 = {
    "model_type": "qwen3", "vocab_size": 151669, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
    "use_sliding_window": False, "sliding_window": None, "max_window_layers": 28,
    "architectures": ["Qwen3Model"],
}
SHAPES = {
    "minilm": ({**_BERT, "hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12,
                "intermediate_size": 1536}, 8192),
    "bert-base": ({**_BERT, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                   "intermediate_size": 3072}, 4096),
    "qwen3-0.6b": ({**_QWEN3, "hidden_size": 1024, "num_hidden_layers": 28,
                    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                    "intermediate_size": 3072}, 2048),
}
DRY_SHAPES = {
    "tiny-bert": ({**_BERT, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "intermediate_size": 128}, 48),
    "tiny-qwen3": ({**_QWEN3, "vocab_size": 30522, "hidden_size": 64, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                    "intermediate_size": 128}, 48),
}
PARITY_TEXTS = 256


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def corpus(n: int, seed: int, max_len: int = 256) -> list[list[int]]:
    """[CLS] content [SEP] with mixed lengths: 30% short, 55% medium, 15% long
    (about 64 tokens on average)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        r = rng.random()
        k = int(rng.integers(3, 20) if r < 0.3 else rng.integers(30, 100) if r < 0.85
                else rng.integers(120, max_len - 1))
        out.append([101, *rng.integers(1000, 29000, k).tolist(), 102])
    return out


def torch_available() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def make_checkpoint(config: dict, folder: Path, seed: int, use_torch: bool) -> None:
    """A Hugging Face folder with seeded random weights: made by transformers
    when torch is here (so the peer loads the very same weights), otherwise
    by the engine's own model classes. Kept when already there."""
    if (folder / "config.json").exists():
        return
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_bytes(TOKENIZER.read_bytes())
    if use_torch:
        import torch
        from transformers import AutoConfig, AutoModel

        torch.manual_seed(seed)
        cfg = AutoConfig.for_model(**config)
        model = AutoModel.from_config(cfg)
        model.save_pretrained(folder, safe_serialization=True)
        return
    from mlx.utils import tree_flatten

    from mlx_embed import loading

    arch = loading.architecture(config["model_type"])
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))


def seconds(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def engine_rates(model, ids: list[list[int]], reps: int, call: int, one_call: bool = True) -> dict:
    def whole():
        model.embed_ids(ids)

    def calls_of(n):
        for i in range(0, len(ids), n):
            model.embed_ids(ids[i : i + n])

    def overlapped(n):
        # What a model thread can do: submit batch k+1 before collecting k.
        prev = None
        for i in range(0, len(ids), n):
            cur = model.submit_ids(ids[i : i + n])
            if prev is not None:
                prev.result()
            prev = cur
        if prev is not None:
            prev.result()

    n = len(ids)
    out = {}
    if one_call:
        whole()  # new shapes compile their kernels once
        out["one_call"] = n / seconds(whole, reps)
    calls_of(call)
    out[f"calls_of_{call}"] = n / seconds(lambda: calls_of(call), reps)
    out[f"calls_of_{call}_overlapped"] = n / seconds(lambda: overlapped(call), reps)
    return out


def latency_ms(model, ids: list[list[int]], reps: int, rows: int = 1) -> float:
    few = ids[:rows]
    model.embed_ids(few)
    return 1e3 * seconds(lambda: model.embed_ids(few), reps)


def mlx_vectors(model, ids) -> np.ndarray:
    return np.frombuffer(model.embed_ids(ids).vectors, "<f4").reshape(len(ids), -1)


def parity(ref: np.ndarray, got: np.ndarray) -> dict:
    cos = (ref * got).sum(1) / np.linalg.norm(ref, axis=1) / np.linalg.norm(got, axis=1)
    return {"min_cosine": float(cos.min()), "max_abs_diff": float(np.abs(ref - got).max())}


class TorchPeer:
    def __init__(self, folder: Path, pooling: str, dtype: str):
        import torch
        from transformers import AutoModel

        self.torch = torch
        self.dev = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = AutoModel.from_pretrained(folder, dtype=getattr(torch, dtype)).to(self.dev).eval()
        self.pooling = pooling

    def embed(self, ids: list[list[int]], batch: int) -> np.ndarray:
        torch = self.torch
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))  # as sentence-transformers
        out = np.empty((len(ids), self.model.config.hidden_size), np.float32)
        with torch.inference_mode():
            for s in range(0, len(order), batch):
                idx = order[s : s + batch]
                L = max(len(ids[i]) for i in idx)
                arr = torch.zeros((len(idx), L), dtype=torch.long)
                mask = torch.zeros((len(idx), L), dtype=torch.long)
                for r, i in enumerate(idx):
                    arr[r, : len(ids[i])] = torch.tensor(ids[i])
                    mask[r, : len(ids[i])] = 1
                arr, mask = arr.to(self.dev), mask.to(self.dev)
                h = self.model(input_ids=arr, attention_mask=mask).last_hidden_state
                if self.pooling == "mean":
                    m = mask.unsqueeze(-1).to(h.dtype)
                    v = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
                else:
                    v = h[torch.arange(len(idx), device=self.dev), mask.sum(1) - 1]
                out[idx] = v.float().cpu().numpy()
        return out

    def rate(self, ids, batch: int, reps: int) -> float:
        self.embed(ids[: batch * 2], batch)
        return len(ids) / seconds(lambda: self.embed(ids, batch), reps)


def device_used_bytes():
    try:
        import torch

        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            return total - free
    except ImportError:
        pass
    return None


def memory_run(model, calls: int, seed: int, max_rows: int) -> dict:
    """Varied shapes, as a server sees them: every call a new padded shape."""
    rng = np.random.default_rng(seed)
    pool = corpus(4096, seed + 1)
    before = {**model.memory(), "device_used_bytes": device_used_bytes()}
    samples, every = [], max(1, calls // 8)
    t0 = time.perf_counter()
    for c in range(calls):
        rows = int(rng.integers(1, max_rows + 1))
        pick = rng.integers(0, len(pool), rows)
        model.embed_ids([pool[i] for i in pick])
        if (c + 1) % every == 0:
            samples.append({"calls": c + 1, **model.memory(), "device_used_bytes": device_used_bytes()})
    mx.synchronize()
    secs = time.perf_counter() - t0
    after = {**model.memory(), "device_used_bytes": device_used_bytes()}
    return {"calls": calls, "seconds": secs, "before": before, "after": after, "samples": samples}


def peak_memory(model, ids: list[list[int]], call: int) -> dict:
    """MLX's peak memory (MB) over one call of every text, then over calls
    of ``call``, each from a reset peak: what a setting costs in device
    memory (CUDA graphs off hold a pass's temporaries until it has run)."""
    out = {}
    for label, size in (("one_call", len(ids)), (f"calls_of_{call}", call)):
        mx.synchronize()
        mx.reset_peak_memory()
        for i in range(0, len(ids), size):
            model.embed_ids(ids[i : i + size])
        mx.synchronize()
        out[f"peak_mb_{label}"] = mx.get_peak_memory() / 2**20
    out["active_mb"] = mx.get_active_memory() / 2**20
    # Evaluation points (ops.EvaluationPoints): on by default with graphs off.
    out["eval_chunk_mb"] = model.scheduler.eval_chunk_mb
    return out


def shape_costs(model, args, calls: int = 60) -> dict:
    """ms per call for calls of 1-64 random texts: the first pass (every
    shape new to the process) and the same calls again (shapes built)."""
    pool = corpus(4096, args.seed + 1)
    rng = np.random.default_rng(args.seed + 5)
    batches = [[pool[i] for i in rng.integers(0, len(pool), int(rng.integers(1, args.call * 2 + 1)))]
               for _ in range(calls)]
    model.embed_ids(pool[:8])
    out = {}
    for label in ("new_shapes_ms_per_call", "same_shapes_ms_per_call"):
        t0 = time.perf_counter()
        for b in batches:
            model.embed_ids(b)
        out[label] = 1e3 * (time.perf_counter() - t0) / calls
    return out


def padding_factor(model, ids: list[list[int]], call: int) -> float:
    """Padded tokens per real token when ``ids`` run in calls of ``call``
    under the model's plan (``call=0``: one call)."""
    sched = model.scheduler
    lengths = np.array([len(x) for x in ids])
    step = call or len(ids)
    padded = 0
    for i in range(0, len(ids), step):
        part = lengths[i : i + step]
        padded += sum(sched.padded_size(int(part[idx].max()), len(idx)) for idx in sched.plan(part))
    return padded / int(lengths.sum())


def threaded_rate(models: list, ids: list[list[int]], call: int, reps: int) -> float:
    """texts/s with one engine instance per thread, each on its own device
    stream, sharing calls of ``call`` round robin (several model threads)."""
    calls = [ids[i : i + call] for i in range(0, len(ids), call)]

    def run_all():
        errors = []

        def work(k):
            try:
                # MLX streams belong to the thread that made them.
                with mx.stream(mx.new_stream(mx.default_device())):
                    for c in calls[k :: len(models)]:
                        models[k].embed_ids(c)
            except Exception as e:  # noqa: BLE001 - re-raised below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(len(models))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    run_all()  # new shapes build once
    return len(ids) / seconds(run_all, reps)


def small_calls(load, ids, call: int, reps: int) -> dict:
    """Server-sized calls of ``call`` texts under the defaults (with the
    padding they carry, against one call's), and several model threads (one
    engine instance each, as separate model threads would run them).
    (``mx.compile`` of the forward pass was probed twice on an H200 without
    a gain, docs/benchmarks.md.)"""
    m = load()
    out = {"defaults": {**engine_rates(m, ids, reps, call),
                        "padding_one_call": padding_factor(m, ids, 0),
                        f"padding_calls_of_{call}": padding_factor(m, ids, call)}}
    for n in (2, 4):
        models = [load() for _ in range(n)]
        out[f"threads_{n}"] = {f"calls_of_{call}": threaded_rate(models, ids, call, reps)}
    for n in (2, 4):
        # One engine, consecutive calls on alternate streams (what --streams gives the server).
        out[f"streams_{n}"] = engine_rates(load(streams=n, pipeline=True), ids, reps, call, one_call=False)
    return out


PROFILE_ROWS = (1, 8, 32, 128, 512)
PROFILE_LENGTH = 64


def graph_primitives(*outputs) -> dict:
    """The primitives MLX would run for ``outputs``, by name (from
    ``mx.export_to_dot``; evaluated inputs such as the weights are not ops)."""
    import io
    import re
    from collections import Counter

    dot = io.StringIO()
    mx.export_to_dot(dot, *outputs)
    return dict(Counter(re.findall(r'label ="(\w+)"', dot.getvalue())).most_common())


PROBE_KINDS = ("one", "views", "adds", "matmuls")


def phase_medians(stages, runs: int, warmup: int) -> dict:
    """Median ms of each stage of a pass, and of the whole (``total_ms``),
    over ``runs`` passes after ``warmup`` untimed ones (new shapes build
    there). ``stages``: (name, fn) pairs run in order, each given the
    previous one's result (the first None)."""
    times: dict = {name: [] for name, _ in stages}
    times["total_ms"] = []
    for k in range(warmup + runs):
        value = None
        start = mark = time.perf_counter()
        took = []
        for name, fn in stages:
            value = fn(value)
            now = time.perf_counter()
            took.append((name, now - mark))
            mark = now
        if k >= warmup:
            for name, seconds_ in took:
                times[name].append(seconds_ * 1e3)
            times["total_ms"].append((mark - start) * 1e3)
    return {name: float(np.median(v)) for name, v in times.items()}


def submitted(y: mx.array) -> mx.array:
    mx.async_eval(y)
    return y


def kernel_probe(n: int, reps: int) -> dict:
    """What one primitive costs a pass, by kind: one add alone, then that
    add followed by a chain of ``n`` views (reshapes), element-wise adds or
    small matmuls ([64, 384] by [384, 384]; bfloat16 on a GPU). For each,
    building the graph, ``mx.async_eval`` returning and the wait for the
    result, in ms (medians of ``reps``), and each chain's excess over the
    add alone per primitive in µs (``us_each``). The fourth lease found a
    pass's fixed cost unmoved by a third fewer views: this says what a kernel
    costs the host and the device, and so what fewer kernels would save."""
    dtype = mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16
    # From NumPy: real buffers (mx.ones and mx.full evaluate to one broadcast
    # element, which a matmul would copy out every time).
    x = mx.array(np.ones((64, 384), dtype=np.float32)).astype(dtype)
    ones = mx.array(np.ones((64, 384), dtype=np.float32)).astype(dtype)
    w = mx.array(np.full((384, 384), 1.0 / 384, dtype=np.float32)).astype(dtype)
    mx.eval(x, ones, w)

    def chain(kind: str) -> mx.array:
        y = x + ones
        for i in range(0 if kind == "one" else n):
            if kind == "views":
                y = y.reshape(384, 64) if i % 2 == 0 else y.reshape(64, 384)
            elif kind == "adds":
                y = y + ones
            else:
                y = y @ w
        return y

    out: dict = {"chain": n, "dtype": str(dtype), "passes": reps}
    for kind in PROBE_KINDS:
        out[kind] = phase_medians((("build_ms", lambda _, kind=kind: chain(kind)), ("submit_ms", submitted),
                                   ("wait_ms", lambda y: mx.eval(y))), reps, warmup=2)
        out[kind]["primitives"] = sum(graph_primitives(chain(kind)).values())
    for kind in PROBE_KINDS[1:]:
        out[kind]["us_each"] = {key: 1e3 * (out[kind][key] - out["one"][key]) / n
                                for key in ("build_ms", "submit_ms", "wait_ms", "total_ms")}
    return out


def pass_profile(model, ids: list[list[int]], passes: int, row_counts=PROFILE_ROWS) -> dict:
    """Where one device pass's time goes, by rows, every text cut to
    ``PROFILE_LENGTH`` tokens: the host's padding (``host_ms``), building the
    graph in Python (``graph_ms``), ``mx.async_eval`` returning (``submit_ms``:
    MLX encoding and launching the kernels on the host) and waiting for the
    vectors (``wait_ms``), medians of ``passes``; with the graph's primitives.
    A straight line through the rows gives a pass's fixed cost (intercept)
    and its cost per text (slope): the fixed cost is what holds server-sized
    calls back on a GPU (docs/benchmarks.md, third lease)."""
    from mlx_embed import ops
    from mlx_embed.scheduler import _Call

    sched = model.scheduler
    texts = [x[: PROFILE_LENGTH - 1] + x[-1:] for x in ids if len(x) >= PROFILE_LENGTH]
    out: dict = {"length": PROFILE_LENGTH, "passes": passes, "rows": {}}
    for rows in row_counts:
        # Texts repeat where the corpus has fewer long ones (the dry run's).
        batch = (texts * -(-rows // len(texts)))[:rows]
        lengths = np.full(rows, PROFILE_LENGTH, dtype=np.int64)
        idx = np.arange(rows)
        def graph(host):
            with ops.forward_context(sched.context):
                return sched._graph(host, "pooled")[0]

        def host(_, batch=batch, lengths=lengths, idx=idx):
            return sched._host_arrays(idx, _Call(batch, None, lengths, None))

        primitives = graph_primitives(graph(host(None)))
        out["rows"][rows] = phase_medians((("host_ms", host), ("graph_ms", graph), ("submit_ms", submitted),
                                           ("wait_ms", np.array)), passes, warmup=3)
        out["rows"][rows]["primitives"] = sum(primitives.values())
    if len(out["rows"]) >= 2:
        x = np.array(list(out["rows"]), dtype=np.float64)
        y = np.array([r["total_ms"] for r in out["rows"].values()])
        slope, intercept = np.polyfit(x, y, 1)
        out["fixed_ms"], out["ms_per_text"] = float(intercept), float(slope)
    out["primitives_by_name"] = primitives
    return out


def float16_rows(load, folder: Path, ids: list[list[int]], reps: int, call: int) -> dict:
    """The engine in float16: rates, one-text latency, and its vectors
    against float32's on the same ids (no torch needed: an fp16 overflow,
    which bf16's range hides, shows as a low cosine or NaN)."""
    half = load(folder, dtype="float16")
    out = {**engine_rates(half, ids, reps, call), "latency_ms": latency_ms(half, ids, max(5, reps * 5))}
    sub = ids[:PARITY_TEXTS]
    got = mlx_vectors(half, sub)
    del half
    out["vs_float32"] = parity(mlx_vectors(load(folder, dtype="float32"), sub), got)
    out["finite"] = bool(np.isfinite(got).all())
    return out


def packed_ab(load, ids: list[list[int]], reps: int, rounds: int, call: int, new_shapes) -> dict:
    """A model on each pass's real tokens (``load(packed_rows=True)``)
    against padded passes (the default), rounds interleaved: one call, calls of ``call`` and of 64 random texts (what the
    server's batches are: mixed lengths, padded to the longest), back to back
    and overlapped; texts/s medians, each ratio packed over padded; and the
    two paths' vectors on the same ids. First, ``new_shapes(model)`` (ms a
    call over calls of random sizes, new shapes then the same again) padded,
    then packed: run second, packed's first pass pays only for the shapes
    packing adds (its row counts), which is what packing costs a new server."""
    models = {"padded": load(), "packed": load(packed_rows=True)}
    out: dict = {"rounds": rounds, "new_shapes": {key: new_shapes(m) for key, m in models.items()}}
    runs: dict = {key: [] for key in models}
    for _ in range(rounds):
        for key, m in models.items():
            rates = engine_rates(m, ids, reps, call)
            if call != 64:
                rates.update(engine_rates(m, ids, reps, 64, one_call=False))
            runs[key].append(rates)
    for key, rows in runs.items():
        out[key] = {name: float(np.median([r[name] for r in rows])) for name in rows[0]}
    out["speedup"] = {name: out["packed"][name] / out["padded"][name] for name in out["padded"]}
    sub = ids[:PARITY_TEXTS]
    out["vectors"] = parity(mlx_vectors(models["padded"], sub), mlx_vectors(models["packed"], sub))
    return out


JOINED_ROWS = (1, 8, 32)


def joined_ab(load, ids: list[list[int]], reps: int, rounds: int, row_counts=JOINED_ROWS) -> dict:
    """A decoder with its q/k/v and gate/up projections joined into one
    matmul each (``joined_linears=True``, ``sibling_linears.py``) against the
    same checkpoint with them apart (the default): ms a call of 1, 8
    and 32 texts, both models loaded once and timed in turn for ``rounds``
    rounds, which goes first alternating (medians of every round's median of
    ``reps``), the kernels a pass
    has (matrix products in the graph) and the largest difference between
    their vectors."""
    models = {"joined": load(joined_linears=True), "separate": load()}
    times: dict = {key: {rows: [] for rows in row_counts} for key in models}
    for k in range(rounds):
        for key, m in list(models.items())[:: 1 if k % 2 == 0 else -1]:
            for rows in row_counts:
                few = ids[:rows]
                m.embed_ids(few)
                times[key][rows].append(seconds(lambda m=m, few=few: m.embed_ids(few), reps))
    out: dict = {"groups": models["joined"].joined_groups, "rounds": rounds, "reps": reps, "rows": {}}
    for rows in row_counts:
        joined, separate = (1e3 * statistics.median(times[k][rows]) for k in ("joined", "separate"))
        out["rows"][rows] = {"joined_ms": joined, "separate_ms": separate, "speedup": separate / joined}
    vectors = [mlx_vectors(m, ids[: row_counts[-1]]) for m in models.values()]
    out["max_abs_diff"] = float(np.abs(vectors[0] - vectors[1]).max())
    probe = mx.array([ids[0][:16]])
    out["matmuls"] = {
        key: sum(n for name, n in graph_primitives(m.model(probe, mx.ones(probe.shape, dtype=mx.int32))).items()
                 if name in ("Matmul", "AddMM", "QuantizedMatmul"))
        for key, m in models.items()
    }
    return out


# Settings MLX's CUDA backend reads once per process (so each set runs in a
# child process): whether an evaluation's kernels are recorded into CUDA
# graphs (instantiated or updated, then launched) or launched one by one;
# whether fused attention goes to cuDNN or MLX's own kernels; kernels per
# CUDA graph. A small pass's fixed cost is host time in MLX's backend
# (docs/benchmarks.md, fourth lease), which these change.
MLX_ENV_SETS = {
    "mlx_defaults": {},
    "graphs_off": {"MLX_USE_CUDA_GRAPHS": "0"},
    "cudnn_sdpa_off": {"MLX_CUDA_USE_CUDNN_SDPA": "0"},
    "graphs_off_cudnn_sdpa_off": {"MLX_USE_CUDA_GRAPHS": "0", "MLX_CUDA_USE_CUDNN_SDPA": "0"},
    "ops_per_graph_20": {"MLX_MAX_OPS_PER_BUFFER": "20"},
    "ops_per_graph_60": {"MLX_MAX_OPS_PER_BUFFER": "60"},
    "ops_per_graph_200": {"MLX_MAX_OPS_PER_BUFFER": "200"},
    # Graphs off as the fifth lease ran them: a pass evaluated whole, every
    # temporary kept until it has run (the engine's default with graphs off
    # now evaluates a pass in pieces, ops.EvaluationPoints).
    "graphs_off_unbounded": {"MLX_USE_CUDA_GRAPHS": "0"},
}
GRAPH_OPS_SETS = ("ops_per_graph_20", "ops_per_graph_60", "ops_per_graph_200")
# Engine settings a set adds to its process (this script's child and the
# server take the same flag).
ENGINE_ARGS = {"graphs_off_unbounded": ["--eval-chunk-mb", "0"]}


def mlx_env_ab(name: str, workdir: Path, args, labels) -> dict:
    """The default engine's rates (and, with ``--pass-profile``, its pass
    profile) under each of ``labels``' MLX environment sets, each in a child
    process of this script (``--rates-only``), the sets run in turn."""
    out = {}
    for label in labels:
        with tempfile.TemporaryDirectory(prefix="bench_gpu-env-") as tmp:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--stage", "engine", "--workdir",
                   str(workdir), "--no-core", "--no-torch", "--rates-only", "--shapes", name,
                   "--call", str(args.call), "--reps", str(args.reps), "--out", tmp]
            cmd += ["--texts", str(args.texts)] if args.texts else []
            cmd += ["--batch-tokens", str(args.batch_tokens)] if args.batch_tokens else []
            if label in ENGINE_ARGS:
                cmd += ENGINE_ARGS[label]
            elif args.eval_chunk_mb is not None:
                cmd += ["--eval-chunk-mb", str(args.eval_chunk_mb)]
            cmd += ["--dry-run"] if args.dry_run else []
            cmd += ["--pass-profile"] if args.pass_profile and label not in GRAPH_OPS_SETS else []
            env = {**os.environ, **MLX_ENV_SETS[label]}
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            results = Path(tmp, "results.json")
            child = json.loads(results.read_text())["results"].get(name, {}) if results.exists() else {}
            if r.returncode != 0:
                # A setting MLX's backend fails under says so in its row; the other sets still run.
                child["error"] = f"exit {r.returncode}: {r.stderr[-2000:]}"
                log(f"{name} {label}: {child['error']}")
            out[label] = {"env": MLX_ENV_SETS[label], "engine_args": ENGINE_ARGS.get(label, []), **child}
    return out


def graph_ops(name: str, workdir: Path, args) -> dict:
    """The default engine's rates with MLX_MAX_OPS_PER_BUFFER at 20 (MLX's
    CUDA default), 60 and 200 (kernels per CUDA graph), each in a child
    process."""
    return {label: row.get("rates", row) for label, row in mlx_env_ab(name, workdir, args, GRAPH_OPS_SETS).items()}


# The collector's caps the third lease measured against the CPU's 64 inputs /
# 8192 tokens; since then they are the server's own defaults on a GPU.
BIG = ["--max-batch-size", "256", "--max-batch-tokens", "32768"]
SERVER_FLAGS = {"defaults": [], "streams_2": ["--streams", "2"], "streams_4": ["--streams", "4"],
                "threads_2": ["--model-threads", "2"], "threads_4": ["--model-threads", "4"],
                "big_batches": BIG,
                # The third lease's best two, together, and bigger still.
                "big_threads_2": [*BIG, "--model-threads", "2"], "big_streams_2": [*BIG, "--streams", "2"],
                "bigger_batches": ["--max-batch-size", "512", "--max-batch-tokens", "65536"],
                # Callers answered together wait for each other: 4 ms is the GPU's
                # default, measured on an H200 beside these (docs/benchmarks.md,
                # fourth lease).
                "regroup_off": ["--regroup-window-ms", "0"], "regroup_2": ["--regroup-window-ms", "2"],
                "regroup_4": ["--regroup-window-ms", "4"], "regroup_8": ["--regroup-window-ms", "8"],
                # The server's default flags in a process with MLX_ENV_SETS' settings.
                **{label: ENGINE_ARGS.get(label, []) for label in MLX_ENV_SETS if label != "mlx_defaults"},
                # The BERT family's layers on each batch's real tokens alone.
                "packed_rows": ["--packed-rows", "true"], "packed_graphs_off": ["--packed-rows", "true"]}
# The MLX settings of a server flag set's process, by label.
SERVER_MLX_ENV = {**MLX_ENV_SETS, "packed_graphs_off": MLX_ENV_SETS["graphs_off"]}
# What --server runs unless --server-flags names others: today's defaults
# beside the regroup window off and shorter.
DEFAULT_SERVER_FLAGS = ("defaults", "regroup_off", "regroup_2")
# (texts per request, connections): the one-text-per-request load of issue
# 11's target, and bulk callers sending server-sized calls.
SERVER_LOADS = ((1, 64), (32, 4))


def get_json(url: str, timeout: float = 30.0):
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def start_server(folder: Path, dtype: str, flags: list[str], log_dir: Path, mlx_env: dict | None = None):
    """``python -m mlx_embed serve`` on a free loopback port, once /health
    answers; ``mlx_env`` adds MLX settings to its environment."""
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]),
           **(mlx_env or {})}
    return replicas.start_replica(
        replicas.free_port(), log_dir, ["--model", str(folder), "--dtype", dtype, "--no-cache", *flags],
        timeout=300, env=env, command=[sys.executable, "-m", "mlx_embed", "serve"])


def request_bodies(contents: list[list[int]], per_request: int) -> list[str]:
    """/v1/embeddings bodies of ``per_request`` token-id inputs each, vectors in base64."""
    return [json.dumps({"input": contents[i : i + per_request], "encoding_format": "base64"})
            for i in range(0, len(contents), per_request)]


def server_load(base: str, contents: list[list[int]], per_request: int, connections: int, workdir: Path,
                deadline: float, keep: int = 0) -> dict:
    """Every text once through /v1/embeddings as token ids (specials
    included: the server runs them as given), ``per_request`` texts a request, over ``connections``; with
    how the server grouped them into model calls (what the regroup window
    changes)."""
    bodies = request_bodies(contents, per_request)
    out = http_load.send_all(base, "/v1/embeddings", bodies, workdir / f"bodies-{per_request}.jsonl",
                             connections, min(8, connections), deadline, keep)
    out["texts_per_s"] = len(contents) / out["seconds"]
    return out


def server_load_wrk(base: str, contents: list[list[int]], per_request: int, connections: int,
                    workdir: Path, seconds: float) -> dict:
    """``server_load`` with wrk as the client (``http_load.send_wrk``): the
    same bodies over and over for ``seconds``; what the Python client costs a
    round is the difference between the two rows."""
    bodies = request_bodies(contents, per_request)
    threads = max(1, min(4, (os.cpu_count() or 2) // 2, connections))
    out = http_load.send_wrk(base, "/v1/embeddings", bodies, workdir / f"wrk-bodies-{per_request}.jsonl",
                             connections, threads, seconds)
    out["texts_per_s"] = out["answered"] * len(contents) / len(bodies) / out["seconds"]
    return out


def engine_reference(folder: Path, dtype: str, ids: list[list[int]], check: int, reps: int):
    """The engine's one-call texts/s on ``ids`` (each text's, specials
    included, which the server runs as given), and the first ``check`` texts'
    unit vectors."""
    m = mlx_embed.load(folder, dtype=dtype)
    m.embed_ids(ids)  # new shapes build once
    rate = len(ids) / seconds(lambda: m.embed_ids(ids), reps)
    want = np.frombuffer(m.embed_ids(ids[:check]).vectors, dtype="<f4").reshape(check, -1)
    return rate, want / np.linalg.norm(want, axis=1, keepdims=True)


def server_rows(name: str, folder: Path, ids: list[list[int]], args, workdir: Path) -> dict:
    """The server beside the engine's one call in this process (see the module doc)."""
    # bf16 as the engine rows run it on a GPU; fp32 on the CPU (the dry run,
    # --allow-cpu), where half precision has no fast path.
    on_cpu = mx.default_device() == mx.cpu
    dtype, min_cosine = ("float32", 0.99999) if on_cpu else ("bfloat16", 0.999)
    check = min(64, len(ids))
    rate, want = engine_reference(folder, dtype, ids, check, args.reps)
    out = {"dtype": dtype, "engine_one_call": rate}
    mx.clear_cache()
    limit = 30 if args.dry_run else 120
    for label in args.server_flags:
        flags = SERVER_FLAGS[label]
        if past_deadline(args):
            # A shape's flag sets take minutes on a GPU (a server start each):
            # what ran is kept, the rest says why it is missing.
            out[label] = {"flags": " ".join(flags), "skipped": "past --deadline"}
            continue
        mlx_env = SERVER_MLX_ENV.get(label, {})
        row = {"flags": " ".join(flags), "mlx_env": mlx_env}
        out[label] = row
        try:
            server = start_server(folder, dtype, flags, workdir / f"server-{name}-{label}", mlx_env)
        except (RuntimeError, OSError, TimeoutError) as err:
            # A flag set the server fails to start under says so; the other sets still run.
            row["error"] = str(err)[-2000:]
            continue
        base = server.url
        try:
            info = get_json(base + "/info")
            details = info.get("details", {})
            row["device"], row["details"] = details.get("device"), details
            row["model_threads"] = info.get("batching", {}).get("model_threads")
            row["batching"] = info.get("batching", {})
            for per_request, connections in SERVER_LOADS:
                server_load(base, ids, per_request, connections, workdir, limit)  # shapes build once
                keep = -(-check // per_request)
                got = server_load(base, ids, per_request, connections, workdir, limit, keep=keep)
                vectors = http_load.answered_vectors(got.pop("answers"), per_request, check)
                cos = float((vectors * want).sum(axis=1).min())
                if cos < min_cosine:
                    raise RuntimeError(f"{label}: server answers differ from the engine (min cosine {cos})")
                got["min_cosine_vs_engine"] = cos
                got["vs_engine_one_call"] = got["texts_per_s"] / out["engine_one_call"]
                got["wrk"] = wrk_row(base, ids, per_request, connections, workdir, args,
                                     out["engine_one_call"])
                row[f"texts_{per_request}_per_request_c{connections}"] = got
        except Exception as err:  # noqa: BLE001 - what the other flag sets measure still counts
            row["error"] = f"{type(err).__name__}: {str(err)[-2000:]}"
            log(f"{name} {label}: {row['error']}")
            if args.dry_run:
                raise
        finally:
            row["exit_code"] = server.stop()
    return out


def wrk_row(base: str, contents, per_request: int, connections: int, workdir: Path, args,
            engine_one_call: float) -> dict:
    """The same load with wrk as the client (``--wrk-seconds``), or why it
    is missing: a wrk that fails (not installed, a library missing on the
    device machine) leaves the Python client's row standing."""
    if args.wrk_seconds <= 0:
        return {"skipped": "--wrk-seconds 0"}
    try:
        got = server_load_wrk(base, contents, per_request, connections, workdir, args.wrk_seconds)
    except (RuntimeError, OSError, ValueError, KeyError, subprocess.TimeoutExpired) as err:
        log(f"wrk: {err}")
        return {"error": str(err)[-500:]}
    got["vs_engine_one_call"] = got["texts_per_s"] / engine_one_call
    return got


def pooling_of(config: dict) -> str:
    return "last" if config["model_type"] == "qwen3" else "mean"


def half_of(config: dict) -> str:
    return "bfloat16" if config["model_type"] == "qwen3" else "float16"


# ------------------------------------------------------------------ stages


def torch_figures(name: str, config: dict, folder: Path, ids, args) -> dict:
    """Reference vectors (fp32, first PARITY_TEXTS ids) and the torch rows;
    cached in the checkpoint folder for a later engine stage."""
    cached = folder / "torch.json"
    if cached.exists():
        return json.loads(cached.read_text())
    pooling = pooling_of(config)
    peer32 = TorchPeer(folder, pooling, "float32")
    np.save(folder / "torch_ref.npy", peer32.embed(ids[:PARITY_TEXTS], 32))
    one = [ids[0]]
    peer32.embed(one, 1)
    res = {"torch_latency_ms_fp32": 1e3 * seconds(lambda: peer32.embed(one, 1), max(5, args.reps * 5))}
    half = half_of(config)
    peer = TorchPeer(folder, pooling, half)
    res[f"torch_{half}"] = {f"batch_{b}": peer.rate(ids, b, args.reps) for b in (32, 256)}
    res["torch_latency_ms_half"] = 1e3 * seconds(lambda: peer.embed(one, 1), max(5, args.reps * 5))
    cached.write_text(json.dumps(res))
    log(f"{name} torch: {res}")
    return res


class Report:
    """results.json, rewritten after every section."""

    def __init__(self, out, meta: dict):
        self.out, self.meta, self.results = out, meta, {}

    def save(self) -> None:
        if self.out:
            os.makedirs(self.out, exist_ok=True)
            Path(self.out, "results.json").write_text(
                json.dumps({"meta": self.meta, "results": self.results}, indent=2))


def past_deadline(args) -> bool:
    return bool(args.deadline) and time.perf_counter() - T0 > args.deadline


def section(report: Report, shape: str, key: str, fn, args, optional: bool = True) -> None:
    """Run one measurement into results[shape][key]; an optional one is
    skipped past the deadline, and a failure is recorded, not fatal."""
    res = report.results.setdefault(shape, {})
    if optional and past_deadline(args):
        res[key] = {"skipped": "past --deadline"}
        log(f"{shape} {key}: skipped (deadline)")
        report.save()
        return
    t0 = time.perf_counter()
    try:
        res[key] = fn()
    except Exception as e:  # noqa: BLE001 - the other sections still run
        res[key] = {"error": f"{type(e).__name__}: {e}"}
        traceback.print_exc()
        if args.dry_run:
            raise
    log(f"{shape} {key} ({time.perf_counter() - t0:.1f}s): {str(res[key])[:400]}")
    report.save()


def engine_core(report, name, config, folder, ids, args, common) -> None:
    res = report.results.setdefault(name, {"texts": len(ids), "tokens": sum(map(len, ids))})
    ref_path = folder / "torch_ref.npy"
    ref = np.load(ref_path) if ref_path.exists() else None
    sub = ids[:PARITY_TEXTS]
    for dtype in ("bfloat16", "float32"):
        def run(dtype=dtype):
            m = mlx_embed.load(folder, dtype=dtype, **common)
            rates = engine_rates(m, ids, args.reps, args.call)
            res[f"latency_ms_{dtype}"] = latency_ms(m, ids, max(5, args.reps * 5))
            res["device"], res["engine_details"] = m.device, m.spec().details
            if ref is not None:
                res[f"parity_{'fp32' if dtype == 'float32' else 'bf16'}"] = parity(ref, mlx_vectors(m, sub))
            return rates

        section(report, name, f"engine_{dtype}", run, args, optional=False)
    res["latency_ms_fp32"] = res.get("latency_ms_float32")
    report.save()


def engine_optional(report, plans, args, common) -> None:
    """The memory run (Qwen3 shape), then the optional sections in priority
    order, each across the shapes, so a deadline drops the least wanted."""
    reps = max(1, args.reps - 1)

    def load(folder, **kw):
        return mlx_embed.load(folder, **{"dtype": "bfloat16", **common, **kw})

    qwen3_plans = [p for p in plans if p[1]["model_type"] == "qwen3"]
    profile_args = (5, PROFILE_ROWS[:3]) if args.dry_run else (30,)
    if args.rates_only:
        for name, config, folder, ids in plans:
            section(report, name, "rates", lambda f=folder, i=ids: engine_rates(
                load(f), i, reps, args.call), args, optional=False)
            if args.pass_profile:
                section(report, name, "pass_profile", lambda f=folder, i=ids: pass_profile(
                    load(f), i, *profile_args), args, optional=False)
            section(report, name, "peak_memory", lambda f=folder, i=ids: peak_memory(load(f), i, args.call),
                    args, optional=False)
        return
    # The pass profile first: a second of device time says where a
    # server-sized pass's fixed cost goes. Then MLX's backend settings,
    # which change that cost. Then the server: it is issue 11's target
    # itself; the engine-level small-call rows only explain it.
    if args.pass_profile:
        for name, config, folder, ids in plans:
            section(report, name, "pass_profile", lambda f=folder, i=ids: pass_profile(
                load(f), i, *profile_args), args)
    if args.joined_ab:
        # The bf16 default on a GPU; float32 on the CPU, which has no fast
        # half-precision path.
        dtype = "float32" if mx.default_device() == mx.cpu else "bfloat16"
        for name, config, folder, ids in qwen3_plans:
            section(report, name, "joined_linears", lambda f=folder, i=ids: joined_ab(
                lambda **kw: load(f, dtype=dtype, fast_ops="exact", **kw), i, reps, 1 if args.dry_run else 3), args)
            if args.pass_profile:
                section(report, name, "pass_profile_joined", lambda f=folder, i=ids: pass_profile(
                    load(f, joined_linears=True), i, *profile_args), args)
    if args.packed_ab:
        # bf16 as on a GPU; float32 on the CPU, which has no fast half-precision path.
        dtype = "float32" if mx.default_device() == mx.cpu else "bfloat16"
        for name, config, folder, ids in plans:
            section(report, name, "packed_rows", lambda f=folder, i=ids: packed_ab(
                lambda **kw: load(f, dtype=dtype, **kw), i, reps, 1 if args.dry_run else 3, args.call,
                lambda m: shape_costs(m, args, 10 if args.dry_run else 60)), args)
    if args.mlx_env:
        for name, config, folder, ids in plans:
            section(report, name, "mlx_env", lambda n=name, f=folder: mlx_env_ab(
                n, f.parent, args, ["mlx_defaults", *args.mlx_env]), args)
    if args.server:
        for name, config, folder, ids in plans:
            section(report, name, "server", lambda n=name, f=folder, i=ids: server_rows(
                n, f, i, args, f.parent), args)
    if args.float16:
        for name, config, folder, ids in plans:
            section(report, name, "engine_float16", lambda f=folder, i=ids: float16_rows(load, f, i, reps, args.call),
                    args)
    if args.small_calls:
        for name, config, folder, ids in plans:
            section(report, name, "small_calls", lambda f=folder, i=ids: small_calls(
                lambda **kw: load(f, **kw), i, args.call, reps), args)
    if args.graph_ops:
        for name, config, folder, ids in plans:
            section(report, name, "graph_ops", lambda n=name, f=folder: graph_ops(n, f.parent, args), args)
    if args.sweep:
        budgets = (1024, 2048) if args.dry_run else (4096, 8192, 32768, 65536)
        for bt in budgets:
            for name, config, folder, ids in plans:
                section(report, name, f"batch_tokens_{bt}", lambda f=folder, i=ids, bt=bt: engine_rates(
                    load(f, batch_tokens=bt), i, reps, args.call), args)
    for name, config, folder, ids in plans:
        if args.no_core:
            break
        if config["model_type"] == "qwen3" or args.dry_run:
            section(report, name, "memory", lambda f=folder: memory_run(
                load(f), args.memory_calls, args.seed, args.call * 2), args, optional=False)
    bert = [p for p in plans if p[1]["model_type"] == "bert"]
    if args.variants:
        for name, config, folder, ids in plans:
            section(report, name, "new_shapes", lambda f=folder: {
                f"shape_buckets={b}": shape_costs(load(f, shape_buckets=b), args, 10 if args.dry_run else 60)
                for b in (True, False)
            }, args)
        for name, config, folder, ids in bert:
            for dtype in ("bfloat16", "float32"):
                # The path the default does not take for this dtype here.
                fused_flag = not mlx_embed.ops.default_fused_attention(dtype)

                def other(folder=folder, ids=ids, dtype=dtype, fused_flag=fused_flag):
                    m = load(folder, dtype=dtype, fused_attention=fused_flag)
                    out = {"rates": engine_rates(m, ids, reps, args.call),
                           "latency_ms": latency_ms(m, ids, max(5, reps * 5))}
                    ref_path = folder / "torch_ref.npy"
                    if ref_path.exists():
                        out["parity"] = parity(np.load(ref_path), mlx_vectors(m, ids[:PARITY_TEXTS]))
                    return out

                label = "fused" if fused_flag else "matmul"
                section(report, name, f"attention_{label}_{dtype}", other, args)
        for name, config, folder, ids in plans:
            for streams in (2, 4):
                section(report, name, f"streams_{streams}", lambda f=folder, i=ids, s=streams: engine_rates(
                    load(f, streams=s), i, reps, args.call, one_call=False), args)
    if args.quantized:
        for name, config, folder, ids in qwen3_plans:
            big = ids[: min(len(ids), 1024)]
            for label, kw in (("bf16", {}), ("8-bit", {"quantize": 8}), ("4-bit", {"quantize": 4})):
                def quant(folder=folder, big=big, kw=kw):
                    m = load(folder, group_size=64, **kw)
                    m.embed_ids(big)
                    return {"texts_per_s_one_call": len(big) / seconds(lambda: m.embed_ids(big), reps),
                            "two_texts_ms": latency_ms(m, big, max(5, reps * 5), rows=2)}

                section(report, name, f"quantized_{label}", quant, args)


def cell(value, spec: str = ".0f") -> str:
    """A table cell: ``-`` for a figure that was not measured (None or NaN)."""
    return "-" if value is None or value != value else format(value, spec)


def rate_cells(rates: dict, call: int) -> str:
    """One call | calls of ``call`` | overlapped, texts/s, as table cells."""
    return " | ".join(cell(rates.get(k)) for k in ("one_call", f"calls_of_{call}", f"calls_of_{call}_overlapped"))


def mlx_env_table(name: str, sets: dict, call: int) -> list[str]:
    lines = ["", f"MLX settings, {name} (each in its own process; pass profile: fixed ms + ms a text, "
                 "and a 32-row pass's submit / wait ms):",
             f"| set | one call | calls of {call} | overlapped | fixed ms | ms a text | submit 32 | wait 32 "
             "| peak MB one call | peak MB calls |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, row in sets.items():
        rates, prof, peak = row.get("rates", {}), row.get("pass_profile", {}), row.get("peak_memory", {})
        r32 = prof.get("rows", {}).get("32", {})
        lines.append(
            f"| {label} | {rate_cells(rates, call)} | {cell(prof.get('fixed_ms'), '.2f')} | "
            f"{cell(prof.get('ms_per_text'), '.4f')} | {cell(r32.get('submit_ms'), '.2f')} | "
            f"{cell(r32.get('wait_ms'), '.2f')} | {cell(peak.get('peak_mb_one_call'))} | "
            f"{cell(peak.get(f'peak_mb_calls_of_{call}'))} |")
    return lines


def packed_table(name: str, packed: dict, call: int) -> list[str]:
    keys = list(packed["padded"])
    shapes = packed["new_shapes"]
    return ["", f"packed rows, {name} (texts/s, padded -> packed, medians of {packed['rounds']} rounds; "
                f"vectors min cosine {packed['vectors']['min_cosine']:.6f}; ms a call over new shapes / the "
                f"same again: padded {shapes['padded']['new_shapes_ms_per_call']:.1f} / "
                f"{shapes['padded']['same_shapes_ms_per_call']:.1f}, packed after it "
                f"{shapes['packed']['new_shapes_ms_per_call']:.1f} / {shapes['packed']['same_shapes_ms_per_call']:.1f}):",
            "| " + " | ".join(keys) + " |", "|" + "---:|" * len(keys),
            "| " + " | ".join(f"{packed['padded'][k]:.0f} -> {packed['packed'][k]:.0f} "
                              f"({packed['speedup'][k]:.2f}x)" for k in keys) + " |"]


def summary(results: dict, call: int) -> str:
    nan = float("nan")
    # Without torch (not installed, --no-torch, the dry run) the peer and
    # parity columns are left out, as the module doc says.
    peers = any(r.get("torch_float16") or r.get("torch_bfloat16") or r.get("parity_fp32")
                or r.get("torch_latency_ms_fp32") for r in results.values())
    head = f"| shape | engine bf16 one call | bf16 calls of {call} | overlapped | engine fp32 one call "
    head += ("| torch half b256 | torch half b32 | 1-text ms engine fp32/torch fp32 | parity min cos |" if peers
             else "| 1-text ms engine fp32 |")
    lines = [head, "|---|" + "---:|" * (8 if peers else 5)]
    for name, r in results.items():
        b, f = r.get("engine_bfloat16", {}), r.get("engine_float32", {})
        lat = cell(r.get("latency_ms_fp32"), ".1f")
        row = f"| {name} | {rate_cells(b, call)} | {cell(f.get('one_call'))} | "
        if peers:
            peer = r.get("torch_float16") or r.get("torch_bfloat16") or {}
            row += (f"{cell(peer.get('batch_256'))} | {cell(peer.get('batch_32'))} | "
                    f"{lat} / {cell(r.get('torch_latency_ms_fp32'), '.1f')} | "
                    f"{cell(r.get('parity_fp32', {}).get('min_cosine'), '.7f')} |")
        else:
            row += f"{lat} |"
        lines.append(row)
    for key, table in (("mlx_env", mlx_env_table), ("packed_rows", packed_table)):
        for name, r in results.items():
            got = r.get(key)
            if isinstance(got, dict) and "error" not in got and "skipped" not in got:
                lines += table(name, got, call)
    loads = [f"texts_{n}_per_request_c{c}" for n, c in SERVER_LOADS]
    for name, r in results.items():
        server = r.get("server")
        if not isinstance(server, dict) or "engine_one_call" not in server:
            continue
        lines += ["", f"server, {name} ({server['dtype']}; engine one call {server['engine_one_call']:.0f} texts/s):",
                  "| flags | " + " | ".join(loads) + " |", "|---|" + "---:|" * len(loads)]
        for label in (k for k in SERVER_FLAGS if k in server):
            for client, pick in CLIENTS:
                got = [pick(server[label].get(k)) for k in loads]
                if not any(got):
                    continue
                cells = [f"{g['texts_per_s']:.0f} ({g['vs_engine_one_call']:.2f}x, "
                         f"{g.get('inputs_per_call', nan):.1f} a call)" if g else "-" for g in got]
                lines.append(f"| {label}{client} | " + " | ".join(cells) + " |")
        lines += ["", f"{http_load.ROUND_TITLE}, {name}:", *http_load.round_header("flags", "load")]
        for label in (k for k in SERVER_FLAGS if k in server):
            for client, pick in CLIENTS:
                for k in loads:
                    g = pick(server[label].get(k))
                    if g and g.get("round_ms"):
                        lines.append(f"| {label}{client} | {k} | {http_load.round_cells(g['round_ms'])} |")
    return "\n".join(lines)


def _measured(row):
    return row if isinstance(row, dict) and "texts_per_s" in row else None


# A server load's row by client: the Python client's own, then wrk's inside it.
CLIENTS = (("", _measured), (", wrk", lambda row: _measured((row or {}).get("wrk"))))


def main(argv=None) -> int:
    global mlx_embed, mx
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, seconds not minutes")
    p.add_argument("--allow-cpu", action="store_true", help="run the real shapes without a GPU")
    p.add_argument("--no-torch", action="store_true", help="leave the torch peer and parity out")
    p.add_argument("--stage", choices=("all", "torch", "engine"), default="all",
                   help="torch: checkpoints and torch figures only; engine: reuse them")
    p.add_argument("--workdir", help="checkpoints and torch figures kept here (default: a temp folder)")
    p.add_argument("--deadline", type=float, help="skip optional sections after this many seconds")
    p.add_argument("--variants", action="store_true", help="fused attention, streams, fp16")
    p.add_argument("--sweep", action="store_true", help="batch_tokens sweep")
    p.add_argument("--small-calls", action="store_true",
                   help="calls of --call texts: padding, model threads")
    p.add_argument("--server", action="store_true",
                   help="the Rust server on this machine (python -m mlx_embed serve) under HTTP load")
    p.add_argument("--pass-profile", action="store_true",
                   help="one pass's time by phase (host, graph, submit, wait) for 1-512 texts, and its primitives")
    p.add_argument("--float16", action="store_true",
                   help="every shape in fp16: rates, one-text latency, vectors against fp32")
    p.add_argument("--joined-ab", action="store_true",
                   help="decoder shapes: q/k/v and gate/up joined into one matmul each against apart (the "
                        "default), calls of 1-32 texts (with --pass-profile: the joined pass's profile too)")
    p.add_argument("--packed-ab", action="store_true",
                   help="each pass's real tokens alone (load(packed_rows=True): an encoder's layers, a decoder's "
                        "feed-forward) against padded passes, one call and calls of --call and 64 random texts")
    p.add_argument("--kernel-probe", action="store_true",
                   help="what one view, element-wise add or small matmul costs a pass, host and device")
    p.add_argument("--wrk-seconds", type=float, default=5.0,
                   help="--server: each load also with wrk as the client for this long (0: not)")
    p.add_argument("--server-flags", default=",".join(DEFAULT_SERVER_FLAGS),
                   help=f"comma list of the server flag sets --server runs, of {', '.join(SERVER_FLAGS)}")
    p.add_argument("--graph-ops", action="store_true",
                   help="one call and calls of --call with MLX_MAX_OPS_PER_BUFFER 20/60/200")
    p.add_argument("--mlx-env", default="",
                   help="comma list of MLX settings to run the engine under, each beside MLX's defaults in "
                        f"a child process: {', '.join(k for k in MLX_ENV_SETS if k != 'mlx_defaults')}")
    p.add_argument("--rates-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--no-core", action="store_true",
                   help="leave out the core figures and the memory run (measured before)")
    p.add_argument("--quantized", action="store_true", help="Qwen3 shape: 8/4-bit kernels vs bf16")
    p.add_argument("--batch-tokens", type=int, help="device sub-batch budget (default: the engine's)")
    p.add_argument("--eval-chunk-mb", type=int,
                   help="load(eval_chunk_mb=): MB of layer outputs between a pass's evaluation points "
                        "(default: the engine's, 64 with CUDA graphs off, else 0)")
    p.add_argument("--texts", type=int, help="texts per shape (default: 8192/4096/2048)")
    p.add_argument("--call", type=int, default=32, help="texts per call for the small-call rows")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--memory-calls", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="folder for results.json")
    args = p.parse_args(argv)
    args.server_flags = [x.strip() for x in args.server_flags.split(",") if x.strip()]
    unknown = sorted(set(args.server_flags) - set(SERVER_FLAGS))
    if unknown:
        p.error(f"unknown --server-flags {', '.join(unknown)}; known: {', '.join(SERVER_FLAGS)}")
    args.mlx_env = [x.strip() for x in args.mlx_env.split(",") if x.strip()]
    unknown = sorted(x for x in args.mlx_env if x not in MLX_ENV_SETS or x == "mlx_defaults")
    if unknown:
        p.error(f"unknown --mlx-env {', '.join(unknown)}; known: "
                f"{', '.join(k for k in MLX_ENV_SETS if k != 'mlx_defaults')}")

    if args.stage != "torch":
        import mlx_embed as _mlx_embed

        import mlx.core as _mx

        mlx_embed, mx = _mlx_embed, _mx
    if args.dry_run:
        mx.set_default_device(mx.cpu)
        picked = [s.strip() for s in args.shapes.split(",") if s.strip() in DRY_SHAPES]
        shapes = {n: DRY_SHAPES[n] for n in picked} or DRY_SHAPES
        args.reps, args.memory_calls, args.call = 1, min(args.memory_calls, 40), 8
        args.wrk_seconds = min(args.wrk_seconds, 1.0)
    else:
        names = [s.strip() for s in args.shapes.split(",") if s.strip()]
        unknown = set(names) - set(SHAPES)
        if unknown:
            p.error(f"unknown shapes {sorted(unknown)}")
        shapes = {n: SHAPES[n] for n in names}
        if mx is not None and mx.default_device() == mx.cpu and not args.allow_cpu:
            p.error("no GPU: MLX runs on the CPU here (use --dry-run or --allow-cpu)")
    use_torch = torch_available() and not args.no_torch and not args.dry_run
    if args.stage == "torch" and not use_torch:
        p.error("--stage torch needs torch and transformers")
    meta = {"mlx": getattr(mx, "__version__", None), "device": None, "torch": None,
            "argv": sys.argv[1:]}
    if use_torch:
        import torch
        import transformers

        meta["torch"] = torch.__version__
        meta["transformers"] = transformers.__version__
        if torch.cuda.is_available():
            meta["torch_device"] = torch.cuda.get_device_name()
    report = Report(args.out, meta)
    if args.kernel_probe and args.stage != "torch":
        # The device's, not a shape's: in meta, before any shape's sections.
        meta["kernel_probe"] = kernel_probe(*((20, 3) if args.dry_run else (200, 30)))
        log(f"kernel probe: {json.dumps(meta['kernel_probe'])[:600]}")
        report.save()
    common = {"batch_tokens": args.batch_tokens} if args.batch_tokens else {}
    if args.eval_chunk_mb is not None:
        common["eval_chunk_mb"] = args.eval_chunk_mb
    with tempfile.TemporaryDirectory(prefix="bench_gpu-") as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        plans = []
        for name, (config, n) in shapes.items():
            folder = work / name
            make_checkpoint(config, folder, args.seed, use_torch)
            ids = corpus(args.texts or n, args.seed)
            plans.append((name, config, folder, ids))
            log(f"{name}: checkpoint ready")
            if use_torch or (folder / "torch.json").exists():
                # An earlier --stage torch left them, or torch is here.
                report.results.setdefault(name, {}).update(torch_figures(name, config, folder, ids, args))
                report.save()
        if args.stage != "torch":
            for name, config, folder, ids in plans:
                if not args.no_core:
                    engine_core(report, name, config, folder, ids, args, common)
                meta["device"] = report.results.setdefault(name, {}).get("device") or str(mx.default_device())
            engine_optional(report, plans, args, common)
    report.save()
    print(f"\n# {meta}")
    if args.stage != "torch":
        print(summary(report.results, args.call))
    if args.server:
        # The rows that ran are written and printed above; a server that did
        # not start (or failed under load) still fails the run.
        failed = server_errors(report.results)
        for where, err in failed:
            print(f"error: --server {where}: {err}", file=sys.stderr)
        if failed:
            return 1
    return 0


def server_errors(results: dict) -> list[tuple[str, str]]:
    """(shape and flag set, error) of every --server row that failed."""
    failed = []
    for name, r in results.items():
        server = r.get("server")
        if not isinstance(server, dict):
            continue
        if "error" in server:  # the section itself (the engine's reference run)
            failed.append((name, str(server["error"])))
        for label, row in server.items():
            if isinstance(row, dict) and "error" in row:
                failed.append((f"{name} {label}", str(row["error"])))
    return failed


if __name__ == "__main__":
    raise SystemExit(main())
