"""Which head a checkpoint is loaded with: embedding, classifier or reranker.

* A folder whose config.json names a ``*ForSequenceClassification``
  architecture (``models/sequence_classification.py``) is a cross-encoder:
  one label makes it a ``reranker`` (ms-marco-MiniLM, bge-reranker), several
  a ``classifier`` (labels from ``id2label``), as TEI decides.
* A decoder with a yes/no reranker file (Qwen3: ``models/qwen3_reranker.py``)
  is a ``reranker`` when asked for (``kind="reranker"``, the server's
  ``--rerank-model``), or when its folder is named like one ("...Reranker...",
  as Qwen/Qwen3-Reranker-* are): its config.json says only
  ``Qwen3ForCausalLM``, the same as Qwen3-Embedding's.
* Anything else is an ``embedding`` model.

The choice is returned as the model module to build, so the loader stays
generic: scorer modules return raw logits ``[B, num_labels]`` from
``model(ids, mask, token_type_ids)`` and the scheduler takes them unpooled.
"""

from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass, field
from types import ModuleType
from typing import Optional

from . import models, st_modules
from .models import sequence_classification

KINDS = ("embedding", "classifier", "reranker")

# config.json model_type -> the decoder-reranker module for it.
DECODER_RERANKERS = {"qwen3": "qwen3_reranker"}


@dataclass(frozen=True)
class Head:
    kind: str
    # The module to build instead of the architecture's embedding file; None
    # for embedding models.
    module: Optional[ModuleType]


@dataclass
class ScoreHead(st_modules.StPipeline):
    """What follows a scorer's model: nothing. Its output is already one raw
    logit per label (the activation is the caller's), so it is not pooled."""

    labels: list = field(default_factory=list)

    def output_dim(self, hidden_size: int) -> int:
        return len(self.labels)

    def __call__(self, h, mask):
        return h


def _named_like_reranker(path: str) -> bool:
    name = os.path.basename(os.path.abspath(path).rstrip("/"))
    # Hugging Face cache layout: .../models--org--name/snapshots/<sha>
    m = re.search(r"models--[^/]+?--([^/]+)/snapshots/[^/]+/?$", os.path.abspath(path))
    if m:
        name = m.group(1)
    return "rerank" in name.lower()


def resolve(config: dict, path: str, kind: Optional[str] = None) -> Head:
    """The head for a checkpoint; ``kind`` (one of :data:`KINDS`) forces it
    and fails clearly where the checkpoint has no such head."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    model_type = config.get("model_type")
    if sequence_classification.architecture(config) is not None:
        labels = sequence_classification.labels_from_config(config)
        natural = "reranker" if len(labels) == 1 else "classifier"
        if kind == "embedding":
            raise ValueError(
                f"{path} is a sequence classifier ({', '.join(config.get('architectures', []))}), "
                "not an embedding model"
            )
        if kind == "reranker" and len(labels) != 1:
            raise ValueError(
                f"{path} is a {len(labels)}-label classifier; a reranker has one label"
            )
        return Head(kind or natural, sequence_classification)
    decoder = DECODER_RERANKERS.get(model_type or "")
    if decoder is not None and (
        kind == "reranker" or (kind is None and _named_like_reranker(path))
    ):
        return Head("reranker", importlib.import_module(f"{models.__name__}.{decoder}"))
    if kind in ("classifier", "reranker"):
        archs = ", ".join(config.get("architectures") or []) or "none"
        raise ValueError(
            f"{path} has no {kind} head (architectures: {archs}); supported: "
            f"{', '.join(sequence_classification.ARCHITECTURES)}, and yes/no rerankers on "
            f"{', '.join(DECODER_RERANKERS)}"
        )
    return Head("embedding", None)
