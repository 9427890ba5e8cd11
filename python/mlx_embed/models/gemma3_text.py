"""Gemma 3 text encoder as in EmbeddingGemma (embeddinggemma-300m).

mlx-lm's Gemma 3 blocks (q/k-norm attention, sandwich RMSNorms with
``1 + weight``, GeGLU-tanh MLP) as they are; what differs from the causal LM
is the masking. EmbeddingGemma sets ``use_bidirectional_attention: true``:
global layers see every real token, sliding layers every real token at most
``sliding_window // 2`` positions away on either side (transformers turns the
config's window into that symmetric one), and padding is masked in both. The embedding scale sqrt(hidden_size) is taken in the weights'
dtype (transformers), not rounded through bfloat16 (mlx-lm's LM), which in
float32 differs by up to 0.2%.

The sentence-transformers folder adds the Dense layers after mean pooling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from .. import ops
from . import DECODER_SIBLINGS, checked_decoder_params, decoder_weights, mlx_lm_model

_lm = mlx_lm_model("gemma3_text")

# The attention by the native kernel on the CPU's native path, given the
# layer's ops.BandMask (the real keys, and a sliding layer's window).
ops.engine_attention(_lm)
# A pass may be evaluated after each block (ops.EvaluationPoints).
ops.layer_boundary(_lm.TransformerBlock)

EMBEDDING_DEFAULTS = {"pooling": "mean"}

# Queries/keys/values and gate/up as one matmul each (sibling_linears.py).
JOINED_LINEARS = DECODER_SIBLINGS

_GLOBAL, _LOCAL = "full_attention", "sliding_attention"


@dataclass
class ModelArgs(_lm.ModelArgs):
    use_bidirectional_attention: bool = False
    layer_types: Optional[list] = None
    hidden_activation: str = "gelu_pytorch_tanh"

    @classmethod
    def from_dict(cls, params: dict) -> "ModelArgs":
        params = dict(params)
        if not params.get("use_bidirectional_attention"):
            raise ValueError(
                "gemma3_text: only use_bidirectional_attention=true (EmbeddingGemma) is supported "
                "as an embedding model"
            )
        if params.get("attn_logit_softcapping") is not None:
            raise ValueError("gemma3_text: attn_logit_softcapping is not supported")
        # transformers >= 5 writes per-layer-type rope_parameters and drops
        # the flat keys mlx-lm reads.
        rope = params.get("rope_parameters") or {}
        for kind, key in ((_GLOBAL, "rope_theta"), (_LOCAL, "rope_local_base_freq")):
            p = rope.get(kind)
            if isinstance(p, dict):
                if p.get("rope_type", "default") != "default":
                    raise ValueError(
                        f"gemma3_text: rope_type={p['rope_type']!r} for {kind} is not supported"
                    )
                params.setdefault(key, p.get("rope_theta"))
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "head_dim"):
            if key not in params:
                raise ValueError(f"gemma3_text: config.json lacks {key!r}")
        params = checked_decoder_params(
            params, "gemma3_text", "hidden_activation", "gelu_pytorch_tanh"
        )
        return super().from_dict(params)

    def __post_init__(self):
        if self.hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(
                f"gemma3_text: hidden_activation={self.hidden_activation!r} is not supported"
            )
        n, every = self.num_hidden_layers, self.sliding_window_pattern
        pattern = [_GLOBAL if (i + 1) % every == 0 else _LOCAL for i in range(n)]
        if self.layer_types is None:
            self.layer_types = pattern
        elif list(self.layer_types) != pattern:
            # mlx-lm's blocks pick each layer's RoPE base from the pattern.
            every = self.layer_types.index(_GLOBAL) + 1 if _GLOBAL in self.layer_types else n + 1
            self.sliding_window_pattern = every
            pattern = [_GLOBAL if (i + 1) % every == 0 else _LOCAL for i in range(n)]
            if list(self.layer_types) != pattern:
                raise ValueError(
                    "gemma3_text: layer_types must repeat (sliding x k, full) as Gemma 3 does"
                )


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
        # Gemma3TextModel saves without the "model." prefix, the causal LM
        # (and mlx-lm conversions) with it.
        return decoder_weights(weights, drop=("lm_head.",), skip="rotary_emb")


class _Encoder(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [_lm.TransformerBlock(args, i) for i in range(args.num_hidden_layers)]
        for layer in self.layers:
            layer.mlp = GeGLU(args.hidden_size, args.intermediate_size)
        self.norm = _lm.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, input_ids: mx.array, attention_mask: mx.array) -> mx.array:
        h = self.embed_tokens(input_ids)
        h = h * mx.array(self.args.hidden_size**0.5, dtype=h.dtype)
        keys = ops.KeyMask(attention_mask, h.dtype)
        masks = {
            _GLOBAL: ops.BandMask(keys),
            _LOCAL: ops.BandMask(keys, half=self.args.sliding_window // 2),
        }
        with ops.packed_feed_forwards(keys):
            for kind, layer in zip(self.args.layer_types, self.layers):
                h = layer(h, masks[kind])
        return self.norm(h)


@ops.packs_feed_forward
class GeGLU(_lm.MLP):
    """mlx-lm's Gemma 3 feed-forward with its GeGLU through ``ops`` (the
    native kernel on the CPU: MLX's compiled tanh runs one scalar at a time).
    Gemma 2's is the same network (gemma2.py uses this class)."""

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(ops.gelu_tanh_gated(self.gate_proj(x), self.up_proj(x)))
