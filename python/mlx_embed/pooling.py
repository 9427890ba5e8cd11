"""Pooling the last hidden state into one vector per sequence, on the device.

The modes are sentence-transformers' (``Pooling(pooling_mode=...)``), with
the same arithmetic; several modes concatenate in the order given. The L2
normalization (:func:`unit_rows`) is the server's, on the host.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from . import ops

MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
# Other spellings of the same modes (this package's older API, configs).
ALIASES = {
    "last": "lasttoken", "last_token": "lasttoken", "last-token": "lasttoken",
    "mean_sqrt_len": "mean_sqrt_len_tokens", "mean-sqrt-len": "mean_sqrt_len_tokens",
}


def check_modes(mode) -> tuple[str, ...]:
    """A mode (str) or modes (list, concatenated) as canonical names;
    ValueError naming the supported ones otherwise."""
    modes = (mode,) if isinstance(mode, str) else tuple(mode)
    out = tuple(ALIASES.get(m, m) for m in modes)
    bad = [m for m in out if m not in MODES]
    if bad or not out:
        raise ValueError(f"unsupported pooling {mode!r}; supported: {', '.join(MODES)}")
    return out


def describe(modes: tuple[str, ...]) -> str:
    """Display name: ``mean``, ``cls``, ``last`` (last token), ``mean+max``..."""
    return "+".join("last" if m == "lasttoken" else m for m in modes)


def pool(h, mask, modes: tuple[str, ...], xp=mx):
    """``h`` [B, L, D], ``mask`` [B, L] (1 = a token to pool: the real
    tokens, padding at the end, less any prompt left out at the start);
    returns [B, D * len(modes)]. ``xp`` is the array library of ``h`` and
    ``mask``: ``mlx.core`` (on the device), or ``numpy`` for a host buffer
    (the same arithmetic; ``StPipeline.pool_on_host``)."""
    m = mask.astype(h.dtype)[..., None]
    out = []
    total = None
    for mode in modes:
        if mode == "cls":
            # The first position the mask keeps (0 but where a prompt is
            # left out), as sentence-transformers 6 reads it.
            first = xp.argmax(mask, axis=1).astype(xp.int32)
            out.append(xp.take_along_axis(h, first[:, None, None], axis=1)[:, 0])
        elif mode == "lasttoken":
            # The last position the mask keeps, not its count less one: a
            # pool mask may leave a prompt's leading positions out. A row
            # that keeps none pools zeros.
            positions = xp.arange(h.shape[1], dtype=xp.int32)[None, :]
            last = (mask.astype(xp.int32) * positions).max(axis=1)
            kept = xp.take_along_axis(m[..., 0], last[:, None], axis=1)
            out.append(xp.take_along_axis(h, last[:, None, None], axis=1)[:, 0] * kept)
        elif mode == "max":
            # A Python float is weakly typed in both libraries: h's dtype stays.
            out.append(xp.where(m > 0, h, -float("inf")).max(axis=1))
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            # Sums in float32, cast back, as sentence-transformers does: in
            # float16 a long input's sum overflows and its count rounds.
            if total is None:
                m32 = mask.astype(xp.float32)[..., None]
                total = (h * m32).sum(axis=1)
                count = xp.maximum(m32.sum(axis=1), 1e-9)
            out.append((total / (count if mode == "mean" else xp.sqrt(count))).astype(h.dtype))
        elif mode == "weightedmean":
            # Token i (counting from 1) weighs i; float32 weights, since their
            # sum L(L+1)/2 is past float16's range from L = 362.
            w = mask.astype(xp.float32)[..., None] * xp.arange(1, h.shape[1] + 1, dtype=xp.float32)[None, :, None]
            out.append(((h * w).sum(axis=1) / xp.maximum(w.sum(axis=1), 1e-9)).astype(h.dtype))
        else:
            raise ValueError(f"unsupported pooling {mode!r}; supported: {', '.join(MODES)}")
    return out[0] if len(out) == 1 else xp.concatenate(out, axis=-1)


def unit_rows(vec) -> np.ndarray:
    """Each row (last axis) of ``vec`` over its L2 norm, as
    sentence-transformers normalizes (eps 1e-12): a new float32 NumPy array.

    The server's normalization, ``mlx_embed_core::l2_normalize`` through the
    extension, so the library's vectors are the server's to the last bit (the
    server normalizes after its cache and ``dimensions``, which keep raw
    vectors, so it cannot take the engine's normalized ones). On the host:
    a call's vectors are there after its one sync anyway, and the pass is a
    few microseconds."""
    out = np.array(vec, dtype=np.float32, order="C")
    native = getattr(ops._native, "unit_rows_", None)
    if out.size == 0:
        return out
    if native is None:
        return _unit_rows_like_native(out)
    native(out)
    return out


# l2_normalize's partial sums (crates/mlx-embed-core, NORM_LANES).
_NORM_LANES = 8


def _unit_rows_like_native(x: np.ndarray) -> np.ndarray:
    """:func:`unit_rows` without the extension: l2_normalize's arithmetic in
    its order (float64 squares, exact; summed in lanes of components j, j + 8,
    ..., lane 0 first; each quotient rounded to float32 once), so a source
    checkout gives the same bits."""
    wide = x.astype(np.float64)
    squares = wide * wide
    dim = x.shape[-1]
    whole = dim - dim % _NORM_LANES
    lanes = np.zeros((*x.shape[:-1], _NORM_LANES))
    for start in range(0, whole, _NORM_LANES):
        lanes += squares[..., start : start + _NORM_LANES]
    lanes[..., : dim - whole] += squares[..., whole:]
    total = np.zeros(x.shape[:-1])
    for lane in range(_NORM_LANES):
        total += lanes[..., lane]
    return (wide / np.maximum(np.sqrt(total), 1e-12)[..., None]).astype(np.float32)


def span_means(rows: np.ndarray, spans) -> np.ndarray:
    """The mean of each ``(start, end)`` span of ``rows`` (float32 [tokens,
    width]): late chunking's chunk vectors. As the server's
    ``mlx_embed_core::span_means`` computes them, bit for bit: the rows of a
    span added one after another in float64 (a cumulative sum, which adds in
    row order, where ``sum`` may pair them up), divided and rounded to
    float32 once."""
    rows = np.asarray(rows, dtype=np.float32)
    out = np.empty((len(spans), rows.shape[1]), dtype=np.float32)
    for i, (start, end) in enumerate(spans):
        total = np.cumsum(rows[start:end], axis=0, dtype=np.float64)[-1]
        out[i] = total / (end - start)
    return out
