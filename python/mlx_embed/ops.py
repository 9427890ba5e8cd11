"""GELU and attention softmax with fast CPU paths.

On MLX's Linux CPU backend, transcendental ops (erf, exp, tanh) run through a
slow per-element path (measured here: nn.gelu ~50 ns/element, exp ~23
ns/element, against ~1 ns for a compiled multiply-add), and GELU + softmax
were most of a MiniLM forward pass (docs/benchmarks.md). Three paths, best
first, chosen per model by ``load(fast_ops=...)``:

* ``native`` (default on CPU): the SIMD kernels of our Rust extension
  (crates/mlx-embed-kernels, AVX-512 or AVX2+FMA where the CPU has it), run in place on
  the evaluated MLX array's buffer with the GIL released. The softmax takes
  the key lengths instead of an additive mask and fuses scale, mask, max,
  exp, sum and normalize into three passes per row (~1 ns/element against
  ~5 for the compiled-MLX path below). Costs one ``mx.eval`` per call: the
  graph is cut there, which a forward pass on CPU pays for in a few µs.
* ``mlx``: the same math from mul/add/div/floor, which mx.compile fuses into
  one generated C++ loop (MLX builds those without AVX, hence slower):

  - erf: rational approximation erf(z) ~= z * P(z^2) / Q(z^2) on [-4, 4]
    (|erf(4)| = 1 - 1.5e-8, so clamping costs nothing in float32). P and Q
    are degree 5 in z^2, fitted here by iteratively reweighted least squares
    (``_fit_erf``); max error of the fit 2.2e-8, GELU error in float32
    within ~2 ulp of |x|.
  - exp (for softmax, inputs <= 0 after the max shift): 2^y split into
    2^floor(y) (built by writing the exponent bits) times a degree-5
    polynomial for 2^frac(y), relative error ~2e-7 in float32.

  The Rust kernels use these same fitted coefficients.
* ``exact``: MLX's built-in ops; always used on
  Metal/CUDA, where they are fast and exact.

The choice is per model (``load(fast_ops=...)``, the environment variable is
only the fallback): a :class:`ForwardContext`, made active on the forward
pass's thread by the scheduler, so the model files call plain functions
(``ops.gelu(x)``) and two models in one process keep their own settings.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, ContextManager, Iterator, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .errors import InvalidOption

try:
    from . import _native
except ImportError:  # a source checkout without the built extension
    _native = None

# Fitted by _fit_erf(5, 5): erf(z) ~= z * P(z^2) / Q(z^2), lowest degree first.
_ERF_P = (
    1.1283789789718095, 0.19622960512197415, 0.053464160480915734,
    0.004002538479012231, 0.0002879699322235691, 1.974418855487038e-06,
)
_ERF_Q = (
    1.0, 0.5072351421680261, 0.11646770212989477,
    0.015442337596287003, 0.0012159984841483736, 3.7472741600798454e-05,
)
# Fitted by _fit_pow2(5): 2^f on [0, 1], relative error 7.5e-8 (fit), i.e.
# already below float32 resolution. Degree 5, not 6: MLX's compiled CPU
# kernel for the whole exp measured 2.8x slower with the 7-coefficient
# polynomial (8.9 vs 3.2 ns/element on [4,12,256,256]; the degree-6 Horner
# chain alone is 1.8 vs 0.3 ns), same float32 accuracy (max rel 2.4e-7 vs 1.2e-7).
_POW2 = (
    0.9999999250392893, 0.6931530737676816, 0.24015361496020945,
    0.05582631885690079, 0.008989343820482068, 0.0018775736154880579,
)
_LOG2E = 1.4426950408889634
# Fitted by _fit_erfc_scaled(10, 0.5): exp(a^2) erfc(a) ~= u * E(u), u = 1 / (1 + a / 2),
# a >= 0, lowest degree first; relative error 2.0e-8 on [0, 10] (fit), 3.3e-7 evaluated in
# float32. For gelu_precise.
_ERFCX = (
    0.2820645063102559, 0.28285686968807855, 0.2386464343109971, 0.22553336895709558,
    -0.0982901970066329, 0.4212179920756974, -0.6699489581339909, 0.42886920408034934,
    -0.1232279184425278, 0.012278678501321121,
)
_SQRT1_2 = 0.7071067811865476


def _horner(coeffs, t):
    acc = coeffs[-1]
    for c in reversed(coeffs[:-1]):
        acc = acc * t + c
    return acc


def _gelu_rational(x: mx.array) -> mx.array:
    z = mx.clip(x * _SQRT1_2, -4.0, 4.0)
    t = z * z
    erf = z * _horner(_ERF_P, t) / _horner(_ERF_Q, t)
    return 0.5 * x * (1.0 + erf)


def _gelu_erfc(x: mx.array) -> mx.array:
    # erfc(|x| / sqrt 2) to a few float32 ulps of itself, however small: the exponential of the
    # exact half-square times the fitted smooth factor. 1 + erf(z) loses erf's absolute error
    # to cancellation where erf nears -1, so this side is 0.5 x erfc(-z) instead.
    # Beyond |x| = 20 the exponential is 0 in float32 (e^-200), so clipping there changes no
    # finite result, and it keeps inf * 0 out: GELU(+inf) = +inf, GELU(-inf) = -0 (its limit).
    c = mx.clip(x, -20.0, 20.0)
    u = 1.0 / (1.0 + (0.5 * _SQRT1_2) * mx.abs(c))
    half_e = (0.5 * c) * (mx.exp(-0.5 * (c * c)) * (u * _horner(_ERFCX, u)))
    return mx.where(x < 0, half_e, x - half_e)


_gelu_erfc_compiled = mx.compile(_gelu_erfc, shapeless=True)


def gelu_precise(x: mx.array) -> mx.array:
    """Exact (erf) GELU with a small relative error down its negative tail
    too (bias 4e-8 of the value near x = -2, where MLX's ``erf`` GELU is off
    by -1.7e-6 of it and the 1 + erf forms by several ulps of 1), on any
    device and path. For a head whose GELU input sits in that tail and is then
    normalized (a masked-LM head's transform): there a same-signed error in
    every token survives the LayerNorm and adds up over a text's tokens in
    SPLADE's sum. float32 only; other dtypes take :func:`gelu`."""
    if x.dtype != mx.float32:
        return gelu(x)
    return _gelu_erfc_compiled(x)


def _exp_nonpositive(x: mx.array) -> mx.array:
    # Below 2^-126 float32 goes subnormal; those weights are < 1e-38 of the
    # row max, i.e. zero for any softmax purpose.
    y = mx.maximum(x * _LOG2E, -126.0)
    n = mx.floor(y)
    frac = _horner(_POW2, y - n)
    scale = ((n.astype(mx.int32) + 127) << 23).view(mx.float32)
    return frac * scale


def _softmax_fast(x: mx.array) -> mx.array:
    e = _exp_nonpositive(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# Not shapeless: the view() in the exp cannot be traced shapeless, and the
# shape-specialized kernels measured faster anyway. Retracing for a new shape
# is ~1 ms once the C++ kernel is in MLX's on-disk cache; the engine rounds
# sequence lengths up to a few buckets to keep the shape count small.
_gelu_compiled = mx.compile(_gelu_rational)
_softmax_compiled = mx.compile(_softmax_fast)


# Values of ``MLX_EMBED_FAST_OPS`` and the path each names (``load(fast_ops=)`` takes the three names).
_PATH_NAMES = {
    "native": "native", "1": "native", "true": "native", "yes": "native", "": "native",
    "mlx": "mlx",
    "exact": "exact", "0": "exact", "false": "exact", "no": "exact",
}


# The extension's kernel_api these modules call (crates/mlx-embed/src/kernels.rs).
KERNEL_API = 4


def native_available() -> bool:
    # An extension built from an older tree lacks entry points or arguments
    # these modules call, and then the native path is not offered at all.
    return _native is not None and getattr(_native, "kernel_api", 0) >= KERNEL_API


def resolve_path(fast_ops: Optional[str] = None, device: Optional[mx.Device] = None) -> str:
    """``native``, ``mlx`` or ``exact`` for a ``load(fast_ops=)`` value (None:
    ``MLX_EMBED_FAST_OPS``, default native); see the module docstring.

    The native and compiled-MLX paths exist because MLX's *CPU* backend is
    slow at transcendentals; on Metal/CUDA the built-in ops win, so any
    request resolves to ``exact`` there. An explicit ``native`` without the
    built extension is an error; the default quietly takes ``mlx``.
    """
    explicit = fast_ops is not None
    raw = fast_ops if explicit else os.environ.get("MLX_EMBED_FAST_OPS", "native")
    # The environment's older spellings (1/0, true/false) stay its own; the
    # keyword takes the three names.
    name = (fast_ops if fast_ops in ("native", "mlx", "exact") else None) if explicit else (
        _PATH_NAMES.get(str(raw).strip().lower()))
    if name is None:
        raise InvalidOption(f"fast_ops must be 'native', 'mlx' or 'exact', got {raw!r}")
    if (device or mx.default_device()) != mx.cpu:
        return "exact"
    if name == "native" and not native_available():
        if explicit:
            raise InvalidOption("fast_ops='native' needs the built extension mlx_embed._native")
        return "mlx"
    return name


@dataclass(frozen=True)
class ForwardContext:
    """How element-wise ops run for one model: the path and how many threads
    the native kernels may use. Each model owns one; the scheduler makes it
    active on the thread running a forward pass (``forward_context``), so two
    models in one process never see each other's settings while the model
    files keep calling plain module functions."""

    path: str = "exact"
    kernel_threads: int = 1
    # BERT-style self-attention through mx.fast.scaled_dot_product_attention
    # (one fused kernel where the backend has one, e.g. cuDNN on CUDA in
    # half precision) instead of two matmuls around a softmax.
    fused_attention: bool = False
    # A pass on its real tokens alone (``KeyMask.packed_rows``): an encoder's
    # layers (``run_layers``; attention alone on the padded layout), a
    # decoder's feed-forward (``packed_feed_forwards``).
    packed_rows: bool = False

    def with_threads(self, n: int) -> "ForwardContext":
        return replace(self, kernel_threads=max(1, int(n)))

    def describe(self) -> str:
        """``native (avx512f)``, ``native (avx2+fma)``, ``native (generic)``, ``mlx`` or ``exact``."""
        return f"native ({_native.kernel_simd})" if self.path == "native" else self.path


def make_context(
    fast_ops: Optional[str] = None,
    kernel_threads: Optional[int] = None,
    fused_attention: Optional[bool] = None,
    dtype: str = "float32",
    packed_rows: bool = False,
) -> ForwardContext:
    path = resolve_path(fast_ops)
    if fused_attention is None:
        fused_attention = default_fused_attention(dtype)
    return ForwardContext(
        path=path,
        kernel_threads=max(1, int(kernel_threads or os.cpu_count() or 1)),
        fused_attention=bool(fused_attention) and path == "exact",
        packed_rows=bool(packed_rows),
    )


def default_fused_attention(dtype: str, device: Optional[mx.Device] = None) -> bool:
    """On a GPU in half precision. Measured on an H200 (docs/benchmarks.md,
    bf16, one call): 1.46x (MiniLM shape) and 1.50x (BERT-base) over the
    matmul-softmax-matmul path, where cuDNN's fused kernel runs; in float32
    there is no fused kernel and MLX's fallback measured 0.68-0.72x. On the
    CPU the native kernel fuses attention already."""
    return (device or mx.default_device()) != mx.cpu and dtype in ("float16", "bfloat16")


_active = threading.local()
_process_default: Optional[ForwardContext] = None


def default_context() -> ForwardContext:
    """What module functions use outside any ``forward_context`` (a model file
    called directly, e.g. by a profiler): the environment's settings."""
    global _process_default
    if _process_default is None:
        _process_default = make_context()
    return _process_default


def current() -> ForwardContext:
    return getattr(_active, "ctx", None) or default_context()


@contextmanager
def _on_this_thread(local: threading.local, name: str, value):
    """``local.<name>`` is ``value`` on this thread inside (nests)."""
    prev = getattr(local, name, None)
    setattr(local, name, value)
    try:
        yield value
    finally:
        setattr(local, name, prev)


def forward_context(ctx: ForwardContext) -> ContextManager[ForwardContext]:
    """Make ``ctx`` the active context on this thread (nests)."""
    return _on_this_thread(_active, "ctx", ctx)


# Building a lazy graph is not safe from two threads at once in every case:
# the GIL can switch threads in the middle of an mx.compile trace (ours on the
# compiled-MLX path; nn.silu/nn.gelu_approx inside models), while the other
# thread looks up the same compile cache. So graph building holds this lock
# (``building_graph``), and every point where a forward pass evaluates or runs
# a native kernel lets go of it, which is where the engine's workers overlap.
# It is process-wide, not per model: the compile cache it guards is MLX's.
_graph_lock = threading.Lock()
_holds_graph_lock = threading.local()


@contextmanager
def building_graph() -> Iterator[None]:
    """Hold the graph lock while building (part of) a forward pass."""
    with _graph_lock:
        _holds_graph_lock.value = True
        try:
            yield
        finally:
            _holds_graph_lock.value = False


@contextmanager
def _graph_lock_released() -> Iterator[None]:
    if not getattr(_holds_graph_lock, "value", False):
        yield
        return
    _holds_graph_lock.value = False
    _graph_lock.release()
    try:
        yield
    finally:
        _graph_lock.acquire()
        _holds_graph_lock.value = True


def _native_buffer(x: mx.array) -> Optional[np.ndarray]:
    """The evaluated array's own buffer as a NumPy view (no copy), or None
    when it is not one writable C-contiguous float32 block the kernels can
    work on in place; callers then take the MLX path."""
    if x.dtype != mx.float32:
        return None
    with _graph_lock_released():
        mx.eval(x)
    view = np.array(x, copy=False)
    if not (view.flags.writeable and view.flags.c_contiguous):
        return None
    return view


def host_view(x: mx.array) -> np.ndarray:
    """``x`` as a NumPy view (no copy), evaluated first outside the graph
    lock (a no-op for an array made from a host buffer)."""
    with _graph_lock_released():
        mx.eval(x)
    return np.array(x, copy=False)


def _readonly_buffer(x: mx.array) -> np.ndarray:
    return np.ascontiguousarray(host_view(x), dtype=np.float32)


def gelu(x: mx.array, *, overwrite_input: bool = False) -> mx.array:
    """Exact (erf) GELU. With ``overwrite_input`` (x is a temporary nobody
    reads again) the native path writes the result into x's buffer."""
    ctx = current()
    if ctx.path == "native" and overwrite_input:
        buf = _native_buffer(x)
        if buf is not None:
            with _graph_lock_released():
                _native.gelu_(buf, ctx.kernel_threads)
            return x
    if ctx.path != "exact" and x.dtype == mx.float32:
        return _gelu_compiled(x)
    return nn.gelu(x)


def _pack(weight: mx.array, bias: Optional[mx.array]) -> tuple:
    """``(packed weight, bias view or None, outputs, inputs)`` of a float32
    [outputs, inputs] ``weight`` for the native kernel."""
    outputs, inputs = weight.shape
    packed = np.empty(_native.linear_packed_len(outputs, inputs), dtype=np.float32)
    _native.pack_linear_weights(_readonly_buffer(weight), outputs, inputs, packed)
    return packed, None if bias is None else _readonly_buffer(bias), outputs, inputs


def _packed_linear(layer: nn.Module) -> Optional[tuple]:
    """``(packed weight, bias view or None, outputs, inputs)`` of a float32
    ``nn.Linear`` for the native kernel, packed on first use and kept on the
    layer (tied to the weight array it was packed from); None for anything
    else (quantized layers, other dtypes), which keep MLX's matmul."""
    if getattr(layer, "dropped", False):
        return _dropped_entry(layer)
    if type(layer) not in (nn.Linear, EngineLinear) or layer.weight.dtype != mx.float32:
        return None
    weight = layer.weight
    cached = layer.__dict__.get("_mlx_embed_packed")
    if cached is not None and cached[0] is weight:
        return cached[1]
    entry = _pack(weight, layer.bias if "bias" in layer else None)
    # A plain attribute, not a module child: nn.Module keeps arrays, dicts
    # and lists as parameters, and this must not become one.
    object.__setattr__(layer, "_mlx_embed_packed", (weight, entry))
    return entry


class EngineLinear(nn.Linear):
    """A float32 ``nn.Linear`` of a model on the CPU's native path (``prepare``
    gives its layers this class): inside the engine's passes it runs in the
    native kernel (:func:`linear`), whose every output is summed in k order
    whatever the rows, so a text's bits do not follow the batch it ran in.
    OpenBLAS's sgemm picks its kernel, and with it the order of the sums,
    from the matrix sizes (docs/architecture.md, "Same bits"). A layer whose
    MLX weight ``prepare`` let go of (``dropped``) runs in the kernel
    everywhere: it has nothing else to run on."""

    dropped = False

    def __call__(self, x: mx.array) -> mx.array:
        if self.dropped and x.dtype != mx.float32:
            # MLX's matmul would read the stand-in: zeros.
            return linear(self, x.astype(mx.float32)).astype(x.dtype)
        if x.dtype == mx.float32 and (self.dropped or _native_pass()):
            return linear(self, x)
        return super().__call__(x)


def _native_pass() -> bool:
    ctx = getattr(_active, "ctx", None)
    return ctx is not None and ctx.path == "native"


def prepare(model: nn.Module, ctx: ForwardContext) -> None:
    """On the native path, make every float32 ``nn.Linear`` of ``model`` an
    :class:`EngineLinear` and pack its weight for the kernel now (at load)
    rather than in the first forward pass; then let go of MLX's copy of the
    weight where nothing else in the model holds that array (a tied
    embedding or head keeps its own): the packed copy is as large as the
    weights (1.8 GB for Qwen3-0.6B), and the layer never reads MLX's again.
    Quantized layers and other dtypes keep MLX's matmul."""
    if ctx.path != "native":
        return
    from mlx.utils import tree_flatten

    holders: dict[int, int] = {}
    for _, array in tree_flatten(model.parameters()):
        holders[id(array)] = holders.get(id(array), 0) + 1
    for _, module in model.named_modules():
        if type(module) is not nn.Linear or module.weight.dtype != mx.float32:
            continue
        module.__class__ = EngineLinear
        _packed_linear(module)
        if holders.get(id(module.weight), 0) == 1:
            _drop_weight(module)


def _drop_weight(layer: "EngineLinear") -> None:
    """Replace the packed layer's MLX weight by a stand-in of its shape and
    dtype that holds no memory (a broadcast zero), so shape and dtype
    readers (the engine's descriptions) still see the layer as it is."""
    weight, entry = layer.__dict__["_mlx_embed_packed"]
    stand_in = mx.broadcast_to(mx.zeros((1, 1), dtype=weight.dtype), weight.shape)
    layer.weight = stand_in
    object.__setattr__(layer, "_mlx_embed_packed", (stand_in, entry))
    object.__setattr__(layer, "dropped", True)


def _dropped_entry(layer: "EngineLinear") -> tuple:
    """The packed entry of a layer whose MLX weight was let go of. A pass
    over the parameters that copies them as they are (``set_dtype(float32)``,
    ``update(parameters())``) hands the layer a new array of the stand-in,
    which must not be packed in turn (zeros); new float32 weights are the
    layer's from then on; any other dtype is refused, as there is nothing
    left to cast."""
    stand_in, entry = layer.__dict__["_mlx_embed_packed"]
    weight = layer.weight
    if weight is stand_in:
        return entry
    if weight.dtype != mx.float32:
        raise ValueError(
            f"this linear's float32 weights were packed for the native kernel and MLX's copy let go of "
            f"(ops.prepare); it cannot become {weight.dtype}: load the model with that dtype instead"
        )
    if weight.shape == stand_in.shape and all(s == 0 for s in host_view(weight).strides):
        object.__setattr__(layer, "_mlx_embed_packed", (weight, entry))
        return entry
    object.__setattr__(layer, "dropped", False)
    return _packed_linear(layer)


def _packed_rows_matrix(owner, weight: mx.array, bias: Optional[mx.array], key: str, source) -> tuple:
    """``(packed, bias view or None, outputs, inputs)`` for ``x @ weight.T (+
    bias)`` by the native kernel, packed once and kept on ``owner`` under
    ``key`` (tied to ``source``, the array it was made from)."""
    attr = "_mlx_embed_packed_" + key
    cached = owner.__dict__.get(attr)
    if cached is not None and cached[0] is source:
        return cached[1]
    entry = _pack(weight, bias)
    object.__setattr__(owner, attr, (source, entry))
    return entry


def rows_times(
    x: mx.array, weight: mx.array, bias: Optional[mx.array] = None, *, owner, key: str = "w", source=None
):
    """``x @ weight.T (+ bias)`` for a float32 [out, in] ``weight`` that is
    not an ``nn.Linear``'s (a Dense module, a reranker's score rows): inside
    the engine's passes on the native path by the native kernel, each row's
    outputs the same bits whatever the other rows; MLX's matmul elsewhere.
    Packed once per ``source`` (default: ``weight``), the array the weight
    is made from where the caller reshapes it."""
    if _native_pass() and x.dtype == weight.dtype == mx.float32 and weight.ndim == 2:
        entry = _packed_rows_matrix(owner, weight, bias, key, weight if source is None else source)
        return _run_packed(entry, x, None)
    y = x @ weight.T
    return y if bias is None else y + bias


def linear(layer: nn.Module, x: mx.array, *, activation: Optional[str] = None) -> mx.array:
    """``layer(x)``, then ``activation`` (None or ``"gelu"``, exact). On the native path a float32
    ``nn.Linear`` runs in the SIMD kernel on weights packed once (the BLAS
    re-packs them on every call, a large share of a small pass), with the
    bias and the GELU fused into it."""
    if activation not in (None, "gelu"):
        raise ValueError(f"linear: activation must be None or 'gelu', got {activation!r}")
    ctx = current()
    native = ctx.path == "native" or getattr(layer, "dropped", False)
    entry = _packed_linear(layer) if native and x.dtype == mx.float32 else None
    if entry is None:
        y = layer(x)
        return gelu(y, overwrite_input=True) if activation else y
    return _run_packed(entry, x, activation)


def _run_packed(entry: tuple, x: mx.array, activation: Optional[str]) -> mx.array:
    packed, bias, outputs, inputs = entry
    ctx = current()
    if x.shape[-1] != inputs:
        raise ValueError(f"linear: input width {x.shape[-1]}, layer takes {inputs}")
    with _graph_lock_released():
        mx.eval(x)
    xs = np.array(x, copy=False)
    if not xs.flags.c_contiguous:
        xs = np.ascontiguousarray(xs)
    dst = _scratch(xs.size // inputs * outputs).reshape(*x.shape[:-1], outputs)
    with _graph_lock_released():
        _native.linear_(xs, packed, bias, dst, inputs, outputs, activation == "gelu",
                        ctx.kernel_threads)
    # A new array from the host buffer, not an evaluated MLX output for the
    # kernel to fill: the copy is made here on the calling thread, where an
    # MLX allocation would cost an evaluation on the stream's thread (a
    # thread hand-off; measured 35 vs 45 us for [256, 1536], 3 vs 11 us for
    # [17, 1536]). So the scratch buffer is free again at once.
    return mx.array(dst)


def positions_from_ids(input_ids: mx.array, padding_idx: int) -> Optional[np.ndarray]:
    """transformers' RoBERTa and MPNet position ids, where they are not the
    plain run ``padding_idx + 1, + 2, ...`` for some real token, else None.

    transformers numbers a row's positions from its ids: a token with the
    padding id takes position ``padding_idx`` and does not advance the count
    (``create_position_ids_from_input_ids``). Padding at a row's end is
    masked, so only a padding id with a real token after it changes a
    result: a text with a literal ``<pad>`` in it. Those rows get [B, L]
    int32 positions as transformers gives them."""
    ids = np.array(input_ids, copy=False)
    real = ids != padding_idx
    # A padding id followed in its row by one that is not is a real token.
    later = np.logical_or.accumulate(real[:, ::-1], axis=1)[:, ::-1]
    if not (~real[:, :-1] & later[:, 1:]).any():
        return None
    return (np.cumsum(real, axis=1) * real + padding_idx).astype(np.int32)


def position_rows(
    table: nn.Embedding, input_ids: mx.array, first: int, padding_idx: Optional[int] = None
) -> mx.array:
    """Each token's position embedding in an MLX graph: the plain run of
    rows from ``first`` ([L, D], broadcast over the batch), or, with
    ``padding_idx`` (RoBERTa, MPNet), transformers' numbering where a row
    needs it ([B, L, D]; :func:`positions_from_ids`)."""
    exact = None if padding_idx is None else positions_from_ids(input_ids, padding_idx)
    if exact is None:
        return table.weight[first : first + input_ids.shape[1]]
    return table(mx.array(exact))


def embeddings_on_host(
    word: nn.Module,
    ids: mx.array,
    positions: tuple[nn.Module, int],
    norm: nn.Module,
    types: Optional[nn.Module] = None,
    type_ids: Optional[mx.array] = None,
    padding_idx: Optional[int] = None,
) -> Optional[np.ndarray]:
    """A BERT-style embedding layer computed on the host, for the native
    encoder: ``norm((word[ids] + types[type_ids]) + position rows)``, in
    transformers' order of additions, as a new writable float32 [B, L, D]
    (``post_ln_encoder`` takes it as it is). ``positions`` is the position
    table and the first row a sequence uses (with ``padding_idx``, as
    :func:`position_rows` numbers them); without ``type_ids`` every
    token takes ``types`` row 0. MLX would run the same gathers, adds and
    norm on its stream's thread, one hand-off each (about 0.2 ms of a
    one-text pass, docs/benchmarks.md). None off the native path, or for
    tables that are not float32 ``nn.Embedding`` (quantized) or a norm
    without weight and bias: the caller then builds the MLX graph."""
    ctx = current()
    position_table, first = positions
    tables = [word, position_table] + ([types] if types is not None else [])
    if (
        ctx.path != "native"
        or any(type(t) is not nn.Embedding or t.weight.dtype != mx.float32 for t in tables)
        or "weight" not in norm
        or "bias" not in norm
    ):
        return None
    word_rows, position_rows = _table_view(word), _table_view(position_table)
    type_rows = None if types is None else _table_view(types)
    norm_params = _norm_params(norm)
    with _graph_lock_released():
        ids_host = np.array(ids, copy=False)
        length = ids_host.shape[1]
        exact = None if padding_idx is None else positions_from_ids(ids_host, padding_idx)
        if exact is not None:
            # The kernel adds one [L, D] block to every row: zeros, once
            # each token's own position row is in (same order of additions).
            rows = np.zeros((length, position_rows.shape[1]), dtype=np.float32)
        else:
            # The kernel repeats the position rows over the batch's sequences, so
            # a short slice would repeat where MLX refuses to broadcast.
            rows = position_rows[first : first + length]
            if len(rows) != length:
                raise ValueError(
                    f"{length} tokens but {len(position_rows) - first} position rows from {first}"
                )
        x = word_rows[ids_host]  # a new C-contiguous [B, L, D]
        if type_rows is not None:
            x += type_rows[0 if type_ids is None else np.array(type_ids, copy=False)]
        if exact is not None:
            x += position_rows[exact]
        _native.add_layer_norm_(x, rows, *norm_params, norm.eps, ctx.kernel_threads)
    return x


def _table_view(table: nn.Embedding) -> np.ndarray:
    """An embedding table's weight as a NumPy view, made once per weight array."""
    cached = table.__dict__.get("_mlx_embed_view")
    if cached is None or cached[0] is not table.weight:
        cached = (table.weight, _readonly_buffer(table.weight))
        # A plain attribute: see _packed_linear.
        object.__setattr__(table, "_mlx_embed_view", cached)
    return cached[1]


def post_ln_encoder(blocks, x, mask: "KeyMask") -> Optional[mx.array]:
    """BERT's post-LN ``blocks`` over ``x`` [B, L, D] in one native call, or
    None where that does not apply (another path or dtype, or a block the
    call does not cover: tanh GELU, no bias, quantized), and the caller runs
    them one by one. The same kernels in the same order, so the same bits;
    what it saves is the trip through Python and MLX around each of a pass's
    seven kernel calls per block (docs/benchmarks.md). ``x`` is an MLX array,
    or a writable float32 NumPy array the call may overwrite
    (``embeddings_on_host``'s)."""
    ctx = current()
    on_host = isinstance(x, np.ndarray)
    if ctx.path != "native" or x.dtype != (np.float32 if on_host else mx.float32):
        return None
    specs = []
    for block in blocks:
        spec = _post_ln_spec(block)
        if spec is None:
            return None
        specs.append(spec)
    if on_host:
        buf = x
    else:
        with _graph_lock_released():
            mx.eval(x)
        buf = np.array(x, dtype=np.float32)  # our own writable copy
    lengths = mask.lengths
    with _graph_lock_released():
        _native.post_ln_encoder_(buf, lengths, x.shape[1], specs, ctx.kernel_threads)
    return mx.array(buf)


def _post_ln_spec(block) -> Optional[tuple]:
    """The ``post_ln_encoder_`` tuple of one block, made once per set of
    weight arrays and kept on the block; None if it does not qualify."""
    cached = block.__dict__.get("_mlx_embed_post_ln")
    # Modules are dicts: .get skips nn.Module's slower attribute lookup, and
    # this check runs for every block of every pass.
    if cached is not None and all(
        m.get("weight") is w and m.get("bias") is b for m, (w, b) in zip(cached[0], cached[1])
    ):
        return cached[2]
    parts = getattr(block, "post_ln_parts", lambda: None)()
    if parts is None:
        return None
    heads, scale, qkv, out, norm1, up, down, norm2 = parts
    modules = (qkv, out, norm1, up, down, norm2)
    sources = tuple((m.get("weight"), m.get("bias")) for m in modules)
    spec = None
    linears = [_packed_linear(m) for m in (qkv, out, up, down)]
    norms_ok = all("weight" in n and "bias" in n for n in (norm1, norm2))
    if norms_ok and all(e is not None and e[1] is not None for e in linears):
        (qw, qb, *_), (ow, ob, *_), (uw, ub, *_), (dw, db, *_) = linears
        n1, n2 = _norm_params(norm1), _norm_params(norm2)
        spec = (int(heads), float(scale), qw, qb, ow, ob, *n1, float(norm1.eps),
                uw, ub, dw, db, *n2, float(norm2.eps))
    # A plain attribute: see _packed_linear.
    object.__setattr__(block, "_mlx_embed_post_ln", (modules, sources, spec))
    return spec


_scratch_local = threading.local()


def _scratch(n: int) -> np.ndarray:
    """This thread's reusable float32 buffer of at least ``n`` floats (a
    fresh large allocation per call would page-fault it in every time)."""
    buf = getattr(_scratch_local, "buf", None)
    if buf is None or buf.size < n:
        buf = _scratch_local.buf = np.empty(max(n, 1 << 16), dtype=np.float32)
    return buf[:n]


def gelu_tanh(x: mx.array) -> mx.array:
    return nn.gelu_approx(x)


def softmax(x: mx.array) -> mx.array:
    """Softmax over the last axis."""
    if current().path != "exact" and x.dtype == mx.float32:
        return _softmax_compiled(x)
    return mx.softmax(x, axis=-1, precise=True)


def add_layer_norm(
    x: mx.array, residual: mx.array, norm: nn.LayerNorm, *, overwrite_input: bool = False
) -> mx.array:
    """``norm(x + residual)``. With ``overwrite_input`` (x is a temporary)
    the native path fuses the add into the norm and writes into x's buffer."""
    ctx = current()
    if (
        ctx.path == "native"
        and overwrite_input
        and x.shape == residual.shape
        and "weight" in norm
        and "bias" in norm
    ):
        buf = _native_buffer(x)
        if buf is not None:
            inputs = [_readonly_buffer(residual), *_norm_params(norm)]
            with _graph_lock_released():
                _native.add_layer_norm_(buf, *inputs, norm.eps, ctx.kernel_threads)
            return x
    return norm(x + residual)


def _norm_params(norm: nn.LayerNorm) -> tuple:
    """The norm's weight and bias as NumPy views, made once per weight array
    (a forward pass reads them twelve times)."""
    cached = norm.__dict__.get("_mlx_embed_params")
    if cached is None or cached[0] is not norm.weight or cached[1] is not norm.bias:
        cached = (norm.weight, norm.bias, _readonly_buffer(norm.weight), _readonly_buffer(norm.bias))
        # A plain attribute: see _packed_linear.
        object.__setattr__(norm, "_mlx_embed_params", cached)
    return cached[2], cached[3]


def bucket_length(n: int) -> int:
    """``n`` rounded up to 16 or to one of 4 steps per octave above it
    (20, 24, 28, 32, 40, 48, ...): at most 25% padding, ~4 lengths per
    doubling of the longest text."""
    if n <= 16:
        return 16
    step = 1 << ((n - 1).bit_length() - 3)
    return -(-n // step) * step


class PackedRows:
    """A padded pass's real tokens as rows of their own. A pass of mixed
    lengths is padded to its longest text, so 64 random texts of ~64 tokens
    carry ~4x their real tokens (docs/benchmarks.md, fifth lease), and every
    projection, norm and activation of a layer computes the padding too.
    Packed, they run on the real tokens alone, and only attention, which
    needs each text's tokens side by side, goes back to the padded layout
    for its one call (``unpack``, then ``pack``).

    ``pack`` takes [B, L, C] to [rows, C], the real tokens in row-major
    order; the row count is rounded up (``bucket_length``) so that a GPU sees
    few distinct shapes, the extra rows repeating the first token.
    ``unpack`` takes [rows, C] back to [B, L, C]; a padding slot gets the
    first token's row, whose values attention masks as a key and the engine
    drops as an output, as it does the padding's own."""

    def __init__(self, mask: np.ndarray):
        self.shape = mask.shape
        slots = np.flatnonzero(mask.reshape(-1)).astype(np.int32)
        self.real = len(slots)
        self.rows = bucket_length(self.real)
        gather = np.zeros(self.rows, dtype=np.int32)
        gather[: self.real] = slots
        scatter = np.zeros(mask.size, dtype=np.int32)
        scatter[slots] = np.arange(self.real, dtype=np.int32)
        self._gather, self._scatter = mx.array(gather), mx.array(scatter)

    def pack(self, x: mx.array) -> mx.array:
        B, L = self.shape
        return mx.take(x.reshape(B * L, x.shape[-1]), self._gather, axis=0)

    def unpack(self, x: mx.array) -> mx.array:
        B, L = self.shape
        return mx.take(x, self._scatter, axis=0).reshape(B, L, x.shape[-1])


def run_layers(layers, x: mx.array, mask: "KeyMask", *args) -> mx.array:
    """``x = layer(x, mask, *args)`` through ``layers``, on the pass's real
    tokens packed into rows where the context packs rows (``PackedRows``);
    the result [B, L, D] as the padded path's. A layer then gets x as
    [rows, D]: its attention takes its projection to the padded layout with
    ``padded`` and back with ``like``."""
    rows = mask.packed_rows()
    if rows is not None:
        x = rows.pack(x)
    for layer in layers:
        x = layer(x, mask, *args)
    return x if rows is None else rows.unpack(x)


def padded(t: mx.array, mask: "KeyMask") -> mx.array:
    """A layer's [rows, C] (packed rows) as [B, L, C]; [B, L, C] as it is."""
    return mask.packed_rows().unpack(t) if t.ndim == 2 else t


def like(out: mx.array, x: mx.array, mask: "KeyMask") -> mx.array:
    """Attention's [B, L, C] in the layout of the layer's input ``x``."""
    return mask.packed_rows().pack(out) if x.ndim == 2 else out


_feed_forward_rows = threading.local()


def packed_feed_forwards(mask: "KeyMask") -> ContextManager[Optional["PackedRows"]]:
    """Inside, on this thread, a feed-forward class patched by
    ``packs_feed_forward`` runs on the pass's real tokens alone where the
    context packs rows (``KeyMask.packed_rows``). For decoders whose layer
    loop is mlx-lm's: the feed-forward, most of a block's matmul work, drops
    the padding, while attention, norms and residuals keep mlx-lm's padded
    layout (a padding slot then holds the pass's first token's values, which
    a causal or key mask never lets a real token see)."""
    return _on_this_thread(_feed_forward_rows, "rows", _PassRows(mask.packed_rows(), mask))


class _PassRows:
    """What ``packed_feed_forwards`` makes known on its thread: the packed
    rows (or None) and the pass's keys, which a decoder's causal attention
    (mlx-lm's, told only "causal") needs to attend per text."""

    def __init__(self, rows: Optional["PackedRows"], keys: "KeyMask"):
        self.rows, self.keys = rows, keys


def _pass_keys() -> Optional["KeyMask"]:
    state = getattr(_feed_forward_rows, "rows", None)
    return None if state is None else state.keys


def packs_feed_forward(cls: type) -> type:
    """Patch a feed-forward module class (mlx-lm's ``MLP``, ours) so that
    inside ``packed_feed_forwards`` it runs on packed rows: [B, L, D] in and
    out, the real tokens alone in between. Outside, its own call, unchanged
    (another mlx-lm user in the process, a KV cache)."""
    if cls.__dict__.get("_mlx_embed_packs", False):
        return cls
    call = cls.__call__

    def packed_call(self, x):
        state = getattr(_feed_forward_rows, "rows", None)
        rows = None if state is None else state.rows
        if rows is None or x.ndim != 3:
            return call(self, x)
        return rows.unpack(call(self, rows.pack(x)))

    cls.__call__ = packed_call
    cls._mlx_embed_packs = True
    return cls


class EvaluationPoints:
    """Where a pass is evaluated in pieces, and how far ahead of the device
    the host may queue them: a bound on device memory for MLX's CUDA backend
    with CUDA graphs off.

    MLX (0.32) keeps every buffer an evaluation's kernels read until its
    work is committed and has run. With graphs on it commits every 20
    kernels and stops queueing when 10 commits are outstanding, which bounds
    memory by itself. With graphs off (``MLX_USE_CUDA_GRAPHS=0``) it commits
    once per evaluation and never stops the host: a pass's every temporary
    lives until the pass has run, and the host queues pass after pass
    meanwhile (on an H200, peak memory 64 GB against 17.9 with graphs on,
    docs/benchmarks.md, fifth lease).

    So inside ``bounded_evaluation(points)`` a layer class patched by
    ``layer_boundary`` evaluates its output (``mx.async_eval``, which
    commits) once the layers built since the last point have output
    ``chunk_bytes``, and the host waits for the oldest point while more than
    ``depth`` are queued. The scheduler marks each pass's output too
    (``mark``), so the bound holds across the passes of a call (the server's
    model thread has at most two calls queued: it submits call k+1, then
    collects call k). A 64-text MiniLM pass outputs less than a chunk in all
    its layers and gets no point of its own beyond the pass; a 64-text
    Qwen3-0.6B pass of long texts gets points inside."""

    def __init__(self, chunk_bytes: int, depth: int = 2):
        self.chunk_bytes = int(chunk_bytes)
        self.depth = int(depth)
        self.points = 0
        self._built = 0
        self._queued: list[mx.array] = []

    def after_layer(self, out) -> None:
        if not isinstance(out, mx.array):
            return
        self._built += out.nbytes
        if self._built >= self.chunk_bytes:
            # An evaluation point lets go of the graph lock, as every other does.
            with _graph_lock_released():
                mx.async_eval(out)
            self.mark(out)

    def mark(self, out: mx.array) -> None:
        """``out`` is queued on the device (async_eval'd): count it as a
        point, and wait while more than ``depth`` are outstanding."""
        self._built = 0
        self.points += 1
        self._queued.append(out)
        while len(self._queued) > self.depth:
            oldest = self._queued.pop(0)
            with _graph_lock_released():
                mx.eval(oldest)

    def settled(self) -> None:
        """Everything queued has run (the caller evaluated the pass): start
        the next pass with nothing counted or held."""
        self._built = 0
        self._queued.clear()


_evaluation = threading.local()


def bounded_evaluation(points: Optional[EvaluationPoints]) -> ContextManager[Optional[EvaluationPoints]]:
    """Make ``points`` active on this thread for the passes built inside
    (None: no points, the pass evaluates whole)."""
    return _on_this_thread(_evaluation, "points", points)


def layer_boundary(cls: type) -> type:
    """Patch a transformer layer class (ours, mlx-lm's decoder blocks) so
    that inside ``bounded_evaluation`` a pass may be evaluated after it
    (``EvaluationPoints``). Outside, its own call, unchanged."""
    if cls.__dict__.get("_mlx_embed_boundary", False):
        return cls
    call = cls.__call__

    def call_then_mark(self, *args, **kwargs):
        out = call(self, *args, **kwargs)
        points = getattr(_evaluation, "points", None)
        if points is not None:
            points.after_layer(out)
        return out

    cls.__call__ = call_then_mark
    cls._mlx_embed_boundary = True
    cls._mlx_embed_layer_call = call
    return cls


class KeyMask:
    """Which keys of a padded batch are real tokens, in the two forms the
    softmax paths take: per-sequence lengths (native kernel) or an additive
    [B, 1, 1, L] mask (MLX). Each is built on first use, once per forward.
    Padding must be at the end of each row (as the engine pads)."""

    def __init__(self, attention_mask: mx.array, dtype: mx.Dtype):
        self._mask = attention_mask
        self.dtype = dtype
        self._lengths: Optional[list[int]] = None
        self._additive: Optional[mx.array] = None
        self._packed: Optional[PackedRows] = None
        self._packing_decided = False

    @classmethod
    def of_length(cls, n: int, dtype: mx.Dtype) -> "KeyMask":
        """One text of ``n`` tokens, all real."""
        return cls(mx.array(np.ones((1, n), dtype=np.int32)), dtype)

    def packed_rows(self) -> Optional[PackedRows]:
        """The pass's real tokens as rows (``PackedRows``) where the active
        context packs rows and packing drops at least a quarter of the rows a
        layer computes; None otherwise. Decided once per forward, from the
        mask on the host."""
        if not self._packing_decided:
            self._packing_decided = True
            if current().packed_rows and self._mask.shape[0] > 1:
                with _graph_lock_released():
                    mask = np.array(self._mask, copy=False)
                if 4 * bucket_length(int(mask.sum())) <= 3 * mask.size:
                    self._packed = PackedRows(mask)
        return self._packed

    @property
    def length(self) -> int:
        """Keys per row, padding included."""
        return self._mask.shape[1]

    @property
    def lengths(self) -> list[int]:
        if self._lengths is None:
            # On the host: the engine's mask is an array made from NumPy,
            # already there, while an MLX sum would cost an evaluation (a
            # hand-off to the stream's thread) per forward pass.
            with _graph_lock_released():
                mask = np.array(self._mask, copy=False)
            self._lengths = mask.astype(np.int64).sum(axis=1).tolist()
        return self._lengths

    @property
    def masked_value(self) -> float:
        """What an additive mask adds for a hidden key: large negative rather
        than -inf so an all-padding row could never make NaNs; exp() of it
        underflows to exactly 0 (-3e4 fits half precision)."""
        return -1e9 if self.dtype == mx.float32 else -3e4

    @property
    def additive(self) -> mx.array:
        if self._additive is None:
            keep = self._mask[:, None, None, :].astype(mx.bool_)
            self._additive = mx.where(keep, 0.0, self.masked_value).astype(self.dtype)
        return self._additive


def attention_probs(q: mx.array, k: mx.array, mask: KeyMask, scale: float) -> mx.array:
    """softmax(scale * q @ k^T) over keys, padding keys weighted 0; q and k
    are [B, H, L, head_dim]."""
    ctx = current()
    if ctx.path == "native":
        scores = q @ k.swapaxes(-1, -2)
        buf = _native_buffer(scores)
        if buf is not None:
            lengths = mask.lengths
            with _graph_lock_released():
                _native.masked_softmax_(buf, lengths, scale, ctx.kernel_threads)
            return scores
        return softmax(scores * scale + mask.additive)
    return softmax((q * scale) @ k.swapaxes(-1, -2) + mask.additive)


# Attention scores larger than this are computed a block of query rows at a
# time. One 8192-token input to a 12-head model would otherwise hold several
# [heads, 8192, 8192] float32 matrices (3.2 GB each) at once.
SCORES_BLOCK_BYTES = 128 << 20


def query_blocks(q: mx.array, keys: int) -> list[tuple[int, int]]:
    """[start, end) query-row blocks of ``q`` [B, H, L, head_dim] whose
    scores against ``keys`` keys stay within SCORES_BLOCK_BYTES; one block
    (all rows) for the inputs embedding servers mostly see."""
    B, H, L, _ = q.shape
    rows = max(1, SCORES_BLOCK_BYTES // (B * H * keys * q.dtype.size))
    if rows >= L:
        return [(0, L)]
    return [(i, min(i + rows, L)) for i in range(0, L, rows)]


def per_text(q: mx.array, k: mx.array, v: mx.array, lengths: list[int], run, tail=None) -> mx.array:
    """Self-attention of a padded batch one text at a time, each on its real
    tokens alone: ``run(q, k, v, b, n)`` for text ``b``'s first ``n``
    positions ([1, H, n, head_dim] each), the outputs padded back to the
    batch's length (padding rows 0) and stacked. An encoder's attention with
    a position bias the streaming kernel does not compute (T5's, MPNet's
    buckets) goes so on the native path (the others, and the decoders', run
    in :func:`decoder_attention`'s kernel), so that a text's bits do not
    follow its batch: every matmul and
    softmax of a text then has the shapes the text alone gives it, where a
    padded batch's would change the scores' row length and OpenBLAS's choice
    of kernel (docs/architecture.md, "Same bits"). Measured on the
    Qwen3-0.6B and ModernBERT-base shapes: no slower than the padded batch
    (docs/benchmarks.md, "Batch-invariant CPU passes").

    ``tail(q, k, v, b, n)``: the rows after a text's real tokens, against
    its real keys, where a caller reads them (an encoder's: a ColBERT
    query's expansion tokens are outputs its keys leave out); else 0."""
    B, L = q.shape[0], q.shape[2]
    outs = []
    for b, n in enumerate(lengths):
        n = max(1, min(int(n), L))
        qb, kb, vb = (mx.contiguous(t[b : b + 1, :, :n]) for t in (q, k, v))
        out = run(qb, kb, vb, b, n)
        if n < L and tail is not None:
            out = mx.concatenate([out, tail(mx.contiguous(q[b : b + 1, :, n:]), kb, vb, b, n)], axis=2)
        elif n < L:
            out = mx.pad(out, [(0, 0), (0, 0), (0, L - n), (0, 0)])
        outs.append(out)
    return outs[0] if B == 1 else mx.concatenate(outs, axis=0)


def _text_rows(term: mx.array, b: int, n: int) -> mx.array:
    """Text ``b``'s share of an additive attention term [B or 1, H or 1,
    rows, L]: its real keys."""
    i = b if term.shape[0] > 1 else 0
    return term[i : i + 1, :, :, :n]


def attends_per_text(q: mx.array) -> bool:
    """Whether attention runs per text (in :func:`decoder_attention`'s
    kernel, or an encoder's with T5's or MPNet's bias by ``per_text``): in
    the engine's passes on the native path, in float32."""
    return _native_pass() and q.dtype == mx.float32


def blocked_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    *,
    mask: Optional[KeyMask] = None,
    additive: Optional[Callable[[int, int], mx.array]] = None,
    alibi: Optional[list[float]] = None,
    window: Optional[int] = None,
    fused: bool = False,
    one_text: bool = False,
) -> mx.array:
    """``softmax(scale * q @ k^T + A) @ v`` for [B, H, L, head_dim] q, k, v,
    where A is the padding ``mask`` or ``additive(start, end)``: the whole
    additive term (padding included) for query rows [start, end), e.g. a
    position bias. ``fused``: through ``mx.fast.scaled_dot_product_attention``.
    ``alibi``: the [H] slopes when ``additive`` is ALiBi's ``-slope_h * |i -
    j|`` plus ``mask``; ``window``: likewise when ``additive`` is a local band
    (keys at most ``window`` positions from the query) plus ``mask``.

    In the engine's passes on the CPU's native path in float32, ``mask``
    alone, ``alibi`` or
    ``window`` run whole in :func:`decoder_attention`'s kernel (bidirectional,
    each text over its own keys, every row including a ColBERT query's past
    its keys; the bias or band computed inside its key tiles): no score
    matrix at any length, and a text's bits its own (docs/benchmarks.md,
    "An encoder's attention in the streaming kernel").

    When the scores would pass SCORES_BLOCK_BYTES the query rows go in
    blocks, each evaluated before the next is built: left lazy, MLX runs
    every block's matmul first and holds all their scores at once (measured
    on one 4096-token, 12-head layer: 1.7 GB at once, 0.22 GB in blocks of
    512 rows).

    Otherwise on the native path (another ``additive``: T5's and MPNet's
    relative position bias) each text attends on its own (``per_text``;
    ``one_text``: ``q`` is one text's, its keys all real)."""
    streams = additive is None or alibi is not None or window is not None
    if mask is not None and not fused and streams and attends_per_text(q):
        return decoder_attention(q, k, v, scale, mask, causal=False, window=window, slopes=alibi, all_rows=True)
    if mask is not None and not one_text and attends_per_text(q):

        def text(qb, kb, vb, b, n, first=0):
            bias = None
            if additive is not None:
                bias = lambda start, end: _text_rows(additive(first + start, first + end), b, n)  # noqa: E731
            return blocked_attention(
                qb, kb, vb, scale, mask=KeyMask.of_length(n, mask.dtype), additive=bias,
                fused=fused, one_text=True,
            )

        return per_text(q, k, v, mask.lengths, text, tail=lambda qb, kb, vb, b, n: text(qb, kb, vb, b, n, n))
    blocks = query_blocks(q, k.shape[2])
    outs = []
    for start, end in blocks:
        qb = q if len(blocks) == 1 else q[:, :, start:end]
        if additive is None:
            if fused:
                out = mx.fast.scaled_dot_product_attention(qb, k, v, scale=scale, mask=mask.additive)
            else:
                out = attention_probs(qb, k, mask, scale) @ v
        elif fused:
            out = mx.fast.scaled_dot_product_attention(qb, k, v, scale=scale, mask=additive(start, end))
        else:
            out = softmax((qb * scale) @ k.swapaxes(-1, -2) + additive(start, end)) @ v
        if len(blocks) > 1:
            with _graph_lock_released():
                mx.eval(out)
        outs.append(out)
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)


def capped_causal_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    *,
    softcap: Optional[float] = None,
    window: Optional[int] = None,
) -> mx.array:
    """Causal ``softmax(cap(scale * q @ k^T) + mask) @ v`` with Gemma 2's
    attention logit soft-capping, ``cap(s) = tanh(s / softcap) * softcap``
    before the mask (transformers' order), and an optional sliding ``window``:
    query i sees keys j with ``i - window < j <= i`` (transformers' rule; a
    window as long as the input is plain causal attention). ``q`` is [B, H, L,
    head_dim], ``k`` and ``v`` [B, Hkv, L, head_dim] with H a multiple of Hkv
    (query head h reads kv head ``h // (H / Hkv)``). Right padding needs no
    mask: a real token never sees the padding after it.

    On the CPU's native path the native kernel (:func:`decoder_attention`).
    Elsewhere MLX's matmuls, tanh and softmax in float32 (transformers upcasts
    the softmax; the cap bounds the scores, so -1e9 masks in any dtype):
    MLX's fused attention takes no soft-cap. Past SCORES_BLOCK_BYTES the
    query rows go in blocks, each against only the keys it can see (up to
    its last row, from its first row's window), evaluated before the next: a
    4,096-token input to 16 heads would otherwise hold 1 GB of scores per
    temporary."""
    if attends_per_text(q):
        return decoder_attention(
            q, k, v, scale, _pass_keys(), causal=True,
            window=None if window is None else max(0, window - 1), softcap=softcap,
        )
    B, H, L, hd = q.shape
    kv_heads = k.shape[1]
    rep = H // kv_heads
    if window is not None and window >= L:
        window = None
    # A kv head's query heads side by side: one matmul per kv head, no
    # repeated keys (mlx-lm's Gemma 2 attention does the same).
    q = (q * mx.array(scale, dtype=q.dtype)).reshape(B, kv_heads, rep, L, hd)
    k, v = mx.expand_dims(k, 2), mx.expand_dims(v, 2)
    blocks = query_blocks(q.reshape(B, H, L, hd), L)
    outs = []
    for start, end in blocks:
        first = 0 if window is None else max(0, start - window + 1)
        scores = (q[:, :, :, start:end] @ k[:, :, :, first:end].swapaxes(-1, -2)).astype(mx.float32)
        if softcap is not None:
            scores = mx.tanh(scores / softcap) * softcap
        rows = mx.arange(start, end)[:, None]
        cols = mx.arange(first, end)[None, :]
        seen = cols <= rows
        if window is not None:
            seen = seen & (cols > rows - window)
        scores = scores + mx.where(seen, 0.0, -1e9).astype(mx.float32)
        out = (softmax(scores).astype(v.dtype) @ v[:, :, :, first:end]).reshape(B, H, end - start, hd)
        if len(blocks) > 1:
            with _graph_lock_released():
                mx.eval(out)
        outs.append(out)
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)


class BandMask:
    """What a bidirectional decoder layer (EmbeddingGemma) lets a query see:
    the batch's real keys, and with ``half`` only those at most ``half``
    positions from the query (a sliding layer). Passed as ``mask`` to an
    mlx-lm attention whose module :func:`engine_attention` wraps: the native
    softmax takes it as key lengths and a window, MLX as ``additive``."""

    def __init__(self, keys: KeyMask, half: Optional[int] = None):
        self.keys = keys
        self.half = half
        self._additive: Optional[mx.array] = None

    @property
    def additive(self) -> mx.array:
        """[B, 1, 1, L] (padding only) or [B, 1, L, L] (with the window)."""
        if self._additive is None:
            if self.half is None:
                self._additive = self.keys.additive
            else:
                L = self.keys.length
                pos = mx.arange(L)
                near = mx.abs(pos[:, None] - pos[None, :]) <= self.half
                hidden = mx.array(self.keys.masked_value, dtype=self.keys.dtype)
                self._additive = mx.where(near, self.keys.additive, hidden)
        return self._additive

    def rows(self, start: int, end: int) -> mx.array:
        """``additive`` for query rows [start, end) (a block of them)."""
        additive = self.additive
        if additive.shape[2] == 1 or (start, end) == (0, additive.shape[2]):
            return additive
        return additive[:, :, start:end]


def engine_attention(module) -> None:
    """Make an mlx-lm model module's attention (its module-level
    ``scaled_dot_product_attention``) run this engine's inside the engine's
    forward passes, and mlx-lm's own everywhere else (a KV cache, attention
    sinks, another mlx-lm user in the process), for a "causal" mask (Qwen3,
    Qwen2, Mistral, Llama, Gemma) and a :class:`BandMask` (EmbeddingGemma,
    EuroBERT: the real keys, and a sliding layer's window):

    - on the CPU's native path, the native kernel (:func:`decoder_attention`):
      each text over its own tokens, keys in tiles, never a score matrix;
    - elsewhere MLX's attention (the mask's additive form where it is a
      ``BandMask``), query rows in blocks for long inputs: MLX's
      ``mx.fast.scaled_dot_product_attention`` falls back (the CPU; float32
      on CUDA) to holding a layer's whole [B, H, L, L] scores, 4.2 GB for
      one 8,192-token input to a 16-head model, measured. Past
      ``SCORES_BLOCK_BYTES`` the query rows go in blocks, each evaluated
      before the next: causal ones against only the keys up to their last
      row, a ``BandMask``'s against every key (one 8,192-token input to a
      12-head EuroBERT would otherwise hold 3.2 GB of scores per layer).
      In half precision on a GPU MLX's fused kernel, which never holds the
      scores, runs whole."""
    original = module.scaled_dot_product_attention
    if getattr(original, "_mlx_embed_attention", False):
        return

    def attention(queries, keys, values, cache=None, scale=1.0, mask=None, **kwargs):
        band = isinstance(mask, BandMask)
        causal = isinstance(mask, str) and mask == "causal"
        in_pass = (
            cache is None
            and not kwargs.get("sinks")
            and getattr(_active, "ctx", None) is not None
            and queries.shape[2] == keys.shape[2]
        )
        if not (in_pass and (band or causal)):
            return original(
                queries, keys, values, cache=cache, scale=scale, mask=mask.additive if band else mask, **kwargs
            )
        if attends_per_text(queries):
            return decoder_attention(
                queries, keys, values, scale, mask.keys if band else _pass_keys(),
                causal=causal, window=mask.half if band else None,
            )
        whole = mx.default_device() != mx.cpu and queries.dtype in (mx.float16, mx.bfloat16)
        blocks = [(0, queries.shape[2])] if whole else query_blocks(queries, keys.shape[2])
        outs = []
        for start, end in blocks:
            one = len(blocks) == 1
            if band:
                qb = queries if one else queries[:, :, start:end]
                out = original(qb, keys, values, cache=cache, scale=scale, mask=mask.rows(start, end), **kwargs)
            else:
                # "causal" aligns the last query with the last key: rows
                # [start, end) against keys [0, end) is the causal mask's band.
                qb, kb, vb = (
                    (queries, keys, values)
                    if one
                    else (queries[:, :, start:end], keys[:, :, :end], values[:, :, :end])
                )
                out = original(qb, kb, vb, cache=cache, scale=scale, mask="causal", **kwargs)
            if len(blocks) > 1:
                with _graph_lock_released():
                    mx.eval(out)
            outs.append(out)
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)

    attention._mlx_embed_attention = True
    attention.__wrapped_original__ = original
    module.scaled_dot_product_attention = attention


def _heads_view(x: mx.array) -> np.ndarray:
    """An evaluated [B, H, L, head_dim] array as a NumPy view in its own
    layout (a transpose's or a broadcast's strides; no copy), or a copy where
    the kernel could not read it: a head's features not side by side, or a
    negative stride (a reversed slice)."""
    view = host_view(x)
    readable = all(s >= 0 or n == 1 for s, n in zip(view.strides, view.shape))
    if readable and (view.strides[-1] == view.itemsize or view.shape[-1] == 1):
        return view
    return np.ascontiguousarray(view)


def decoder_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    keys: Optional[KeyMask],
    *,
    causal: bool,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    slopes: Optional[list[float]] = None,
    all_rows: bool = False,
) -> mx.array:
    """A decoder's or an encoder's self-attention on the CPU's native path by
    the native kernel (``_native.decoder_attention_``): ``q`` [B, H, L, head_dim], ``k``
    and ``v`` [B, Hkv, L, head_dim] read as they lie after RoPE (the
    transposes' strides, no copies), H a multiple of Hkv; each text over its
    first ``keys.lengths[b]`` positions (None: all L, which a causal mask
    makes exact for right padding), causal or not, keys at most ``window``
    positions from the query, scores soft-capped by ``softcap`` or less ALiBi's
    ``slopes[h] * |i - j|``. Returns [B, H, L, head_dim] (a transpose of the
    kernel's [B, L, H * head_dim], which the caller's merge of the heads
    undoes for free); padding rows 0, or with ``all_rows`` attending to the
    text's keys too (an encoder's: a ColBERT query's expansion rows), a row
    that sees none of them (past a window) 0.

    Keys go in fixed tiles of positions with a streaming softmax, so a text's
    bits follow its own tokens alone (not the batch, its padding or the
    threads) and no [queries, keys] score matrix is held at any length
    (docs/benchmarks.md, "A decoder's attention in one native kernel")."""
    B, H, L, hd = q.shape
    lengths = [L] * B if keys is None else keys.lengths
    # The kernel reads float32 (the native path's passes run in it).
    q, k, v = (t if t.dtype == mx.float32 else t.astype(mx.float32) for t in (q, k, v))
    with _graph_lock_released():
        mx.eval(q, k, v)
    qs, ks, vs = (_heads_view(t) for t in (q, k, v))
    dst = _scratch(B * L * H * hd).reshape(B, L, H * hd)
    with _graph_lock_released():
        _native.decoder_attention_(
            qs, ks, vs, lengths, float(scale), dst, causal=causal, window=window, softcap=softcap,
            slopes=slopes, all_rows=all_rows,
            threads=current().kernel_threads,
        )
    # A new array from the host buffer (see _run_packed): the scratch is free again at once.
    return mx.array(dst).reshape(B, L, H, hd).transpose(0, 2, 1, 3)


def _native_gated(gate: mx.array, up: mx.array, activation: str) -> Optional[mx.array]:
    """``act(gate) * up`` by the native kernel inside the engine's passes on
    the native path, written into ``gate``'s buffer: callers pass their gate
    projection's fresh output, which nothing else reads (a joined projection's
    one-row slice is its own half of the product). None where it does not
    apply (other paths, outside a pass, a gate that is not one contiguous
    float32 block such as a joined projection's slice of several rows, a gate
    sharing memory with ``up``): callers take MLX's."""
    ctx = getattr(_active, "ctx", None)
    if ctx is None or ctx.path != "native" or not gate.dtype == up.dtype == mx.float32 or gate.shape != up.shape:
        return None
    # Each evaluates its own array (gate first: the rest of the layer so
    # far); a gate the kernel cannot take leaves up to MLX's graph.
    buf = _native_buffer(gate)
    if buf is None:
        return None
    up_buf = _readonly_buffer(up)
    if np.may_share_memory(buf, up_buf):
        return None
    with _graph_lock_released():
        _native.gated_linear_unit_(buf, up_buf, activation, ctx.kernel_threads)
    return gate


def gelu_tanh_gated(gate: mx.array, up: mx.array) -> mx.array:
    """GeGLU, ``gelu_approx(gate) * up`` (Gemma 3's feed-forward): the native
    kernel where ``_native_gated`` applies, MLX's ops elsewhere."""
    out = _native_gated(gate, up, "gelu_tanh")
    return out if out is not None else nn.gelu_approx(gate) * up


def native_swiglu(module) -> None:
    """Make an mlx-lm model module's ``swiglu(gate, up)`` (the feed-forward
    activation of Qwen3, Qwen2, Llama/Mistral) run the native kernel where
    ``_native_gated`` applies, mlx-lm's own function elsewhere (another
    mlx-lm user in the process included). MLX's compiled SiLU runs one
    scalar exp at a time on the CPU (docs/benchmarks.md, "The decoders'
    gated feed-forward by a native kernel")."""
    original = module.swiglu
    if getattr(original, "_mlx_embed_native", False):
        return

    def swiglu(gate: mx.array, up: mx.array) -> mx.array:
        out = _native_gated(gate, up, "silu")
        return out if out is not None else original(gate, up)

    swiglu._mlx_embed_native = True
    swiglu.__wrapped_original__ = original
    module.swiglu = swiglu


def attention(qkv: mx.array, mask: KeyMask, n_heads: int, scale: float) -> mx.array:
    """Multi-head self-attention from the fused projection ``qkv`` [B, L,
    3 * D] (q, k, v of each position side by side, heads inside each) to
    merged heads [B, L, D], padding keys weighted 0.

    On the native path one kernel call reads the projection as it lies and
    writes the merged heads (no transpose copies, no evaluation point
    between the two matmuls and the softmax); elsewhere MLX's matmuls around
    :func:`attention_probs`."""
    B, L, three_d = qkv.shape
    D = three_d // 3
    ctx = current()
    if ctx.path == "native" and qkv.dtype == mx.float32:
        with _graph_lock_released():
            mx.eval(qkv)
        src = np.array(qkv, copy=False)
        if not src.flags.c_contiguous:
            src = np.ascontiguousarray(src)
        dst = _scratch(B * L * D).reshape(B, L, D)
        lengths = mask.lengths
        with _graph_lock_released():
            _native.attention_(src, lengths, n_heads, scale, dst, ctx.kernel_threads)
        return mx.array(dst)
    hd = D // n_heads
    if ctx.fused_attention:
        q, k, v = mx.split(qkv.reshape(B, L, 3 * n_heads, hd).transpose(0, 2, 1, 3), 3, axis=1)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask.additive)
        return out.transpose(0, 2, 1, 3).reshape(B, L, D)
    # One contiguous copy into [3, B, H, L, hd], then slices that are
    # contiguous views: MLX's matmul would otherwise copy each strided
    # q/k/v on its own, measured 2.5x slower on the CPU.
    parts = mx.contiguous(qkv.reshape(B, L, 3, n_heads, hd).transpose(2, 0, 3, 1, 4))
    q, k, v = parts[0], parts[1], parts[2]
    probs = attention_probs(q, k, mask, scale)
    return (probs @ v).transpose(0, 2, 1, 3).reshape(B, L, D)


def _fit_erf(deg_p: int = 5, deg_q: int = 5, zmax: float = 4.0, iters: int = 30):
    """Regenerate _ERF_P/_ERF_Q (needs numpy only). Linearized least squares
    on erf(z) Q(t) - z P(t) = 0 with Q(0) = 1, reweighted by 1/Q
    (Sanathanan-Koerner) and by the error (Lawson) towards minimax."""
    import math

    import numpy as np

    z = np.concatenate([np.linspace(0, zmax, 4000),
                        (np.cos(np.linspace(0, np.pi, 4000)) + 1) * zmax / 2])
    t, y = z * z, np.array([math.erf(v) for v in z])
    w, qprev, best = np.ones_like(z), np.ones_like(z), None
    for _ in range(iters):
        a = np.concatenate([z[:, None] * t[:, None] ** np.arange(deg_p + 1),
                            -y[:, None] * t[:, None] ** np.arange(1, deg_q + 1)], axis=1)
        wt = (w / qprev)[:, None]
        c, *_ = np.linalg.lstsq(a * wt, y * wt[:, 0], rcond=None)
        p, q = c[: deg_p + 1], np.concatenate([[1.0], c[deg_p + 1 :]])
        qv = np.polynomial.polynomial.polyval(t, q)
        err = z * np.polynomial.polynomial.polyval(t, p) / qv - y
        m = np.abs(err).max()
        if best is None or m < best[0]:
            best = (m, p.tolist(), q.tolist())
        qprev = np.abs(qv)
        w = w * (np.abs(err) / m + 1e-3) ** 0.5
        w /= w.max()
    return best


def _fit_erfc_scaled(deg: int = 10, c: float = 0.5, amax: float = 10.0, iters: int = 30):
    """Regenerate _ERFCX (needs numpy only): exp(a^2) erfc(a) ~= sum_k e_k u^(k+1),
    u = 1 / (1 + c a), by relative-error least squares reweighted towards minimax (Lawson)."""
    import math

    import numpy as np

    a = np.concatenate([np.linspace(0, amax, 6000), (np.cos(np.linspace(0, np.pi, 6000)) + 1) * amax / 2])
    y = np.array([math.erfc(v) * math.exp(v * v) for v in a])
    basis = (1 / (1 + c * a))[:, None] ** np.arange(1, deg + 1)
    w, best = 1 / y, None
    for _ in range(iters):
        coeffs, *_ = np.linalg.lstsq(basis * w[:, None], y * w, rcond=None)
        err = basis @ coeffs / y - 1
        m = np.abs(err).max()
        if best is None or m < best[0]:
            best = (m, coeffs.tolist())
        w = w * (np.abs(err) / m + 1e-3) ** 0.5
    return best


def _fit_pow2(deg: int = 5, iters: int = 40):
    """Regenerate _POW2: relative-error minimax-ish fit of 2^f on [0, 1]."""
    import numpy as np

    f = np.concatenate([np.linspace(0, 1, 5000), (np.cos(np.linspace(0, np.pi, 5000)) + 1) / 2])
    y = 2.0 ** f
    a = f[:, None] ** np.arange(deg + 1)
    w, best = np.ones_like(f), None
    for _ in range(iters):
        wt = (w / y)[:, None]
        c, *_ = np.linalg.lstsq(a * wt, y * wt[:, 0], rcond=None)
        err = (a @ c - y) / y
        m = np.abs(err).max()
        if best is None or m < best[0]:
            best = (m, c.tolist())
        w = w * (np.abs(err) / m + 1e-3) ** 0.5
        w /= w.max()
    return best
