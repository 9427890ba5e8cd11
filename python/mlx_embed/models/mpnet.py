"""MPNet encoder (all-mpnet-base-v2, multi-qa-mpnet-base).

A BERT-shaped post-LN encoder with two differences: absolute positions start
at ``padding_idx + 1`` as in RoBERTa, and every layer adds one shared,
T5-style relative position bias (32 buckets over the signed distance) to the
attention scores.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

import mlx.core as mx
import mlx.nn as nn

from .. import ops
from . import config_args, join_linears, relative_position_buckets

EMBEDDING_DEFAULTS = {"pooling": "mean"}

# HF's MPNetEncoder buckets with these constants whatever the config says,
# so a config asking for other values describes a model nobody can run.
_NUM_BUCKETS = 32
_MAX_DISTANCE = 128


@dataclass
class ModelArgs:
    model_type: str = "mpnet"
    vocab_size: int = 30527
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    max_position_embeddings: int = 514
    layer_norm_eps: float = 1e-5
    relative_attention_num_buckets: int = 32
    pad_token_id: int = 1

    @classmethod
    def from_dict(cls, params: dict) -> "ModelArgs":
        return cls(**config_args(cls, params))

    def __post_init__(self):
        if self.hidden_act != "gelu":
            raise ValueError(f"mpnet: hidden_act={self.hidden_act!r} is not supported (only 'gelu')")
        if self.relative_attention_num_buckets != _NUM_BUCKETS:
            raise ValueError(
                f"mpnet: relative_attention_num_buckets={self.relative_attention_num_buckets} "
                f"is not supported (only {_NUM_BUCKETS})"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("mpnet: hidden_size must be divisible by num_attention_heads")
        if self.max_position_embeddings <= self.pad_token_id + 1:
            raise ValueError("mpnet: max_position_embeddings leaves no room after padding_idx")


def distance_buckets(length: int) -> np.ndarray:
    """[L, L] bucket of (key - query) distances, as MPNet was trained (T5's
    buckets: 32 of them, log-spaced up to 128)."""
    pos = np.arange(length)
    return relative_position_buckets(pos[None, :] - pos[:, None], _NUM_BUCKETS, _MAX_DISTANCE)


class Embeddings(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.word_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.position_embeddings = nn.Embedding(args.max_position_embeddings, args.hidden_size)
        self.norm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.first_position = args.pad_token_id + 1
        self.padding_idx = args.pad_token_id

    def __call__(self, input_ids: mx.array) -> mx.array:
        # Padding (at the end of each row) is masked everywhere, so its
        # position value does not matter; real tokens get p, p+1, ..., but
        # for a padding id inside a text (a literal "<pad>"), numbered as
        # transformers numbers it.
        positions = ops.position_rows(
            self.position_embeddings, input_ids, self.first_position, self.padding_idx
        )
        x = self.word_embeddings(input_ids) + positions
        return self.norm(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.head_dim = dim // self.n_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.out_proj = nn.Linear(dim, dim, bias=True)

    def __call__(self, x: mx.array, mask: ops.KeyMask, bias: mx.array) -> mx.array:
        B, L, D = x.shape
        qkv = self.qkv(x).reshape(B, L, 3, self.n_heads, self.head_dim)
        qkv = mx.contiguous(qkv.transpose(2, 0, 3, 1, 4))
        q, k, v = qkv[0], qkv[1], qkv[2]
        # The position bias and the padding as one additive term: for a real
        # key the same sum as adding them one after the other (its mask is 0).
        out = ops.blocked_attention(
            q, k, v, self.scale, mask=mask, additive=lambda start, end: bias[:, :, start:end] + mask.additive
        )
        out = out.transpose(0, 2, 1, 3).reshape(B, L, D)
        return self.out_proj(out)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.up = nn.Linear(args.hidden_size, args.intermediate_size)
        self.down = nn.Linear(args.intermediate_size, args.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down(ops.gelu(self.up(x), overwrite_input=True))


@ops.layer_boundary
class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.attention_norm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.ffn = FeedForward(args)
        self.ffn_norm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def __call__(self, x: mx.array, mask: ops.KeyMask, bias: mx.array) -> mx.array:
        x = ops.add_layer_norm(self.attention(x, mask, bias), x, self.attention_norm, overwrite_input=True)
        return ops.add_layer_norm(self.ffn(x), x, self.ffn_norm, overwrite_input=True)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.embeddings = Embeddings(args)
        self.relative_attention_bias = nn.Embedding(_NUM_BUCKETS, args.num_attention_heads)
        self.layers = [TransformerBlock(args) for _ in range(args.num_hidden_layers)]

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def max_length(self) -> int:
        return self.args.max_position_embeddings - self.args.pad_token_id - 1

    def __call__(self, input_ids: mx.array, attention_mask: mx.array) -> mx.array:
        L = input_ids.shape[1]
        x = self.embeddings(input_ids)
        mask = ops.KeyMask(attention_mask, x.dtype)
        buckets = mx.array(distance_buckets(L).astype(np.int32))
        # [L, L, H] -> [1, H, L, L], shared by every layer.
        bias = self.relative_attention_bias(buckets).transpose(2, 0, 1)[None].astype(x.dtype)
        for layer in self.layers:
            x = layer(x, mask, bias)
        return x

    _RENAMES = (
        (r"^embeddings\.LayerNorm\.", "embeddings.norm."),
        (r"^encoder\.relative_attention_bias\.", "relative_attention_bias."),
        (r"^encoder\.layer\.(\d+)\.attention\.attn\.(q|k|v)\.", r"layers.\1.attention.\2."),
        (r"^encoder\.layer\.(\d+)\.attention\.attn\.o\.", r"layers.\1.attention.out_proj."),
        (r"^encoder\.layer\.(\d+)\.attention\.LayerNorm\.", r"layers.\1.attention_norm."),
        (r"^encoder\.layer\.(\d+)\.intermediate\.dense\.", r"layers.\1.ffn.up."),
        (r"^encoder\.layer\.(\d+)\.output\.dense\.", r"layers.\1.ffn.down."),
        (r"^encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"layers.\1.ffn_norm."),
    )

    def sanitize(self, weights: dict) -> dict:
        out = {}
        for name, w in weights.items():
            if name.startswith("mpnet."):
                name = name[len("mpnet.") :]
            if name.startswith(("pooler.", "lm_head.", "classifier.")) or name.endswith("position_ids"):
                continue
            for pat, rep in self._RENAMES:
                name, n = re.subn(pat, rep, name)
                if n:
                    break
            out[name] = w
        for i in range(self.args.num_hidden_layers):
            pre = f"layers.{i}.attention."
            join_linears(out, [pre + p for p in ("q", "k", "v")], pre + "qkv")
        return out
