"""Float32 means float32: MLX's TF32 matmuls are turned off unless the user
asked for them.

MLX runs float32 matmuls (and on M5-class Metal, attention) with TF32 tensor
cores unless ``MLX_ENABLE_TF32=0``: 10 mantissa bits per product instead of
23. On an H200 (docs/benchmarks.md, fourth lease) that moved the float32
scores of the reranker and classifier fixtures by up to 2.1e-2 against the
CPU (5.6e-3 of the score), and float32 embeddings to a cosine of 0.9999961;
with it off, 1.1e-5 and 0.9999999.
Someone who picks float32 on a GPU, where bfloat16 is the default, picks it
for exact results, so the engine keeps float32 exact; bfloat16 and float16
matmuls are unaffected. MLX reads the variable once per process, at its
first float32 matmul, so this runs at import, before any MLX work, and an
explicit ``MLX_ENABLE_TF32`` in the environment is left as it is.

No MLX import here: it runs before ``_blas.setup()`` has bound MLX's BLAS.
"""

from __future__ import annotations

import os
import re

VARIABLE = "MLX_ENABLE_TF32"


def keep_float32_exact() -> None:
    """Turn MLX's TF32 matmuls off for this process unless the environment
    already says what it wants."""
    os.environ.setdefault(VARIABLE, "0")


def float32_matmul() -> str:
    """``exact`` or ``tf32``: what float32 matmuls run as on a backend with
    TF32 (CUDA, M5-class Metal), read as MLX reads ``MLX_ENABLE_TF32``:
    C's ``atoi``, so unset means on, and anything that does not start with
    a nonzero integer (``0``, ``""``, ``no``) means off."""
    value = os.environ.get(VARIABLE)
    if value is None:
        return "tf32"
    match = re.match(r"\s*([+-]?\d+)", value)
    return "tf32" if match and int(match.group(1)) != 0 else "exact"
