"""DistilBERT encoder (msmarco-distilbert-*, multi-qa-distilbert-*,
distiluse-base-multilingual-*, distilbert-base-nli-*) for embeddings.

The block is BERT's, unchanged (post-LN, GELU, q/k/v fused by ``sanitize``),
so it comes from ``bert.py`` and runs through the same native fused encoder
on the CPU. What differs: the config's names (``dim``, ``n_layers``,
``n_heads``, ``hidden_dim``, ``activation``), no token-type embeddings, every
LayerNorm's eps fixed at 1e-12 in transformers' code (the config has no eps),
and the checkpoint's names (``transformer.layer.N.attention.q_lin``,
``sa_layer_norm``, ``ffn.lin1``, ``output_layer_norm``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import ops
from . import bert, config_args

EMBEDDING_DEFAULTS = {"pooling": "mean"}

# transformers' DistilBERT hard-codes this eps for all its LayerNorms.
LAYER_NORM_EPS = 1e-12

# Weights of task heads on top of the encoder (DistilBertForMaskedLM,
# ...ForSequenceClassification, ...ForQuestionAnswering,
# ...ForTokenClassification): not part of an embedding.
_HEADS = ("vocab_transform.", "vocab_layer_norm.", "vocab_projector.", "pre_classifier.",
          "classifier.", "qa_outputs.")


@dataclass
class ModelArgs:
    model_type: str = "distilbert"
    vocab_size: int = 30522
    dim: int = 768
    n_layers: int = 6
    n_heads: int = 12
    hidden_dim: int = 3072
    activation: str = "gelu"
    max_position_embeddings: int = 512
    sinusoidal_pos_embds: bool = False

    @classmethod
    def from_dict(cls, params: dict) -> "ModelArgs":
        return cls(**config_args(cls, params))

    def __post_init__(self):
        if self.sinusoidal_pos_embds:
            # transformers writes a sinusoid table into position_embeddings at
            # init; whether a checkpoint carries it or relies on the init is
            # not something this file guesses.
            raise ValueError("distilbert: sinusoidal_pos_embds=true is not supported")
        if self.activation not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"distilbert: activation={self.activation!r} is not supported")
        if self.dim % self.n_heads:
            raise ValueError("distilbert: dim must be divisible by n_heads")

    def encoder_args(self) -> bert.ModelArgs:
        """The same network in BERT's terms, for the blocks BERT's file builds."""
        return bert.ModelArgs(
            model_type=self.model_type, vocab_size=self.vocab_size, hidden_size=self.dim,
            num_hidden_layers=self.n_layers, num_attention_heads=self.n_heads,
            intermediate_size=self.hidden_dim, hidden_act=self.activation,
            max_position_embeddings=self.max_position_embeddings, type_vocab_size=1,
            layer_norm_eps=LAYER_NORM_EPS,
        )


class Embeddings(nn.Module):
    """Word + position embeddings, then LayerNorm: no token types."""

    def __init__(self, args: bert.ModelArgs):
        super().__init__()
        self.word_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.position_embeddings = nn.Embedding(args.max_position_embeddings, args.hidden_size)
        self.norm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def __call__(self, input_ids: mx.array, token_type_ids: Optional[mx.array] = None) -> mx.array:
        # token_type_ids (sentence pairs) are ignored: DistilBERT has none,
        # and transformers' DistilBERT does not take them either.
        L = input_ids.shape[1]
        return self.norm(self.word_embeddings(input_ids) + self.position_embeddings.weight[:L])

    def on_host(
        self, input_ids: mx.array, token_type_ids: Optional[mx.array] = None
    ) -> Optional[np.ndarray]:
        """``__call__`` computed on the host for the native encoder, or None
        off it (``ops.embeddings_on_host``)."""
        return ops.embeddings_on_host(
            self.word_embeddings, input_ids, (self.position_embeddings, 0), self.norm
        )


class Model(bert.Model):
    # bert.Model's forward takes token types; DistilBERT has no table for
    # them, so the engine sends none (pairs included).
    reads_type_ids = False

    def __init__(self, args: ModelArgs):
        # Not bert.Model.__init__: it would build BERT's token-type table.
        nn.Module.__init__(self)
        self.config = args
        # bert.Model's properties and sanitize read BERT's field names.
        self.args = args.encoder_args()
        self.model_type = args.model_type
        self.embeddings = Embeddings(self.args)
        self.layers = [bert.TransformerBlock(self.args) for _ in range(args.n_layers)]

    @property
    def hidden_size(self) -> int:
        """The width (config.json calls it ``dim``)."""
        return self.config.dim

    # Checkpoint name (without "distilbert.") -> the names bert.Model.sanitize
    # produces from BERT's, so its q/k/v fusion applies unchanged.
    _RENAMES = (
        (r"^embeddings\.LayerNorm\.", "embeddings.norm."),
        (r"^transformer\.layer\.(\d+)\.attention\.q_lin\.", r"layers.\1.attention.query."),
        (r"^transformer\.layer\.(\d+)\.attention\.k_lin\.", r"layers.\1.attention.key."),
        (r"^transformer\.layer\.(\d+)\.attention\.v_lin\.", r"layers.\1.attention.value."),
        (r"^transformer\.layer\.(\d+)\.attention\.out_lin\.", r"layers.\1.attention.out_proj."),
        (r"^transformer\.layer\.(\d+)\.sa_layer_norm\.", r"layers.\1.attention_norm."),
        (r"^transformer\.layer\.(\d+)\.ffn\.lin1\.", r"layers.\1.ffn.up."),
        (r"^transformer\.layer\.(\d+)\.ffn\.lin2\.", r"layers.\1.ffn.down."),
        (r"^transformer\.layer\.(\d+)\.output_layer_norm\.", r"layers.\1.ffn_norm."),
    )

    def sanitize(self, weights: dict) -> dict:
        # DistilBertFor* keep the encoder under "distilbert." beside their heads.
        kept = {}
        for name, w in weights.items():
            if name.startswith("distilbert."):
                name = name[len("distilbert."):]
            if not name.startswith(_HEADS):
                kept[name] = w
        return super().sanitize(kept)
