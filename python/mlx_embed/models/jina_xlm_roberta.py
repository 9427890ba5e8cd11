"""Jina XLM-RoBERTa with rotary positions and task LoRA (jina-embeddings-v3).

Written from the architecture's published definitions: Jina's remote code
(``jinaai/xlm-roberta-flash-implementation``: ``modeling_xlm_roberta.py``,
``mha.py``, ``embedding.py``, ``modeling_lora.py``), which the folder people
download (``model_type: "xlm-roberta"``, ``position_embedding_type:
"rotary"``, ``architectures: ["XLMRobertaLoRA"]``) runs, and transformers'
native ``jina_embeddings_v3`` model (``jinaai/jina-embeddings-v3-hf``). One
network for both layouts:

- XLM-R's word and token-type embeddings with no position table, then a
  LayerNorm (``emb_ln``);
- post-LN blocks: fused q/k/v with biases, rotate-half RoPE over the whole
  head (base ``rotary_emb_base``, 20000; the native config's
  ``rope_parameters``), output projection, GELU MLP ``fc1``/``fc2``.

Task adapters (original layout only): every ``nn.Linear`` and
``nn.Embedding`` of the encoder carries one LoRA per task in
``lora_adaptations``, stacked on a first axis, scaling ``lora_alpha /
lora_rank``. A linear's update is ``B_t @ A_t`` (A [rank, in], B [out,
rank]); an embedding's is ``A_t @ B_t`` (A [vocab, rank], B [rank, dim]),
the transpose. The remote code merges the task's update into the weight
and runs the merged matrix; here the adapters stay low rank and are
applied per row, so rows of different tasks share one pass: every task's
``x A^T`` is computed at once ([.., tasks*rank], a few columns), the
columns of the other tasks are zeroed by the row's selector (which also
holds the scaling), and one matmul with the stacked ``B`` adds the row's
update. A row with no task (``-1``) gets the base weights, as the remote
code runs them without a task (its ``encode()`` "disables LoRA").
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


@dataclass
class ModelArgs:
    model_type: str = "xlm-roberta"
    vocab_size: int = 250002
    hidden_size: int = 1024
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    intermediate_size: int = 4096
    hidden_act: str = "gelu"
    max_position_embeddings: int = 8194
    type_vocab_size: int = 1
    layer_norm_eps: float = 1e-5
    pad_token_id: int = 1
    position_embedding_type: str = "rotary"
    # transformers' JinaEmbeddingsV3Config.default_theta; the remote config
    # states rotary_emb_base.
    rotary_emb_base: Optional[float] = None
    rope_parameters: Optional[dict] = None
    rotary_emb_interleaved: bool = False
    rotary_emb_scale_base: Optional[float] = None
    rotary_emb_dim: Optional[float] = None
    lora_adaptations: list = field(default_factory=list)
    lora_rank: int = 4
    lora_alpha: float = 1.0
    load_trained_adapters: bool = True

    @classmethod
    def from_dict(cls, params: dict) -> "ModelArgs":
        args = config_args(cls, params)
        if params.get("model_type") == "jina_embeddings_v3":
            # transformers' native model: rotary by construction, and no
            # adapters in its weights (an XLM-R config key it inherits
            # would say "absolute").
            for key in ("position_embedding_type", "lora_adaptations"):
                args.pop(key, None)
        return cls(**args)

    def __post_init__(self):
        arch = self.model_type
        if self.position_embedding_type != "rotary":
            raise ValueError(
                f"{arch}: position_embedding_type={self.position_embedding_type!r} is not "
                "supported by the Jina XLM-RoBERTa file (only 'rotary')"
            )
        if self.hidden_act != "gelu":
            raise ValueError(f"{arch}: hidden_act={self.hidden_act!r} is not supported (only 'gelu')")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"{arch}: hidden_size must be divisible by num_attention_heads")
        self.head_dim = self.hidden_size // self.num_attention_heads
        rope = self.rope_parameters if isinstance(self.rope_parameters, dict) else {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"{arch}: rope_type={rope['rope_type']!r} is not supported (only plain RoPE)")
        base = self.rotary_emb_base if self.rotary_emb_base is not None else rope.get("rope_theta", 20000.0)
        self.rope_base = float(base)
        unsupported = {
            "rotary_emb_interleaved": self.rotary_emb_interleaved,
            "rotary_emb_scale_base": self.rotary_emb_scale_base is not None,
            "rotary_emb_dim": self.rotary_emb_dim is not None and int(self.rotary_emb_dim) != self.head_dim,
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise ValueError(
                f"{arch}: unsupported rotary variant ("
                + ", ".join(f"{k}={getattr(self, k)!r}" for k in bad)
                + "); supported: rotate-half over the whole head, no xPos scaling"
            )
        tasks = self.lora_adaptations or []
        if not isinstance(tasks, list) or not all(isinstance(t, str) for t in tasks) or len(set(tasks)) != len(tasks):
            raise ValueError(f"{arch}: lora_adaptations must be a list of distinct task names, got {tasks!r}")
        if tasks and not self.load_trained_adapters:
            raise ValueError(f"{arch}: load_trained_adapters=false (adapters to be trained) is not supported")
        if tasks and (int(self.lora_rank) < 1):
            raise ValueError(f"{arch}: lora_rank must be >= 1, got {self.lora_rank!r}")
        self.tasks = tuple(tasks)
        self.lora_scaling = float(self.lora_alpha) / int(self.lora_rank) if tasks else 0.0


def _low_rank(x: mx.array, down: mx.array, up: mx.array, select: mx.array) -> mx.array:
    """The rows' LoRA updates: ``x`` [.., in] through every task's ``down``
    ([tasks*rank, in]), the other tasks' columns zeroed and the row's
    scaled by ``select`` ([.., tasks*rank], broadcast over tokens), then
    ``up`` ([tasks*rank, out])."""
    return ((x @ down.T) * select) @ up


class LoraLinear(nn.Module):
    """A linear (``base``, which ``quantize`` may turn into a quantized one)
    plus per-task low-rank updates (``tasks`` of them, kept in float)."""

    def __init__(self, dims_in: int, dims_out: int, tasks: int, rank: int):
        super().__init__()
        self.base = nn.Linear(dims_in, dims_out, bias=True)
        if tasks:
            self.lora_a = mx.zeros((tasks * rank, dims_in))
            self.lora_b = mx.zeros((tasks * rank, dims_out))

    def __call__(self, x: mx.array, select: Optional[mx.array]) -> mx.array:
        y = self.base(x)
        if select is None:
            return y
        return y + _low_rank(x, self.lora_a, self.lora_b, select)


class LoraEmbedding(nn.Module):
    """An embedding table (``base``) plus per-task low-rank updates: an id's
    update is its row of A (all tasks side by side, [tasks*rank]) times B."""

    def __init__(self, rows: int, dims: int, tasks: int, rank: int):
        super().__init__()
        self.base = nn.Embedding(rows, dims)
        if tasks:
            self.lora_a = mx.zeros((rows, tasks * rank))
            self.lora_b = mx.zeros((tasks * rank, dims))

    def __call__(self, ids: mx.array, select: Optional[mx.array]) -> mx.array:
        x = self.base(ids)
        if select is None:
            return x
        return x + (self.lora_a[ids] * select) @ self.lora_b


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, tasks, rank = args.hidden_size, len(args.tasks), int(args.lora_rank)
        self.n_heads = args.num_attention_heads
        self.head_dim = args.head_dim
        self.base = args.rope_base
        self.scale = self.head_dim**-0.5
        self.Wqkv = LoraLinear(dim, 3 * dim, tasks, rank)
        self.out_proj = LoraLinear(dim, dim, tasks, rank)

    def __call__(self, x: mx.array, mask: ops.KeyMask, select) -> mx.array:
        qkv = ops.padded(self.Wqkv(x, select), mask)
        B, L, D = qkv.shape[0], qkv.shape[1], x.shape[-1]
        qkv = mx.contiguous(qkv.reshape(B, L, 3, self.n_heads, self.head_dim).transpose(2, 0, 3, 1, 4))

        def rope(t):
            return mx.fast.rope(t, self.head_dim, traditional=False, base=self.base, scale=1.0, offset=0)

        out = ops.blocked_attention(rope(qkv[0]), rope(qkv[1]), qkv[2], self.scale, mask=mask)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, D)
        return self.out_proj(ops.like(out, x, mask), select)


class Mlp(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        tasks, rank = len(args.tasks), int(args.lora_rank)
        self.fc1 = LoraLinear(args.hidden_size, args.intermediate_size, tasks, rank)
        self.fc2 = LoraLinear(args.intermediate_size, args.hidden_size, tasks, rank)

    def __call__(self, x: mx.array, select) -> mx.array:
        return self.fc2(nn.gelu(self.fc1(x, select)), select)


@ops.layer_boundary
class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.mixer = Attention(args)
        self.norm1 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.mlp = Mlp(args)
        self.norm2 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def __call__(self, x: mx.array, mask: ops.KeyMask, select=None) -> mx.array:
        x = ops.add_layer_norm(self.mixer(x, mask, select), x, self.norm1, overwrite_input=True)
        return ops.add_layer_norm(self.mlp(x, select), x, self.norm2, overwrite_input=True)


class Embeddings(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        tasks, rank = len(args.tasks), int(args.lora_rank)
        self.word_embeddings = LoraEmbedding(args.vocab_size, args.hidden_size, tasks, rank)
        self.token_type_embeddings = LoraEmbedding(args.type_vocab_size, args.hidden_size, tasks, rank)

    def __call__(self, input_ids: mx.array, select) -> mx.array:
        # Single segment: type 0 on every position (with its row's update).
        types = self.token_type_embeddings(mx.zeros((1, 1), dtype=mx.int32), select)
        return self.word_embeddings(input_ids, select) + types


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.embeddings = Embeddings(args)
        self.emb_ln = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.layers = [Block(args) for _ in range(args.num_hidden_layers)]

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def max_length(self) -> int:
        return self.args.max_position_embeddings

    @property
    def adapters(self) -> tuple:
        """The task names a row may select (``adapter`` indexes them)."""
        return self.args.tasks

    def selector(self, adapter: Optional[mx.array]) -> Optional[mx.array]:
        """Per row [B, 1, tasks*rank]: the scaling on the row's task's
        columns, 0 elsewhere (all 0 for a row with no task, -1); None where
        no row has a task."""
        if adapter is None or not self.args.tasks:
            return None
        rank = int(self.args.lora_rank)
        column_task = mx.arange(len(self.args.tasks) * rank) // rank
        hit = column_task[None, :] == adapter.astype(mx.int32)[:, None]
        dtype = self.embeddings.word_embeddings.lora_a.dtype
        return (hit.astype(mx.float32) * self.args.lora_scaling).astype(dtype)[:, None, :]

    def __call__(self, input_ids: mx.array, attention_mask: mx.array, adapter: Optional[mx.array] = None) -> mx.array:
        """Last hidden state [B, L, D]. ``adapter``: per row, the index of
        its task in ``adapters`` (-1: none); None: every row runs the base
        weights."""
        select = self.selector(adapter)
        x = self.emb_ln(self.embeddings(input_ids, select))
        if select is not None:
            select = mx.broadcast_to(select, (x.shape[0], x.shape[1], select.shape[-1]))
        mask = ops.KeyMask(attention_mask, x.dtype)
        # ops.run_layers packs x alone; the selector is per token too.
        rows = mask.packed_rows()
        if rows is not None:
            x = rows.pack(x)
            select = None if select is None else rows.pack(select)
        for layer in self.layers:
            x = layer(x, mask, select)
        return x if rows is None else rows.unpack(x)

    # Native (transformers' jina_embeddings_v3) names -> the remote code's,
    # which are ours; conversion_mapping.py maps the other way.
    _NATIVE = (
        (r"^embeddings\.LayerNorm\.", "emb_ln."),
        (r"^layers\.(\d+)\.self_attn\.o_proj\.", r"layers.\1.mixer.out_proj."),
        (r"^layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.norm1."),
        (r"^layers\.(\d+)\.post_mlp_layernorm\.", r"layers.\1.norm2."),
    )

    def sanitize(self, weights: dict) -> dict:
        tasks, rank = len(self.args.tasks), int(self.args.lora_rank)
        out, lora = {}, {}
        for name, w in weights.items():
            # XLMRobertaLoRA and *ForMaskedLM keep the encoder under "roberta.".
            name = name.removeprefix("roberta.")
            if name.startswith(("pooler.", "lm_head.")) or name.endswith(("position_ids", "inv_freq")):
                continue
            name = re.sub(r"^encoder\.layers\.", "layers.", name)
            for pat, rep in self._NATIVE:
                name = re.sub(pat, rep, name)
            # torch parametrizations: the base weight, then the LoRA stacks.
            m = re.match(r"^(.*)\.parametrizations\.weight\.(original|0\.lora_A|0\.lora_B)$", name)
            if m is None:
                out[name] = w
            elif m.group(2) == "original":
                out[m.group(1) + ".weight"] = w
            else:
                lora.setdefault(m.group(1), {})[m.group(2)[-1]] = w
        # The native layout's separate q/k/v, as the fused projection.
        for i in range(self.args.num_hidden_layers):
            pre = f"layers.{i}.self_attn."
            for suffix in ("weight", "bias"):
                parts = [f"{pre}{p}_proj.{suffix}" for p in "qkv"]
                if all(p in out for p in parts):
                    out[f"layers.{i}.mixer.Wqkv.{suffix}"] = mx.concatenate([out.pop(p) for p in parts], axis=0)
        # The LoRA'd modules' own weights live in their base layer.
        lora_modules = (
            r"^(embeddings\.\w+_embeddings|layers\.\d+\.(mixer\.(Wqkv|out_proj)|mlp\.fc[12]))\.(weight|bias)$"
        )
        out = {re.sub(lora_modules, r"\1.base.\4", k): v for k, v in out.items()}
        if lora and not tasks:
            raise ValueError(
                f"{self.model_type}: the weights hold LoRA adapters but config.json names no lora_adaptations"
            )
        for module, ab in lora.items():
            a, b = ab.get("A"), ab.get("B")
            if a is None or b is None or a.shape[0] != tasks:
                raise ValueError(
                    f"{module}: LoRA weights must be lora_A and lora_B for the {tasks} tasks "
                    f"of lora_adaptations, got { ({k: v.shape for k, v in ab.items()}) }"
                )
            if module.startswith("embeddings."):
                # Embedding: A [tasks, rows, rank], B [tasks, rank, dim].
                out[module + ".lora_a"] = a.transpose(1, 0, 2).reshape(a.shape[1], tasks * rank)
                out[module + ".lora_b"] = b.reshape(tasks * rank, b.shape[-1])
            else:
                # Linear: A [tasks, rank, in], B [tasks, out, rank].
                out[module + ".lora_a"] = a.reshape(tasks * rank, a.shape[-1])
                out[module + ".lora_b"] = b.transpose(0, 2, 1).reshape(tasks * rank, b.shape[1])
        return out
