"""mlx-embed model engine: text embeddings with MLX.

Import order matters: ``_blas.setup()`` must run before anything imports
``mlx.core`` so that MLX's CPU matmuls bind to an optimized CBLAS (see
``_blas.py``). Everything that touches MLX is therefore imported lazily below.

Public API::

    model = mlx_embed.load(path=None, *, dtype="float32", quantize=None,
                           instruction=None, revision=None, cache_dir=None, pooling=None, max_length=None,
                           batch_tokens=None, workers=None, fast_ops=None,
                           cache_limit_mb=None, pipeline=None, streams=1,
                           fused_attention=None, shape_buckets=None,
                           joined_linears=False, packed_rows=False, eval_chunk_mb=None,
                           group_size=32,
                           name=None, kind=None)
                           # pooling="splade": a BertForMaskedLM / DistilBertForMaskedLM
                           # folder's SPLADE vectors (a SparseEncoder folder is SPLADE by itself)
    model.embed(texts, *, normalize=True, truncate=True,
                truncation_direction=None, prompt_name=None, prompt=None,
                instruction=None, truncate_to=None) -> np.ndarray float32 [len(texts), model.dim]
    model.embed_with_counts(...) -> (array, tokens_per_text)
    model.embed_sparse(texts, ...) -> [(indices int32, values float32) per text]   # SPLADE and BGE-M3 models
    model.encode(texts, ...) -> (ids, tokens_before_truncation)
    model.count_tokens(texts, ...) -> tokens_per_text
    model.spec() -> mlx_embed.spec.ModelSpec        # the Rust bridge's view
    model.embed_tokens(texts, ...) -> [np.ndarray float32 [tokens, hidden] per text]
    model.embed_ids(ids, type_ids=None, *, output="pooled"|"tokens") -> mlx_embed.spec.EmbedResult
    model.submit_ids(ids, type_ids=None, *, output=...).result()   # embed_ids in two steps
    # rerankers and classifiers:
    model.rerank(query, documents, *, top_n=None, raw_scores=False, truncate=True,
                 truncation_direction=None, instruction=None) -> [(index, score)] best first
    model.score(pairs, *, raw_scores=False, ...) -> np.ndarray float32 [len(pairs), labels]
                                                    # a reranker's: [len(pairs), 1]
    model.predict(texts_or_pairs, *, raw_scores=False, ...) -> np.ndarray [n, labels]
    model.memory() -> dict                          # MLX active/cache/peak bytes
    model.info() -> dict
    mlx_embed.blas_info() -> dict
    mlx_embed.errors.InvalidInput                   # bad input (a ValueError)
    mlx_embed.errors.InvalidOption                  # load(): a setting it refuses (a ValueError;
                                                    # InvalidOptionType, a TypeError too)
    mlx_embed.errors.InvalidModel                   # load(): the folder's files make no model (a ValueError;
                                                    # ModelFolderMissing, a FileNotFoundError too;
                                                    # MissingDependency, an ImportError too: a package
                                                    # this model needs, named)
    mlx_embed.workers.most_workers() -> (most, why) # the workers bound (the container's CPU quota counted)
"""

import time as _time

from . import startup as _startup

_t0 = _time.perf_counter()
_age = _startup.process_age()
if _age is not None:
    # Before any of our code: the binary (or python) and the interpreter's start.
    _startup.record("process_start", _age)

from . import _blas  # noqa: E402  (timed with the rest of the package import)
from . import precision as _precision  # noqa: E402

_blas.setup()
_precision.keep_float32_exact()
_startup.record("import_mlx_embed", _time.perf_counter() - _t0)

__version__ = "0.1.0"
__all__ = ["load", "blas_info", "EmbeddingModel", "InvalidInput", "__version__"]


def blas_info() -> dict:
    """Which CBLAS MLX uses here and its measured fp32 matmul GFLOP/s
    (measured once, on first call)."""
    return _blas.info(measure=True)


def load(path=None, *, dtype="float32", quantize=None, instruction=None, **kwargs):
    """Load an embedding model from a local Hugging Face folder, a Hugging Face
    repo id (``"BAAI/bge-small-en-v1.5"``: its snapshot in the local Hugging
    Face cache, downloaded there first, and a branch or tag brought up to
    the commit the Hub names, unless ``HF_HUB_OFFLINE`` is set; a local
    folder of that name wins; ``revision=`` a branch, tag or commit sha,
    ``cache_dir=`` another cache, see ``hub.py``), or the bundled
    all-MiniLM-L6-v2 when ``path`` is None.

    Engine settings, per model (environment variables are only fallbacks):
    ``fast_ops`` "native" | "mlx" | "exact" (CPU element-wise path),
    ``workers`` (MLX threads on the CPU; at most 4 per core and 256, ``MLX_EMBED_WORKERS`` too), ``batch_tokens`` (padded tokens per
    device pass), ``cache_limit_mb`` (MLX buffer cache; default 0 on the CPU,
    2048 on a GPU), ``pipeline`` (async sub-batch submission; default on a GPU),
    ``streams`` (device streams the passes of a call spread over; 1),
    ``fused_attention`` (BERT-style attention through
    ``mx.fast.scaled_dot_product_attention``; default on a GPU in fp16/bf16),
    ``shape_buckets`` (pad passes to a bounded set of shapes; default on a GPU),
    ``joined_linears`` (a decoder's q/k/v and gate/up projections as one
    matmul each; off, see ``sibling_linears.py``), ``packed_rows`` (an
    encoder's layers, a decoder's feed-forward, on a pass's real tokens
    alone; off until a GPU measures it, see ``ops.PackedRows``),
    ``eval_chunk_mb`` (with MLX's CUDA graphs off, a pass is evaluated every
    this many MB of layer outputs, at most two of a call's pieces queued ahead of the
    device, which bounds its memory; default 64 there, 0 (off) elsewhere, see
    ``ops.EvaluationPoints``).

    What the folder is: ``pooling`` overrides its pooling ("splade" makes a
    masked-LM checkpoint a SPLADE sparse model), ``kind`` forces "embedding",
    "classifier" or "reranker" (see ``heads.py``), ``truncation_side``
    ("right" or "left") the end a call that names no ``truncation_direction``
    cuts from (default: the folder's, as sentence-transformers cuts it:
    ``tokenizer_config.json``'s ``truncation_side``, else the direction of
    ``tokenizer.json``'s truncation, else right).
    """
    with _startup.timed("import_engine"):
        from .engine import load as _load

    return _load(path, dtype=dtype, quantize=quantize, instruction=instruction, **kwargs)


def __getattr__(name):
    if name == "EmbeddingModel":
        from .engine import EmbeddingModel

        return EmbeddingModel
    if name == "InvalidInput":
        from .errors import InvalidInput

        return InvalidInput
    raise AttributeError(f"module 'mlx_embed' has no attribute {name!r}")
