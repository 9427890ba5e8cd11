"""XLM-RoBERTa / RoBERTa encoder (multilingual-e5, bge-m3 dense, paraphrase-multilingual).

The transformer block is BERT's, unchanged (post-LN, GELU, fused q/k/v), so
it comes from ``bert.py``; what differs is the embedding layer and the names.
RoBERTa numbers positions from ``padding_idx + 1`` (fairseq heritage): the
first real token sits at position ``pad_token_id + 1``, and the table has
``pad_token_id + 1`` rows more than the longest input (514 rows, 512 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.nn as nn

from . import bert

# No sentence-transformers folder: mean over tokens, as multilingual-e5 does.
EMBEDDING_DEFAULTS = {"pooling": "mean"}


@dataclass
class ModelArgs(bert.ModelArgs):
    model_type: str = "xlm-roberta"
    vocab_size: int = 250002
    max_position_embeddings: int = 514
    type_vocab_size: int = 1
    # transformers' default for XLM-RoBERTa, RoBERTa and CamemBERT configs
    # that leave the key out (published ones state it).
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 1

    def __post_init__(self):
        super().__post_init__()
        if self.max_position_embeddings <= self.pad_token_id + 1:
            raise ValueError(
                f"{self.model_type}: max_position_embeddings={self.max_position_embeddings} "
                f"leaves no positions after padding_idx={self.pad_token_id}"
            )

    @property
    def max_length(self) -> int:
        return self.max_position_embeddings - self.pad_token_id - 1


class Embeddings(bert.Embeddings):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        # Padding sits at the end of each row and is masked out of attention
        # and pooling, so giving it positions p+n.. instead of padding_idx
        # (as HF does) cannot change a real token's result; a padding id
        # inside a text (a literal "<pad>") is numbered as HF numbers it.
        self.first_position = args.pad_token_id + 1
        self.padding_idx = args.pad_token_id


class Model(bert.Model):
    def __init__(self, args: ModelArgs):
        # Not bert.Model.__init__: it would first allocate BERT's embedding
        # tables (250k x 1024 floats for XLM-R large) only to replace them.
        nn.Module.__init__(self)
        self.args = args
        self.model_type = args.model_type
        self.embeddings = Embeddings(args)
        self.layers = [bert.TransformerBlock(args) for _ in range(args.num_hidden_layers)]

    @property
    def max_length(self) -> int:
        return self.args.max_length

    def sanitize(self, weights: dict) -> dict:
        # XLMRobertaForMaskedLM and friends keep the encoder under "roberta.".
        return super().sanitize(
            {(k[len("roberta."):] if k.startswith("roberta.") else k): v for k, v in weights.items()}
        )
