"""ModernBERT encoder (gte-modernbert-base, modernbert-embed-base).

Pre-LN blocks without biases (by default), rotary positions with one base for
the global and one for the local layers, GeGLU feed-forward, and alternating
attention: every ``global_attn_every_n_layers``-th layer (from layer 0) sees
the whole input, the others a window of ``local_attention // 2`` tokens on
each side. Layer 0 has no attention norm (the embedding norm precedes it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from .. import ops
from . import config_args

EMBEDDING_DEFAULTS = {"pooling": "mean"}

_GLOBAL, _LOCAL = "full_attention", "sliding_attention"


@dataclass
class ModelArgs:
    model_type: str = "modernbert"
    vocab_size: int = 50368
    hidden_size: int = 768
    num_hidden_layers: int = 22
    num_attention_heads: int = 12
    intermediate_size: int = 1152
    hidden_activation: str = "gelu"
    max_position_embeddings: int = 8192
    norm_eps: float = 1e-5
    norm_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    local_attention: int = 128
    global_attn_every_n_layers: int = 3
    global_rope_theta: float = 160000.0
    local_rope_theta: float = 10000.0
    # transformers >= 5 spells the two settings above as these.
    layer_types: Optional[list] = None
    rope_parameters: Optional[dict] = None
    pad_token_id: int = 50283
    layer_kinds: list = field(default_factory=list, init=False)
    thetas: dict = field(default_factory=dict, init=False)

    @classmethod
    def from_dict(cls, params: dict) -> "ModelArgs":
        return cls(**config_args(cls, params))

    def __post_init__(self):
        if self.hidden_activation not in ("gelu", "gelu_pytorch_tanh", "gelu_new"):
            raise ValueError(
                f"modernbert: hidden_activation={self.hidden_activation!r} is not supported "
                "(gelu, gelu_pytorch_tanh)"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("modernbert: hidden_size must be divisible by num_attention_heads")
        n = self.num_hidden_layers
        if self.layer_types is not None:
            if len(self.layer_types) != n or set(self.layer_types) - {_GLOBAL, _LOCAL}:
                raise ValueError(f"modernbert: layer_types must be {n} of {_GLOBAL!r}/{_LOCAL!r}")
            self.layer_kinds = list(self.layer_types)
        else:
            every = self.global_attn_every_n_layers
            self.layer_kinds = [_LOCAL if i % every else _GLOBAL for i in range(n)]
        # A null local theta is the global one, as transformers reads it.
        local = self.local_rope_theta if self.local_rope_theta is not None else self.global_rope_theta
        self.thetas = {_GLOBAL: self.global_rope_theta, _LOCAL: local}
        for kind, params in (self.rope_parameters or {}).items():
            if not isinstance(params, dict) or kind not in self.thetas:
                continue
            if params.get("rope_type", "default") != "default":
                raise ValueError(
                    f"modernbert: rope_type={params['rope_type']!r} is not supported (only 'default')"
                )
            self.thetas[kind] = float(params.get("rope_theta", self.thetas[kind]))


def _layer_norm(args: ModelArgs) -> nn.LayerNorm:
    return nn.LayerNorm(args.hidden_size, eps=args.norm_eps, bias=args.norm_bias)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, kind: str):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.head_dim = dim // self.n_heads
        self.scale = self.head_dim**-0.5
        self.is_global = kind == _GLOBAL
        self.half_window = args.local_attention // 2
        self.rope_base = args.thetas[kind]
        self.Wqkv = nn.Linear(dim, 3 * dim, bias=args.attention_bias)
        self.Wo = nn.Linear(dim, dim, bias=args.attention_bias)

    def __call__(self, x: mx.array, mask: ops.KeyMask, window, sees_a_key: Optional[mx.array]) -> mx.array:
        """``window(start, end)``: the local band plus padding mask for query
        rows [start, end) (local layers only); ``sees_a_key``: [B, L, 1],
        0 for the rows whose band holds no real key, or None when every row's
        does."""
        B, L, D = x.shape
        qkv = self.Wqkv(x).reshape(B, L, 3, self.n_heads, self.head_dim)
        qkv = mx.contiguous(qkv.transpose(2, 0, 3, 1, 4))
        # Rotate-half RoPE over the whole head, positions 0..L-1 per row.
        q = mx.fast.rope(qkv[0], self.head_dim, traditional=False, base=self.rope_base, scale=1.0, offset=0)
        k = mx.fast.rope(qkv[1], self.head_dim, traditional=False, base=self.rope_base, scale=1.0, offset=0)
        v = qkv[2]
        if self.is_global:
            out = ops.blocked_attention(q, k, v, self.scale, mask=mask)
        else:
            out = ops.blocked_attention(q, k, v, self.scale, mask=mask, additive=window, window=self.half_window)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, D)
        if sees_a_key is not None and not self.is_global:
            # A row with every key of its band masked attends to nothing:
            # torch's SDPA (transformers' default) answers 0 for it, where a
            # softmax over equally masked scores would spread it evenly.
            out = out * sees_a_key
        return self.Wo(out)


class MLP(nn.Module):
    """GeGLU: the first half of Wi's output through GELU, gated by the second."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.Wi = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.Wo = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)
        self.tanh_gelu = args.hidden_activation != "gelu"

    def __call__(self, x: mx.array) -> mx.array:
        h, gate = mx.split(self.Wi(x), 2, axis=-1)
        h = ops.gelu_tanh(h) if self.tanh_gelu else ops.gelu(h)
        return self.Wo(h * gate)


@ops.layer_boundary
class Layer(nn.Module):
    def __init__(self, args: ModelArgs, index: int):
        super().__init__()
        # Layer 0 reads the normed embeddings directly (an identity norm).
        self.attn_norm = _layer_norm(args) if index else None
        self.attn = Attention(args, args.layer_kinds[index])
        self.mlp_norm = _layer_norm(args)
        self.mlp = MLP(args)

    def __call__(self, x: mx.array, mask: ops.KeyMask, window, sees_a_key: Optional[mx.array]) -> mx.array:
        h = self.attn_norm(x) if self.attn_norm is not None else x
        x = x + self.attn(h, mask, window, sees_a_key)
        return x + self.mlp(self.mlp_norm(x))


class Embeddings(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.norm = _layer_norm(args)

    def __call__(self, input_ids: mx.array) -> mx.array:
        return self.norm(self.tok_embeddings(input_ids))


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.embeddings = Embeddings(args)
        self.layers = [Layer(args, i) for i in range(args.num_hidden_layers)]
        self.final_norm = _layer_norm(args)

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def max_length(self) -> int:
        return self.args.max_position_embeddings

    def __call__(self, input_ids: mx.array, attention_mask: mx.array) -> mx.array:
        L = input_ids.shape[1]
        x = self.embeddings(input_ids)
        mask = ops.KeyMask(attention_mask, x.dtype)
        half = self.args.local_attention // 2
        neg = mask.masked_value
        whole: list = []

        def window(start: int, end: int) -> mx.array:
            # Local layers: |query - key| <= local_attention // 2, on top of
            # the padding mask; all rows made once per forward.
            if (start, end) == (0, L) and whole:
                return whole[0]
            near = mx.abs(mx.arange(start, end)[:, None] - mx.arange(L)[None, :]) <= half
            band = mask.additive + mx.where(near, 0.0, neg).astype(x.dtype)
            if (start, end) == (0, L):
                whole.append(band)
            return band

        sees_a_key = self._sees_a_key(mask, L, half)
        for layer in self.layers:
            x = layer(x, mask, window, sees_a_key)
        return self.final_norm(x)

    @staticmethod
    def _sees_a_key(mask: ops.KeyMask, L: int, half: int) -> Optional[mx.array]:
        """[B, L, 1] 1 for the rows with a real key within ``half`` of them
        (keys are each row's first ``length``: row i sees one while
        i < length + half), 0 for the others; None when all do. Rows past the
        keys are a ColBERT query's expansion tokens, computed but not
        attended to (and padding, whose rows nobody reads)."""
        lengths = mask.lengths
        if L <= min(lengths) + half:
            return None
        limit = mx.array(lengths)[:, None, None] + half
        return (mx.arange(L)[None, :, None] < limit).astype(mask.dtype)

    def sanitize(self, weights: dict) -> dict:
        out = {}
        for name, w in weights.items():
            # ModernBertForMaskedLM & co. keep the encoder under "model.".
            if name.startswith("model."):
                name = name[len("model.") :]
            if name.startswith(("head.", "decoder.", "classifier.", "drop.")):
                continue
            if re.match(r"layers\.0\.attn_norm\.", name):
                continue
            out[name] = w
        return out
