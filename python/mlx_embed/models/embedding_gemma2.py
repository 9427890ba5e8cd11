"""EmbeddingGemma 2's text encoder (google/embeddinggemma-2), as
transformers' ``EmbeddingGemma2TextModel``.

A bidirectional Gemma 4-style stack, with what sets it apart from the
EmbeddingGemma v1 file (gemma3_text.py):

- RMSNorm scales by ``weight`` (not ``1 + weight``); queries and keys are
  RMS-normed per head with a scale, values without one, and the scores are
  not scaled (1.0: the norms set the magnitude);
- sliding layers see keys at most ``sliding_window`` positions away on either
  side: the config's window is already the radius (its docstring), not
  v1's width that transformers halves;
- full layers may have their own head width and key/value heads
  (``per_layer_config``, or ``global_head_dim`` / ``num_global_key_value_heads``
  where config.json has none, as transformers derives them), with RoPE over
  that width;
- projection-only per-layer embeddings (PLE): one linear of the scaled token
  embeddings, times ``hidden_size ** -0.5``, cut into one
  ``hidden_size_per_layer_input`` slice per layer and RMS-normed; each layer
  ends with a third residual block gated by its slice, then multiplies the
  stream by its saved ``layer_scalar``;
- the last norm is followed by ``embedding_projection`` to ``embedding_dim``
  on every token; the folder's mean pooling comes after (a bias-free linear
  commutes with the mean).

The published checkpoint is the multimodal ``EmbeddingGemma2Model``: the text
stack under ``language_model.``, beside vision and audio towers. Only text is
served: the towers' weights are dropped at load. Its forward swaps the image,
video and audio placeholder ids for the pad id before the embedding lookup,
which a text containing those tokens meets here too.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from .. import ops
from . import DECODER_SIBLINGS, config_args, mlx_lm_model
from .gemma3_text import GeGLU

log = logging.getLogger(__name__)

# Called through this module's global so that ops.engine_attention can make
# it the engine's attention (the native kernel, with the window, on the CPU).
scaled_dot_product_attention = mlx_lm_model("base").scaled_dot_product_attention
ops.engine_attention(sys.modules[__name__])

EMBEDDING_DEFAULTS = {"pooling": "mean"}

# Queries/keys/values and gate/up as one matmul each (sibling_linears.py).
JOINED_LINEARS = DECODER_SIBLINGS

_GLOBAL, _LOCAL = "full_attention", "sliding_attention"
_ARCH = "embedding_gemma2"

# What the multimodal checkpoint holds beside the text stack.
_TOWERS = ("vision_tower.", "embed_vision.", "audio_tower.", "embed_audio.")

# EmbeddingGemma2Config's placeholder ids (replaced by the pad id).
_PLACEHOLDERS = {"image_token_id": 258_880, "video_token_id": 258_884, "audio_token_id": 258_881}

# per_layer_config keys this file builds a layer from.
_PER_LAYER_KEYS = ("head_dim", "num_key_value_heads", "intermediate_size")


@dataclass
class ModelArgs:
    # EmbeddingGemma2TextConfig's defaults, for keys config.json leaves out.
    model_type: str = "embedding_gemma2_text"
    vocab_size: int = 262_144
    hidden_size: int = 512
    intermediate_size: int = 2048
    num_hidden_layers: int = 24
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 256
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 262_144
    rms_norm_eps: float = 1e-6
    pad_token_id: Optional[int] = 0
    rope_parameters: Optional[dict] = None
    attention_bias: bool = False
    sliding_window: int = 512
    sliding_window_pattern: int = 6
    layer_types: Optional[list] = None
    hidden_size_per_layer_input: int = 512
    embedding_dim: int = 768
    global_head_dim: int = 512
    num_global_key_value_heads: int = 1
    per_layer_config: Optional[dict] = None
    # From the multimodal config around the text one: ids swapped for the pad id.
    placeholder_ids: list = field(default_factory=list)

    @classmethod
    def from_dict(cls, params: dict) -> "ModelArgs":
        placeholders: list = []
        if params.get("model_type") == _ARCH:
            placeholders = [int(params.get(k, v)) for k, v in _PLACEHOLDERS.items() if params.get(k, v) is not None]
            text = params.get("text_config") or {}
            if not isinstance(text, dict):
                raise ValueError(f"{_ARCH}: text_config must be an object, got {type(text).__name__}")
            params = text
        args = cls(**config_args(cls, params))
        args.placeholder_ids = placeholders
        return args

    def __post_init__(self):
        if self.hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(f"{_ARCH}: hidden_activation={self.hidden_activation!r} is not supported")
        if self.attention_bias:
            raise ValueError(f"{_ARCH}: attention_bias=true is not supported")
        if not self.hidden_size_per_layer_input:
            raise ValueError(f"{_ARCH}: hidden_size_per_layer_input must be set (PLE is part of the model)")
        n = self.num_hidden_layers
        if self.layer_types is None:
            every = self.sliding_window_pattern
            self.layer_types = [_GLOBAL if (i + 1) % every == 0 else _LOCAL for i in range(n)]
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != n or set(self.layer_types) - {_GLOBAL, _LOCAL}:
            raise ValueError(f"{_ARCH}: layer_types must be {n} of {_LOCAL!r} / {_GLOBAL!r}")
        if self.layer_types[-1] != _GLOBAL:
            log.warning("%s: the last layer must use full attention; made so, as transformers does", _ARCH)
            self.layer_types[-1] = _GLOBAL
        if self.per_layer_config is not None:
            self.per_layer_config = _layer_overrides(self.per_layer_config, n)
        rope = self.rope_parameters or {}
        self.rope_theta = {}
        for kind, theta in ((_LOCAL, 10_000.0), (_GLOBAL, 1_000_000.0)):
            p = rope.get(kind) if rope else {"rope_type": "default", "rope_theta": theta}
            if kind in self.layer_types:
                if not isinstance(p, dict):
                    raise ValueError(f"{_ARCH}: rope_parameters lacks {kind!r}")
                if p.get("rope_type", "default") != "default":
                    raise ValueError(f"{_ARCH}: rope_type={p['rope_type']!r} for {kind} is not supported")
                self.rope_theta[kind] = float(p.get("rope_theta", theta))
        self.layers = [self._layer(i) for i in range(n)]
        for kind in (_LOCAL, _GLOBAL):
            widths = {lc["head_dim"] for lc, t in zip(self.layers, self.layer_types) if t == kind}
            if len(widths) > 1:
                # transformers builds one RoPE table per layer type.
                raise ValueError(f"{_ARCH}: {kind} layers of different head_dim are not supported")

    def _layer(self, i: int) -> dict:
        """Layer ``i``'s head width, key/value heads and feed-forward width:
        the global ones with config.json's ``per_layer_config`` overrides, or
        where it has none, transformers' default for full layers."""
        base = {k: getattr(self, k) for k in _PER_LAYER_KEYS}
        if self.per_layer_config is None:
            if self.layer_types[i] == _GLOBAL:
                base.update(head_dim=self.global_head_dim, num_key_value_heads=self.num_global_key_value_heads)
        else:
            over = self.per_layer_config.get(i) or {}
            unknown = sorted(set(over) - set(_PER_LAYER_KEYS))
            if unknown:
                raise ValueError(f"{_ARCH}: per_layer_config[{i}] sets {', '.join(unknown)}, which is not supported")
            base.update(over)
        if self.num_attention_heads % base["num_key_value_heads"]:
            raise ValueError(f"{_ARCH}: layer {i}'s num_key_value_heads does not divide num_attention_heads")
        return base


def _layer_overrides(per_layer_config: dict, n: int) -> dict:
    """``per_layer_config`` by layer index. transformers reads its keys with
    ``int()`` and writes them zero-padded to the widest index, so a
    24-layer config.json (google/embeddinggemma-2's) says "05" for layer 5."""
    out = {}
    for key, over in per_layer_config.items():
        try:
            i = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"{_ARCH}: per_layer_config key {key!r} is not a layer index") from None
        if not 0 <= i < n:
            raise ValueError(f"{_ARCH}: per_layer_config key {key!r} is not a layer index in [0, {n})")
        out[i] = over
    return out


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = _Encoder(args)
        self._placeholders = mx.array(args.placeholder_ids, dtype=mx.int32) if args.placeholder_ids else None

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def max_length(self) -> int:
        return self.args.max_position_embeddings

    @property
    def hidden_size(self) -> int:
        # What a token's vector is wide after embedding_projection: the pooled width.
        return self.args.embedding_dim

    def __call__(self, input_ids: mx.array, attention_mask: mx.array) -> mx.array:
        if self._placeholders is not None:
            hit = (input_ids[..., None] == self._placeholders).any(axis=-1)
            input_ids = mx.where(hit, self.args.pad_token_id or 0, input_ids)
        return self.model(input_ids, attention_mask)

    def sanitize(self, weights: dict) -> dict:
        """The text stack's weights under ``model.``: the multimodal save keeps
        them under ``language_model.`` (beside the towers, dropped here), the
        text model's own save bare."""
        out, dropped = {}, set()
        for name, w in weights.items():
            name = name.removeprefix("model.")
            if name.startswith(_TOWERS):
                dropped.add(name.split(".", 1)[0])
                continue
            if "rotary_emb." in name:
                continue
            out["model." + name.removeprefix("language_model.")] = w
        if dropped:
            log.info("%s: serving text only; left out the %s weights", _ARCH, ", ".join(sorted(dropped)))
        return out


class _Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: dict, kind: str):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = layer["num_key_value_heads"]
        self.head_dim = hd = layer["head_dim"]
        dim = args.hidden_size
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self._eps = args.rms_norm_eps
        self.rope = nn.RoPE(hd, traditional=False, base=args.rope_theta[kind])

    def __call__(self, x: mx.array, mask: ops.BandMask) -> mx.array:
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = mx.fast.rms_norm(self.v_proj(x).reshape(B, L, self.n_kv_heads, -1), None, self._eps)
        out = scaled_dot_product_attention(self.rope(q), self.rope(k), v.transpose(0, 2, 1, 3), scale=1.0, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class _PLEBlock(nn.Module):
    """A layer's third residual block: its per-layer slice gates a bottleneck."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, ple = args.hidden_size, args.hidden_size_per_layer_input
        self.per_layer_input_gate = nn.Linear(dim, ple, bias=False)
        self.per_layer_projection = nn.Linear(ple, dim, bias=False)
        self.post_per_layer_input_norm = nn.RMSNorm(dim, eps=args.rms_norm_eps)

    def __call__(self, h: mx.array, per_layer: mx.array) -> mx.array:
        gated = ops.gelu_tanh_gated(self.per_layer_input_gate(h), per_layer)
        return h + self.post_per_layer_input_norm(self.per_layer_projection(gated))


@ops.layer_boundary
class _Layer(nn.Module):
    def __init__(self, args: ModelArgs, i: int):
        super().__init__()
        layer, kind = args.layers[i], args.layer_types[i]
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = _Attention(args, layer, kind)
        self.mlp = GeGLU(dim, layer["intermediate_size"])
        self.input_layernorm = nn.RMSNorm(dim, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(dim, eps=eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(dim, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(dim, eps=eps)
        self.ple_block = _PLEBlock(args)
        self.layer_scalar = mx.ones((1,))

    def __call__(self, h: mx.array, mask: ops.BandMask, per_layer: mx.array) -> mx.array:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), mask))
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return self.ple_block(h, per_layer) * self.layer_scalar


class _PLE(nn.Module):
    """The per-layer embeddings, from the scaled token embeddings alone."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_layers, self.width = args.num_hidden_layers, args.hidden_size_per_layer_input
        self.scale = args.hidden_size**-0.5
        self.per_layer_model_projection = nn.Linear(args.hidden_size, self.n_layers * self.width, bias=False)
        self.per_layer_projection_norm = nn.RMSNorm(self.width, eps=args.rms_norm_eps)

    def __call__(self, h: mx.array) -> mx.array:
        p = self.per_layer_model_projection(h) * mx.array(self.scale, dtype=h.dtype)
        return self.per_layer_projection_norm(p.reshape(*h.shape[:-1], self.n_layers, self.width))


class _Encoder(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.ple = _PLE(args)
        self.layers = [_Layer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.embedding_projection = nn.Linear(args.hidden_size, args.embedding_dim, bias=False)

    def __call__(self, input_ids: mx.array, attention_mask: mx.array) -> mx.array:
        h = self.embed_tokens(input_ids)
        # sqrt(hidden_size) in the weights' dtype, as transformers takes it.
        h = h * mx.array(self.args.hidden_size**0.5, dtype=h.dtype)
        # One contiguous [B, L, width] slice per layer (the gate's kernel takes
        # no strided input).
        per_layer = mx.contiguous(self.ple(h).transpose(2, 0, 1, 3))
        keys = ops.KeyMask(attention_mask, h.dtype)
        masks = {_GLOBAL: ops.BandMask(keys), _LOCAL: ops.BandMask(keys, half=self.args.sliding_window)}
        with ops.packed_feed_forwards(keys):
            for i, (kind, layer) in enumerate(zip(self.args.layer_types, self.layers)):
                h = layer(h, masks[kind], per_layer[i])
        return self.embedding_projection(self.norm(h))
