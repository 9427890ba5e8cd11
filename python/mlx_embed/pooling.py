"""Pooling the last hidden state into one vector per sequence, on the device."""

from __future__ import annotations

import mlx.core as mx


def pool(h: mx.array, mask: mx.array, last: mx.array, kind: str) -> mx.array:
    """``h`` [B, L, D], ``mask`` [B, L] (1 = real token, padding at the end),
    ``last`` [B] the index of each row's last real token; returns [B, D]."""
    if kind == "mean":
        m = mask.astype(h.dtype)[..., None]
        s = (h * m).sum(axis=1)
        return s / mx.maximum(m.sum(axis=1), 1e-9)
    if kind == "cls":
        return h[:, 0]
    if kind == "last":
        return mx.take_along_axis(h, last[:, None, None], axis=1)[:, 0]
    if kind == "none":
        # Scoring heads (classifiers, rerankers) already give [B, labels].
        return h
    raise ValueError(f"pooling must be mean, cls or last, got {kind!r}")
