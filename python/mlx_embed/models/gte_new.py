"""Alibaba GTE encoder, ``model_type: "new"`` (gte-base/large-en-v1.5,
gte-multilingual-base, gte-multilingual-reranker-base).

Written from the architecture's published definition (Alibaba-NLP/new-impl's
``modeling.py``, which Hugging Face runs as remote code), for checkpoints in
its format (``encoder.layer.N.attention.qkv_proj``, ``mlp.up_gate_proj``, ...).
A post-LN BERT without absolute positions:

* embeddings: word + token type (when ``type_vocab_size > 0``; single texts
  take type 0), then LayerNorm;
* rotary positions (rotate-half over the whole head) with base
  ``rope_theta`` and, with ``rope_scaling: {"type": "ntk", "factor": f}``,
  fixed NTK scaling at every length: base ``rope_theta * f`` and every
  frequency divided by ``f ** (2 / head_dim)`` (how the reference builds its
  cos/sin cache for ``max_position_embeddings * f`` positions);
* per layer: fused ``qkv_proj``, softmax(q k^T / sqrt(head_dim)) v,
  ``o_proj``, ``attn_ln(x + attn)``, then a GLU feed-forward
  ``down_proj(up * gelu(gate))`` where ``up_gate_proj`` holds up then gate
  (no bias), and ``mlp_ln(x + mlp)``;
* on the CPU's native path the projections, the attention (fed the rotated
  fused q/k/v), the exact GELU (fused into the gate's GEMM) and the residual
  LayerNorms run in the project's kernels (ops.py); RoPE is one compiled
  MLX loop.
* optionally log-n attention scaling (``logn_attention_scale``): each row's
  queries times log(its length) / log(max_position_embeddings), clipped
  from below at 1 with ``logn_attention_clip1``.

``unpad_inputs`` / ``use_memory_efficient_attention`` only choose how the
reference executes attention (xformers on unpadded rows); padded rows with
masked keys compute the same function, so they are accepted and ignored.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import ops
from . import LengthTables, config_args, join_linears, split_linear

# The model cards and the sentence-transformers folders pool the first token.
EMBEDDING_DEFAULTS = {"pooling": "cls"}

_GELU = ("gelu", "gelu_new", "gelu_pytorch_tanh")


@dataclass
class ModelArgs:
    # Defaults are NewConfig's (configuration.py of Alibaba-NLP/new-impl).
    model_type: str = "new"
    vocab_size: int = 30528
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    max_position_embeddings: int = 2048
    type_vocab_size: int = 1
    layer_norm_type: str = "layer_norm"
    layer_norm_eps: float = 1e-12
    position_embedding_type: str = "rope"
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    # transformers 5 re-saves rope_scaling / rope_theta under this name.
    rope_parameters: Optional[dict] = None
    pack_qkv: bool = True
    unpad_inputs: bool = False
    use_memory_efficient_attention: bool = False
    logn_attention_scale: bool = False
    logn_attention_clip1: bool = False

    @classmethod
    def from_dict(cls, params: dict) -> "ModelArgs":
        kw = config_args(cls, params)
        rp = params.get("rope_parameters")
        if isinstance(rp, dict) and "rope_theta" in rp and "rope_theta" not in params:
            kw["rope_theta"] = rp["rope_theta"]
        return cls(**kw)

    def __post_init__(self):
        rp = self.rope_parameters if isinstance(self.rope_parameters, dict) else {}
        if self.rope_scaling is None and (rp.get("type") or rp.get("rope_type", "default")) != "default":
            self.rope_scaling = rp
        name = self.model_type
        bad = []
        if self.position_embedding_type != "rope":
            bad.append(f"position_embedding_type={self.position_embedding_type!r} (only 'rope')")
        if self.layer_norm_type != "layer_norm":
            bad.append(f"layer_norm_type={self.layer_norm_type!r} (only 'layer_norm')")
        if self.hidden_act not in _GELU:
            bad.append(f"hidden_act={self.hidden_act!r} (only {', '.join(_GELU)})")
        sc = self.rope_scaling
        if sc is not None:
            kind = sc.get("type", sc.get("rope_type"))
            if kind != "ntk" or sc.get("mixed_b") is not None or float(sc.get("factor", 0)) < 1:
                bad.append(f"rope_scaling={sc!r} (only fixed NTK: type 'ntk', factor >= 1, no mixed_b)")
        if bad:
            raise ValueError(f"{name}: unsupported variant: " + "; ".join(bad))
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"{name}: hidden_size must be divisible by num_attention_heads")
        self.head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim % 2:
            raise ValueError(f"{name}: rotary positions need an even head size")


def inverse_frequencies(args: ModelArgs) -> np.ndarray:
    """The rotary inverse frequencies [head_dim / 2] in float32, as the
    reference computes them (in float32): 1 / base^(2i / d), with fixed NTK
    scaling base * f and a further division by f^(2/d)."""
    d = args.head_dim
    exponents = np.arange(0, d, 2, dtype=np.float32) / np.float32(d)
    if args.rope_scaling is None:
        return (1.0 / np.power(np.float32(args.rope_theta), exponents)).astype(np.float32)
    f = float(args.rope_scaling["factor"])
    inv = (1.0 / np.power(np.float32(args.rope_theta * f), exponents)).astype(np.float32)
    return (inv / np.float32(f ** (2.0 / d))).astype(np.float32)


def rope_table(args: ModelArgs, length: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [length, head_dim] of positions 0..length-1: the angles in
    float32 as the reference forms them (position x inverse frequency), each
    frequency twice (rotate-half layout)."""
    inv = inverse_frequencies(args)
    angles = np.arange(length, dtype=np.float32)[:, None] * inv[None, :]
    angles = np.concatenate([angles, angles], axis=1).astype(np.float64)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _rotate(qkv: mx.array, c: mx.array, s: mx.array) -> mx.array:
    """Rotate-half RoPE on every head of the fused projection [B, L, 3 * D],
    read as [B, L, 3H, 2, d/2]: (x1 c - x2 s, x2 c + x1 s) per head, with
    c = 1 and s = 0 on the value heads, so the result keeps the fused layout
    the attention kernel reads."""
    B, L, W = qkv.shape
    x = qkv.reshape(B, L, c.shape[1], 2, c.shape[2])
    x1, x2 = x[..., 0, :], x[..., 1, :]
    return mx.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).reshape(B, L, W)


# One fused loop instead of six array passes (measured 7 vs 70 ms for
# [8, 256, 2304] on a 2-core x86, where a gather-based version was slowest).
_rotate_compiled = mx.compile(_rotate)


class Rotary:
    """The rotary positions of one model: cos/sin tables [L, 3H, d/2] per
    input length (q and k heads rotated, v heads kept), shared by the layers
    of a pass."""

    def __init__(self, args: ModelArgs):
        self.args = args
        self._tables = LengthTables(self._build)

    def _build(self, length: int) -> tuple[np.ndarray, np.ndarray]:
        a = self.args
        H, half = a.num_attention_heads, a.head_dim // 2
        cos, sin = rope_table(a, length)
        c = np.ones((length, 3 * H, half), np.float32)
        s = np.zeros((length, 3 * H, half), np.float32)
        # Both halves of a row hold the same frequencies.
        c[:, : 2 * H] = cos[:, None, :half]
        s[:, : 2 * H] = sin[:, None, :half]
        return c, s

    def tables(self, length: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        c, s = self._tables(length)
        return c.astype(dtype), s.astype(dtype)

    def __call__(self, qkv: mx.array, tables, q_scale: Optional[mx.array]) -> mx.array:
        out = _rotate_compiled(qkv, *tables)
        return out if q_scale is None else out * q_scale


def _logn_scale(args: ModelArgs, attention_mask: mx.array, dtype: mx.Dtype) -> mx.array:
    """[B, 1, 3 * D]: log(length) / log(max_position_embeddings) on each row's
    query part (clipped from below at 1 with logn_attention_clip1), 1 on k
    and v."""
    n = np.array(attention_mask, copy=False).astype(np.float32).sum(axis=1)
    scale = np.log(n) / np.float32(math.log(args.max_position_embeddings))
    if args.logn_attention_clip1:
        scale = np.maximum(scale, 1.0)
    D = args.hidden_size
    out = np.ones((len(n), 1, 3 * D), np.float32)
    out[:, 0, :D] = scale[:, None]
    return mx.array(out).astype(dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.scale = args.head_dim**-0.5
        self.qkv_proj = nn.Linear(dim, 3 * dim, bias=True)
        self.o_proj = nn.Linear(dim, dim, bias=True)

    def __call__(self, x: mx.array, mask: ops.KeyMask, rotary: Rotary, tables, q_scale) -> mx.array:
        qkv = rotary(ops.padded(ops.linear(self.qkv_proj, x), mask), tables, q_scale)
        return ops.linear(self.o_proj, ops.like(ops.attention(qkv, mask, self.n_heads, self.scale), x, mask))


class GatedMLP(nn.Module):
    """``down_proj(up(x) * gelu(gate(x)))``. The checkpoint's ``up_gate_proj``
    (up rows, then gate rows) is kept as two projections, so the GELU runs
    fused into the gate's GEMM on the native path instead of over a strided
    half of one output."""


    def __init__(self, args: ModelArgs):
        super().__init__()
        self.up = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.gate = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=True)
        self.tanh_gelu = args.hidden_act != "gelu"

    def __call__(self, x: mx.array) -> mx.array:
        if self.tanh_gelu:
            act = ops.gelu_tanh(ops.linear(self.gate, x))
        else:
            act = ops.linear(self.gate, x, activation="gelu")
        return ops.linear(self.down_proj, act * ops.linear(self.up, x))


@ops.layer_boundary
class Layer(nn.Module):
    """Post-LN: attn_ln(x + attention(x)), then mlp_ln(x + mlp(x))."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.attn_ln = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.mlp = GatedMLP(args)
        self.mlp_ln = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def __call__(self, x: mx.array, mask: ops.KeyMask, rotary: Rotary, tables, q_scale) -> mx.array:
        x = ops.add_layer_norm(self.attention(x, mask, rotary, tables, q_scale), x, self.attn_ln,
                               overwrite_input=True)
        return ops.add_layer_norm(self.mlp(x), x, self.mlp_ln, overwrite_input=True)


class Embeddings(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.word_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        if args.type_vocab_size > 0:
            self.token_type_embeddings = nn.Embedding(args.type_vocab_size, args.hidden_size)
        # Always a LayerNorm (layer_norm_type applies to the layers only).
        self.LayerNorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def __call__(self, input_ids: mx.array, token_type_ids: Optional[mx.array] = None) -> mx.array:
        x = self.word_embeddings(input_ids)
        if "token_type_embeddings" in self:
            # Single texts: type 0 everywhere, one row broadcast. A model
            # without a type table ignores the pair types it is given, as the
            # reference does.
            x = x + (self.token_type_embeddings.weight[0] if token_type_ids is None
                     else self.token_type_embeddings(token_type_ids))
        return self.LayerNorm(x)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.embeddings = Embeddings(args)
        self.layers = [Layer(args) for _ in range(args.num_hidden_layers)]
        # Not a module child: no parameters, and nn.Module would keep its
        # arrays as such.
        object.__setattr__(self, "_rotary", Rotary(args))

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def max_length(self) -> int:
        return self.args.max_position_embeddings

    def __call__(
        self,
        input_ids: mx.array,
        attention_mask: mx.array,
        token_type_ids: Optional[mx.array] = None,
    ) -> mx.array:
        """Last hidden state [B, L, D] for right-padded rows; token types only
        for sentence pairs."""
        x = self.embeddings(input_ids, token_type_ids)
        mask = ops.KeyMask(attention_mask, x.dtype)
        tables = self._rotary.tables(input_ids.shape[1], x.dtype)
        q_scale = _logn_scale(self.args, attention_mask, x.dtype) if self.args.logn_attention_scale else None
        return ops.run_layers(self.layers, x, mask, self._rotary, tables, q_scale)

    def sanitize(self, weights: dict) -> dict:
        out = {}
        for name, w in weights.items():
            # NewForMaskedLM / NewForSequenceClassification keep the encoder under "new.".
            if name.startswith("new."):
                name = name[len("new.") :]
            if name.startswith(("pooler.", "lm_head.", "classifier.")) or name.endswith(
                ("position_ids", "inv_freq", "cos_cached", "sin_cached")
            ):
                continue
            out[re.sub(r"^encoder\.layer\.(\d+)\.", r"layers.\1.", name)] = w
        for i in range(self.args.num_hidden_layers):
            # pack_qkv: false checkpoints keep q/k/v apart; the packed
            # projection is their concatenation in that order (the reference
            # splits it so). Quantized tensors split along axis 0 as well.
            pre = f"layers.{i}."
            join_linears(out, [f"{pre}attention.{p}_proj" for p in "qkv"], pre + "attention.qkv_proj")
            split_linear(out, pre + "mlp.up_gate_proj", (pre + "mlp.up", pre + "mlp.gate"))
        return out
