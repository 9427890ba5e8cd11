"""Which device MLX runs on, and its memory: usage figures and the buffer cache limit."""

from __future__ import annotations

import logging
import os
import threading
from typing import Optional

import mlx.core as mx

from . import precision

log = logging.getLogger("mlx_embed")

# MLX keeps freed buffers in a cache for reuse, unbounded by default on a GPU,
# and every new padded shape leaves buffers behind. Measured on an H200 (issue
# 11): with varied-shape calls the cache grew to 111 GB and the process died
# out of device memory, while active memory stayed at 2.4 GB; capped at 2 GB
# it stayed at 2.0 GB with the same throughput (1,774 vs 1,922 texts/s, fp32,
# one call of 2,048 texts). So 2 GB is the default on Metal and CUDA.
DEFAULT_GPU_CACHE_LIMIT_MB = 2048

_MB = 1024 * 1024
# MLX has no getter for the cache limit; the last value we set (process-wide).
_cache_limit_bytes: Optional[int] = None


# MLX gives every OS thread that runs an op its own default stream, and each
# stream its own scheduler thread, kept until the process ends: a model called
# from threads that come and go (a thread per request, a pool that is replaced)
# added one OS thread and its buffers per caller. And an MLX thread holds a
# compile cache (thread_local in MLX 0.32) whose destructor takes the GIL: run
# at the thread's exit while the interpreter finalizes, Python ends the thread
# inside it and the process aborts ("terminate called without an active
# exception", exit 134). So a Python thread other than the main one, on its
# first model call or load, borrows streams that can move between threads
# (``mx.new_thread_unsafe_stream``) as its defaults, and gives them back when
# it ends, after dropping its MLX thread state while it still holds the GIL.
# One thread holds a stream at a time (MLX leaves a shared stream's ordering to
# its users), so the streams made number the engine's most concurrent callers,
# not all the threads that ever called. The main thread, which outlives the
# interpreter's threads, and foreign threads (C's, ``_thread``'s, Rust's
# through PyO3: Python's threading never sees them end, so a lease might not
# come back) keep MLX's own default streams, unless the thread says that it
# keeps its Python thread state to its end and clears it there
# (``keep_thread_streams``: the Rust bridge's threads do).
_free_streams: dict = {}
_made_streams = 0
# False once a lease failed (logged once): threads then keep MLX's own streams
# (and still drop their MLX state as they end).
_lending = True
_free_lock = threading.Lock()
_thread_lease = threading.local()


class _Lease:
    """One thread's MLX state, dropped with the thread's Python state: its
    borrowed default streams (one per device it runs on), which go back, and
    its compile cache and stream encoders, which are cleared."""

    # Held by the class: at interpreter exit the module's globals may be gone
    # before a lease is dropped.
    _ident = staticmethod(threading.get_ident)

    def __init__(self, clear: bool = True):
        self.owner = self._ident()
        # False on a thread whose Python state ends after MLX's own thread
        # state (``keep_thread_streams``): there is nothing left to clear.
        self.clear = clear
        self.streams: list = []
        # More streams for the thread's passes (``Scheduler(streams=)``).
        self.extra: list = []

    def borrow(self, devices) -> None:
        try:
            for d in devices:
                self.streams.append(_borrow(d))
        except BaseException:
            _give_back(self.streams)
            self.streams = []
            raise
        for s in self.streams:
            mx.set_default_stream(s)

    def more(self, n: int) -> list:
        """``n`` more streams on the default device, the same ones call after call."""
        while len(self.extra) < n:
            self.extra.append(_borrow(mx.default_device()))
        return self.extra[:n]

    def __del__(self):
        # Dropped on another thread only as the interpreter finalizes with the
        # owner still alive (a daemon thread; ``threading.local`` then drops
        # every thread's values on the main thread): ``clear_streams`` would
        # clear the main thread's state, not the owner's (and on a GPU, MLX's
        # main thread clears every lent stream's encoder, which the owner may
        # be running on), and the streams are not free to lend. The process
        # is ending; leave both.
        if self._ident() != self.owner:
            return
        # While the thread still holds the GIL (see above).
        if self.clear:
            mx.clear_streams()
        _give_back(self.streams + self.extra)


def _give_back(streams) -> None:
    with _free_lock:
        for s in streams:
            _free_streams[str(s.device)].append(s)


def _borrow(d):
    global _made_streams
    with _free_lock:
        free = _free_streams.setdefault(str(d), [])
        if free:
            return free.pop()
    # MLX 0.32 keeps these streams' encoders in one unlocked map, which a new
    # stream can rehash while another thread looks up its own: making them
    # only when the free list is empty keeps that to a process's first
    # rises in concurrency (no failure seen in 3 x 3,000 streams made beside
    # 3 evaluating threads).
    s = mx.new_thread_unsafe_stream(d)
    with _free_lock:
        _made_streams += 1
    return s


def claim_thread_streams() -> None:
    """Give a short-lived Python thread borrowed default streams before it
    runs MLX (see ``_Lease``); a no-op after its first call, and on the main
    thread and on foreign threads other than kept ones (``keep_thread_streams``)."""
    global _lending
    if getattr(_thread_lease, "claimed", False):
        return
    _thread_lease.claimed = True
    kept = getattr(_thread_lease, "kept", False)
    if not kept:
        # (Not asked on a kept thread: it would leave a dummy Thread object
        # in ``threading`` for good.)
        t = threading.current_thread()
        if t is threading.main_thread() or isinstance(t, threading._DummyThread):
            return
    devices = [mx.default_device()]
    if devices[0] != mx.cpu:
        # Code that names the CPU (``mx.stream(mx.cpu)``) takes its default.
        devices.append(mx.Device(mx.cpu))
    lease = _thread_lease.lease = _Lease(clear=not kept)
    if not _lending:
        return
    try:
        lease.borrow(devices)
    except Exception as e:  # a backend without streams that move between threads
        if _lending:
            _lending = False
            log.warning("MLX streams cannot be lent to threads here (%s): each thread keeps its own", e)


def keep_thread_streams() -> None:
    """Lend streams to the calling foreign thread too, from its first model
    call to its end: for a thread that keeps one Python thread state until
    it ends and clears it there, on itself, holding the GIL (the Rust
    bridge's ``thread_state``, for a Rust thread that calls the model). Its
    lease then goes back as a Python thread's does, without
    ``mx.clear_streams``: the bridge clears the thread state from a Rust
    thread-local destructor, which runs after MLX's own thread-locals (made
    later, so destroyed first) are gone; calling it then would reach them
    destroyed. (Skipping it keeps nothing: 200 Rust threads one after
    another, each loading and embedding, added 11 MB and 1 thread, as 20
    did.) Call it before the thread's first model call."""
    _thread_lease.kept = True


def extra_streams(n: int) -> list:
    """``n`` streams of this thread's own besides its default, for a call's
    passes to rotate over: lent with its other streams on a thread that
    borrows them, made for good on the main thread and foreign threads."""
    lease = getattr(_thread_lease, "lease", None)
    if lease is not None and lease.streams:
        return lease.more(n)
    return [mx.new_stream(mx.default_device()) for _ in range(n)]


def lent_streams() -> int:
    """Streams made for lending so far (each has one MLX scheduler thread)."""
    return _made_streams


def is_cpu() -> bool:
    return mx.default_device().type == mx.DeviceType.cpu


def backend() -> str:
    """``cpu``, ``cuda`` or ``metal``."""
    if is_cpu():
        return "cpu"
    if mx.cuda.is_available():
        return "cuda"
    if mx.metal.is_available():
        return "metal"
    return "gpu"


def device_name() -> str:
    """E.g. ``cpu (AMD EPYC)`` or ``cuda (NVIDIA H200)``: for /info and logs."""
    try:
        name = str(mx.device_info().get("device_name") or "").strip()
    except Exception:  # an old MLX or a backend without device_info
        name = ""
    return f"{backend()} ({name})" if name else backend()


CUDA_GRAPHS_VARIABLE = "MLX_USE_CUDA_GRAPHS"


def cuda_graphs() -> Optional[str]:
    """On CUDA, how MLX sends a pass's kernels: ``on`` (MLX's default)
    records them into CUDA graphs, instantiated or updated and launched 20
    kernels at a time; ``off`` (``MLX_USE_CUDA_GRAPHS=0``) launches each one
    as it is built. None off CUDA. MLX reads the variable once, at its first
    kernel; this reads it as MLX does.

    Measured on an H200 (docs/benchmarks.md, fifth lease): ``off`` ran
    server-sized work 1.1-1.3x faster (calls of 32 texts, the server at 64
    connections), but without graphs MLX keeps every temporary buffer of an
    evaluation until all of it has run, and the process's peak device memory
    rose from 17.9 GB to 64 GB over one-call runs of 2,048 Qwen3-0.6B texts.
    So MLX's default stays until that peak is bounded and measured."""
    if backend() != "cuda":
        return None
    return "on" if precision.mlx_switch_on(os.environ.get(CUDA_GRAPHS_VARIABLE)) else "off"


def apply_cache_limit(cache_limit_mb: Optional[int]) -> int:
    """Set MLX's buffer cache limit; returns the MB applied.

    None picks the default: 2 GB on a GPU, 0 on the CPU. The CPU keeps no
    cache because MLX frees it from a C++ static destructor at process exit,
    which aborted about one exit in five here (heap corruption in
    CommonAllocator::~CommonAllocator) once the model had run on a non-main
    thread; the cost measured within noise (glibc reuses freed blocks anyway).
    The limit is process-wide: the last model loaded sets it.
    """
    global _cache_limit_bytes
    if cache_limit_mb is None:
        cache_limit_mb = 0 if is_cpu() else DEFAULT_GPU_CACHE_LIMIT_MB
    cache_limit_mb = int(cache_limit_mb)
    if cache_limit_mb < 0:
        raise ValueError(f"cache_limit_mb must be >= 0, got {cache_limit_mb}")
    if cache_limit_mb and is_cpu():
        log.warning(
            "cache_limit_mb=%d on the CPU: MLX may abort at process exit while freeing "
            "its cache (0, the CPU default, avoids it)", cache_limit_mb,
        )
    _cache_limit_bytes = cache_limit_mb * _MB
    mx.set_cache_limit(_cache_limit_bytes)
    return cache_limit_mb


def memory() -> dict[str, int]:
    """MLX's memory figures in bytes: ``active`` (live arrays), ``cache``
    (freed buffers kept for reuse), ``peak`` (highest active since start) and
    ``cache_limit`` (-1 when never set by us)."""
    return {
        "active_bytes": int(mx.get_active_memory()),
        "cache_bytes": int(mx.get_cache_memory()),
        "peak_bytes": int(mx.get_peak_memory()),
        "cache_limit_bytes": -1 if _cache_limit_bytes is None else int(_cache_limit_bytes),
    }
