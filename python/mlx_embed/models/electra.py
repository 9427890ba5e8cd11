"""ELECTRA encoder (the discriminator: ms-marco-electra-base's, electra-*-discriminator).

ELECTRA's encoder is BERT's, unchanged (post-LN, GELU, the same layer names
under ``electra.``), so the blocks come from ``bert.py`` and run through the
same native fused encoder on the CPU. What differs is the embedding layer:
its word, position and type tables and its LayerNorm are ``embedding_size``
wide, and ``embeddings_project`` (a Linear to ``hidden_size``) follows the
norm when the two widths differ (the small models: 128 -> 256). transformers
builds that projection only then, so a checkpoint carries it only then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import ops
from . import bert

# A bare ElectraModel folder (no sentence-transformers modules): mean over
# tokens, as sentence-transformers pools a folder it has no modules for.
EMBEDDING_DEFAULTS = {"pooling": "mean"}

# Weights of task heads on top of the encoder (ElectraForPreTraining's
# discriminator head, ElectraForMaskedLM's generator head, the sequence,
# token, multiple-choice and QA heads): not part of an embedding.
_HEADS = ("discriminator_predictions.", "generator_predictions.", "generator_lm_head.",
          "classifier.", "sequence_summary.", "qa_outputs.")


@dataclass
class ModelArgs(bert.ModelArgs):
    # transformers' ElectraConfig defaults (the small discriminator's), for a
    # config.json that leaves a key out; published configs state them.
    model_type: str = "electra"
    embedding_size: int = 128
    hidden_size: int = 256
    num_attention_heads: int = 4
    intermediate_size: int = 1024

    def __post_init__(self):
        super().__post_init__()
        if self.embedding_size < 1:
            raise ValueError(f"electra: embedding_size must be positive, got {self.embedding_size}")


class Model(bert.Model):
    def __init__(self, args: ModelArgs):
        # Not bert.Model.__init__: its embedding tables are hidden_size wide.
        nn.Module.__init__(self)
        self.args = args
        self.model_type = args.model_type
        self.embeddings = bert.Embeddings(args, dim=args.embedding_size)
        if args.embedding_size != args.hidden_size:
            self.embeddings_project = nn.Linear(args.embedding_size, args.hidden_size)
        self.layers = [bert.TransformerBlock(args) for _ in range(args.num_hidden_layers)]

    def embed(self, input_ids: mx.array, token_type_ids: Optional[mx.array] = None):
        # The norm runs at embedding_size, before the projection (transformers'
        # order); on the native path the projection is the packed kernel too.
        x = super().embed(input_ids, token_type_ids)
        if "embeddings_project" not in self:
            return x
        if isinstance(x, np.ndarray):
            x = mx.array(x)
        return ops.linear(self.embeddings_project, x)

    def sanitize(self, weights: dict) -> dict:
        # Every ElectraFor* keeps the encoder under "electra." beside its head
        # (embeddings_project among the encoder's weights, outside "embeddings.").
        kept = {}
        for name, w in weights.items():
            if name.startswith("electra."):
                name = name[len("electra.") :]
            if not name.startswith(_HEADS):
                kept[name] = w
        return super().sanitize(kept)
