"""EuroBERT encoder (EuroBERT/EuroBERT-210m, -610m, -2.1B and their
sentence-transformers fine-tunes), as transformers 5's native
``EuroBertModel`` computes it.

EuroBERT is Llama's network run as an encoder: the blocks are llama.py's
(mlx-lm's Llama ``TransformerBlock``: RMSNorm pre-norm, GQA with
``head_dim``, rotate-half RoPE, SwiGLU, the ``attention_bias`` /
``mlp_bias`` biases), and so are the config checks (``llama_params``) and
the joined projections. What differs is the mask: every real token attends
to every real token of its row (transformers' ``create_bidirectional_mask``),
padding hidden as a key. Pooling is the folder's (sentence-transformers'
mean for the published fine-tunes); the sequence-classification head
(``classifier_pooling``) is in sequence_classification.py.

Defaults where config.json is silent are ``EuroBertConfig``'s where they
differ from ``LlamaConfig``'s: ``rms_norm_eps`` 1e-5. RoPE: the published
checkpoints run plain RoPE (``rope_theta`` 250000, ``rope_scaling`` null);
a scaling is refused by name, as no EuroBERT checkpoint uses one and no
fixture backs it.

The tokenizer (Llama 3's byte-level BPE) adds ``<|begin_of_text|>`` and,
where the folder's tokenizer.json says so, ``<|end_of_text|>``: the engine
runs the folder's template as transformers 5 does, and appends nothing of
its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .. import ops
from . import decoder_weights
from .llama import JOINED_LINEARS, _lm, llama_params

__all__ = ["EMBEDDING_DEFAULTS", "JOINED_LINEARS", "Model", "ModelArgs"]

EMBEDDING_DEFAULTS = {"pooling": "mean"}


@dataclass
class ModelArgs(_lm.ModelArgs):
    @classmethod
    def from_dict(cls, params: dict) -> "ModelArgs":
        params = dict(params)
        params.setdefault("rms_norm_eps", 1e-5)  # EuroBertConfig's (LlamaConfig's is 1e-6)
        params = llama_params(params, "eurobert", scalings=("default",))
        # An encoder: no window, no LM head tied or untied to read.
        params["sliding_window"] = None
        params["tie_word_embeddings"] = False
        return super().from_dict(params)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = _Encoder(args)

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def max_length(self) -> int:
        return self.args.max_position_embeddings

    def __call__(self, input_ids: mx.array, attention_mask: mx.array) -> mx.array:
        return self.model(input_ids, attention_mask)

    def sanitize(self, weights: dict) -> dict:
        # EuroBertModel (sentence-transformers folders) saves without the
        # "model." prefix, EuroBertForMaskedLM (the published checkpoints)
        # with it plus an LM head that embeddings never use.
        return decoder_weights(weights, drop=("lm_head.",))


class _Encoder(nn.Module):
    """mlx-lm's ``LlamaModel`` weights and blocks, looped over with the
    bidirectional padding mask instead of its causal one."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [_lm.TransformerBlock(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, input_ids: mx.array, attention_mask: mx.array) -> mx.array:
        h = self.embed_tokens(input_ids)
        keys = ops.KeyMask(attention_mask, h.dtype)
        # Every real key, no window (llama.py's module wraps the attention
        # so that the native kernel takes it on the CPU).
        mask = ops.BandMask(keys)
        with ops.packed_feed_forwards(keys):
            for layer in self.layers:
                h = layer(h, mask)
        return self.norm(h)
