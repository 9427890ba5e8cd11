"""Pooling the last hidden state into one vector per sequence, on the device
(on the host where the forward pass ends there: the native CPU path)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from . import ops


def pool(
    h: mx.array, mask: mx.array, last: mx.array, kind: str, *, normalize: bool = False
) -> mx.array:
    """``h`` [B, L, D], ``mask`` [B, L] (1 = real token, padding at the end),
    ``last`` [B] the index of each row's last real token; returns float32
    [B, D], L2-normalized with ``normalize`` (eps 1e-12, as
    sentence-transformers)."""
    if ops.current().path == "native" and h.dtype == mx.float32:
        # The native kernels leave h as a host-made array: pooling it with
        # NumPy saves the call's last hand-off to MLX's stream thread.
        return mx.array(_pool_host(h, mask, last, kind, normalize))
    vec = _pool_mlx(h, mask, last, kind).astype(mx.float32)
    if normalize:
        norm = mx.sqrt((vec * vec).sum(axis=-1, keepdims=True))
        vec = vec / mx.maximum(norm, 1e-12)
    return vec


def _pool_host(h, mask, last, kind: str, normalize: bool) -> np.ndarray:
    hv = np.array(h, copy=False)
    if kind == "mean":
        m = np.array(mask, copy=False).astype(np.float32)
        # Sum over tokens in order, as MLX's reduction does.
        vec = np.einsum("bld,bl->bd", hv, m) / np.maximum(m.sum(axis=1), 1e-9)[:, None]
    elif kind == "cls":
        vec = hv[:, 0].copy()
    elif kind == "last":
        vec = hv[np.arange(hv.shape[0]), np.array(last, copy=False)].copy()
    else:
        raise ValueError(f"pooling must be mean, cls or last, got {kind!r}")
    vec = vec.astype(np.float32, copy=False)
    if normalize:
        vec = vec / np.maximum(np.sqrt((vec * vec).sum(axis=-1, keepdims=True)), 1e-12)
    return vec


def _pool_mlx(h: mx.array, mask: mx.array, last: mx.array, kind: str) -> mx.array:
    if kind == "mean":
        m = mask.astype(h.dtype)[..., None]
        s = (h * m).sum(axis=1)
        return s / mx.maximum(m.sum(axis=1), 1e-9)
    if kind == "cls":
        return h[:, 0]
    if kind == "last":
        return mx.take_along_axis(h, last[:, None, None], axis=1)[:, 0]
    raise ValueError(f"pooling must be mean, cls or last, got {kind!r}")
