"""Gemma (version 1) decoder: the backbone of BAAI/bge-reranker-v2-gemma
(a ``GemmaForCausalLM``, scored by ``decoder_reranker.py``), and as an
embedding model a Gemma folder pooled at its last token.

mlx-lm's Gemma blocks and model (causal GQA attention scaled by
``head_dim ** -0.5``, RoPE, the ``1 + weight`` RMSNorms before attention and
before the feed-forward, ``head_dim`` from the config), with two things
changed to run as transformers does:

* the feed-forward is Gemma 3's GeGLU with the tanh GELU
  (``gemma3_text.GeGLU``): mlx-lm's Gemma MLP uses the exact GELU, while
  transformers runs ``gelu_pytorch_tanh`` (its config reads the published
  ``hidden_act: "gelu"`` as that, and transformers 4's ``hidden_activation``
  names it);
* attention goes through the engine's kernels (``ops.engine_attention``).

The embeddings are scaled by sqrt(hidden_size) in the weights' dtype, as
transformers does (mlx-lm's model multiplies by a Python float, which MLX
casts to the array's dtype). Unlike Gemma 2 there are no post-attention /
post-feed-forward norms, no soft-capping and no sliding window. The LM head
is the embedding table (tied), which only the reranker reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .. import ops
from . import DECODER_SIBLINGS, checked_decoder_params, decoder_weights, mlx_lm_model, plain_rope_only
from .gemma3_text import GeGLU

_lm = mlx_lm_model("gemma")

# The attention by the native kernel on the CPU's native path, long inputs in
# query blocks elsewhere (ops.engine_attention).
ops.engine_attention(_lm)
# A pass may be evaluated after each block (ops.EvaluationPoints).
ops.layer_boundary(_lm.TransformerBlock)

# As Gemma 2's: last-token pooling over the tokenizer's "<bos> ..." (no EOS
# appended: Gemma's tokenizer adds none).
EMBEDDING_DEFAULTS = {"pooling": "last"}

# Queries/keys/values and gate/up as one matmul each (sibling_linears.py).
JOINED_LINEARS = DECODER_SIBLINGS

_TANH_GELU = "gelu_pytorch_tanh"


def _activation(params: dict) -> str:
    """The feed-forward's activation as transformers runs it: 4.x reads
    ``hidden_activation`` (tanh GELU when null), 5.x ``hidden_act``, with the
    published ``"gelu"`` read as the tanh GELU by both."""
    given = params.get("hidden_activation")
    if given is None:
        given = params.get("hidden_act", _TANH_GELU)
        if given == "gelu":
            given = _TANH_GELU
    return given


@dataclass
class ModelArgs(_lm.ModelArgs):
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True

    @classmethod
    def from_dict(cls, params: dict) -> "ModelArgs":
        params = dict(params)
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                    "head_dim", "intermediate_size"):
            if key not in params:
                raise ValueError(f"gemma: config.json lacks {key!r}")
        if params.get("use_bidirectional_attention"):
            raise ValueError("gemma: use_bidirectional_attention=true is not supported (only causal attention)")
        plain_rope_only(params, "gemma")
        params["hidden_activation"] = _activation(params)
        params = checked_decoder_params(params, "gemma", "hidden_activation", _TANH_GELU)
        params.setdefault("num_key_value_heads", params["num_attention_heads"])
        params.setdefault("rms_norm_eps", 1e-6)
        params.setdefault("rope_theta", 10000.0)
        return super().from_dict(params)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = _lm.GemmaModel(args)
        for layer in self.model.layers:
            layer.mlp = GeGLU(args.hidden_size, args.intermediate_size)

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def max_length(self) -> int:
        return self.args.max_position_embeddings

    def __call__(self, input_ids: mx.array, attention_mask: mx.array) -> mx.array:
        # attention_mask only packs the feed-forwards: causal attention never
        # reads the right padding (qwen2.py); the final norm is GemmaModel's.
        with ops.packed_feed_forwards(ops.KeyMask(attention_mask, mx.float32)):
            return self.model(input_ids)

    def sanitize(self, weights: dict) -> dict:
        # GemmaModel saves without the "model." prefix, GemmaForCausalLM with
        # it and (untied checkpoints) an LM head an embedding never uses.
        return decoder_weights(weights, drop=("lm_head.",))
