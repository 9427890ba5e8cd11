"""JinaBERT: BERT with ALiBi instead of position embeddings (Jina AI's
jina-embeddings-v2 encoders and jina-reranker-v1 cross-encoders).

Their ``config.json`` says ``model_type: "bert"`` and
``position_embedding_type: "alibi"`` (``models.module_for`` sends those here,
not to bert.py) and runs as remote code. Written from the semantics of the
qk-post-norm JinaBERT (jinaai/jina-bert-v2-qk-post-norm's ``modeling_bert.py``,
the code of jina-embeddings-v2-base-code), for checkpoints in its format
(``encoder.layer.N.attention.self.layer_norm_q``, ``mlp.up_gated_layer``,
``layer_norm_1`` ...):

* embeddings: word + token type, then LayerNorm; no position table;
* per layer, post-LN throughout:
  - q = LN_q(x Wq + bq), k = LN_k(x Wk + bk) (each over the whole hidden
    width, before the heads are split), v = x Wv + bv;
  - softmax(q k^T / sqrt(head_dim) + alibi) v, where head h's bias is
    ``-slope_h * |i - j|`` (symmetric: every key is penalized by its
    distance, before or after), unscaled by 1/sqrt(head_dim);
  - a = LN_attn(out_proj(ctx) + x) (BERT's attention output), then
    r = LN_1(x + a): the layer's input is added a second time;
  - GLU: ``up_gated_layer`` [2 * intermediate] holds up then gate;
    down(up * act(gate)) with exact GELU (``feed_forward_type: "geglu"``) or
    ReLU (``"reglu"``), then LN_2(r + mlp).
* ALiBi slopes as the reference builds them: for a power-of-two head count n,
  ``start = 2 ** (-8 / n)`` and slope_h = start ** (h + 1); otherwise the
  slopes of the largest power of two p below n, then every other slope of 2p
  (``[0::2]``) for the remaining n - p heads.

The attention runs through MLX (the native fused kernel takes no bias): one
matmul, the bias and padding mask added, the project's softmax, one matmul;
or MLX's fused SDPA with the bias as its additive mask where the backend
uses that. The projections, GELU and residual LayerNorms use ops.py's
kernels.

Not implemented, refused at load: jinaai/jina-bert-implementation's layout
(``mlp.gated_layers`` / ``mlp.wo`` / ``mlp.layernorm``, no q/k norms; the code
of jina-embeddings-v2-small/base-en/de/es/zh and jina-reranker-v1), which has
no reference fixture here yet; ``feed_forward_type: "original"`` (a plain MLP);
position types other than ALiBi.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import ops
from . import LengthTables, join_linears, split_linear

# jina-embeddings-v2 folders (and the reference's own encode()) mean-pool.
EMBEDDING_DEFAULTS = {"pooling": "mean"}

# The remote code this file follows, as config.json's auto_map names it, and
# the one it does not (another layer layout under the same model_type).
_IMPLEMENTED = "jina-bert-v2-qk-post-norm"
_OTHER_LAYOUT = "jina-bert-implementation"


def alibi_slopes(n_heads: int) -> list[float]:
    """Head slopes in the reference's order (its ``_get_alibi_head_slopes``)."""

    def power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n_heads).is_integer():
        return power_of_2(n_heads)
    p = 2 ** math.floor(math.log2(n_heads))
    return power_of_2(p) + alibi_slopes(2 * p)[0::2][: n_heads - p]


def alibi_bias(n_heads: int, length: int) -> np.ndarray:
    """[n_heads, length, length] float32: ``-slope_h * |i - j|``."""
    pos = np.arange(length, dtype=np.float64)
    dist = np.abs(pos[None, :] - pos[:, None])
    slopes = np.asarray(alibi_slopes(n_heads), dtype=np.float64)
    return (-slopes[:, None, None] * dist[None]).astype(np.float32)


@dataclass
class ModelArgs:
    # Defaults are the reference JinaBertConfig's.
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
    feed_forward_type: str = "geglu"
    auto_map: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, params: dict) -> "ModelArgs":
        fields = cls.__dataclass_fields__
        return cls(**{k: v for k, v in params.items() if k in fields and v is not None})

    def __post_init__(self):
        bad = []
        if self.position_embedding_type != "alibi":
            bad.append(f"position_embedding_type={self.position_embedding_type!r} (only 'alibi')")
        if self.feed_forward_type not in ("geglu", "reglu"):
            bad.append(f"feed_forward_type={self.feed_forward_type!r} (only 'geglu', 'reglu')")
        code = " ".join(str(v) for v in (self.auto_map or {}).values())
        if _OTHER_LAYOUT in code:
            bad.append(_other_layout_message(f"auto_map names {_OTHER_LAYOUT}"))
        if bad:
            raise ValueError("JinaBERT: unsupported variant: " + "; ".join(bad))
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("JinaBERT: hidden_size must be divisible by num_attention_heads")
        self.head_dim = self.hidden_size // self.num_attention_heads


def _other_layout_message(why: str) -> str:
    return (
        f"{why}: jinaai/{_OTHER_LAYOUT}'s layer layout (mlp.gated_layers / mlp.wo / mlp.layernorm, "
        f"no q/k LayerNorms) is not implemented; only jinaai/{_IMPLEMENTED}'s (q/k LayerNorms, "
        "mlp.up_gated_layer, layer_norm_1/2) is"
    )


class Embeddings(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.word_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.token_type_embeddings = nn.Embedding(args.type_vocab_size, args.hidden_size)
        self.norm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def __call__(self, input_ids: mx.array, token_type_ids: Optional[mx.array] = None) -> mx.array:
        # Single texts are type 0 everywhere: one row broadcast.
        types = (self.token_type_embeddings.weight[0] if token_type_ids is None
                 else self.token_type_embeddings(token_type_ids))
        return self.norm(self.word_embeddings(input_ids) + types)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.scale = args.head_dim**-0.5
        # One [D, 3D] projection (sanitize() fuses query/key/value): one GEMM
        # instead of three on small batches.
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.q_norm = nn.LayerNorm(dim, eps=args.layer_norm_eps)
        self.k_norm = nn.LayerNorm(dim, eps=args.layer_norm_eps)
        self.out_proj = nn.Linear(dim, dim, bias=True)

    def __call__(self, x: mx.array, bias: mx.array) -> mx.array:
        """``bias``: ALiBi plus the padding mask, [B, H, L, L]."""
        B, L, D = x.shape
        H = self.n_heads
        qkv = ops.linear(self.qkv, x)
        q = self.q_norm(qkv[..., :D])
        k = self.k_norm(qkv[..., D : 2 * D])
        v = qkv[..., 2 * D :]
        q, k, v = (t.reshape(B, L, H, D // H).transpose(0, 2, 1, 3) for t in (q, k, v))
        if ops.current().fused_attention:
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=bias)
        else:
            # The bias is added after the 1/sqrt(head_dim) scaling, as in the
            # reference (ALiBi slopes are not scaled).
            out = ops.softmax((q * self.scale) @ k.swapaxes(-1, -2) + bias) @ v
        return ops.linear(self.out_proj, out.transpose(0, 2, 1, 3).reshape(B, L, D))


class GatedMLP(nn.Module):
    """``down(up(x) * act(gate(x)))``; the checkpoint's ``up_gated_layer``
    (up rows, then gate rows) is kept as two projections so the GELU runs
    fused into the gate's GEMM on the native path."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.up = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.gate = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down = nn.Linear(args.intermediate_size, args.hidden_size, bias=True)
        # The reference's GLU ignores hidden_act: nn.GELU() (exact) or nn.ReLU().
        self.relu = args.feed_forward_type == "reglu"

    def __call__(self, x: mx.array) -> mx.array:
        if self.relu:
            act = mx.maximum(ops.linear(self.gate, x), 0.0)
        else:
            act = ops.linear(self.gate, x, activation="gelu")
        return ops.linear(self.down, act * ops.linear(self.up, x))


class Layer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        eps = args.layer_norm_eps
        self.attention = Attention(args)
        self.attention_norm = nn.LayerNorm(args.hidden_size, eps=eps)
        self.norm1 = nn.LayerNorm(args.hidden_size, eps=eps)
        self.mlp = GatedMLP(args)
        self.norm2 = nn.LayerNorm(args.hidden_size, eps=eps)

    def __call__(self, x: mx.array, bias: mx.array) -> mx.array:
        a = ops.add_layer_norm(self.attention(x, bias), x, self.attention_norm, overwrite_input=True)
        # The reference adds the layer's input again after the attention
        # block's own residual LayerNorm (layer_norm_1(residual + attention_output)).
        r = ops.add_layer_norm(a, x, self.norm1, overwrite_input=True)
        return ops.add_layer_norm(self.mlp(r), r, self.norm2, overwrite_input=True)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.embeddings = Embeddings(args)
        self.layers = [Layer(args) for _ in range(args.num_hidden_layers)]
        # Not a module child (no parameters): ALiBi biases per padded length.
        object.__setattr__(
            self, "_alibi", LengthTables(lambda n: (alibi_bias(args.num_attention_heads, n),), keep=8)
        )

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def max_length(self) -> int:
        # ALiBi has no table to run out of; the checkpoints' trained length
        # (8192 for jina-embeddings-v2) is the limit the loader applies.
        return self.args.max_position_embeddings

    def _alibi_table(self, length: int, dtype: mx.Dtype) -> mx.array:
        (table,) = self._alibi(length)
        return table.astype(dtype)[None]

    def __call__(
        self,
        input_ids: mx.array,
        attention_mask: mx.array,
        token_type_ids: Optional[mx.array] = None,
    ) -> mx.array:
        """Last hidden state [B, L, D] for right-padded rows (ALiBi distances
        between real tokens are the same as unpadded); token types only for
        sentence pairs."""
        x = self.embeddings(input_ids, token_type_ids)
        mask = ops.KeyMask(attention_mask, x.dtype)
        bias = self._alibi_table(input_ids.shape[1], x.dtype) + mask.additive
        for layer in self.layers:
            x = layer(x, bias)
        return x

    _RENAMES = (
        (r"^embeddings\.LayerNorm\.", "embeddings.norm."),
        (r"^encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\.", r"layers.\1.attention.\2."),
        (r"^encoder\.layer\.(\d+)\.attention\.self\.layer_norm_q\.", r"layers.\1.attention.q_norm."),
        (r"^encoder\.layer\.(\d+)\.attention\.self\.layer_norm_k\.", r"layers.\1.attention.k_norm."),
        (r"^encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"layers.\1.attention.out_proj."),
        (r"^encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.", r"layers.\1.attention_norm."),
        (r"^encoder\.layer\.(\d+)\.layer_norm_1\.", r"layers.\1.norm1."),
        (r"^encoder\.layer\.(\d+)\.layer_norm_2\.", r"layers.\1.norm2."),
        (r"^encoder\.layer\.(\d+)\.mlp\.up_gated_layer\.", r"layers.\1.mlp.up_gated."),
        (r"^encoder\.layer\.(\d+)\.mlp\.down_layer\.", r"layers.\1.mlp.down."),
    )

    def sanitize(self, weights: dict) -> dict:
        if any(".mlp.gated_layers." in n for n in weights):
            raise ValueError("JinaBERT: " + _other_layout_message("the weights have mlp.gated_layers"))
        out = {}
        for name, w in weights.items():
            # JinaBertForMaskedLM / ForSequenceClassification keep the encoder under "bert.".
            if name.startswith("bert."):
                name = name[len("bert.") :]
            if name.startswith(("pooler.", "cls.", "classifier.")) or name.endswith(
                ("position_ids", "token_type_ids")
            ):
                continue
            for pat, rep in self._RENAMES:
                name, n = re.subn(pat, rep, name)
                if n:
                    break
            out[name] = w
        for i in range(self.args.num_hidden_layers):
            pre = f"layers.{i}."
            join_linears(out, [f"{pre}attention.{p}" for p in ("query", "key", "value")], pre + "attention.qkv")
            split_linear(out, pre + "mlp.up_gated", (pre + "mlp.up", pre + "mlp.gate"))
        return out
