"""DeBERTa-v2 / v3 encoder (mxbai-rerank-*-v1, nli-deberta-v3, ms-marco
DeBERTa cross-encoders; ``model_type: "deberta-v2"``).

A post-LN BERT-shaped block whose attention is disentangled: besides the
content-to-content score ``q_i . k_j`` every layer adds a content-to-position
term ``q_i . Pk[r]`` (c2p) and a position-to-content term ``k_j . Pq[r]``
(p2c), where ``r`` is the bucketed relative distance ``i - j`` and ``Pk``,
``Pq`` are one shared table of relative embeddings projected by the layer
(by its own query/key projections with ``share_att_key``, as v3 does). All
three terms are divided by ``sqrt(head_dim * (1 + number of pos terms))``.

DeBERTa-v3 has no absolute positions (``position_biased_input: false``) and
no token types (``type_vocab_size: 0``); v2-xlarge adds a convolution on the
embeddings after the first layer (``conv_kernel_size``). Every switch that
transformers' ``DebertaV2Model`` reads is read here; values it does not
implement are refused at load.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

import mlx.core as mx
import mlx.nn as nn

from .. import ops
from . import config_args

# A bare encoder folder (no sentence-transformers modules) embeds by mean.
EMBEDDING_DEFAULTS = {"pooling": "mean"}

# transformers' ACT2FN names this file computes, and how.
_ACTIVATIONS = {
    "gelu": nn.gelu,
    "gelu_new": nn.gelu_approx,
    "gelu_pytorch_tanh": nn.gelu_approx,
    "tanh": mx.tanh,
    "relu": nn.relu,
}
_POS_TERMS = ("c2p", "p2c")


def activation(name: str, what: str):
    fn = _ACTIVATIONS.get(str(name).lower())
    if fn is None:
        raise ValueError(
            f"deberta-v2: {what}={name!r} is not supported (supported: {', '.join(_ACTIVATIONS)})"
        )
    return fn


@dataclass
class ModelArgs:
    model_type: str = "deberta-v2"
    # Defaults are transformers' DebertaV2Config's (what a config.json that
    # leaves a key out means).
    vocab_size: int = 128100
    hidden_size: int = 1536
    num_hidden_layers: int = 24
    num_attention_heads: int = 24
    intermediate_size: int = 6144
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 0
    layer_norm_eps: float = 1e-7
    relative_attention: bool = False
    max_relative_positions: int = -1
    position_buckets: int = -1
    position_biased_input: bool = True
    pos_att_type: Optional[Union[str, list]] = None
    share_att_key: bool = False
    norm_rel_ebd: str = "none"
    embedding_size: Optional[int] = None
    attention_head_size: Optional[int] = None
    conv_kernel_size: int = 0
    conv_groups: int = 1
    conv_act: str = "tanh"
    pooler_hidden_size: Optional[int] = None
    pooler_hidden_act: str = "gelu"

    @classmethod
    def from_dict(cls, params: dict) -> "ModelArgs":
        return cls(**config_args(cls, params))

    def __post_init__(self):
        if self.model_type != "deberta-v2":
            # DeBERTa v1 ("deberta") differs (its own attention and LayerNorm).
            raise ValueError(f"deberta-v2: model_type {self.model_type!r} is not 'deberta-v2'")
        # transformers accepts "p2c|c2p" as well as a list.
        types = self.pos_att_type
        if types is None:
            types = []
        elif isinstance(types, str):
            types = types.lower().split("|")
        self.pos_att_type = [str(t).strip().lower() for t in types if str(t).strip()]
        unknown = [t for t in self.pos_att_type if t not in _POS_TERMS]
        if unknown:
            raise ValueError(
                f"deberta-v2: pos_att_type {unknown} is not supported (only 'c2p' and 'p2c'; "
                "'p2p' is DeBERTa v1's)"
            )
        norms = [x.strip() for x in str(self.norm_rel_ebd or "none").lower().split("|")]
        if any(x not in ("none", "layer_norm") for x in norms):
            raise ValueError(
                f"deberta-v2: norm_rel_ebd={self.norm_rel_ebd!r} is not supported "
                "(only 'layer_norm' or 'none')"
            )
        self.norm_rel_ebd = "layer_norm" if "layer_norm" in norms else "none"
        if str(self.hidden_act).lower() not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"deberta-v2: hidden_act={self.hidden_act!r} is not supported")
        if self.embedding_size is None:
            self.embedding_size = self.hidden_size
        if self.attention_head_size is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError("deberta-v2: hidden_size must be divisible by num_attention_heads")
            self.attention_head_size = self.hidden_size // self.num_attention_heads
        if self.attention_head_size * self.num_attention_heads != self.hidden_size:
            # The attention output projection is [hidden, hidden] in transformers,
            # so any other width could not have been run there either.
            raise ValueError(
                f"deberta-v2: attention_head_size {self.attention_head_size} x "
                f"{self.num_attention_heads} heads != hidden_size {self.hidden_size}"
            )
        if self.pooler_hidden_size is not None and self.pooler_hidden_size != self.hidden_size:
            raise ValueError(
                f"deberta-v2: pooler_hidden_size {self.pooler_hidden_size} != hidden_size "
                f"{self.hidden_size} is not supported"
            )
        if self.type_vocab_size < 0:
            raise ValueError(f"deberta-v2: type_vocab_size must be >= 0, got {self.type_vocab_size}")
        if self.conv_kernel_size > 0:
            if self.conv_kernel_size % 2 == 0:
                # transformers pads (k-1)//2 on both sides: an even kernel
                # shortens the sequence and the residual add fails there.
                raise ValueError(
                    f"deberta-v2: conv_kernel_size={self.conv_kernel_size} (even) is not supported"
                )
            if self.hidden_size % max(1, self.conv_groups):
                raise ValueError("deberta-v2: hidden_size must be divisible by conv_groups")
            activation(self.conv_act, "conv_act")

    @property
    def max_relative(self) -> int:
        """The distance the log buckets reach (transformers: the position table's
        size when the config says -1)."""
        return self.max_relative_positions if self.max_relative_positions >= 1 else self.max_position_embeddings

    @property
    def span(self) -> int:
        """Half the rows of the relative embedding table that are used."""
        return self.position_buckets if self.position_buckets > 0 else self.max_relative

    @property
    def score_scale(self) -> float:
        # transformers takes the square root in float32.
        return float(np.sqrt(np.float32(self.attention_head_size * (1 + len(self.pos_att_type)))))


def log_bucket_positions(rel: np.ndarray, buckets: int, max_position: int) -> np.ndarray:
    """Signed relative distances -> DeBERTa's log buckets: exact inside
    ``buckets // 2``, log-spaced beyond, reaching ``buckets // 2 + mid - 1``
    at ``max_position - 1`` (and further past it: the caller clamps).

    Computed in float32 like transformers (its ratio is a float32 log), so
    ``ceil`` lands on the same side at every boundary."""
    rel = np.asarray(rel, dtype=np.int64)
    mid = buckets // 2
    sign = np.sign(rel)
    inside = (rel < mid) & (rel > -mid)
    abs_pos = np.where(inside, mid - 1, np.abs(rel)).astype(np.float32)
    denom = np.log(np.float32((max_position - 1) / mid), dtype=np.float32)
    ratio = np.log(abs_pos / np.float32(mid), dtype=np.float32) / denom
    log_pos = np.ceil(ratio * np.float32(mid - 1)) + np.float32(mid)
    return np.where(abs_pos <= mid, rel, (log_pos * sign).astype(np.int64)).astype(np.int64)


@functools.lru_cache(maxsize=64)
def _relative_index(length: int, buckets: int, max_position: int, span: int) -> tuple[mx.array, int, int]:
    """([L, L] index, first, last): query i uses row ``first + index[i, j]``
    of the relative table for key j. Only rows ``first..last`` are ever read
    (2L - 1 of v3's 512 for inputs under 128 tokens), so the layers project
    and score against that slice, not the whole table."""
    pos = np.arange(length)
    rel = pos[:, None] - pos[None, :]
    if buckets > 0 and max_position > 0:
        rel = log_bucket_positions(rel, buckets, max_position)
    rows = np.clip(rel + span, 0, 2 * span - 1)
    first, last = int(rows.min()), int(rows.max())
    return mx.array((rows - first).astype(np.int32)), first, last


@functools.lru_cache(maxsize=1024)
def _relative_index_of(length: int, buckets: int, max_position: int, span: int) -> tuple[mx.array, int, int]:
    """``_relative_index``, kept per length: attention one text at a time
    asks for each text's."""
    return _relative_index(length, buckets, max_position, span)


class Embeddings(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        e = args.embedding_size
        self.word_embeddings = nn.Embedding(args.vocab_size, e)
        if args.position_biased_input:
            self.position_embeddings = nn.Embedding(args.max_position_embeddings, e)
        if args.type_vocab_size > 0:
            self.token_type_embeddings = nn.Embedding(args.type_vocab_size, e)
        if e != args.hidden_size:
            self.embed_proj = nn.Linear(e, args.hidden_size, bias=False)
        self.norm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def __call__(self, input_ids: mx.array, mask: mx.array, token_type_ids: Optional[mx.array]) -> mx.array:
        L = input_ids.shape[1]
        x = self.word_embeddings(input_ids)
        if "position_embeddings" in self:
            x = x + self.position_embeddings.weight[:L]
        if "token_type_embeddings" in self:
            x = x + (
                self.token_type_embeddings.weight[0]
                if token_type_ids is None
                else self.token_type_embeddings(token_type_ids)
            )
        if "embed_proj" in self:
            x = self.embed_proj(x)
        # Padding rows are zeroed as transformers does: the convolution
        # (v2-xlarge) reads neighbours, and must see zeros past the end.
        return self.norm(x) * mask[..., None]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.head_dim = args.attention_head_size
        self.scale = args.score_scale
        self.c2p = "c2p" in args.pos_att_type
        self.p2c = "p2c" in args.pos_att_type
        self.index_args = (args.position_buckets, args.max_relative, args.span)
        self.relative = args.relative_attention
        self.query_proj = nn.Linear(dim, dim)
        self.key_proj = nn.Linear(dim, dim)
        self.value_proj = nn.Linear(dim, dim)
        self.share_att_key = args.share_att_key
        if self.relative and not args.share_att_key:
            if self.c2p:
                self.pos_key_proj = nn.Linear(dim, dim)
            if self.p2c:
                self.pos_query_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def _heads(self, x: mx.array) -> mx.array:
        # [..., L, D] -> [..., H, L, d]
        *lead, L, _ = x.shape
        x = x.reshape(*lead, L, self.n_heads, self.head_dim)
        return mx.swapaxes(x, -2, -3)

    def _scores(self, q, k, index, pk, pq) -> mx.array:
        """Scaled scores of queries against keys, with the relative terms
        (``pk``/``pq``: the projected relative rows ``index`` reads)."""
        scores = q @ k.swapaxes(-1, -2)
        if pk is not None or pq is not None:
            # [1, 1, L, L]: take_along_axis broadcasts it over batch and heads.
            idx = index[None, None]
            if pk is not None:
                # c2p[i, j] = q_i . Pk[index[i, j]]
                scores = scores + mx.take_along_axis(q @ pk.swapaxes(-1, -2), idx, axis=-1)
            if pq is not None:
                # p2c[i, j] = k_j . Pq[index[i, j]]: gathered per key row with
                # the transposed index, then turned back to [query, key].
                by_key = mx.take_along_axis(k @ pq.swapaxes(-1, -2), idx.swapaxes(-1, -2), axis=-1)
                scores = scores + by_key.swapaxes(-1, -2)
        return scores * (1.0 / self.scale)

    def __call__(
        self, x: mx.array, mask: ops.KeyMask, rel: Optional[mx.array], index: Optional[mx.array]
    ) -> mx.array:
        B, L, D = x.shape
        q = self._heads(ops.linear(self.query_proj, x))
        k = self._heads(ops.linear(self.key_proj, x))
        v = self._heads(ops.linear(self.value_proj, x))
        relative = self.relative and (self.c2p or self.p2c)
        pk = pq = None
        if relative and self.c2p:
            pk = self._heads(ops.linear(self.key_proj if self.share_att_key else self.pos_key_proj, rel))
        if relative and self.p2c:
            pq = self._heads(ops.linear(self.query_proj if self.share_att_key else self.pos_query_proj, rel))
        if not ops.attends_per_text(q):
            probs = ops.softmax(self._scores(q, k, index, pk, pq) + mask.additive)
            out = probs @ v
        else:
            # One text at a time (ops.per_text), against the relative rows its
            # own length reads: a row's projection is the same bits whatever
            # the slice (ops.linear), and so is each text's every product.
            first = _relative_index_of(L, *self.index_args)[1] if relative else 0

            def text(qb, kb, vb, b, n):
                idx, lo, hi = _relative_index_of(n, *self.index_args) if relative else (None, 0, 0)
                rows = slice(lo - first, hi - first + 1)
                pkb = None if pk is None else pk[:, rows]
                pqb = None if pq is None else pq[:, rows]
                return ops.softmax(self._scores(qb, kb, idx, pkb, pqb)) @ vb

            out = ops.per_text(q, k, v, mask.lengths, text)
        out = out.swapaxes(1, 2).reshape(B, L, D)
        return ops.linear(self.out_proj, out)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.up = nn.Linear(args.hidden_size, args.intermediate_size)
        self.down = nn.Linear(args.intermediate_size, args.hidden_size)
        self.tanh_gelu = args.hidden_act.lower() != "gelu"

    def __call__(self, x: mx.array) -> mx.array:
        if self.tanh_gelu:
            return ops.linear(self.down, ops.gelu_tanh(ops.linear(self.up, x)))
        return ops.linear(self.down, ops.linear(self.up, x, activation="gelu"))


@ops.layer_boundary
class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.attention_norm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.ffn = FeedForward(args)
        self.ffn_norm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def __call__(self, x, mask, rel, index) -> mx.array:
        x = ops.add_layer_norm(self.attention(x, mask, rel, index), x, self.attention_norm, overwrite_input=True)
        return ops.add_layer_norm(self.ffn(x), x, self.ffn_norm, overwrite_input=True)


class ConvLayer(nn.Module):
    """v2-xlarge's convolution over the (masked) embeddings, added to the
    first layer's output: LayerNorm(h + act(conv(e))), padding rows zero."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        D, k, g = args.hidden_size, args.conv_kernel_size, max(1, args.conv_groups)
        # MLX's layout [out, kernel, in / groups] (torch's is [out, in / groups, kernel]).
        self.weight = mx.zeros((D, k, D // g))
        self.bias = mx.zeros((D,))
        self.groups = g
        self.padding = (k - 1) // 2
        self.act = activation(args.conv_act, "conv_act")
        self.norm = nn.LayerNorm(D, eps=args.layer_norm_eps)

    def __call__(self, embedded: mx.array, h: mx.array, mask: mx.array) -> mx.array:
        m = mask[..., None]
        if self.groups == 1 and ops.attends_per_text(embedded):
            # As one linear over each position's window of rows, by the native
            # kernel (ops.rows_times): a text's outputs then do not follow its
            # batch, as MLX's convolution (a BLAS product over every row of the
            # batch) makes them. The padding rows are zero, as the window
            # beyond a text's end is.
            D, k, _ = self.weight.shape
            L, p = embedded.shape[1], self.padding
            x = mx.pad(embedded, [(0, 0), (p, p), (0, 0)])
            count = L + 2 * p - k + 1
            windows = mx.concatenate([x[:, j : j + count] for j in range(k)], axis=-1)
            out = ops.rows_times(
                windows, self.weight.reshape(D, -1), self.bias, owner=self, key="conv", source=self.weight
            )
        else:
            out = mx.conv1d(embedded, self.weight, padding=self.padding, groups=self.groups) + self.bias
        out = self.act(out * m)
        return self.norm(h + out) * m


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.embeddings = Embeddings(args)
        self.layers = [TransformerBlock(args) for _ in range(args.num_hidden_layers)]
        if args.relative_attention:
            self.rel_embeddings = nn.Embedding(2 * args.span, args.hidden_size)
            if args.norm_rel_ebd == "layer_norm":
                self.rel_norm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        if args.conv_kernel_size > 0:
            self.conv = ConvLayer(args)

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def max_length(self) -> int:
        # The relative buckets (and v2's absolute table) were trained up to it;
        # every published tokenizer caps there too.
        return self.args.max_position_embeddings

    def __call__(
        self,
        input_ids: mx.array,
        attention_mask: mx.array,
        token_type_ids: Optional[mx.array] = None,
    ) -> mx.array:
        """Last hidden state [B, L, D] for right-padded rows; ``token_type_ids``
        only matter when the model has a token-type table."""
        a = self.args
        L = input_ids.shape[1]
        dtype = self.embeddings.norm.weight.dtype
        m = attention_mask.astype(dtype)
        x = self.embeddings(input_ids, m, token_type_ids)
        mask = ops.KeyMask(attention_mask, x.dtype)
        rel = index = None
        if a.relative_attention:
            index, first, last = _relative_index(L, a.position_buckets, a.max_relative, a.span)
            rel = self.rel_embeddings.weight[first : last + 1]
            if "rel_norm" in self:
                rel = self.rel_norm(rel)
        embedded = x
        for i, layer in enumerate(self.layers):
            x = layer(x, mask, rel, index)
            if i == 0 and "conv" in self:
                x = self.conv(embedded, x, m)
        return x

    _RENAMES = (
        (r"^embeddings\.LayerNorm\.", "embeddings.norm."),
        (r"^encoder\.rel_embeddings\.", "rel_embeddings."),
        (r"^encoder\.LayerNorm\.", "rel_norm."),
        (r"^encoder\.conv\.conv\.", "conv."),
        (r"^encoder\.conv\.LayerNorm\.", "conv.norm."),
        (r"^encoder\.layer\.(\d+)\.attention\.self\.", r"layers.\1.attention."),
        (r"^encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"layers.\1.attention.out_proj."),
        (r"^encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.", r"layers.\1.attention_norm."),
        (r"^encoder\.layer\.(\d+)\.intermediate\.dense\.", r"layers.\1.ffn.up."),
        (r"^encoder\.layer\.(\d+)\.output\.dense\.", r"layers.\1.ffn.down."),
        (r"^encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"layers.\1.ffn_norm."),
    )

    def sanitize(self, weights: dict) -> dict:
        out = {}
        for name, w in weights.items():
            if name.startswith("deberta."):
                name = name[len("deberta.") :]
            # Heads an encoder never uses: MLM (lm_predictions, cls), v3's
            # replaced-token detector (mask_predictions), classifiers.
            if name.startswith(("lm_predictions.", "cls.", "mask_predictions.", "pooler.", "classifier.")):
                continue
            if name.endswith("position_ids"):
                continue
            # v3 checkpoints may still carry an absolute table they never add
            # (transformers ignores it the same way).
            if name == "embeddings.position_embeddings.weight" and not self.args.position_biased_input:
                continue
            for pat, rep in self._RENAMES:
                name, n = re.subn(pat, rep, name)
                if n:
                    break
            if name == "conv.weight" and w.ndim == 3:
                w = w.transpose(0, 2, 1)
            out[name] = w
        return out
