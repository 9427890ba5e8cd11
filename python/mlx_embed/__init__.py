"""mlx-embed model engine: text embeddings with MLX.

Import order matters: ``_blas.setup()`` must run before anything imports
``mlx.core`` so that MLX's CPU matmuls bind to an optimized CBLAS (see
``_blas.py``). Everything that touches MLX is therefore imported lazily below.

Public API::

    model = mlx_embed.load(path=None, *, dtype="float32", quantize=None,
                           instruction=None, pooling=None, max_length=None,
                           batch_tokens=None, group_size=64, name=None)
    model.embed(texts, *, normalize=True, truncate=True, instruction=None)
        -> np.ndarray float32 [len(texts), model.dim]
    model.embed_with_counts(...) -> (array, tokens_per_text)
    model.embed_raw(inputs) -> (bytes, counts, counts_before_truncation, padded)
    model.info() -> dict
    mlx_embed.blas_info() -> dict

Test-only hook: if the environment variable ``MLX_EMBED_TEST_FAULT`` is set to
a marker string when a model is loaded, ``embed``/``embed_raw`` raise
``RuntimeError("injected test fault on input {i}")`` for any text containing
the marker. It exists for the server's error-path tests; never set it in
production.
"""

from . import _blas

_blas.setup()

__version__ = "0.1.0"
__all__ = ["load", "blas_info", "EmbeddingModel", "__version__"]


def blas_info() -> dict:
    """Which CBLAS MLX uses here and its measured fp32 matmul GFLOP/s
    (measured once, on first call)."""
    return _blas.info(measure=True)


def load(path=None, *, dtype="float32", quantize=None, instruction=None, **kwargs):
    """Load an embedding model from a local Hugging Face folder (or the bundled
    all-MiniLM-L6-v2 when ``path`` is None)."""
    from .engine import load as _load

    return _load(path, dtype=dtype, quantize=quantize, instruction=instruction, **kwargs)


def __getattr__(name):
    if name == "EmbeddingModel":
        from .engine import EmbeddingModel

        return EmbeddingModel
    raise AttributeError(f"module 'mlx_embed' has no attribute {name!r}")
