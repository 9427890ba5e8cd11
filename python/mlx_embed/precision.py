"""Float32 means float32: MLX's TF32 matmuls are turned off unless the user
asked for them.

MLX runs float32 matmuls (and on M5-class Metal, attention) with TF32 tensor
cores unless ``MLX_ENABLE_TF32=0``: 10 mantissa bits per product instead of
23. On an H200 (docs/benchmarks.md, fourth lease) that moved the float32
scores of the reranker and classifier fixtures by up to 2.1e-2 against the
CPU (5.6e-3 of 1 + the score), and float32 embeddings to a cosine of 0.9999961;
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
from typing import Optional

VARIABLE = "MLX_ENABLE_TF32"
# What the variable said when the package set it (MLX reads it once, at its
# first float32 matmul, which comes after that); None: never set up.
_at_import: Optional[str] = None


def keep_float32_exact() -> None:
    """Turn MLX's TF32 matmuls off for this process unless the environment
    already says what it wants."""
    global _at_import
    _at_import = os.environ.setdefault(VARIABLE, "0")


def mlx_switch_on(value: Optional[str]) -> bool:
    """Whether MLX reads an on/off variable that defaults to on
    (``MLX_ENABLE_TF32``, ``MLX_USE_CUDA_GRAPHS``) as on for this value: it
    reads it with C's ``atoi`` (glibc: ``(int) strtol``), so unset means on,
    ASCII whitespace, a sign and ASCII digits make the number, anything else
    reads 0, and the number is cut to a 32-bit int."""
    if value is None:
        return True
    match = re.match(r"[ \t\n\v\f\r]*([+-]?[0-9]+)", value)
    if not match:
        return False
    number = max(-(2**63), min(2**63 - 1, int(match.group(1))))
    return number & 0xFFFFFFFF != 0


def float32_matmul(on_cpu: bool) -> str:
    """``exact`` or ``tf32``: what float32 matmuls run as. ``tf32`` only off
    the CPU (CUDA; on Metal, M5-class chips only), as the variable read when
    the package was imported."""
    if on_cpu:
        return "exact"
    value = _at_import if _at_import is not None else os.environ.get(VARIABLE)
    return "tf32" if mlx_switch_on(value) else "exact"
