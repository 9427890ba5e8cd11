"""BGE-M3's sparse head: lexical weights beside the dense vector.

A BAAI/bge-m3 folder holds, next to its dense sentence-transformers
pipeline, ``sparse_linear.pt``: a ``Linear(hidden, 1)`` state dict. BGE-M3
(FlagEmbedding's ``return_sparse=True``) weighs every token of the last
hidden state with ``relu(linear(h))``, drops the tokenizer's ``cls``,
``eos``, ``pad`` and ``unk`` tokens and any weight of 0, and keeps, per
distinct token id, its largest weight: a sparse vector over the vocabulary
("lexical weights") for hybrid search, from the same forward pass as the
dense vector.

The scheduler runs the head per token (``output="token_weights"``, one
weight per real token); :func:`entries` turns a text's weights and ids into
its sparse entries. ``colbert_linear.pt`` (the multi-vector head) is not
read: no route serves multi-vector output.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np

from . import torch_weights
from .json_files import read_json
from .st_modules import DenseLayer

FILE = "sparse_linear.pt"
# The tokenizer's special tokens BGE-M3 leaves out of the lexical weights.
SKIPPED_SPECIALS = ("cls_token", "eos_token", "pad_token", "unk_token")
# Token ids cross the Rust seam as float32 beside their weights: exact below 2^24.
MAX_VOCAB = 1 << 24
# What transformers' tokenizer classes take for those tokens where the files
# name none (a class's __init__ defaults; BERT's has no eos token), by the
# class tokenizer_config.json names, else by config.json's model_type.
CLASS_DEFAULTS = {
    "XLMRobertaTokenizer": {"cls_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"},
    "BertTokenizer": {"cls_token": "[CLS]", "pad_token": "[PAD]", "unk_token": "[UNK]"},
}
MODEL_TYPE_CLASSES = {"xlm-roberta": "XLMRobertaTokenizer", "bert": "BertTokenizer"}


@dataclass(frozen=True)
class LexicalHead:
    """``relu(h @ W.T + b)`` per token, and the token ids never weighed."""

    linear: DenseLayer
    skipped_ids: frozenset

    def __call__(self, h: mx.array) -> mx.array:
        """[B, L, hidden] -> each token's weight, [B, L, 1]."""
        return self.linear(h.astype(self.linear.weight.dtype))


def read(
    folder: str, token_files: str, hidden: int, vocab_size: int, token_id, default_skips,
    model_type: Optional[str] = None,
) -> Optional[LexicalHead]:
    """The folder's lexical head, or None where it has no ``sparse_linear.pt``.

    ``token_files`` is the folder of the tokenizer's files; ``token_id`` maps
    a token's text to its id (None: not in the vocabulary);
    ``default_skips`` are the ids skipped where neither the tokenizer files
    nor their class's defaults (:data:`CLASS_DEFAULTS`, the class named in
    tokenizer_config.json, else ``model_type``'s) name the tokens of
    :data:`SKIPPED_SPECIALS` (the specials the tokenizer adds, and padding)."""
    path = os.path.join(folder, FILE)
    if not os.path.isfile(path):
        return None
    try:
        weights = torch_weights.load(path)
    except ValueError as e:
        # Its advice is for the model's weights; this file is only ever read as it is.
        reason = str(e).split("; convert it to safetensors", 1)[0]
        raise ValueError(
            f"{reason}; BGE-M3's sparse head must be torch.save(sparse_linear.state_dict()) of a "
            f"Linear(hidden, 1), or leave {FILE} out of the folder to serve the dense vectors alone"
        ) from None
    unknown = sorted(set(weights) - {"weight", "bias"})
    if "weight" not in weights or unknown:
        raise ValueError(
            f"{path}: a BGE-M3 sparse head is a Linear(hidden, 1) state dict (weight, bias); "
            f"got {sorted(weights)}"
        )
    w, b = weights["weight"], weights.get("bias")
    if tuple(w.shape) != (1, hidden) or (b is not None and tuple(b.shape) != (1,)):
        raise ValueError(
            f"{path}: weight {tuple(w.shape)}, bias {None if b is None else tuple(b.shape)}; "
            f"a sparse head over this model's {hidden}-wide states is weight (1, {hidden}), bias (1,)"
        )
    if vocab_size >= MAX_VOCAB:
        raise ValueError(f"{path}: lexical weights need a vocabulary under {MAX_VOCAB} tokens, got {vocab_size}")
    linear = DenseLayer(w.astype(mx.float32), None if b is None else b.astype(mx.float32), "ReLU")
    skipped = _skipped_ids(token_files, token_id, default_skips, model_type)
    return LexicalHead(linear, frozenset(skipped))


def _skipped_ids(folder: str, token_id, default_skips, model_type: Optional[str] = None) -> set[int]:
    """The ids of the tokenizer's cls, eos, pad and unk tokens, as
    transformers' ``special_tokens_map`` has them: tokenizer_config.json,
    special_tokens_map.json over it, and the tokenizer class's defaults for
    any they leave out (transformers fills those in too)."""
    named: dict = {}
    tokenizer_class = None
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        cfg = read_json(os.path.join(folder, name))
        if isinstance(cfg, dict):
            named.update({k: cfg[k] for k in SKIPPED_SPECIALS if cfg.get(k) is not None})
            tokenizer_class = tokenizer_class or cfg.get("tokenizer_class")
    if isinstance(tokenizer_class, str):
        tokenizer_class = tokenizer_class.removesuffix("Fast")
    defaults = CLASS_DEFAULTS.get(tokenizer_class) or CLASS_DEFAULTS.get(
        MODEL_TYPE_CLASSES.get(model_type or "")
    )
    if defaults is not None:
        named = {**defaults, **named}
    elif not named:
        return {int(i) for i in default_skips}
    ids = set()
    for value in named.values():
        text = value.get("content") if isinstance(value, dict) else value
        tid = token_id(text) if isinstance(text, str) else None
        if tid is not None:
            ids.add(int(tid))
    return ids


def entries(weights: np.ndarray, ids, skipped: frozenset) -> tuple[np.ndarray, np.ndarray]:
    """One text's lexical weights: its distinct token ids (int64, increasing)
    and each one's largest weight (float32), skipped ids and zero weights
    left out."""
    ids = np.asarray(ids, dtype=np.int64)
    weights = np.asarray(weights, dtype=np.float32).reshape(-1)[: len(ids)]
    keep = weights > 0
    if skipped:
        keep &= ~np.isin(ids, np.fromiter(skipped, dtype=np.int64, count=len(skipped)))
    ids, weights = ids[keep], weights[keep]
    # By id, and the largest weight first within an id: its first row wins.
    order = np.lexsort((-weights, ids))
    ids, weights = ids[order], weights[order]
    first = np.ones(len(ids), dtype=bool)
    first[1:] = ids[1:] != ids[:-1]
    return ids[first], weights[first]
