"""T5 / mT5 encoder (sentence-transformers' gtr-t5-*, sentence-t5-*, INSTRUCTOR).

The encoder stack of T5 (``T5EncoderModel``): a token table shared with the
decoder (``shared``) and no absolute positions; pre-norm blocks whose norm is
T5's RMS norm (a weight, no bias, no mean subtracted, in float32); attention
scores ``q @ k^T`` with no 1/sqrt(d) scaling, plus one relative position bias
(bidirectional log buckets over ``key - query``) that the first layer's table
gives and every layer adds; a feed-forward per ``feed_forward_proj``
(``relu``: wo(relu(wi x)); ``gated-gelu``: wo(gelu_new(wi_0 x) * wi_1 x),
T5 v1.1 / mT5 / GTR / ST5); a final norm after the last block.

Checkpoints: ``T5EncoderModel`` saves (``encoder.*``, ``shared.weight``) and
whole ``T5Model`` / ``T5ForConditionalGeneration`` ones (their ``decoder.*``
and ``lm_head`` are dropped).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

import mlx.core as mx
import mlx.nn as nn

from .. import ops
from . import LengthTables, config_args, join_linears, relative_position_buckets

# T5's tokenizer appends </s> itself. sentence-transformers' T5 folders pool
# the mean (their 1_Pooling says so too).
EMBEDDING_DEFAULTS = {
    "pooling": "mean",
    # T5 has no position table. Where neither the folder's max_seq_length nor
    # the tokenizer's model_max_length says, the length it was trained at.
    "fallback_max_length": 512,
}

# No position table bounds an input: the longest one the engine takes
# (explicitly, with max_length) is the loader's usual cap for folders that
# declare none; past it attention's cost is unreasonable anyway.
MAX_POSITIONS = 8192

# config.json keys mT5 configs may leave out, where MT5Config's defaults
# differ from T5Config's.
_MT5_DEFAULTS = {
    "vocab_size": 250112,
    "d_ff": 1024,
    "num_layers": 8,
    "num_heads": 6,
    "feed_forward_proj": "gated-gelu",
}

_ACTIVATIONS = ("relu", "gelu", "gelu_new", "silu")


@dataclass
class ModelArgs:
    model_type: str = "t5"
    vocab_size: int = 32128
    d_model: int = 512
    d_kv: int = 64
    d_ff: int = 2048
    num_layers: int = 6
    num_heads: int = 8
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "relu"

    @classmethod
    def from_dict(cls, params: dict) -> "ModelArgs":
        args = config_args(cls, params)
        if params.get("model_type") == "mt5":
            for k, v in _MT5_DEFAULTS.items():
                args.setdefault(k, v)
        return cls(**args)

    def __post_init__(self):
        parts = self.feed_forward_proj.split("-")
        if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
            raise ValueError(f"{self.model_type}: feed_forward_proj={self.feed_forward_proj!r} is not supported")
        act = parts[-1]
        # transformers reads "gated-gelu" as the tanh GELU (T5 v1.1's), a
        # plain "gelu" as the exact one.
        if self.feed_forward_proj == "gated-gelu":
            act = "gelu_new"
        if act not in _ACTIVATIONS:
            raise ValueError(
                f"{self.model_type}: feed_forward_proj={self.feed_forward_proj!r}: activation {act!r} is not "
                f"supported (only {', '.join(_ACTIVATIONS)}, gated or not)"
            )
        if self.relative_attention_num_buckets < 4 or self.relative_attention_max_distance < 1:
            raise ValueError(f"{self.model_type}: relative_attention_num_buckets must be >= 4")

    @property
    def gated(self) -> bool:
        return self.feed_forward_proj.startswith("gated-")

    @property
    def activation(self) -> str:
        return "gelu_new" if self.feed_forward_proj == "gated-gelu" else self.feed_forward_proj.split("-")[-1]


class RMSNorm(nn.Module):
    """T5LayerNorm: x / sqrt(mean(x^2) + eps) * weight, the statistic in
    float32 (``mx.fast.rms_norm`` accumulates in float32)."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.num_heads
        self.head_dim = args.d_kv
        inner = args.num_heads * args.d_kv
        # q, k and v in one projection (sanitize joins them); no biases in T5.
        self.qkv = nn.Linear(args.d_model, 3 * inner, bias=False)
        self.o = nn.Linear(inner, args.d_model, bias=False)

    def __call__(self, x: mx.array, mask: ops.KeyMask, bias) -> mx.array:
        qkv = ops.padded(ops.linear(self.qkv, x), mask)
        B, L, _ = qkv.shape
        H, hd = self.n_heads, self.head_dim
        parts = mx.contiguous(qkv.reshape(B, L, 3, H, hd).transpose(2, 0, 3, 1, 4))
        q, k, v = parts[0], parts[1], parts[2]
        # No 1/sqrt(d): T5 folds it into the query weights' initialization.
        out = ops.blocked_attention(q, k, v, 1.0, mask=mask, additive=bias, fused=ops.current().fused_attention)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, H * hd)
        return ops.linear(self.o, ops.like(out, x, mask))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gated = args.gated
        self.activation = args.activation
        # Gated: wi_0 (through the activation) and wi_1 side by side in one
        # projection (sanitize joins them).
        self.wi = nn.Linear(args.d_model, (2 if self.gated else 1) * args.d_ff, bias=False)
        self.wo = nn.Linear(args.d_ff, args.d_model, bias=False)

    def _act(self, h: mx.array) -> mx.array:
        if self.activation == "relu":
            return nn.relu(h)
        if self.activation == "gelu_new":
            return ops.gelu_tanh(h)
        if self.activation == "silu":
            return nn.silu(h)
        return ops.gelu(h)

    def __call__(self, x: mx.array) -> mx.array:
        h = ops.linear(self.wi, x)
        if self.gated:
            gate, up = mx.split(h, 2, axis=-1)
            h = self._act(gate) * up
        else:
            h = self._act(h)
        return ops.linear(self.wo, h)


def _clamp_half(x: mx.array) -> mx.array:
    """float16 only: transformers keeps T5's residual stream inside float16's
    range (its values grow past it in the larger checkpoints)."""
    if x.dtype != mx.float16:
        return x
    limit = float(np.finfo(np.float16).max) - 1000.0
    return mx.clip(x, -limit, limit)


@ops.layer_boundary
class Block(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + ff(norm(x))."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.d_model, args.layer_norm_epsilon)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.d_model, args.layer_norm_epsilon)
        self.ffn = FeedForward(args)

    def __call__(self, x: mx.array, mask: ops.KeyMask, bias) -> mx.array:
        x = _clamp_half(x + self.attention(self.attention_norm(x), mask, bias))
        return _clamp_half(x + self.ffn(self.ffn_norm(x)))


class Model(nn.Module):
    max_length = MAX_POSITIONS

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.shared = nn.Embedding(args.vocab_size, args.d_model)
        # The first layer's table in the checkpoint; every layer adds its bias.
        self.relative_attention_bias = nn.Embedding(args.relative_attention_num_buckets, args.num_heads)
        self.layers = [Block(args) for _ in range(args.num_layers)]
        self.final_norm = RMSNorm(args.d_model, args.layer_norm_epsilon)
        # Per padded length L: the bucket of every distance -(L-1)..L-1.
        self._buckets = LengthTables(self._distance_buckets)

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.args.d_model

    def _distance_buckets(self, length: int) -> tuple:
        rel = np.arange(-(length - 1), length)
        a = self.args
        return (relative_position_buckets(rel, a.relative_attention_num_buckets,
                                          a.relative_attention_max_distance).astype(np.int32),)

    def __call__(self, input_ids: mx.array, attention_mask: mx.array) -> mx.array:
        L = input_ids.shape[1]
        x = self.shared(input_ids)
        mask = ops.KeyMask(attention_mask, x.dtype)
        (buckets,) = self._buckets(L)
        # [H, 2L-1]: the bias of each head at each distance key - query.
        per_distance = self.relative_attention_bias(buckets).T.astype(x.dtype)
        whole: list = []

        def bias(start: int, end: int) -> mx.array:
            # Query rows [start, end) against every key: the position bias
            # plus the padding mask, [B, H, rows, L]; all rows made once per
            # forward and shared by the layers.
            if (start, end) == (0, L) and whole:
                return whole[0]
            distance = mx.arange(L)[None, :] - mx.arange(start, end)[:, None] + (L - 1)
            b = mx.take(per_distance, distance, axis=1)[None] + mask.additive
            if (start, end) == (0, L):
                whole.append(b)
            return b

        x = ops.run_layers(self.layers, x, mask, bias)
        return self.final_norm(x)

    _RENAMES = (
        (r"^encoder\.block\.0\.layer\.0\.SelfAttention\.relative_attention_bias\.", "relative_attention_bias."),
        (r"^encoder\.block\.(\d+)\.layer\.0\.SelfAttention\.(q|k|v)\.", r"layers.\1.attention.\2."),
        (r"^encoder\.block\.(\d+)\.layer\.0\.SelfAttention\.o\.", r"layers.\1.attention.o."),
        (r"^encoder\.block\.(\d+)\.layer\.0\.layer_norm\.", r"layers.\1.attention_norm."),
        (r"^encoder\.block\.(\d+)\.layer\.1\.DenseReluDense\.(wi|wi_0|wi_1|wo)\.", r"layers.\1.ffn.\2."),
        (r"^encoder\.block\.(\d+)\.layer\.1\.layer_norm\.", r"layers.\1.ffn_norm."),
        (r"^encoder\.final_layer_norm\.", "final_norm."),
    )

    def sanitize(self, weights: dict) -> dict:
        out = {}
        for name, w in weights.items():
            if name.startswith(("decoder.", "lm_head.")):
                continue
            if name == "encoder.embed_tokens.weight":
                # The shared table, saved a second time by older checkpoints.
                out.setdefault("shared.weight", w)
                continue
            for pat, rep in self._RENAMES:
                name, n = re.subn(pat, rep, name)
                if n:
                    break
            out[name] = w
        for i in range(self.args.num_layers):
            pre = f"layers.{i}."
            join_linears(out, [pre + f"attention.{p}" for p in ("q", "k", "v")], pre + "attention.qkv")
            # wi_0 goes through the activation, wi_1 multiplies it.
            join_linears(out, [pre + "ffn.wi_0", pre + "ffn.wi_1"], pre + "ffn.wi")
        return out
