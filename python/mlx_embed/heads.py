"""Which head a checkpoint is loaded with: embedding, classifier or reranker.

* A folder whose config.json names a ``*ForSequenceClassification``
  architecture (``models/sequence_classification.py``) is a cross-encoder:
  one label makes it a ``reranker`` (ms-marco-MiniLM, bge-reranker), several
  a ``classifier`` (labels from ``id2label``), as TEI decides.
* A decoder that can score yes/no (Qwen3, Qwen2, Gemma: ``models/decoder_reranker.py``)
  is a ``reranker`` when asked for (``kind="reranker"``, the server's
  ``--rerank-model``), when its modules.json has sentence-transformers 6's
  ``LogitScore``, or when its folder is named like one ("...rerank...",
  as Qwen/Qwen3-Reranker-*, mixedbread-ai/mxbai-rerank-base-v2 and
  BAAI/bge-reranker-v2-gemma are): its config.json says only
  ``Qwen3ForCausalLM`` / ``Qwen2ForCausalLM`` / ``GemmaForCausalLM``, the
  same as Qwen3-Embedding's and a chat model's. (gte-Qwen2's ``Qwen2Model``
  folders stay embedding models: no LogitScore, no such name.)
* Another ``*ForSequenceClassification`` is refused unless the caller asks
  for an embedding model or the folder pools it: as an embedding model its
  head would be dropped without a word (or its weights not fit).
* A SPLADE model (a sentence-transformers ``SparseEncoder`` folder, or
  ``pooling="splade"`` as TEI's ``--pooling splade``) is an ``embedding``
  model built with its masked-LM head (``models/masked_lm.py``): its vectors
  span the vocabulary and are mostly zero (``sparse``).
* A sequence-classification checkpoint is an ``embedding`` model where its
  folder says so (a sentence-transformers pipeline that pools it) or the
  caller does (``kind="embedding"``): sentence-transformers loads its encoder
  with ``AutoModel``, which leaves the classification head out, and so does
  the loader (``from_classifier``).
* Anything else is an ``embedding`` model.

The choice is returned as the model module to build, so the loader stays
generic: scorer modules return raw logits ``[B, num_labels]`` from
``model(ids, mask, token_type_ids)`` and the scheduler takes them unpooled.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Optional

from . import hub, models, st_modules
from .errors import InvalidModel, InvalidOption
from .models import masked_lm, sequence_classification

KINDS = ("embedding", "classifier", "reranker")
# The pooling value that selects SPLADE (TEI's --pooling splade).
SPLADE = "splade"

# config.json model_type -> the decoder-reranker module for it.
# One module scores them all (the decoder module's backbone and the true/false
# rows of its LM head); each decoder's default prompt is its reranker's card:
# Qwen3-Reranker's, for Qwen2 mxbai-rerank v2's, for Gemma bge-reranker-v2-gemma's.
DECODER_RERANKERS = {"qwen3": "decoder_reranker", "qwen2": "decoder_reranker", "gemma": "decoder_reranker"}


@dataclass(frozen=True)
class Head:
    kind: str
    # The module to build instead of the architecture's embedding file; None
    # for embedding models.
    module: Optional[ModuleType]
    # SPLADE: vectors over the vocabulary, pooled from the masked-LM logits.
    sparse: bool = False
    # An embedding model whose checkpoint is a sequence classifier's: its
    # weights lose the head before the encoder reads them.
    from_classifier: bool = False


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
    return "rerank" in hub.repo_name(path).lower()


def resolve(
    config: dict, path: str, kind: Optional[str] = None, pooling: Optional[str] = None
) -> Head:
    """The head for a checkpoint; ``kind`` (one of :data:`KINDS`) forces it
    and fails clearly where the checkpoint has no such head; ``pooling`` is
    the caller's override (only ``"splade"`` changes the head)."""
    if kind is not None and kind not in KINDS:
        raise InvalidOption(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    model_type = config.get("model_type")
    declared = st_modules.declares_splade(path)
    if pooling is not None and pooling != SPLADE and declared:
        raise InvalidOption(
            f"{path} is a SPLADE SparseEncoder: pooling={pooling!r} does not apply "
            "(it pools masked-LM logits over the vocabulary, not hidden states)"
        )
    if pooling == SPLADE or (pooling is None and declared):
        if kind not in (None, "embedding"):
            raise InvalidOption(f"kind={kind!r}: {path} is SPLADE, which makes an embedding model, not a {kind}")
        # Whose the SPLADE was: the folder's modules.json where it declares
        # it (a caller's pooling="splade" too only repeats it), else the
        # caller's pooling=.
        refusal = InvalidModel if declared else InvalidOption
        said = "" if declared else "pooling='splade': "
        if sequence_classification.architecture(config):
            raise refusal(f"{said}{path}: SPLADE makes an embedding model, not a scorer "
                          f"({sequence_classification.architecture(config)} in config.json)")
        if model_type not in masked_lm.MODEL_TYPES:
            raise refusal(
                f"{said}"
                f"{path}: SPLADE needs a masked-LM checkpoint of {', '.join(masked_lm.MODEL_TYPES)} "
                f"(BertForMaskedLM, DistilBertForMaskedLM), got model_type {model_type!r}"
            )
        return Head("embedding", masked_lm, sparse=True)
    if sequence_classification.architecture(config) is not None:
        if kind == "embedding" or (kind is None and st_modules.declares_pooling(path)):
            return Head("embedding", None, from_classifier=True)
        labels = sequence_classification.labels_from_config(config)
        natural = "reranker" if len(labels) == 1 else "classifier"
        if kind == "reranker" and len(labels) != 1:
            raise InvalidOption(
                f"{path} is a {len(labels)}-label classifier; a reranker has one label"
            )
        return Head(kind or natural, sequence_classification)
    unsupported = [a for a in config.get("architectures") or ()
                   if str(a).endswith("ForSequenceClassification")]
    if unsupported and kind is None and not st_modules.declares_pooling(path):
        # Loaded as an embedding model, its head would be dropped silently.
        raise InvalidModel(
            f"{path}: {unsupported[0]} is not a supported cross-encoder or classifier "
            f"(supported: {', '.join(sequence_classification.ARCHITECTURES)})"
        )
    decoder = DECODER_RERANKERS.get(model_type or "")
    # sentence-transformers 6 saves a decoder reranker as a CrossEncoder
    # with a LogitScore module, whatever the folder is called.
    logit_score = kind in (None, "reranker") and st_modules.read_logit_score(path) is not None
    if logit_score and decoder is None:
        raise InvalidModel(
            f"{path} is a sentence-transformers LogitScore reranker on model_type {model_type!r}; "
            f"yes/no rerankers are supported on {', '.join(DECODER_RERANKERS)}"
        )
    if decoder is not None and (
        kind == "reranker" or (kind is None and (logit_score or _named_like_reranker(path)))
    ):
        return Head("reranker", importlib.import_module(f"{models.__name__}.{decoder}"))
    if kind in ("classifier", "reranker"):
        archs = ", ".join(config.get("architectures") or []) or "none"
        raise InvalidOption(
            f"{path} has no {kind} head (architectures: {archs}); supported: "
            f"{', '.join(sequence_classification.ARCHITECTURES)}, and yes/no rerankers on "
            f"{', '.join(DECODER_RERANKERS)}"
        )
    return Head("embedding", None)
