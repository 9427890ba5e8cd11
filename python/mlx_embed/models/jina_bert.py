"""JinaBERT: BERT with ALiBi instead of position embeddings (Jina AI's
jina-embeddings-v2 encoders and jina-reranker-v1 cross-encoders).

Their ``config.json`` says ``model_type: "bert"`` and
``position_embedding_type: "alibi"`` (``models.module_for`` sends those here,
not to bert.py) and runs as remote code, in one of two layer layouts:

* jinaai/jina-bert-implementation's (jina-embeddings-v2-small/base-en/de/es/zh,
  jina-reranker-v1): BERT's post-LN layer with a GLU feed-forward;
* jinaai/jina-bert-v2-qk-post-norm's (jina-embeddings-v2-base-code): LayerNorms
  on the query and key, and the layer's input added twice.

``config.json`` names the layout (``auto_map`` or ``_name_or_path``); where it
does not, the weights do (``mlp.gated_layers`` or ``mlp.up_gated_layer``).

* embeddings (both): word + token type, then LayerNorm; no position table;
* attention (both): softmax(q k^T / sqrt(head_dim) + alibi) v, where head h's
  bias is ``-slope_h * |i - j|`` (symmetric: every key is penalized by its
  distance, before or after), unscaled by 1/sqrt(head_dim); then
  a = LN_attn(out_proj(ctx) + x) (BERT's attention output);
* the GLU (both): down(up * act(gate)) with exact GELU
  (``feed_forward_type: "geglu"``) or ReLU (``"reglu"``); ``hidden_act`` is
  not read. The fused projection holds gate then up (``mlp.gated_layers``) or
  up then gate (``mlp.up_gated_layer``);
* jina-bert-implementation's layer: a as above, then
  ``mlp.layernorm(wo(glu(a)) + a)``;
* qk-post-norm's layer: q = LN_q(x Wq + bq), k = LN_k(x Wk + bk) (each over
  the whole hidden width, before the heads are split); after a,
  r = LN_1(x + a) (the layer's input added a second time), then
  LN_2(r + glu(r)).
* ALiBi slopes as the reference builds them: for a power-of-two head count n,
  ``start = 2 ** (-8 / n)`` and slope_h = start ** (h + 1); otherwise the
  slopes of the largest power of two p below n, then every other slope of 2p
  (``[0::2]``) for the remaining n - p heads.

The attention: on the CPU's native path, the streaming attention kernel
(``ops.decoder_attention``), the ALiBi bias computed inside its key tiles from
the slopes; elsewhere MLX: the bias and padding mask added before the
project's softmax, or MLX's fused SDPA with them as its additive mask where
the backend uses that. Long inputs (jina-embeddings-v2 takes 8192 tokens) go
in blocks of query rows (``ops.blocked_attention``), their ALiBi rows made
per block, never a [heads, L, L] table. The projections, GELU and residual
LayerNorms use ops.py's kernels.

Not implemented, refused at load: ``feed_forward_type: "original"`` (a plain
MLP, which no published checkpoint uses); position types other than ALiBi.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import ops
from . import LengthTables, config_args, join_linears, split_linear

# jina-embeddings-v2 folders (and the reference's own encode()) mean-pool.
EMBEDDING_DEFAULTS = {"pooling": "mean"}

# The two layer layouts, as config.json's auto_map / _name_or_path name the
# remote code, and the weight each one's checkpoints have in every layer.
IMPLEMENTATION = "jina-bert-implementation"
QK_POST_NORM = "jina-bert-v2-qk-post-norm"
_LAYOUT_WEIGHTS = {IMPLEMENTATION: ".mlp.gated_layers.", QK_POST_NORM: ".mlp.up_gated_layer."}


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
class AlibiTerms:
    """What one forward pass's attention adds to the scores: the padding
    ``mask``; ALiBi's ``slopes`` (the native path computes the bias from them
    inside its attention kernel's key tiles); ``additive(start, end)``, the bias plus the padding
    mask for query rows [start, end), for the other paths."""

    mask: ops.KeyMask
    slopes: list
    additive: Callable[[int, int], mx.array]


def alibi_rows(slopes: mx.array, start: int, end: int, length: int) -> mx.array:
    """Rows [start, end) of the ALiBi bias, [heads, end - start, length],
    built in the graph from the [heads] ``slopes``."""
    dist = mx.abs(mx.arange(start, end)[:, None] - mx.arange(length)[None, :]).astype(mx.float32)
    return -slopes[:, None, None] * dist[None]


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
    name_or_path: str = ""
    # IMPLEMENTATION or QK_POST_NORM; None until the weights say.
    layout: Optional[str] = field(default=None, init=False)

    @classmethod
    def from_dict(cls, params: dict) -> "ModelArgs":
        kw = config_args(cls, {k: v for k, v in params.items() if v is not None})
        kw["name_or_path"] = str(params.get("_name_or_path") or "")
        return cls(**kw)

    def __post_init__(self):
        bad = []
        if self.position_embedding_type != "alibi":
            bad.append(f"position_embedding_type={self.position_embedding_type!r} (only 'alibi')")
        if self.feed_forward_type not in ("geglu", "reglu"):
            bad.append(f"feed_forward_type={self.feed_forward_type!r} (only 'geglu', 'reglu')")
        code = " ".join([self.name_or_path, *(str(v) for v in (self.auto_map or {}).values())])
        named = [layout for layout in _LAYOUT_WEIGHTS if layout in code]
        if len(named) > 1:
            bad.append(f"config.json names both {IMPLEMENTATION} and {QK_POST_NORM}")
        elif named:
            self.layout = named[0]
        if bad:
            raise ValueError("JinaBERT: unsupported variant: " + "; ".join(bad))
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("JinaBERT: hidden_size must be divisible by num_attention_heads")
        self.head_dim = self.hidden_size // self.num_attention_heads


def layout_of(weights: dict) -> Optional[str]:
    """The layer layout a checkpoint's weight names show, if any."""
    found = {layout for layout, marker in _LAYOUT_WEIGHTS.items() if any(marker in n for n in weights)}
    if len(found) > 1:
        raise ValueError(f"JinaBERT: the weights mix {IMPLEMENTATION}'s and {QK_POST_NORM}'s layer layouts")
    return found.pop() if found else None


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
        self.qk_norm = args.layout == QK_POST_NORM
        if self.qk_norm:
            self.q_norm = nn.LayerNorm(dim, eps=args.layer_norm_eps)
            self.k_norm = nn.LayerNorm(dim, eps=args.layer_norm_eps)
        self.out_proj = nn.Linear(dim, dim, bias=True)

    def __call__(self, x: mx.array, terms: "AlibiTerms") -> mx.array:
        B, L, D = x.shape
        H = self.n_heads
        qkv = ops.linear(self.qkv, x)
        q, k, v = qkv[..., :D], qkv[..., D : 2 * D], qkv[..., 2 * D :]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.reshape(B, L, H, D // H).transpose(0, 2, 1, 3) for t in (q, k, v))
        # The bias is added after the 1/sqrt(head_dim) scaling, as in the
        # reference (ALiBi slopes are not scaled).
        out = ops.blocked_attention(
            q, k, v, self.scale, mask=terms.mask, additive=terms.additive, alibi=terms.slopes,
            fused=ops.current().fused_attention,
        )
        return ops.linear(self.out_proj, out.transpose(0, 2, 1, 3).reshape(B, L, D))


class GatedMLP(nn.Module):
    """``down(up(x) * act(gate(x)))``; the checkpoint's fused projection
    (``up_gated_layer``: up rows, then gate rows; ``gated_layers``: gate rows,
    then up rows) is kept as two so the GELU runs fused into the gate's GEMM
    on the native path."""


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


@ops.layer_boundary
class PostNormLayer(nn.Module):
    """jina-bert-implementation's layer: BERT's, with the GLU feed-forward."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        eps = args.layer_norm_eps
        self.attention = Attention(args)
        self.attention_norm = nn.LayerNorm(args.hidden_size, eps=eps)
        self.mlp = GatedMLP(args)
        self.mlp_norm = nn.LayerNorm(args.hidden_size, eps=eps)

    def __call__(self, x: mx.array, terms: AlibiTerms) -> mx.array:
        a = ops.add_layer_norm(self.attention(x, terms), x, self.attention_norm, overwrite_input=True)
        return ops.add_layer_norm(self.mlp(a), a, self.mlp_norm, overwrite_input=True)


@ops.layer_boundary
class QkPostNormLayer(nn.Module):
    """jina-bert-v2-qk-post-norm's layer: q/k LayerNorms and the layer's
    input added twice."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        eps = args.layer_norm_eps
        self.attention = Attention(args)
        self.attention_norm = nn.LayerNorm(args.hidden_size, eps=eps)
        self.norm1 = nn.LayerNorm(args.hidden_size, eps=eps)
        self.mlp = GatedMLP(args)
        self.norm2 = nn.LayerNorm(args.hidden_size, eps=eps)

    def __call__(self, x: mx.array, terms: AlibiTerms) -> mx.array:
        a = ops.add_layer_norm(self.attention(x, terms), x, self.attention_norm, overwrite_input=True)
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
        self._build_layers()
        # Not a module child (no parameters): ALiBi biases per padded length.
        object.__setattr__(
            self, "_alibi", LengthTables(lambda n: (alibi_bias(args.num_attention_heads, n),), keep=8)
        )
        object.__setattr__(self, "_slopes", alibi_slopes(args.num_attention_heads))

    def _build_layers(self) -> None:
        layer = QkPostNormLayer if self.args.layout == QK_POST_NORM else PostNormLayer
        self.layers = [layer(self.args) for _ in range(self.args.num_hidden_layers)]

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
        length = input_ids.shape[1]
        whole: list = []

        def additive(start: int, end: int) -> mx.array:
            if (start, end) == (0, length):
                # Every layer adds the same [B, H, L, L] term: made once.
                if not whole:
                    whole.append(self._alibi_table(length, x.dtype) + mask.additive)
                return whole[0]
            rows = alibi_rows(mx.array(self._slopes, dtype=mx.float32), start, end, length)
            return rows.astype(x.dtype)[None] + mask.additive

        terms = AlibiTerms(mask, self._slopes, additive)
        for layer in self.layers:
            x = layer(x, terms)
        return x

    _RENAMES = (
        (r"^embeddings\.LayerNorm\.", "embeddings.norm."),
        (r"^encoder\.layer\.(\d+)\.mlp\.gated_layers\.", r"layers.\1.mlp.gated_up."),
        (r"^encoder\.layer\.(\d+)\.mlp\.wo\.", r"layers.\1.mlp.down."),
        (r"^encoder\.layer\.(\d+)\.mlp\.layernorm\.", r"layers.\1.mlp_norm."),
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
        shown = layout_of(weights)
        if shown is not None and self.args.layout not in (None, shown):
            raise ValueError(
                f"JinaBERT: config.json names {self.args.layout}, but the weights are in {shown}'s layout"
            )
        if self.args.layout is None:
            # A folder whose config names neither remote code (auto_map
            # dropped by a conversion): the weights decide.
            self.args.layout = shown or IMPLEMENTATION
            self._build_layers()
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
            split_linear(out, pre + "mlp.gated_up", (pre + "mlp.gate", pre + "mlp.up"))
        return out
