"""How one model call is cut into device passes, and running them.

The Rust core decides which inputs share a model call; this module owns the
next step down (docs/architecture.md): sort the call's sequences by exact
length, cut them into sub-batches of at most ``batch_tokens`` padded tokens
(longest x rows), run each through the model and pooling, and put the
vectors back in input order. With ``output="tokens"`` the pooling and Dense
head are skipped: each input's last hidden state rows (one per real token)
come back, flattened in input order.

Two ways to run the sub-batches:

* workers (the CPU default): MLX's CPU element-wise kernels are
  single-threaded, so sub-batches run on the caller's thread plus worker
  threads, each on its own MLX stream, with OpenBLAS and the native kernels
  at one thread each so the callers do not oversubscribe the cores.
* pipelined (the GPU default): every sub-batch's graph is built and handed
  to the device with ``mx.async_eval`` before the next is built, so the host
  work of pass k+1 (padding, mask, graph) overlaps the device compute of pass
  k; the vectors are gathered into input order on the device and copied to
  the host once per call.

Across calls: ``submit`` returns a :class:`Pending` once the call's passes
are queued, before the host copy; ``Pending.result()`` is the copy. A caller
holding batch k+1 while batch k runs (the server's model thread, keeping the
bridge's one interpreter crossing per batch: submit k+1, then collect k) keeps
the device busy between batches. ``EmbeddingModel.submit_ids`` exposes it,
and the Rust core's model thread uses it (``--pipeline``, on by default on
a GPU).

On a GPU the passes also take a bounded set of shapes (``shape_buckets``):
lengths padded to 4 steps per octave, rows to a power of two, because each
new shape costs a one-time build there (see ``Scheduler.__init__``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import threading
from typing import Callable, NamedTuple, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import _blas, device, ops
from . import workers as workers_module
from .ops import bucket_length

log = logging.getLogger("mlx_embed")

# Padded tokens (longest x rows) per forward pass on the CPU. Measured on a
# 2-core x86 with OpenBLAS and the native kernels (docs/benchmarks.md): the
# per-token cost *rises* with pass size, because the [B, H, L, L] scores and
# [T, 4D] FFN activations fall out of cache; 256-512 was best, 1024 lost ~10%,
# 2048 ~25%. Small passes also feed the parallel workers and waste less on
# padding. GPUs want the opposite: big passes. On an H200 one call climbed
# steeply up to 16384 and was flat or lower at 32768 and 65536 (MiniLM 17.6k
# texts/s at 4096, 36.0k at 16384, 32.7k at 65536; docs/benchmarks.md).
CPU_BATCH_TOKENS = 256
GPU_BATCH_TOKENS = 16384

# What one call returns per input: one pooled vector, or one row per token.
# "token_weights": a per-token head's output (BGE-M3's lexical weights,
# lexical.py), one weight per real token, taken as "tokens" takes rows.
OUTPUTS = ("pooled", "tokens", "token_weights")

# Fewest real tokens in one call worth splitting across the MLX workers.
MIN_PARALLEL_TOKENS = 256

# MLX's CUDA backend records each evaluation into CUDA graphs, and two threads
# recording at once abort the process: on an H200, two engine instances called
# from two threads died with "cudaStreamEndCapture(...) failed: operation failed
# due to a previous error during capture" (docs/benchmarks.md, third lease). So
# off the CPU every Scheduler in the process queues its passes under this one
# lock, pass by pass; the host arrays are built before it is taken, and the host
# copies that collect the passes (``Pending.result``) happen outside it.
_DEVICE_QUEUE_LOCK = threading.Lock()

# A query thread's calls (the Rust core's ``BatcherConfig::query_threads``)
# on the CPU: short by construction, they run beside whatever call holds the
# model's lock, as one more worker would, instead of after it (a long-context
# call holds it for seconds). One kernel thread, no worker threads and the
# BLAS thread count left as it is, so a solo call never changes what a
# running call set up. Off the CPU passes still queue under the device lock.
_SOLO = threading.local()


def call_solo(obj, method: str, *args, **kwargs):
    """``obj.method(*args, **kwargs)`` with every CPU call it makes on this
    thread run solo (see ``_SOLO``); what the Rust bridge's query replica calls."""
    _SOLO.on = True
    try:
        return getattr(obj, method)(*args, **kwargs)
    finally:
        _SOLO.on = False


def default_batch_tokens() -> int:
    return CPU_BATCH_TOKENS if device.is_cpu() else GPU_BATCH_TOKENS


# With MLX's CUDA graphs off, the layer outputs (MB) a pass builds between two
# evaluation points (ops.EvaluationPoints), which bound its device memory.
# A layer's temporaries are ~20-30 times its output (a Qwen3 block's
# projections, norms, rotary copies and 3x-wide gate/up), so a chunk holds
# ~1.5-2 GB and two queued ahead of the device a few GB, under the 17.9 GB
# peak graphs on measured on the same work. A 64-text MiniLM pass outputs
# ~6 MB a layer and gets no point inside. Not yet measured on a GPU.
GRAPHS_OFF_EVAL_CHUNK_MB = 64


def default_eval_chunk_mb() -> int:
    """Evaluation points only where MLX needs them to bound memory: CUDA with
    graphs off (elsewhere MLX commits every few kernels and stops queueing
    by itself)."""
    return GRAPHS_OFF_EVAL_CHUNK_MB if device.cuda_graphs() == "off" else 0


def bucket_rows(n: int) -> int:
    """``n`` rounded up to a power of two."""
    return 1 << max(0, (n - 1).bit_length())


def default_workers() -> int:
    # Parallel callers only pay off where element-wise kernels are the
    # bottleneck: the CPU backend. Two is what was measured (2 cores).
    if not device.is_cpu():
        return 1
    return 2 if (os.cpu_count() or 1) >= 2 else 1


class Scheduler:
    """Runs one model call as device sub-batches; see the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        *,
        head: Callable[[mx.array, mx.array], mx.array],
        dim: int,
        pad_id: int,
        max_length: int,
        context: ops.ForwardContext,
        batch_tokens: Optional[int] = None,
        workers: Optional[int] = None,
        pipeline: Optional[bool] = None,
        streams: int = 1,
        shape_buckets: Optional[bool] = None,
        takes_type_ids: bool = False,
        eval_chunk_mb: Optional[int] = None,
        token_head: Optional[Callable[[mx.array], mx.array]] = None,
    ):
        self.model = model
        # Pooling and any Dense layers: (hidden [B, L, D], mask) -> [B, dim].
        self.head = head
        # hidden [B, L, D] -> [B, L, 1] per-token weights (output="token_weights").
        self.token_head = token_head
        self.dim = dim
        self.pad_id = pad_id
        self.max_length = max_length
        self.context = context
        self.batch_tokens = int(batch_tokens or default_batch_tokens())
        if self.batch_tokens < 1:
            raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
        if workers is None:
            # The bound's one owner checks the fallback as load(workers=).
            workers = workers_module.from_environment() or default_workers()
        self.workers = int(workers)
        if self.workers > 1 and not device.is_cpu():
            # Worker threads would evaluate passes on the device at once,
            # outside the device lock (two threads evaluating on CUDA
            # aborted the process on the H200): one thread queues them there.
            log.info("workers=%d runs as 1 off the CPU: passes queue on the device from one thread",
                     self.workers)
            self.workers = 1
        # Pipelining buys nothing where the forward pass evaluates inside
        # (the native kernels do, on the CPU) and the workers already overlap.
        self.pipeline = (not device.is_cpu()) if pipeline is None else bool(pipeline)
        # Device streams the pipelined path spreads passes over, call after
        # call (``_call_streams``). A probe with separate engine instances on
        # their own streams gained 1.37x-1.69x (issue 11); inside one engine
        # the first lease measured no gain, but then every one-pass call ran
        # on the first stream. 1 by default until a GPU measures the rotation.
        # (load() refuses counts below 1: engine._check_settings.)
        self.streams = int(streams)
        # A stream is used by one thread at a time: a model used from more
        # than one thread (a Python thread pool) keeps its extra streams per
        # thread (device.extra_streams), and its first pass always runs on the
        # caller's default.
        self._thread_streams = threading.local()
        # On a GPU every new (rows, length) shape of a pass costs a one-time
        # build: measured on an H200 (docs/benchmarks.md), 60 calls of 1-64
        # random texts took 14.3 ms each the first time and 6.1 ms again
        # (MiniLM shape), 98 vs 24 ms with cuDNN attention (Qwen3 shape), and
        # MLX keeps only 256 cuDNN attention plans. So passes are padded to a
        # bounded set of shapes there: lengths to 4 steps per octave, rows to
        # a power of two (pad rows are discarded).
        self.shape_buckets = (not device.is_cpu()) if shape_buckets is None else bool(shape_buckets)
        # On the CPU's native path a head that only pools runs in NumPy
        # (``_pool_on_host``), unless passes are pipelined (``--pipeline
        # true``): the host pooling would wait for each pass as it is queued.
        self._pools_on_host = (
            device.is_cpu()
            and context.path == "native"
            and not self.pipeline
            and getattr(head, "pools_on_host", False)
        )
        self.takes_type_ids = takes_type_ids
        # Layer outputs (MB) between a pass's evaluation points; 0: none.
        self.eval_chunk_mb = default_eval_chunk_mb() if eval_chunk_mb is None else int(eval_chunk_mb)
        self._lock = threading.Lock() if device.is_cpu() else _DEVICE_QUEUE_LOCK
        self._blas_threads = _blas.own_num_threads()

    # ------------------------------------------------------------------ plan

    def plan(self, lengths: np.ndarray) -> list[np.ndarray]:
        """Split indices into sub-batches, shortest first, under the token budget."""
        order = np.argsort(lengths, kind="stable")
        batches, start, n = [], 0, len(order)
        budget = self.batch_tokens
        if (
            self.workers > 1
            and not self.pipeline
            and n > 1
            and int(lengths.sum()) >= MIN_PARALLEL_TOKENS
        ):
            # A call smaller than workers x budget would otherwise leave a
            # worker idle: split it into about `workers` equal sub-batches.
            # Tiny calls stay whole: handing half to the other worker costs
            # GIL round trips worth more than the half (measured in the server
            # at 1 connection, 2 short texts: p50 26.7 ms split, 19.4 ms whole).
            share = -(-int(lengths.sum()) // self.workers)
            budget = max(min(budget, share), int(lengths.max()))
        while start < n:
            end = start + 1
            # lengths are ascending along `order`, so the longest of
            # [start, end] is lengths[order[end]].
            while end < n and self.padded_size(int(lengths[order[end]]), end - start + 1) <= budget:
                end += 1
            batches.append(order[start:end])
            start = end
        return batches

    def padded_size(self, longest: int, rows: int) -> int:
        """Padded tokens of a pass over ``rows`` sequences, the longest
        ``longest`` tokens (what the plan's budget counts)."""
        if self.shape_buckets:
            return self.bucket(longest) * bucket_rows(rows)
        # bucket() rounds the compiled-MLX path's lengths up; elsewhere it is
        # the longest itself.
        return self.bucket(longest) * rows

    def bucket(self, n: int) -> int:
        # The compiled-MLX ops are specialized per shape; for them, rounding
        # the padded length up keeps the number of distinct shapes small for
        # a few percent of extra (masked, so result-neutral) tokens. Nothing
        # else in a forward pass depends on the shape, so otherwise pad only
        # to the longest text (the corpus of docs/benchmarks.md at a 1024
        # budget: 8128 padded tokens with buckets, 7970 without).
        if self.shape_buckets:
            return min(bucket_length(n), max(self.max_length, n))
        if self.context.path != "mlx":
            return n
        step = 8 if n <= 64 else 16 if n <= 256 else 64
        return min(-(-n // step) * step, max(self.max_length, n))

    # ------------------------------------------------------------------- run

    def run(
        self,
        ids: Sequence[Sequence[int]],
        type_ids: Optional[Sequence[Sequence[int]]] = None,
        *,
        output: str = "pooled",
        pool_start: Optional[Sequence[int]] = None,
        adapter: Optional[Sequence[int]] = None,
    ) -> tuple[np.ndarray, int]:
        """Pooled float32 vectors [n, dim] in input order, unnormalized
        (:func:`pooling.unit_rows` is the one normalization, the server's),
        and the padded tokens processed.
        ``ids`` are complete sequences (specials included), each non-empty;
        the caller has validated them. ``pool_start``: per input, the leading
        tokens the pooling leaves out (a prompt under sentence-transformers'
        ``include_prompt: false``; they still run through the model).
        ``output="tokens"``: the last hidden state of every token instead,
        [sum of lengths, hidden] float32 with input 0's rows first (never
        normalized). ``adapter``: per input, the index of the task adapter it
        runs with (-1: none; a model with ``adapters`` only)."""
        return self.submit(
            ids, type_ids, output=output, pool_start=pool_start, adapter=adapter
        ).result()

    def submit(
        self,
        ids: Sequence[Sequence[int]],
        type_ids: Optional[Sequence[Sequence[int]]] = None,
        *,
        output: str = "pooled",
        pool_start: Optional[Sequence[int]] = None,
        attend: Optional[Sequence[int]] = None,
        adapter: Optional[Sequence[int]] = None,
    ) -> "Pending":
        """Start a call; ``.result()`` on the answer collects it. Pipelined,
        this returns once every sub-batch is queued on the device, so the
        caller can build and submit the next call before collecting this one
        (consecutive calls then overlap); otherwise the work is done here.
        ``attend``: per input, the keys its tokens attend to, fewer than its
        rows where it ends in tokens that are computed but not attended to
        (a ColBERT query's expansion); None: all of them."""
        device.claim_thread_streams()
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {', '.join(OUTPUTS)}, got {output!r}")
        if output == "token_weights" and self.token_head is None:
            raise ValueError("output='token_weights' needs a model with a per-token head")
        tokens = output != "pooled"
        n = len(ids)
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=n)
        if n == 0:
            out = _TokenRows(lengths) if tokens else np.empty((0, self.dim), dtype=np.float32)
            return Pending(out, 0)
        plan = self.plan(lengths)
        starts = None if tokens or pool_start is None or not any(pool_start) else pool_start
        adapters = None if adapter is None or all(a < 0 for a in adapter) else adapter
        call = _Call(ids, type_ids, lengths, starts, attend, adapters)
        solo = getattr(_SOLO, "on", False) and device.is_cpu()
        # A solo call skips the pipelined path (``--pipeline true`` on the CPU):
        # that path queues its passes under the lock a long call holds.
        if self.pipeline and not solo:
            return self._submit_pipelined(plan, call, output)
        with contextlib.nullcontext() if solo else self._lock:
            out = _TokenRows(lengths) if tokens else np.empty((n, self.dim), dtype=np.float32)
            if self.workers > 1 and len(plan) > 1 and not solo:
                padded = self._run_parallel(plan, call, out, output)
            else:
                if solo:
                    ctx = self.context.with_threads(1)
                    if self.context.path == "native":
                        # The thread count every native pass runs (a running
                        # one has set the same): the per-text attention
                        # products' sums follow it (_pass_blas_threads).
                        self._set_blas_threads(1)
                else:
                    self._set_blas_threads(self._pass_blas_threads())
                    ctx = self.context.with_threads(self._blas_threads or os.cpu_count() or 1)
                with ops.forward_context(ctx), ops.bounded_evaluation(self._evaluation_points()) as points:
                    padded = 0
                    for idx in plan:
                        vec, p = self._submit(idx, call, output)
                        mx.eval(vec)
                        if points is not None:
                            points.settled()
                        _store(out, idx, np.array(vec, copy=False))
                        padded += p
        return Pending(out, padded)

    def _submit(self, idx, call, output) -> tuple[mx.array, int]:
        """Build one sub-batch's padded arrays and its pooled-vector graph
        ([B, dim]); with per-token ``output``, its last hidden state or token
        weights ([B, L, hidden or 1], padding included: the caller keeps each
        row's real tokens)."""
        return self._graph(self._host_arrays(idx, call), output)

    def _host_arrays(self, idx, call: "_Call") -> "_PassArrays":
        """One sub-batch's padded ids, mask, type ids and pool mask, on the host."""
        ids, type_ids, lengths = call.ids, call.type_ids, call.lengths
        # At least one column: a pass of inputs with no tokens (a static
        # model's empty texts) pools all-masked rows, which the mean makes 0.
        L = max(1, self.bucket(int(lengths[idx].max())))
        real = len(idx)
        B = bucket_rows(real) if self.shape_buckets else real
        arr = np.full((B, L), self.pad_id, dtype=np.int32)
        mask = np.zeros((B, L), dtype=np.int32)
        # A pad row sees one (pad) token, so no row has every key masked.
        mask[real:, 0] = 1
        types = np.zeros((B, L), dtype=np.int32) if type_ids is not None else None
        for r, i in enumerate(idx):
            row = ids[i]
            arr[r, : len(row)] = row
            mask[r, : len(row) if call.attend is None else call.attend[i]] = 1
            if types is not None:
                types[r, : len(row)] = type_ids[i]
        pool_mask = None
        if call.pool_start is not None:
            pool_mask = mask.copy()
            for r, i in enumerate(idx):
                pool_mask[r, : call.pool_start[i]] = 0
        # Rows past their keys are padding to the attention alone: the pass
        # must compute them (no packing, which runs the attended rows only).
        beyond = call.attend is not None and any(call.attend[i] < len(ids[i]) for i in idx)
        adapters = None
        if call.adapter is not None:
            # Padding rows run the base weights.
            adapters = np.full((B,), -1, dtype=np.int32)
            adapters[:real] = [call.adapter[i] for i in idx]
            if not (adapters >= 0).any():
                adapters = None  # no row of this pass has a task: the plain forward
        return _PassArrays(arr, mask, types, real, pool_mask, beyond, adapters)

    def _graph(self, host: "_PassArrays", output) -> tuple[mx.array, int]:
        arr, mask, types, real = host.ids, host.mask, host.types, host.real
        B, L = arr.shape
        # Graph building is serialized across workers; the evaluations and
        # native kernels inside the pass, and the final eval, overlap.
        ctx = ops.current()
        every_row = (
            ops.forward_context(dataclasses.replace(ctx, packed_rows=False))
            if host.rows_past_keys and ctx.packed_rows
            else contextlib.nullcontext()
        )
        with ops.building_graph(), every_row:
            mask_mx = mx.array(mask)
            if host.adapters is not None:
                h = self.model(mx.array(arr), mask_mx, adapter=mx.array(host.adapters))
            elif types is not None and self.takes_type_ids:
                h = self.model(mx.array(arr), mask_mx, token_type_ids=mx.array(types))
            else:
                h = self.model(mx.array(arr), mask_mx)
            if host.pool_mask is not None:
                # The head pools under its own mask; the model attended
                # under the real one.
                mask, mask_mx = host.pool_mask, mx.array(host.pool_mask)
            if output != "pooled" or not (self._pools_on_host and h.dtype == mx.float32):
                return self._head_graph(h, mask, mask_mx, real, output), L * B
        # Outside the graph lock: pooling on the host builds no graph.
        return self._pool_on_host(h, mask, real), L * B

    def _head_graph(self, h, mask, mask_mx, real, output) -> mx.array:
        """The pass's output graph after the model: the head."""
        B = h.shape[0]
        if B > real:
            # A new array from the host rows, not a lazy slice: a head that
            # reads the lengths on the host (SPLADE) then waits for no
            # device work queued before it.
            h, mask_mx = h[:real], mx.array(mask[:real])
        if output == "tokens":
            return h.astype(mx.float32)
        if output == "token_weights":
            return self.token_head(h).astype(mx.float32)
        return self.head(h, mask_mx).astype(mx.float32)

    def _pool_on_host(self, h: mx.array, mask: np.ndarray, real: int) -> mx.array:
        """The head (pooling alone) in NumPy, as an evaluated
        [real, dim] array. The native encoder's output is a host buffer
        already, and MLX would hand each op of the pooling to its stream's
        thread (about 0.2 ms of a one-text pass, docs/benchmarks.md); a pass MLX
        computes (not the BERT family's) is evaluated here, as the final
        evaluation would."""
        vec = self.head.pool_on_host(ops.host_view(h)[:real], mask[:real])
        return mx.array(vec.astype(np.float32, copy=False))

    def _call_streams(self, passes: int) -> list:
        """The stream of each of a call's passes, from the calling thread's
        own: None (its current stream), then ``streams - 1`` more. The
        rotation carries on from call to call, so a call of one pass (what a
        server batch of 32 texts is) lands on another stream than the call
        before it, and a caller that submits call k+1 before collecting call
        k has them run side by side on the device."""
        mine = self._thread_streams
        streams = getattr(mine, "streams", None)
        if streams is None:
            streams = mine.streams = [None] + device.extra_streams(self.streams - 1)
            mine.next = 0
        first = mine.next
        mine.next = (first + passes) % len(streams)
        return [streams[(first + k) % len(streams)] for k in range(passes)]

    def _evaluation_points(self) -> Optional[ops.EvaluationPoints]:
        """A call's (or one worker thread's) evaluation points
        (ops.EvaluationPoints), or None. Every path takes them when asked, so
        ``eval_chunk_mb`` in ``/info`` is what runs; by default they are on
        only where CUDA graphs are off (``default_eval_chunk_mb``)."""
        return ops.EvaluationPoints(self.eval_chunk_mb << 20) if self.eval_chunk_mb > 0 else None

    def _submit_pipelined(self, plan, call, output) -> "Pending":
        # Every BLAS thread, as the sequential path's lone passes have: the
        # CPU workers may have left OpenBLAS at one (and float32 sums split
        # over other thread counts differ in the last bits).
        self._set_blas_threads(self._pass_blas_threads())
        parts, padded = [], 0
        points = self._evaluation_points()
        with ops.forward_context(self.context), ops.bounded_evaluation(points):
            for idx, stream in zip(plan, self._call_streams(len(plan))):
                # Padding pass k+1 on the host overlaps pass k on the device,
                # and another thread's passes, which take the lock meanwhile.
                host = self._host_arrays(idx, call)
                on_stream = mx.stream(stream) if stream is not None else contextlib.nullcontext()
                with self._lock, on_stream:
                    vec, p = self._graph(host, output)
                    mx.async_eval(vec)
                # Outside the device queue's lock: a wait for the oldest
                # piece holds up no other thread's passes.
                if points is not None:
                    points.mark(vec)
                parts.append(vec)
                padded += p
            if output != "pooled":
                # Ragged rows: each pass is copied to the host on its own when
                # the result is read (per-token output is rare; pooled keeps
                # one copy).
                rows = _TokenRows(call.lengths)
                for idx, vec in zip(plan, parts):
                    rows.add(idx, vec)
                return Pending(rows, padded)
            order = np.concatenate(plan)
            with self._lock:
                vecs = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
                if not np.array_equal(order, np.arange(len(order))):
                    vecs = vecs[mx.array(np.argsort(order).astype(np.int32))]
                mx.async_eval(vecs)
        return Pending(vecs, padded)

    def _pass_blas_threads(self) -> Optional[int]:
        """OpenBLAS's threads for a pass alone on the cores. One on the
        native path: its linears run in the native kernel (on the context's
        threads), and OpenBLAS is left the per-text attention products, whose
        sums it orders differently on one thread than on two (tiny-qwen3's
        texts of 400+ tokens: 4 of 39 raw vectors differed by up to 1.2e-6
        between a one-text call and a 40-text call, which ran its passes on
        the workers, one BLAS thread each). So a text's bits do not follow
        how many passes its call made."""
        return 1 if self.context.path == "native" else self._blas_threads

    def _set_blas_threads(self, n: Optional[int]) -> None:
        if n is not None and _blas.get_num_threads() != n:
            _blas.set_num_threads(n)

    def _run_parallel(self, plan, call, out, output) -> int:
        """Sub-batches on the caller's thread plus the worker threads.

        MLX's CPU element-wise kernels are single-threaded, so one caller
        leaves the other core(s) idle for most of a pass; OpenBLAS goes to one
        thread meanwhile so the callers do not oversubscribe the cores.
        Measured 1.2-1.4x over one caller with 2-thread BLAS on 2 cores.
        """
        self._set_blas_threads(1)
        ctx = self.context.with_threads(1)
        # Longest sub-batches first: the cheap ones fill in at the end, so
        # neither worker is left alone with one long pass.
        plan = sorted(plan, key=lambda idx: -int(call.lengths[idx].max()) * len(idx))
        # "busy": passes being computed now. The caller waits for those
        # alone, not for a worker to come round to this call: a worker still
        # on another model's call takes none of this one's, and its late
        # drain finds the plan taken and returns.
        state = {"next": 0, "padded": 0, "error": None, "busy": 0}
        cv = threading.Condition()

        def drain() -> None:
            # Each thread its own points: a pass's pieces are its own thread's.
            with ops.forward_context(ctx), ops.bounded_evaluation(self._evaluation_points()) as points:
                while True:
                    with cv:
                        k = state["next"]
                        state["next"] += 1
                        if k >= len(plan) or state["error"] is not None:
                            return
                        state["busy"] += 1
                    p = 0
                    try:
                        vec, p = self._submit(plan[k], call, output)
                        mx.eval(vec)
                        if points is not None:
                            points.settled()
                        _store(out, plan[k], np.array(vec, copy=False))
                    except BaseException as e:  # surfaced on the caller's thread
                        with cv:
                            state["error"] = state["error"] or e
                    finally:
                        with cv:
                            state["padded"] += p
                            state["busy"] -= 1
                            cv.notify_all()

        _WORKERS.submit(drain, self.workers - 1)
        drain()
        with cv:
            cv.wait_for(lambda: state["busy"] == 0)
        if state["error"] is not None:
            raise state["error"]
        return state["padded"]


class _Call(NamedTuple):
    """One call's inputs: ids, type ids (or None), lengths, and the leading
    tokens of each the pooling leaves out (None: none)."""

    ids: Sequence[Sequence[int]]
    type_ids: Optional[Sequence[Sequence[int]]]
    lengths: np.ndarray
    pool_start: Optional[Sequence[int]]
    # Per input, the keys it attends to, where some end before its rows (None: all).
    attend: Optional[Sequence[int]] = None
    # Per input, its task adapter's index, -1 for none (None: no input has one).
    adapter: Optional[Sequence[int]] = None


class _PassArrays(NamedTuple):
    """One pass's inputs on the host, padded to its shape [B, L]: rows past
    ``real`` are padding rows. ``pool_mask``: the mask the head pools under
    when a call leaves prompts out of the pool (None: ``mask``)."""

    ids: np.ndarray
    mask: np.ndarray
    types: Optional[np.ndarray]
    real: int
    pool_mask: Optional[np.ndarray] = None
    # Some row runs past its keys (``_Call.attend``): every row is computed.
    rows_past_keys: bool = False
    # Per row [B], its task adapter's index (-1: none); None: no row has one.
    adapters: Optional[np.ndarray] = None


class _TokenRows:
    """Per-token output of one call: each sub-batch's hidden states
    [B, L, hidden] with the input indices of its rows, until read; then each
    input's first ``lengths[i]`` rows (its real tokens), in input order."""

    def __init__(self, lengths: np.ndarray):
        self.lengths = lengths
        self._parts: list = []

    def add(self, idx: np.ndarray, hidden) -> None:
        # list.append is atomic: worker threads add their passes concurrently.
        self._parts.append((idx, hidden))

    def flat(self) -> np.ndarray:
        """[sum of lengths, hidden] float32: input 0's token rows, then input 1's..."""
        per = [None] * len(self.lengths)
        width = 0
        for idx, hidden in self._parts:
            a = np.array(hidden, copy=False)
            width = a.shape[-1]
            for r, i in enumerate(idx):
                per[i] = a[r, : int(self.lengths[i])]
        if not per:
            return np.empty((0, width), dtype=np.float32)
        return np.ascontiguousarray(np.concatenate(per, axis=0), dtype=np.float32)


def _store(out, idx: np.ndarray, computed: np.ndarray) -> None:
    """Put one pass's output where its inputs go."""
    if isinstance(out, _TokenRows):
        out.add(idx, computed)
    else:
        out[idx] = computed


class Pending:
    """A submitted call: ``result()`` gives (vectors [n, dim] float32 in input
    order, padded tokens), or for per-token output the flat rows
    [sum of lengths, hidden] (``rows`` tells each input's count). For a
    pipelined call the vectors are still on the device until then;
    ``result()`` is the call's host sync."""

    def __init__(self, vectors, padded_tokens: int):
        self._vectors = vectors
        self.padded_tokens = padded_tokens
        self.rows = (
            [int(x) for x in vectors.lengths]
            if isinstance(vectors, _TokenRows)
            else [1] * len(vectors)
        )

    def result(self) -> tuple[np.ndarray, int]:
        v = self._vectors
        if isinstance(v, mx.array):
            v = self._vectors = np.array(v)
        elif isinstance(v, _TokenRows):
            v = self._vectors = v.flat()
        return v, self.padded_tokens


class _WorkerPool:
    """The process's worker threads, shared by every model: each runs MLX on
    its own CPU stream (MLX streams are per thread), blocks on a queue
    between calls, and is never joined. A thread that exits after using MLX
    runs a thread_local destructor that needs the GIL, which is unsafe during
    interpreter shutdown, while a blocked daemon thread is simply discarded
    at exit. So threads are made once for the process, not per model: a
    program that loads model after model keeps as many as one model asked
    for, and a dropped model's memory goes with it (the cores are shared by
    the models anyway)."""

    def __init__(self):
        self._queues: list = []
        self._grow = threading.Lock()

    def submit(self, fn, n: int) -> None:
        """Queue ``fn`` for ``n`` worker threads (made on first use)."""
        with self._grow:
            while len(self._queues) < n:
                q = queue.SimpleQueue()
                threading.Thread(
                    target=self._loop, args=(q,), name=f"mlx_embed-worker-{len(self._queues)}", daemon=True
                ).start()
                self._queues.append(q)
            queues = self._queues[:n]
        for q in queues:
            q.put(fn)

    @staticmethod
    def _loop(q: "queue.SimpleQueue") -> None:
        with mx.stream(mx.new_stream(mx.default_device())):
            while True:
                fn = q.get()
                try:
                    fn()
                except BaseException:  # a drain reports its own errors to its caller
                    pass
                # Held while blocked on the next get, the last call's
                # closure would keep its model (weights and all) alive.
                del fn


_WORKERS = _WorkerPool()
