"""The sentence-transformers pipeline a model folder describes.

``modules.json`` lists Transformer -> Pooling -> optional Dense layers ->
optional Normalize (or a StaticEmbedding, which pools itself, in place of
the first two); ``config_sentence_transformers.json`` carries the
prompts and the default prompt name; ``sentence_bert_config.json`` the
maximum sequence length. ``read_pipeline`` parses all of it once at load
(both the ``pooling_mode_*`` flags of sentence-transformers < 6 and the
``pooling_mode`` list of 6+), and ``pipeline(hidden, mask)`` runs it on MLX
arrays (pooling, then the Dense layers). A folder without ``modules.json``
gets the architecture's defaults. Normalization itself is not applied here: vectors
leave the engine unnormalized and the caller (server or library API)
normalizes.
"""

from __future__ import annotations

import logging
import os
import string
from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import device, ops, pooling, torch_weights
from .errors import InvalidModel, ModelFolderMissing
from .json_files import read_json

log = logging.getLogger("mlx_embed")

_LEGACY_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}

_ACTIVATIONS = {
    "Identity": lambda x: x,
    "Tanh": mx.tanh,
    "ReLU": nn.relu,
    "GELU": nn.gelu,
    "Sigmoid": mx.sigmoid,
    "SiLU": nn.silu,
    # With torch's defaults: sentence-transformers saves the class name alone.
    "LeakyReLU": lambda x: nn.leaky_relu(x, negative_slope=0.01),
    "ELU": lambda x: nn.elu(x, alpha=1.0),
    "Softplus": nn.softplus,
    "Hardtanh": nn.hard_tanh,
    "Mish": nn.mish,
}


@dataclass
class DenseLayer:
    """A sentence-transformers ``Dense`` module: activation(x @ W.T + b)."""

    weight: mx.array  # [out, in]
    bias: Optional[mx.array]
    activation: str

    def __call__(self, x: mx.array) -> mx.array:
        # By the native kernel in the CPU's native passes: each row's outputs
        # the same bits whatever the batch (ops.rows_times).
        return _ACTIVATIONS[self.activation](ops.rows_times(x, self.weight, self.bias, owner=self))


@dataclass
class StPipeline:
    """Everything after the transformer, and the prompts, for one folder."""

    pooling: tuple[str, ...]
    dense: list = field(default_factory=list)
    normalize: bool = False
    prompts: dict = field(default_factory=dict)
    default_prompt_name: Optional[str] = None
    max_seq_length: Optional[int] = None
    # sentence_bert_config.json's do_lower_case: sentence-transformers puts a
    # Lowercase normalizer in front of the tokenizer's own.
    lowercase: bool = False
    include_prompt: bool = True
    has_modules: bool = False
    # config_sentence_transformers.json's truncate_dim (Matryoshka models):
    # sentence-transformers' vectors are cut to their first so many values.
    truncate_dim: Optional[int] = None

    def output_dim(self, hidden_size: int) -> int:
        full = int(self.dense[-1].weight.shape[0]) if self.dense else hidden_size * len(self.pooling)
        return min(full, self.truncate_dim) if self.truncate_dim else full

    def __call__(self, h: mx.array, mask: mx.array) -> mx.array:
        """Last hidden state [B, L, D] of right-padded rows -> the folder's
        (unnormalized) sentence vectors [B, output_dim]."""
        return self._cut(self.project(pooling.pool(h, mask, self.pooling)))

    def _cut(self, x):
        return x[:, : self.truncate_dim] if self.truncate_dim else x

    @property
    def pools_on_host(self) -> bool:
        """Whether ``pool_on_host`` applies: the pipeline is pooling alone (no
        Dense layers, and ``__call__`` not replaced by a subclass's)."""
        return not self.dense and type(self).__call__ is StPipeline.__call__

    def pool_on_host(self, h: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """``__call__`` in NumPy, for a host buffer (see ``pools_on_host``)."""
        if not self.pools_on_host:
            raise ValueError("this pipeline does more than pool: run it with MLX")
        return self._cut(pooling.pool(h, mask, self.pooling, xp=np))

    def project(self, x: mx.array) -> mx.array:
        """The Dense layers, in order."""
        for layer in self.dense:
            x = layer(x.astype(layer.weight.dtype))
        return x


SPLADE_STRATEGIES = ("max", "sum")
SPLADE_ACTIVATIONS = ("relu", "log1p_relu")
# Floats of masked-LM logits one SPLADE step materializes ([tokens, vocab]),
# beyond one row: 274 tokens over a 30,522-word vocabulary, 32 MB.
_SPLADE_CHUNK_FLOATS = 1 << 23


# Tokens summed in float32 before the partial sums are added in float64.
_SUM_BLOCK = 16


def _sum_tokens(seg: mx.array, wide: bool) -> mx.array:
    """``seg.sum(axis=0)`` over a text's tokens, closer to the exact sum: one
    float32 sum per block of ``_SUM_BLOCK`` tokens, then the blocks' sums
    added in float64 (``wide``, the CPU) or compensated float32. A text's 512 terms of ~1
    each add up to ~300, whose float32 ulp is 3e-5: summed one after another
    their rounding was most of a long text's error (8e-5 against float64;
    sentence-transformers' float32 sum 6e-5). A block's ~10 has a 32x smaller
    ulp, and only the block sums, 1/16 of the terms, are widened: widening
    every term cost ~15% of a sum-pooled call, and blocks of 32 left 3e-5 of
    rounding on the compiled-MLX path (blocks of 16 and 8 measured as
    accurate as widening every term)."""
    n = seg.shape[0]
    whole = n - n % _SUM_BLOCK
    parts = []
    if whole:
        parts.append(seg[:whole].reshape(whole // _SUM_BLOCK, _SUM_BLOCK, seg.shape[1]).sum(axis=1))
    if whole < n:
        parts.append(seg[whole:].sum(axis=0, keepdims=True))
    partial = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
    if partial.shape[0] == 1:
        return partial[0]
    return partial.astype(mx.float64).sum(axis=0) if wide else _add_compensated(partial)


def _add_compensated(p: mx.array) -> mx.array:
    """The rows of float32 ``p`` added as by float64 (for devices without it):
    pairwise, each addition's rounding error kept (TwoSum, exact in float32 as
    separate uncompiled ops) and the errors added back at the end. A plain
    float32 sum of a 512-token text's 32 block sums left 7.5e-5 against float64
    on the MLX paths (sentence-transformers float32: 6.3e-5); this 4.4e-5, as
    the float64 one."""
    errors = None
    while p.shape[0] > 1:
        half = p.shape[0] // 2
        a, b = p[:half], p[half : 2 * half]
        s = a + b
        b_part = s - a
        e = ((a - (s - b_part)) + (b - b_part)).sum(axis=0)
        errors = e if errors is None else errors + e
        p = s if p.shape[0] == 2 * half else mx.concatenate([s, p[2 * half :]], axis=0)
    return p[0] + errors


@dataclass
class SpladePipeline(StPipeline):
    """SPLADE (sentence-transformers' ``SpladePooling``): per token,
    ``log1p(relu(logits))`` over the vocabulary (``log1p_relu`` takes log1p
    once more), padding zeroed, then the max or the sum over tokens. The
    output is ``vocab_size`` wide, non-negative and mostly zero: TEI's
    ``/embed_sparse`` lists its non-zero entries."""

    strategy: str = "max"
    activation: str = "relu"
    vocab_size: int = 0
    # config_sentence_transformers.json's max_active_dims: each vector keeps
    # its so many largest weights, as sentence-transformers' encode does.
    max_active_dims: Optional[int] = None
    # The masked-LM model, set at load: ``mlm_scores`` ([tokens, D] ->
    # [tokens, vocab], the logits before the bias) and ``mlm_bias`` ([vocab]).
    model: Optional[object] = None

    def output_dim(self, hidden_size: int) -> int:
        return self.vocab_size

    def __call__(self, h: mx.array, mask: mx.array) -> mx.array:
        # Only real tokens get logits: padding would cost a [rows, L, vocab]
        # mask product (the largest step on the CPU, above the matmul), and
        # sentence-transformers zeroes its logits anyway, which relu and
        # log1p keep at 0, so it never adds to a max or a sum.
        lengths = ops.KeyMask(mask, h.dtype).lengths
        rows, length, width = h.shape
        flat = h.reshape(rows * length, width)
        if sum(lengths) < rows * length:
            real = np.concatenate([r * length + np.arange(n) for r, n in enumerate(lengths)])
            flat = mx.take(flat, mx.array(real.astype(np.int32)), axis=0)
        # Whole rows at a time, so the [tokens, vocab] logits stay bounded.
        budget = max(1, _SPLADE_CHUNK_FLOATS // max(1, self.vocab_size))
        # The sum's partial sums in float64 where the device has it (_sum_tokens).
        wide = self.strategy == "sum" and device.is_cpu()
        out, first, row = [], 0, 0
        while row < rows:
            end, tokens = row, 0
            while end < rows and (end == row or tokens + lengths[end] <= budget):
                tokens += lengths[end]
                end += 1
            scores = self.model.mlm_scores(flat[first : first + tokens])
            if self.strategy == "sum":
                scores = self._activate(scores + self.model.mlm_bias)
            pooled, at = [], 0
            for n in lengths[row:end]:
                seg = scores[at : at + n]
                pooled.append(seg.max(axis=0) if self.strategy == "max" else _sum_tokens(seg, wide))
                at += n
            block = mx.stack(pooled).astype(scores.dtype) if wide else mx.stack(pooled)
            if self.strategy == "max":
                # The bias, relu and log1p never decrease (rounding included),
                # so they may come after the max: they run on [rows, vocab],
                # not on every token's logits, for the same bits.
                block = self._activate(block + self.model.mlm_bias)
            out.append(self._keep_most_active(block))
            first += tokens
            row = end
        return out[0] if len(out) == 1 else mx.concatenate(out, axis=0)

    def _keep_most_active(self, block: mx.array) -> mx.array:
        """Each row's ``max_active_dims`` largest weights (the weights are
        non-negative, so largest is largest in magnitude); a row with fewer
        non-zero ones keeps them all. Weights tied with the smallest one kept
        are kept too (sentence-transformers' topk keeps one of them)."""
        k = self.max_active_dims
        if not k or k >= block.shape[-1]:
            return block
        least = mx.topk(block, k, axis=-1).min(axis=-1, keepdims=True)
        return mx.where(block >= least, block, mx.zeros_like(block))

    def _activate(self, x: mx.array) -> mx.array:
        act = mx.log1p(mx.maximum(x, 0))
        return mx.log1p(act) if self.activation == "log1p_relu" else act


@dataclass(frozen=True)
class ColbertSettings:
    """A PyLate ColBERT folder's settings (config_sentence_transformers.json),
    with PyLate's defaults for the keys it leaves out (``ColBERT.__init__``):
    the prefixes are tokens inserted after ``[CLS]``, the lengths count every
    token (prefix and specials included), and a query is padded with the
    mask token to ``query_length`` unless ``do_query_expansion`` is off.
    ``skiplist_words`` are tokens left out of a document's vectors."""

    query_prefix: str = "[Q] "
    document_prefix: str = "[D] "
    query_length: int = 32
    document_length: int = 180
    do_query_expansion: bool = True
    attend_to_expansion_tokens: bool = False
    skiplist_words: tuple = tuple(string.punctuation)


@dataclass
class ColbertPipeline(StPipeline):
    """A ColBERT model (PyLate): the Dense layers over every token, no
    pooling; the engine keeps the rows each input gives (``multi_vector``)."""

    colbert: ColbertSettings = field(default_factory=ColbertSettings)

    def output_dim(self, hidden_size: int) -> int:
        return int(self.dense[-1].weight.shape[0]) if self.dense else hidden_size

    def __call__(self, h: mx.array, mask: mx.array) -> mx.array:
        raise ValueError("a ColBERT model gives one vector per token, not a pooled vector")


def transformer_config(folder: str) -> dict:
    """The Transformer module's own settings (sentence_bert_config.json, in
    its subfolder in the layout of sentence-transformers before 2.0)."""
    return read_json(os.path.join(folder, transformer_subfolder(folder) or "", "sentence_bert_config.json")) or {}


def _prompts(st_cfg: dict, folder: str) -> tuple[dict, Optional[str]]:
    """config_sentence_transformers.json's prompts and default prompt name, checked."""
    prompts = st_cfg.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise InvalidModel(f"{folder}/{ST_CONFIG}: prompts must map names to strings")
    default_name = st_cfg.get("default_prompt_name")
    if default_name is not None and default_name not in prompts:
        raise InvalidModel(
            f"{folder}/{ST_CONFIG}: default_prompt_name {default_name!r} is not one of the prompts {sorted(prompts)}"
        )
    return dict(prompts), default_name


def _is_colbert(modules, st_cfg: dict) -> bool:
    """PyLate's layout: a Transformer then Dense layers, no Pooling, and a
    PyLate Dense or the ColBERT keys PyLate saves (its MaxSim similarity)."""
    if not isinstance(modules, list) or any(_kind(m) == "Pooling" for m in modules):
        return False
    pylate = any(str(m.get("type", "")).startswith("pylate.") for m in modules)
    return pylate or st_cfg.get("similarity_fn_name") == "MaxSim" or st_cfg.get("model_type") == "ColBERT"


def declares_colbert(folder: str) -> bool:
    """Whether the folder is a PyLate ColBERT model (see :func:`_is_colbert`)
    or a Stanford ColBERT checkpoint (:func:`is_stanford_colbert`)."""
    return is_stanford_colbert(folder) or _is_colbert(
        read_json(os.path.join(folder, "modules.json")), read_json(os.path.join(folder, ST_CONFIG)) or {}
    )


# config.json's first architecture in a checkpoint Stanford's ColBERT saved
# (colbert-ir/colbertv2.0): BERT's weights under ``bert.`` and the
# projection as ``linear.weight`` in the one weight file.
STANFORD_COLBERT = "HF_ColBERT"
STANFORD_METADATA = "artifact.metadata"


def is_stanford_colbert(folder: str) -> bool:
    """PyLate 1.6's test: the first architecture is ``HF_ColBERT`` and the
    folder's modules are a Transformer at most (no modules.json, or one
    naming the Transformer alone), so the projection is the checkpoint's
    ``linear.weight``."""
    config = read_json(os.path.join(folder, "config.json"))
    archs = config.get("architectures") if isinstance(config, dict) else None
    if not (isinstance(archs, list) and archs and archs[0] == STANFORD_COLBERT):
        return False
    modules = read_json(os.path.join(folder, "modules.json"))
    if modules is None:
        return True
    kept = [m for m in modules if _kind(m) != "Dropout"] if isinstance(modules, list) else None
    return kept is not None and len(kept) == 1 and _kind(kept[0]) == "Transformer"


def _stanford_defaults(folder: str) -> ColbertSettings:
    """The settings artifact.metadata gives where config_sentence_transformers.json
    says nothing, as PyLate 1.6 reads it: ``query_token_id`` /
    ``doc_token_id`` are the prefix tokens (the token text: ``[unused0]`` /
    ``[unused1]``, which are also the defaults without the file or the key),
    ``query_maxlen`` / ``doc_maxlen`` the lengths, ``attend_to_mask_tokens``
    whether the expansion is attended to. PyLate reads nothing else: a
    document loses the punctuation whatever ``mask_punctuation`` says."""
    where = os.path.join(folder, STANFORD_METADATA)
    meta = read_json(where)
    if meta is None:
        meta = {}
    elif not isinstance(meta, dict):
        raise InvalidModel(f"{where}: not a JSON object")
    names = {"query_prefix": "query_token_id", "document_prefix": "doc_token_id", "query_length": "query_maxlen",
             "document_length": "doc_maxlen", "attend_to_expansion_tokens": "attend_to_mask_tokens"}
    renamed = {ours: meta.get(theirs) for ours, theirs in names.items()}
    # Stanford's prefixes, not PyLate's [Q] / [D], when the file names none.
    for key, token in (("query_prefix", "[unused0]"), ("document_prefix", "[unused1]")):
        if renamed[key] is None:
            renamed[key] = token
    try:
        return _colbert_settings(renamed, where)
    except ValueError as e:
        # The error names the key as the file has it.
        msg = str(e)
        for ours, theirs in names.items():
            msg = msg.replace(f": {ours} ", f": {theirs} ")
        raise InvalidModel(msg) from None


def _colbert_settings(st_cfg: dict, where: str, defaults: ColbertSettings = ColbertSettings()) -> ColbertSettings:
    values = {}
    for key in ("query_prefix", "document_prefix"):
        value = st_cfg.get(key)
        if value is not None and not isinstance(value, str):
            raise InvalidModel(f"{where}: {key} must be a token (a string), got {value!r}")
        values[key] = getattr(defaults, key) if value is None else value
    for key in ("query_length", "document_length"):
        value = _positive_int(st_cfg, key, where)
        values[key] = getattr(defaults, key) if value is None else value
    for key in ("do_query_expansion", "attend_to_expansion_tokens"):
        value = st_cfg.get(key)
        if value is not None and not isinstance(value, bool):
            raise InvalidModel(f"{where}: {key} must be true or false, got {value!r}")
        values[key] = getattr(defaults, key) if value is None else value
    # PyLate: no expansion, nothing to attend to.
    values["attend_to_expansion_tokens"] = values["attend_to_expansion_tokens"] and values["do_query_expansion"]
    words = st_cfg.get("skiplist_words")
    if words is not None and (not isinstance(words, list) or not all(isinstance(w, str) for w in words)):
        raise InvalidModel(f"{where}: skiplist_words must be a list of tokens (strings)")
    values["skiplist_words"] = defaults.skiplist_words if words is None else tuple(words)
    return ColbertSettings(**values)


def read_colbert_pipeline(folder: str, stanford_linear: Optional[mx.array] = None) -> ColbertPipeline:
    """A PyLate ColBERT folder: Transformer -> Dense+ (PyLate's Dense: a
    linear layer and activation over every token, ``use_residual`` refused),
    its settings from config_sentence_transformers.json. The longest input is
    the longer of the two lengths (PyLate sets the Transformer's
    max_seq_length per call from them, whatever sentence_bert_config.json
    says).

    A Stanford checkpoint (:func:`is_stanford_colbert`) is projected by its
    ``linear.weight`` (``stanford_linear``, taken out of the model's weights
    by the caller: no bias, no activation) and takes its settings from
    artifact.metadata, under config_sentence_transformers.json's where it
    has a modules.json (PyLate reads that file only then)."""
    modules = read_json(os.path.join(folder, "modules.json"))
    stanford = is_stanford_colbert(folder)
    st_cfg = (read_json(os.path.join(folder, ST_CONFIG)) or {}) if modules is not None else {}
    where = f"{folder}/{ST_CONFIG}"
    settings = _colbert_settings(st_cfg, where, _stanford_defaults(folder) if stanford else ColbertSettings())
    bert_cfg = transformer_config(folder)
    prompts, default_name = _prompts(st_cfg, folder)
    pipe = ColbertPipeline(
        pooling=("mean",),
        prompts=prompts,
        default_prompt_name=default_name,
        max_seq_length=max(settings.query_length, settings.document_length),
        lowercase=_flag(bert_cfg, "do_lower_case", folder),
        has_modules=True,
        colbert=settings,
    )
    if stanford:
        if stanford_linear is None:
            raise InvalidModel(f"{folder}: a {STANFORD_COLBERT} checkpoint without its 'linear.weight'")
        weight = stanford_linear.astype(mx.float32)
        mx.eval(weight)
        pipe.dense.append(DenseLayer(weight=weight, bias=None, activation="Identity"))
        return pipe
    ordered = sorted((m for m in modules if _kind(m) != "Dropout"), key=lambda m: m.get("idx", 0))
    for i, m in enumerate(ordered):
        kind, sub = _kind(m), m.get("path", "") or ""
        if i == 0 and kind == "Transformer":
            continue
        if i > 0 and kind == "Dense":
            cfg = read_json(os.path.join(folder, sub, "config.json")) or {}
            if cfg.get("use_residual"):
                raise InvalidModel(f"{folder}/{sub}/config.json: use_residual is not supported")
            pipe.dense.append(_load_dense(folder, sub))
            continue
        raise InvalidModel(
            f"{folder}/modules.json: module {i} ({m.get('type')!r}) is not supported in a ColBERT "
            "model; supported: Transformer -> Dense+ (PyLate's layout)"
        )
    if not pipe.dense:
        raise InvalidModel(
            f"{folder}/modules.json: a ColBERT model without its Dense projection is not supported "
            "(PyLate would add a randomly initialized one)"
        )
    return pipe


def _splade_pooling(cfg: dict, where: str) -> tuple[str, str]:
    strategy = cfg.get("pooling_strategy", "max")
    activation = cfg.get("activation_function", "relu")
    if strategy not in SPLADE_STRATEGIES:
        raise InvalidModel(f"{where}: pooling_strategy {strategy!r} is not one of {SPLADE_STRATEGIES}")
    if activation not in SPLADE_ACTIVATIONS:
        raise InvalidModel(
            f"{where}: activation_function {activation!r} is not one of {SPLADE_ACTIVATIONS}"
        )
    return strategy, activation


def declares_splade(folder: str) -> bool:
    """Whether the folder's modules.json is a SPLADE ``SparseEncoder``."""
    return _has_splade(read_json(os.path.join(folder, "modules.json")))


def _kind(module: dict) -> str:
    """A modules.json entry's class name: sentence-transformers 2-5 write
    ``sentence_transformers.models.Pooling``, 6 another path to the same class."""
    return str(module.get("type", "")).rsplit(".", 1)[-1]


def declares_pooling(folder: str) -> bool:
    """Whether the folder's modules.json pools a Transformer's states: a
    sentence-transformers embedding pipeline (a CrossEncoder's has no
    Pooling module)."""
    modules = read_json(os.path.join(folder, "modules.json"))
    return isinstance(modules, list) and any(
        _kind(m) == "Pooling" for m in modules
    )


ST_CONFIG = "config_sentence_transformers.json"

# Modules whose pipelines the engine does not run, anywhere in modules.json:
# the reason each is refused at load, before anything else is read.
UNSUPPORTED_MODULES = {
    "Router": "a Router (separate query and document pipelines, as inference-free SPLADE's)",
    "SparseStaticEmbedding": "a SparseStaticEmbedding (inference-free SPLADE's query side)",
}


def unsupported_layout(folder: str) -> Optional[str]:
    """Why the folder's sentence-transformers layout cannot be served as it
    says, or None: a module in :data:`UNSUPPORTED_MODULES` (an override such
    as ``pooling="splade"`` would run the files beside it, not its
    pipeline)."""
    modules = read_json(os.path.join(folder, "modules.json"))
    for m in modules if isinstance(modules, list) else ():
        why = UNSUPPORTED_MODULES.get(_kind(m))
        if why is not None:
            return f"{folder}/modules.json has {why}, which is not supported"
    return None


def _check_text_modality(bert_cfg: dict, folder: str) -> None:
    """sentence-transformers 6 renders every text through the chat template
    when its Transformer's ``modality_config`` has a ``message`` entry (a
    folder it built over a chat-templated LM): a text alone gives other
    vectors, so such a folder is refused rather than run as plain text."""
    modality = bert_cfg.get("modality_config")
    if isinstance(modality, dict) and "message" in modality:
        raise InvalidModel(
            f"{folder}/sentence_bert_config.json: modality_config has 'message': "
            "sentence-transformers runs each text through the chat template as a chat "
            "message, which is not supported here (a folder whose modality_config has "
            "'text' only runs as plain text)"
        )


# sentence_bert_config.json keys sentence-transformers 6 applies per task
# (encode_query / encode_document) or for ColBERT-style models only.
_TASK_KEYS = ("query_length", "document_length", "query_expansion")
# processing_kwargs entries that change no vector beyond the cut.
_PROCESSING_KEYS = {"max_length", "truncation", "padding"}


def _processing_max_length(bert_cfg: dict, folder: str) -> Optional[int]:
    """sentence-transformers 6's ``processing_kwargs`` cut (``text`` or
    ``common`` ``max_length``, which the tokenizer call takes over
    ``max_seq_length``), and its per-task lengths: either is refused where
    it would run otherwise than here."""
    where = f"{folder}/sentence_bert_config.json"
    for key in _TASK_KEYS:
        if bert_cfg.get(key) is not None:
            raise InvalidModel(
                f"{where}: {key} is set: sentence-transformers cuts or expands query and document "
                "inputs apart (encode_query / encode_document), which is not supported here"
            )
    kwargs = bert_cfg.get("processing_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise InvalidModel(f"{where}: processing_kwargs must be an object")
    cuts = {}
    for group, values in kwargs.items():
        values = values or {}
        unknown = sorted(set(values) - _PROCESSING_KEYS) if isinstance(values, dict) else [repr(values)]
        if group not in ("text", "common") or unknown or values.get("truncation", True) is not True:
            raise InvalidModel(
                f"{where}: processing_kwargs {group!r} {values!r} is not supported here (only a "
                "text or common max_length)"
            )
        if values.get("max_length") is not None:
            cuts[group] = _positive_int(values, "max_length", where)
    # The tokenizer call takes the text kwargs, then the common ones over them.
    return cuts.get("common", cuts.get("text"))


@dataclass(frozen=True)
class LogitScore:
    """sentence-transformers 6's ``LogitScore`` module: a CrossEncoder over a
    causal LM scores ``logit[true] - logit[false]`` at the last position, or
    ``logit[true]`` alone when it has no false token."""

    true_token_id: int
    false_token_id: Optional[int]


def read_logit_score(folder: str) -> Optional[LogitScore]:
    """The folder's ``LogitScore`` module, or None when modules.json has none."""
    modules = read_json(os.path.join(folder, "modules.json"))
    entry = next((m for m in modules if _kind(m) == "LogitScore"), None) if isinstance(modules, list) else None
    if entry is None:
        return None
    where = os.path.join(folder, entry.get("path", "") or "", "config.json")
    cfg = read_json(where) or {}
    true_id, false_id = cfg.get("true_token_id"), cfg.get("false_token_id")
    for key, value, optional in (("true_token_id", true_id, False), ("false_token_id", false_id, True)):
        if (value is None and not optional) or (value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0)):
            raise InvalidModel(f"{where}: {key} must be a token id (a non-negative integer), got {value!r}")
    return LogitScore(true_id, false_id)


def _has_splade(modules) -> bool:
    return isinstance(modules, list) and any(
        _kind(m) == "SpladePooling" for m in modules
    )


def read_splade_pipeline(folder: str, vocab_size: int) -> SpladePipeline:
    """The folder's SPLADE pipeline: its ``SpladePooling`` settings where it
    has a modules.json (sentence-transformers' ``SparseEncoder``), else
    SPLADE v2's max pooling of relu (a bare ``BertForMaskedLM`` folder served
    with ``pooling="splade"``, as TEI's ``--pooling splade``)."""
    base, splade = _read(folder, "mean", sparse=True)
    pipe = SpladePipeline(
        pooling=("splade",),
        prompts=base.prompts,
        default_prompt_name=base.default_prompt_name,
        max_seq_length=base.max_seq_length,
        lowercase=base.lowercase,
        has_modules=base.has_modules,
        vocab_size=int(vocab_size),
        max_active_dims=_positive_int(
            read_json(os.path.join(folder, ST_CONFIG)) or {}, "max_active_dims", f"{folder}/{ST_CONFIG}"),
    )
    if splade is not None:
        pipe.strategy, pipe.activation = splade
    return pipe


def _positive_int(cfg: dict, key: str, where: str) -> Optional[int]:
    """``cfg[key]``, a whole number of at least 1, or None when unset;
    ``where`` names the file for the error."""
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidModel(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def _flag(cfg: dict, key: str, folder: str) -> bool:
    value = cfg.get(key, False)
    if not isinstance(value, bool):
        raise InvalidModel(f"{folder}/sentence_bert_config.json: {key} must be true or false, got {value!r}")
    return value


def _pooling_modes(cfg: dict, where: str) -> tuple[str, ...]:
    if "pooling_mode" in cfg:
        return pooling.check_modes(cfg["pooling_mode"])
    modes = [mode for key, mode in _LEGACY_FLAGS.items() if cfg.get(key)]
    unknown = [k for k, v in cfg.items() if k.startswith("pooling_mode") and v and k not in _LEGACY_FLAGS]
    if unknown:
        raise InvalidModel(f"unsupported pooling in {where}: {unknown}")
    # sentence-transformers' own fallback when no flag is set.
    return tuple(m for m in pooling.MODES if m in modes) or ("mean",)


def _load_dense(folder: str, sub: str) -> DenseLayer:
    where = os.path.join(sub, "config.json")
    cfg = read_json(os.path.join(folder, where))
    if cfg is None:
        raise ModelFolderMissing(f"{folder}: Dense module {sub!r} has no config.json")
    # sentence-transformers 6 can point a Dense at the token embeddings
    # (module_input_name): it then leaves the sentence vector as it is.
    for key in ("module_input_name", "module_output_name"):
        if cfg.get(key, "sentence_embedding") != "sentence_embedding":
            raise InvalidModel(
                f"{where}: {key}={cfg[key]!r} is not supported (only a Dense over the "
                "sentence embedding, after the pooling)"
            )
    act = str(cfg.get("activation_function", "torch.nn.modules.activation.Tanh")).rsplit(".", 1)[-1]
    if act not in _ACTIVATIONS:
        raise InvalidModel(
            f"{where}: unsupported activation_function {cfg.get('activation_function')!r}; "
            f"supported: {', '.join(_ACTIVATIONS)}"
        )
    path = os.path.join(folder, sub, "model.safetensors")
    if os.path.exists(path):
        w = mx.load(path)
        kind = "safetensors"
    else:
        path = os.path.join(folder, sub, "pytorch_model.bin")
        if not os.path.exists(path):
            raise ModelFolderMissing(f"{folder}/{sub}: Dense weights in neither model.safetensors nor pytorch_model.bin")
        w = torch_weights.load(path)
        kind = "PyTorch zip checkpoint (read without torch)"
    log.info("%s: Dense weights read from %s, %s", os.path.join(folder, sub), os.path.basename(path), kind)
    weight = w.get("linear.weight")
    if weight is None:
        raise InvalidModel(f"{path}: no 'linear.weight'")
    shape = (int(cfg["out_features"]), int(cfg["in_features"]))
    if tuple(weight.shape) != shape:
        raise InvalidModel(f"{path}: linear.weight is {tuple(weight.shape)}, config says {shape}")
    bias = w.get("linear.bias")
    if cfg.get("bias", True) and bias is None:
        raise InvalidModel(f"{path}: config has a bias but the weights do not")
    # In float32 whatever they were saved in, as sentence-transformers loads
    # them (EmbeddingGemma's are bfloat16): run in bfloat16 they moved the
    # vectors by 1.6e-3. They are a few matmuls on pooled vectors.
    weight = weight.astype(mx.float32)
    bias = bias.astype(mx.float32) if bias is not None else None
    # Evaluated here: a lazy load belongs to this thread's stream, and the
    # engine's worker threads could not evaluate it.
    mx.eval(weight, *([bias] if bias is not None else []))
    return DenseLayer(weight=weight, bias=bias, activation=act)


# A first module that is a whole model by itself (no Transformer, no Pooling
# after it), with its files in its own subfolder: class name -> the
# model_type it is built as when the folder has no config.json. A
# StaticEmbedding averages its token rows (``nn.EmbeddingBag``'s mean), which
# is mean pooling over the real tokens.
INPUT_MODULES = {"StaticEmbedding": "static_embedding"}

# InstructorEmbedding's first module (hkunlp/instructor-*).
INSTRUCTOR_TRANSFORMER = "INSTRUCTOR_Transformer"


@dataclass(frozen=True)
class InputModule:
    """A folder's first module when it is one of :data:`INPUT_MODULES`."""

    model_type: str
    # Where its weights and tokenizer.json are (the folder itself for ".").
    files: str


def _first_module(modules) -> Optional[dict]:
    if not isinstance(modules, list) or not modules:
        return None
    return min(modules, key=lambda m: m.get("idx", 0))


def input_module(folder: str) -> Optional[InputModule]:
    """The folder's self-contained first module (a StaticEmbedding), or None
    for a Transformer folder (or no modules.json)."""
    first = _first_module(read_json(os.path.join(folder, "modules.json")))
    if first is None:
        return None
    kind = _kind(first)
    if kind not in INPUT_MODULES:
        return None
    return InputModule(INPUT_MODULES[kind], os.path.normpath(os.path.join(folder, first.get("path", "") or "")))


def transformer_subfolder(folder: str) -> Optional[str]:
    """The subfolder a Transformer first module keeps its files in
    (``0_Transformer/``: config.json, weights, tokenizer files and
    sentence_bert_config.json, as sentence-transformers before 2.0 saved a
    model), or None when they are at the folder itself (or there is no
    modules.json)."""
    first = _first_module(read_json(os.path.join(folder, "modules.json")))
    if first is None or _kind(first) not in ("Transformer", INSTRUCTOR_TRANSFORMER):
        return None
    return first.get("path") or None


def _tokenizer_truncation(files: str) -> Optional[int]:
    """The max_length a tokenizer.json truncates at (sentence-transformers
    leaves it on for a StaticEmbedding), or None."""
    tok = read_json(os.path.join(files, "tokenizer.json")) or {}
    trunc = tok.get("truncation")
    if isinstance(trunc, dict) and isinstance(trunc.get("max_length"), int) and trunc["max_length"] > 0:
        return int(trunc["max_length"])
    return None


def read_pipeline(folder: str, default_pooling: str) -> StPipeline:
    """The folder's sentence-transformers pipeline, or the architecture's
    default (``default_pooling``, nothing else) when it has no modules.json."""
    return _read(folder, default_pooling, sparse=False)[0]


def _read(folder: str, default_pooling: str, sparse: bool) -> tuple[StPipeline, Optional[tuple]]:
    """The pipeline, and a SparseEncoder's ``(strategy, activation)`` (None
    without a ``SpladePooling``; one is accepted only when ``sparse``)."""
    splade: Optional[tuple] = None
    modules = read_json(os.path.join(folder, "modules.json"))
    if sparse and not _has_splade(modules):
        # A dense pipeline's pooling and Dense layers do not apply to SPLADE
        # (pooling="splade" over a folder made for another pooling, which TEI's
        # --pooling splade allows too); its prompts and length still do.
        modules = None
    if isinstance(modules, list) and len(modules) == 1 and _kind(modules[0]) == "Transformer":
        # A Transformer alone (sentence-transformers 6 saves a CrossEncoder
        # so): nothing is pooled yet, and SentenceTransformer(folder) pools it
        # the default way, as for a folder without modules.json.
        modules = None
    st_cfg = read_json(os.path.join(folder, ST_CONFIG)) or {}
    bert_cfg = transformer_config(folder)
    _check_text_modality(bert_cfg, folder)
    processing_cut = _processing_max_length(bert_cfg, folder)
    prompts, default_name = _prompts(st_cfg, folder)
    # The tokenizer call's own max_length wins over max_seq_length.
    max_len = processing_cut or bert_cfg.get("max_seq_length")
    pipe = StPipeline(
        pooling=pooling.check_modes(default_pooling),
        prompts=prompts,
        default_prompt_name=default_name,
        max_seq_length=int(max_len) if max_len else None,
        lowercase=_flag(bert_cfg, "do_lower_case", folder),
        # A sparse vector is not cut: it keeps its most active dimensions.
        truncate_dim=None if sparse else _positive_int(st_cfg, "truncate_dim", f"{folder}/{ST_CONFIG}"),
    )
    if not isinstance(modules, list):
        # A folder with just a 1_Pooling/ (no modules.json) still says how it pools.
        cfg = read_json(os.path.join(folder, "1_Pooling", "config.json"))
        if cfg and not sparse:
            pipe.pooling = _pooling_modes(cfg, "1_Pooling/config.json")
        return pipe, None

    pipe.has_modules = True
    seen_pooling = False
    instructor = False
    # Dropout changes nothing at inference, wherever it sits.
    kept = [m for m in modules if _kind(m) != "Dropout"]
    for i, m in enumerate(sorted(kept, key=lambda m: m.get("idx", 0))):
        kind = _kind(m)
        sub = m.get("path", "") or ""
        if i == 0 and kind in INPUT_MODULES and not sparse:
            pipe.pooling = ("mean",)
            # sentence-transformers' StaticEmbedding reads its tokenizer.json
            # alone: the truncation baked there is its only cut (none: no
            # cut), and sentence_bert_config.json's max_seq_length and
            # do_lower_case, a Transformer module's, do not apply.
            pipe.max_seq_length = _tokenizer_truncation(os.path.join(folder, sub))
            pipe.lowercase = False
            seen_pooling = True
            continue
        if i == 0 and kind == INSTRUCTOR_TRANSFORMER and not sparse:
            # hkunlp/instructor-*: a T5 encoder whose library pools the text's
            # tokens only, leaving the instruction (here: the prompt) out, as
            # sentence-transformers' include_prompt=false does.
            instructor = True
            continue
        if i == 0:
            if kind not in (("Transformer", "MLMTransformer") if sparse else ("Transformer",)):
                raise InvalidModel(
                    f"{folder}/modules.json: the first module must be a Transformer or a StaticEmbedding, "
                    f"got {kind!r}"
                )
            # Its files may be in a subfolder (0_Transformer/): the loader
            # reads the model from there (transformer_subfolder).
            continue
        if kind == "SpladePooling" and sparse and not seen_pooling:
            where = os.path.join(sub, "config.json")
            splade = _splade_pooling(read_json(os.path.join(folder, where)) or {}, where)
            seen_pooling = True
        elif kind == "Pooling" and not seen_pooling and not sparse:
            where = os.path.join(sub, "config.json")
            cfg = read_json(os.path.join(folder, where))
            if cfg is None:
                raise ModelFolderMissing(f"{folder}: Pooling module {sub!r} has no config.json")
            pipe.pooling = _pooling_modes(cfg, where)
            pipe.include_prompt = bool(cfg.get("include_prompt", True))
            seen_pooling = True
        elif kind == "Dense" and seen_pooling and not pipe.normalize:
            pipe.dense.append(_load_dense(folder, sub))
        elif kind == "Normalize" and seen_pooling:
            pipe.normalize = True
        else:
            raise InvalidModel(
                f"{folder}/modules.json: module {i} ({m.get('type')!r}) is not supported here; "
                "supported: Transformer -> Pooling -> Dense* -> Normalize, StaticEmbedding -> "
                "Dense* -> Normalize, or a SPLADE SparseEncoder (MLMTransformer -> SpladePooling)"
            )
    if splade is not None and (pipe.dense or pipe.normalize):
        raise InvalidModel(f"{folder}/modules.json: modules after SpladePooling are not supported")
    if not seen_pooling:
        raise InvalidModel(f"{folder}/modules.json has no Pooling module")
    if instructor:
        pipe.include_prompt = False
    return pipe, splade
