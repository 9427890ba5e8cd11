"""Gemma 2 decoder as an embedding model (BAAI/bge-multilingual-gemma2).

mlx-lm's Gemma 2 blocks (sandwich RMSNorms with ``1 + weight``, GeGLU-tanh
feed-forward, GQA with ``head_dim`` from the config) and its embedding scale,
with the attention redone: mlx-lm's attends to every earlier token, while
Gemma 2 alternates sliding-window layers (the first, third, ... unless the
config's ``layer_types`` says otherwise) with full ones. Attention is causal
as transformers runs it: scores scaled by ``query_pre_attn_scalar ** -0.5``
(not head_dim's), soft-capped by ``tanh(s / c) * c`` with c =
``attn_logit_softcapping`` before the mask and softmax, and a sliding layer's
query i sees keys ``i - sliding_window < j <= i`` (ops.capped_causal_attention).
The window is computed exactly at every length, so max_length stays the
position limit. ``final_logit_softcapping`` belongs to the LM head, which an
embedding never runs.

The embedding scale sqrt(hidden_size) is taken in the weights' dtype
(transformers), not rounded through bfloat16 (mlx-lm's LM). Right padding
needs no mask (causal), and the engine pools each row's last real token.

EOS: Gemma 2's tokenizer adds ``<bos>`` and no ``<eos>``, and
sentence-transformers appends none, so bge-multilingual-gemma2's folder pools
the last text token (its model card's transformers code does the same). So
no ``eos_token`` default here: what the folder's tokenizer gives is what runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from .. import ops
from . import DECODER_SIBLINGS, checked_decoder_params, decoder_weights, mlx_lm_model, plain_rope_only
from .gemma3_text import GeGLU

_lm = mlx_lm_model("gemma2")

# A pass may be evaluated after each block (ops.EvaluationPoints).
ops.layer_boundary(_lm.TransformerBlock)

# bge-multilingual-gemma2: last-token pooling; queries carry an instruction
# in its model card's form, "<instruct>{task}\n<query>{text}", documents none.
EMBEDDING_DEFAULTS = {
    "pooling": "last",
    "instruction_template": "<instruct>{instruction}\n<query>",
}

# Queries/keys/values and gate/up as one matmul each (sibling_linears.py).
JOINED_LINEARS = DECODER_SIBLINGS

_GLOBAL, _LOCAL = "full_attention", "sliding_attention"


@dataclass
class ModelArgs(_lm.ModelArgs):
    # transformers' Gemma2Config defaults where mlx-lm's differ (its 144 is
    # gemma-2-27b's) or where it has the key not at all.
    query_pre_attn_scalar: float = 256.0
    attn_logit_softcapping: Optional[float] = 50.0
    sliding_window: Optional[int] = 4096
    layer_types: Optional[list] = None
    max_position_embeddings: int = 8192

    @classmethod
    def from_dict(cls, params: dict) -> "ModelArgs":
        params = dict(params)
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "vocab_size", "head_dim", "intermediate_size"):
            if key not in params:
                raise ValueError(f"gemma2: config.json lacks {key!r}")
        if params.get("use_bidirectional_attention"):
            raise ValueError("gemma2: use_bidirectional_attention=true is not supported (only causal attention)")
        plain_rope_only(params, "gemma2")
        # transformers' Gemma2MLP reads hidden_activation (hidden_act, which
        # older configs carry beside it, is not read).
        params = checked_decoder_params(params, "gemma2", "hidden_activation", "gelu_pytorch_tanh")
        params.setdefault("rms_norm_eps", 1e-6)
        n = int(params["num_hidden_layers"])
        types = params.get("layer_types")
        if types is None:
            # transformers' default: sliding first, then alternating.
            types = [_LOCAL if i % 2 == 0 else _GLOBAL for i in range(n)]
        if len(types) != n or any(t not in (_GLOBAL, _LOCAL) for t in types):
            raise ValueError(f"gemma2: layer_types must be {n} of {_LOCAL!r} / {_GLOBAL!r}, got {types!r}")
        params["layer_types"] = list(types)
        window = params.get("sliding_window", 4096)
        if _LOCAL in types and (not isinstance(window, int) or window < 1):
            # transformers refuses to build a sliding layer without one.
            raise ValueError(f"gemma2: sliding_window={window!r} is not a positive integer")
        cap = params.get("attn_logit_softcapping", 50.0)
        if cap is not None and not cap > 0:
            raise ValueError(f"gemma2: attn_logit_softcapping={cap!r} is not positive")
        return super().from_dict(params)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = _Decoder(args)

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def max_length(self) -> int:
        return self.args.max_position_embeddings

    def __call__(self, input_ids: mx.array, attention_mask: mx.array) -> mx.array:
        return self.model(input_ids, attention_mask)

    def sanitize(self, weights: dict) -> dict:
        # Gemma2Model (bge-multilingual-gemma2) saves without the "model."
        # prefix, Gemma2ForCausalLM and mlx-lm conversions with it and an LM
        # head (tied to the embeddings) an embedding never uses.
        return decoder_weights(weights, drop=("lm_head.",))


class _Decoder(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [_lm.TransformerBlock(args) for _ in range(args.num_hidden_layers)]
        for layer in self.layers:
            layer.self_attn = _Attention(args)
            layer.mlp = GeGLU(args.hidden_size, args.intermediate_size)
        self.norm = _lm.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, input_ids: mx.array, attention_mask: mx.array) -> mx.array:
        h = self.embed_tokens(input_ids)
        h = h * mx.array(self.args.hidden_size**0.5, dtype=h.dtype)
        # What each block passes its attention as ``mask``: the layer's window.
        windows = {_GLOBAL: None, _LOCAL: self.args.sliding_window}
        with ops.packed_feed_forwards(ops.KeyMask(attention_mask, h.dtype)):
            for kind, layer in zip(self.args.layer_types, self.layers):
                h = layer(h, windows[kind])
        return self.norm(h)


class _Attention(_lm.Attention):
    """mlx-lm's Gemma 2 attention (its projections, RoPE and scale) with the
    scores through ``ops.capped_causal_attention``: causal, soft-capped, and
    the sliding layers' window, which mlx-lm's leaves out."""

    def __call__(self, x: mx.array, window: Optional[int] = None, cache=None) -> mx.array:
        if cache is not None:
            raise ValueError("gemma2: the embedding model runs without a KV cache")
        B, L, _ = x.shape
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        queries = self.rope(queries.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3))
        keys = self.rope(keys.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3))
        values = values.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        out = ops.capped_causal_attention(
            queries, keys, values, self.scale, softcap=self.attn_logit_softcapping, window=window
        )
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
