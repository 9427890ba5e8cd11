"""NomicBERT encoder (nomic-embed-text-v1, v1.5, v2-moe).

Written from the architecture's published definition (Nomic's
``modeling_hf_nomic_bert.py``, which Hugging Face runs as remote code), for
checkpoints in that format: ``n_embd``/``n_head``/... in config.json and
``encoder.layers.N.attn.Wqkv`` weights. A post-LN BERT without absolute
positions: rotary embeddings (rotate-half, base ``rotary_emb_base``, over
``rotary_emb_fraction`` of each head), one fused q/k/v projection, and a
feed-forward that is SwiGLU ``fc2(fc11(x) * silu(fc12(x)))`` (v1, v1.5: no
biases) or GELU ``fc2(gelu(fc1(x)))`` (v2-moe: with biases).

v2-moe (``moe_every_n_layers``, ``num_experts``, ``moe_top_k``): layer i's
feed-forward is a mixture of experts where ``i % moe_every_n_layers == 1``
(the remote code's rule: layer 0 stays dense). Each token's router
probabilities are a softmax over all experts; the top-k experts' GELU MLPs
are summed weighted by those probabilities as they are (not renormalized
over the top k: ``moe_normalize_expert_weights`` false), then one bias shared
by all experts is added once.

Matryoshka: v1.5 and v2-moe are trained so that leading dimensions (v1.5:
64..768, v2-moe: 256 of 768) are usable on their own; the server's
``dimensions`` truncates and renormalizes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from .. import ops
from . import config_args

EMBEDDING_DEFAULTS = {"pooling": "mean"}


@dataclass
class ModelArgs:
    model_type: str = "nomic_bert"
    vocab_size: int = 30528
    n_embd: int = 768
    n_head: int = 12
    n_layer: int = 12
    n_inner: Optional[int] = None
    n_positions: int = 8192
    # Where config.json leaves a key out, Nomic's NomicBertConfig's default
    # (over GPT2Config's), as its remote code reads it: gelu_new and a
    # fraction of 0 are refused below, the rest run.
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    type_vocab_size: int = 2
    rotary_emb_fraction: float = 0.0
    rotary_emb_base: float = 10000.0
    rotary_emb_interleaved: bool = False
    rotary_emb_scale_base: Optional[float] = None
    rotary_scaling_factor: Optional[float] = None
    qkv_proj_bias: bool = True
    mlp_fc1_bias: bool = True
    mlp_fc2_bias: bool = True
    prenorm: bool = False
    causal: bool = False
    parallel_block: bool = False
    use_rms_norm: bool = False
    moe_every_n_layers: int = 0
    num_experts: int = 0
    moe_top_k: int = 1
    moe_normalize_expert_weights: Optional[float] = None
    num_shared_experts: int = 0
    expert_choice_router: bool = False

    @classmethod
    def from_dict(cls, params: dict) -> "ModelArgs":
        if "n_embd" not in params:
            raise ValueError(
                "nomic_bert: config.json is not in Nomic's format (no 'n_embd'); "
                "supported: the published nomic-embed-text checkpoints"
            )
        return cls(**config_args(cls, params))

    def __post_init__(self):
        moe = self.moe_every_n_layers > 0
        unsupported = {
            "activation_function": self.activation_function not in ("swiglu", "gelu")
            or (moe and self.activation_function != "gelu"),
            "rotary_emb_fraction": not 0 < self.rotary_emb_fraction <= 1,
            "rotary_emb_interleaved": self.rotary_emb_interleaved,
            "rotary_emb_scale_base": self.rotary_emb_scale_base is not None,
            "rotary_scaling_factor": self.rotary_scaling_factor is not None,
            "prenorm": self.prenorm,
            "causal": self.causal,
            "parallel_block": self.parallel_block,
            "use_rms_norm": self.use_rms_norm,
            # The remote code's i % n == 1 puts no layer in the mixture at n=1.
            "moe_every_n_layers": self.moe_every_n_layers == 1 or self.moe_every_n_layers < 0,
            "num_experts": moe and self.num_experts < 1,
            "moe_top_k": moe and not 1 <= self.moe_top_k <= self.num_experts,
            "moe_normalize_expert_weights": bool(self.moe_normalize_expert_weights),
            "num_shared_experts": bool(self.num_shared_experts),
            "expert_choice_router": self.expert_choice_router,
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise ValueError(
                "nomic_bert: unsupported variant ("
                + ", ".join(f"{k}={getattr(self, k)!r}" for k in bad)
                + "); supported: swiglu or gelu, post-norm, non-causal, rotate-half rotary without "
                "scaling, and (gelu) token-choice top-k experts every n >= 2 layers, weights not "
                "renormalized, no shared experts"
            )
        if self.n_embd % self.n_head:
            raise ValueError("nomic_bert: n_embd must be divisible by n_head")
        if self.n_inner is None:
            self.n_inner = 4 * self.n_embd
        self.head_dim = self.n_embd // self.n_head
        self.rotary_dim = int(self.head_dim * self.rotary_emb_fraction)
        if self.rotary_dim % 2:
            raise ValueError("nomic_bert: the rotary part of a head must have an even size")


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.n_embd
        self.n_heads = args.n_head
        self.head_dim = args.head_dim
        self.rotary_dim = args.rotary_dim
        self.base = float(args.rotary_emb_base)
        self.scale = self.head_dim**-0.5
        self.Wqkv = nn.Linear(dim, 3 * dim, bias=args.qkv_proj_bias)
        self.out_proj = nn.Linear(dim, dim, bias=args.qkv_proj_bias)

    def __call__(self, x: mx.array, mask: ops.KeyMask) -> mx.array:
        qkv = ops.padded(self.Wqkv(x), mask)
        B, L, D = qkv.shape[0], qkv.shape[1], x.shape[-1]
        qkv = qkv.reshape(B, L, 3, self.n_heads, self.head_dim)
        qkv = mx.contiguous(qkv.transpose(2, 0, 3, 1, 4))

        def rope(t):
            # Rotates the first rotary_dim features of each head only.
            return mx.fast.rope(t, self.rotary_dim, traditional=False, base=self.base, scale=1.0, offset=0)

        q, k, v = rope(qkv[0]), rope(qkv[1]), qkv[2]
        out = ops.blocked_attention(q, k, v, self.scale, mask=mask).transpose(0, 2, 1, 3).reshape(B, L, D)
        return self.out_proj(ops.like(out, x, mask))


class SwiGLU(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.fc11 = nn.Linear(args.n_embd, args.n_inner, bias=args.mlp_fc1_bias)
        self.fc12 = nn.Linear(args.n_embd, args.n_inner, bias=args.mlp_fc1_bias)
        self.fc2 = nn.Linear(args.n_inner, args.n_embd, bias=args.mlp_fc2_bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.fc2(self.fc11(x) * nn.silu(self.fc12(x)))


class GeluMLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.fc1 = nn.Linear(args.n_embd, args.n_inner, bias=args.mlp_fc1_bias)
        self.fc2 = nn.Linear(args.n_inner, args.n_embd, bias=args.mlp_fc2_bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.fc2(ops.gelu(self.fc1(x), overwrite_input=True))


class MixtureOfExperts(nn.Module):
    """Token-choice top-k experts, each a GELU MLP without biases of its own.

    ``w1`` and ``w2`` are the checkpoint's ``[num_experts * n_inner, n_embd]``
    blocks viewed as [experts, n_inner, n_embd]: expert e's up projection is
    ``x @ w1[e].T`` and its down projection ``h @ w2[e]`` (both stored the
    same way round). Only the chosen experts run: ``gather_mm`` over the
    (token, choice) pairs sorted by expert, which measured 4x faster than
    running every expert on every token and zeroing the unchosen (MLX CPU,
    768/3072, 8 experts top-2, 1024 tokens: 7.0 s vs 27.9 s on 2 cores), and
    exact, since no token's result depends on another token.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.moe_top_k
        self.router = nn.Linear(args.n_embd, args.num_experts, bias=False)
        self.w1 = mx.zeros((args.num_experts, args.n_inner, args.n_embd))
        self.w2 = mx.zeros((args.num_experts, args.n_inner, args.n_embd))
        self.bias = mx.zeros((args.n_embd,))

    def __call__(self, x: mx.array) -> mx.array:
        shape, D, k = x.shape, x.shape[-1], self.top_k
        x = x.reshape(-1, D)
        # The remote code routes in float32 whatever the model's dtype.
        probs = mx.softmax(self.router(x).astype(mx.float32), axis=-1, precise=True)
        chosen = mx.argpartition(-probs, k - 1, axis=-1)[:, :k]
        weights = mx.take_along_axis(probs, chosen, axis=-1).astype(x.dtype)
        # Sorted by expert, each expert's rows are one contiguous block.
        flat = chosen.flatten()
        order = mx.argsort(flat)
        experts = flat[order]
        rows = mx.take(x, order // k, axis=0)[:, None, :]
        w1, w2 = self.w1, self.w2
        if x.dtype != mx.float32 and mx.default_device() == mx.cpu:
            # MLX's CPU gather_mm (0.32) takes float32 only: the chosen
            # experts run in float32 there, on weights cast for the call.
            rows, w1, w2 = rows.astype(mx.float32), w1.astype(mx.float32), w2.astype(mx.float32)
        h = mx.gather_mm(rows, w1.swapaxes(-1, -2), rhs_indices=experts, sorted_indices=True)
        y = mx.gather_mm(ops.gelu(h), w2, rhs_indices=experts, sorted_indices=True).astype(x.dtype)
        y = mx.take(y.reshape(-1, D), mx.argsort(order), axis=0).reshape(-1, k, D)
        out = (y * weights[..., None]).sum(axis=1) + self.bias
        return out.reshape(shape)


def is_moe_layer(args: ModelArgs, i: int) -> bool:
    return args.moe_every_n_layers > 0 and i % args.moe_every_n_layers == 1


@ops.layer_boundary
class Block(nn.Module):
    def __init__(self, args: ModelArgs, moe: bool = False):
        super().__init__()
        self.attn = Attention(args)
        self.norm1 = nn.LayerNorm(args.n_embd, eps=args.layer_norm_epsilon)
        if moe:
            self.mlp = MixtureOfExperts(args)
        elif args.activation_function == "gelu":
            self.mlp = GeluMLP(args)
        else:
            self.mlp = SwiGLU(args)
        self.norm2 = nn.LayerNorm(args.n_embd, eps=args.layer_norm_epsilon)

    def __call__(self, x: mx.array, mask: ops.KeyMask) -> mx.array:
        x = ops.add_layer_norm(self.attn(x, mask), x, self.norm1, overwrite_input=True)
        return ops.add_layer_norm(self.mlp(x), x, self.norm2, overwrite_input=True)


class Embeddings(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.word_embeddings = nn.Embedding(args.vocab_size, args.n_embd)
        if args.type_vocab_size > 0:
            self.token_type_embeddings = nn.Embedding(args.type_vocab_size, args.n_embd)

    def __call__(self, input_ids: mx.array) -> mx.array:
        x = self.word_embeddings(input_ids)
        if "token_type_embeddings" in self:
            # Single segment: type 0 on every position.
            x = x + self.token_type_embeddings.weight[0]
        return x


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.embeddings = Embeddings(args)
        self.emb_ln = nn.LayerNorm(args.n_embd, eps=args.layer_norm_epsilon)
        self.layers = [Block(args, is_moe_layer(args, i)) for i in range(args.n_layer)]

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.args.n_embd

    @property
    def max_length(self) -> int:
        return self.args.n_positions

    def __call__(self, input_ids: mx.array, attention_mask: mx.array) -> mx.array:
        x = self.emb_ln(self.embeddings(input_ids))
        mask = ops.KeyMask(attention_mask, x.dtype)
        return ops.run_layers(self.layers, x, mask)

    def sanitize(self, weights: dict) -> dict:
        out = {}
        for name, w in weights.items():
            # NomicBertForPreTraining & co. keep the encoder under "bert.".
            if name.startswith("bert."):
                name = name[len("bert.") :]
            if name.startswith(("cls.", "pooler.", "lm_head.", "classifier.")):
                continue
            name = re.sub(r"^encoder\.layers\.", "layers.", name)
            name = name.replace(".mlp.router.layer.", ".mlp.router.").replace(".mlp.experts.mlp.", ".mlp.")
            name = name.replace(".mlp.experts.bias", ".mlp.bias")
            if name.endswith((".mlp.w1", ".mlp.w2")):
                w = w.reshape(self.args.num_experts, -1, w.shape[-1])
            out[name] = w
        return out
