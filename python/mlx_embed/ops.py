"""Activation and normalization ops used by the model files.

Placeholder exact versions; fast CPU paths are selected in this module.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def gelu(x: mx.array) -> mx.array:
    return nn.gelu(x)


def gelu_tanh(x: mx.array) -> mx.array:
    return nn.gelu_approx(x)


def softmax(x: mx.array) -> mx.array:
    return mx.softmax(x, axis=-1, precise=True)
