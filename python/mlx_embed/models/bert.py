"""BERT encoder (all-MiniLM, BGE, E5, GTE, ...) for embeddings.

One self-contained file in the style of mlx-lm's model files: ``ModelArgs``
from config.json, plain modules, and ``sanitize`` mapping checkpoint names to
ours. Only the encoder is built; the pooler/MLM heads are dropped because
sentence embeddings pool the last hidden state directly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import ops
from . import config_args, join_linears

# What the engine assumes for this architecture when the checkpoint folder
# does not say (sentence-transformers' 1_Pooling config wins over these).
EMBEDDING_DEFAULTS = {"pooling": "mean"}


@dataclass
class ModelArgs:
    model_type: str = "bert"
    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    position_embedding_type: str = "absolute"

    @classmethod
    def from_dict(cls, params: dict) -> "ModelArgs":
        return cls(**config_args(cls, params))

    def __post_init__(self):
        if self.position_embedding_type != "absolute":
            raise ValueError(
                f"bert: position_embedding_type={self.position_embedding_type!r} "
                "is not supported (only 'absolute')"
            )
        if self.hidden_act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"bert: hidden_act={self.hidden_act!r} is not supported")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("bert: hidden_size must be divisible by num_attention_heads")


class Embeddings(nn.Module):
    def __init__(self, args: ModelArgs, dim: Optional[int] = None):
        super().__init__()
        # ``dim``: the tables' width where it is not the encoder's (ELECTRA's
        # embedding_size, projected up to hidden_size after the norm).
        dim = dim or args.hidden_size
        self.word_embeddings = nn.Embedding(args.vocab_size, dim)
        self.position_embeddings = nn.Embedding(args.max_position_embeddings, dim)
        self.token_type_embeddings = nn.Embedding(args.type_vocab_size, dim)
        self.norm = nn.LayerNorm(dim, eps=args.layer_norm_eps)
        # The position row of a sequence's first token (RoBERTa's start after
        # the padding index).
        self.first_position = 0
        # RoBERTa's padding index: positions are numbered from the ids, as
        # transformers numbers them (ops.positions_from_ids); None: BERT's run.
        self.padding_idx: Optional[int] = None

    def __call__(self, input_ids: mx.array, token_type_ids: Optional[mx.array] = None) -> mx.array:
        # Single-segment input (embeddings): token_type_ids are all 0, so the
        # type embedding is one row broadcast over every position. Pairs
        # (cross-encoders) mark the second segment with type 1.
        types = (
            self.token_type_embeddings.weight[0]
            if token_type_ids is None
            else self.token_type_embeddings(token_type_ids)
        )
        positions = ops.position_rows(
            self.position_embeddings, input_ids, self.first_position, self.padding_idx
        )
        # transformers' order: (word + type) + position.
        x = self.word_embeddings(input_ids) + types + positions
        return self.norm(x)

    def on_host(
        self, input_ids: mx.array, token_type_ids: Optional[mx.array] = None
    ) -> Optional[np.ndarray]:
        """``__call__`` computed on the host for the native encoder, or None
        off it (``ops.embeddings_on_host``)."""
        return ops.embeddings_on_host(
            self.word_embeddings, input_ids, (self.position_embeddings, self.first_position),
            self.norm, self.token_type_embeddings, token_type_ids, padding_idx=self.padding_idx,
        )


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.head_dim = dim // self.n_heads
        self.scale = self.head_dim**-0.5
        # q, k and v share one projection: a single [D, 3D] GEMM keeps the BLAS
        # busier than three [D, D] ones on small batches. sanitize() fuses them.
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.out_proj = nn.Linear(dim, dim, bias=True)

    def __call__(self, x: mx.array, mask: ops.KeyMask) -> mx.array:
        qkv = ops.padded(ops.linear(self.qkv, x), mask)
        out = ops.attention(qkv, mask, self.n_heads, self.scale)
        return ops.linear(self.out_proj, ops.like(out, x, mask))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.up = nn.Linear(args.hidden_size, args.intermediate_size)
        self.down = nn.Linear(args.intermediate_size, args.hidden_size)
        self.tanh_gelu = args.hidden_act != "gelu"

    def __call__(self, x: mx.array) -> mx.array:
        if self.tanh_gelu:
            return ops.linear(self.down, ops.gelu_tanh(ops.linear(self.up, x)))
        return ops.linear(self.down, ops.linear(self.up, x, activation="gelu"))


@ops.layer_boundary
class TransformerBlock(nn.Module):
    """Post-LN block, as in the original BERT."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.attention_norm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.ffn = FeedForward(args)
        self.ffn_norm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def post_ln_parts(self) -> Optional[tuple]:
        """What ``ops.post_ln_encoder`` runs this block from; None with the
        tanh GELU, which its fused up projection does not do."""
        if self.ffn.tanh_gelu:
            return None
        a = self.attention
        return (a.n_heads, a.scale, a.qkv, a.out_proj, self.attention_norm, self.ffn.up,
                self.ffn.down, self.ffn_norm)

    def __call__(self, x: mx.array, mask: ops.KeyMask) -> mx.array:
        x = ops.add_layer_norm(self.attention(x, mask), x, self.attention_norm, overwrite_input=True)
        return ops.add_layer_norm(self.ffn(x), x, self.ffn_norm, overwrite_input=True)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.embeddings = Embeddings(args)
        self.layers = [TransformerBlock(args) for _ in range(args.num_hidden_layers)]

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def max_length(self) -> int:
        """Longest input the position table allows."""
        return self.args.max_position_embeddings

    def __call__(
        self,
        input_ids: mx.array,
        attention_mask: mx.array,
        token_type_ids: Optional[mx.array] = None,
    ) -> mx.array:
        """Last hidden state [B, L, D]; ``attention_mask`` is 1 for real tokens,
        which come first in each row (padding at the end); ``token_type_ids``
        only for sentence pairs."""
        x = self.embed(input_ids, token_type_ids)
        mask = ops.KeyMask(attention_mask, mx.float32 if isinstance(x, np.ndarray) else x.dtype)
        fused = ops.post_ln_encoder(self.layers, x, mask)
        if fused is not None:
            return fused
        if isinstance(x, np.ndarray):
            x = mx.array(x)  # blocks the native call does not cover run one by one
        return ops.run_layers(self.layers, x, mask)

    def embed(self, input_ids: mx.array, token_type_ids: Optional[mx.array] = None):
        """The embedding layer's output [B, L, D]: a writable float32 NumPy
        array on the native path (the embeddings are summed on the host and
        go to the encoder's one native call without an MLX evaluation
        between), else an MLX array."""
        x = self.embeddings.on_host(input_ids, token_type_ids)
        if x is None:
            x = (
                self.embeddings(input_ids)
                if token_type_ids is None
                else self.embeddings(input_ids, token_type_ids)
            )
        return x

    # Checkpoint name -> our name. Patterns are applied after stripping any
    # leading "bert." (BertForMaskedLM etc. wrap the encoder under it).
    _RENAMES = (
        (r"^embeddings\.LayerNorm\.", "embeddings.norm."),
        (r"^encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\.", r"layers.\1.attention.\2."),
        (r"^encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"layers.\1.attention.out_proj."),
        (r"^encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.", r"layers.\1.attention_norm."),
        (r"^encoder\.layer\.(\d+)\.intermediate\.dense\.", r"layers.\1.ffn.up."),
        (r"^encoder\.layer\.(\d+)\.output\.dense\.", r"layers.\1.ffn.down."),
        (r"^encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"layers.\1.ffn_norm."),
    )

    def sanitize(self, weights: dict) -> dict:
        out = {}
        for name, w in weights.items():
            if name.startswith("bert."):
                name = name[len("bert.") :]
            if (
                name.startswith(("pooler.", "cls.", "lm_head."))
                or name.endswith("position_ids")
            ):
                continue
            # Very old checkpoints name LayerNorm parameters gamma/beta.
            name = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", name)
            name = re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", name)
            for pat, rep in self._RENAMES:
                name, n = re.subn(pat, rep, name)
                if n:
                    break
            out[name] = w

        # Fuse separate q/k/v projections into the qkv Linear. Works for
        # quantized tensors too: weight, scales and biases are all split along
        # the output dimension (axis 0).
        for i in range(self.args.num_hidden_layers):
            pre = f"layers.{i}.attention."
            join_linears(out, [pre + p for p in ("query", "key", "value")], pre + "qkv")
        return out
