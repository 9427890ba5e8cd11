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

Task adapters, original layout: every ``nn.Linear`` and
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

Task adapters, native layout: transformers' ``JinaEmbeddingsV3Model`` has
no LoRA of its own; its model doc (``model_doc/jina_embeddings_v3.md``,
"Task-Specific LoRA Adapters") loads each task as a PEFT LoRA adapter from
a subfolder of the model folder, ``model.load_adapter(folder,
adapter_name=task, adapter_kwargs={"subfolder": task})`` then
``set_adapter(task)``, the subfolders named ``retrieval_query``,
``retrieval_passage``, ``separation``, ``classification``,
``text_matching`` (served as Jina's task names, ``retrieval.query`` ...).
Each holds ``adapter_config.json`` and ``adapter_model.safetensors``
(``lora_A``/``lora_B`` per linear, ``lora_embedding_A``/``_B`` per
embedding, scaling ``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA, per
module with ``rank_pattern``/``alpha_pattern``). They run in the same
stacks: each adapter's scaling is folded into its ``B``, q/k/v's adapters
sit side by side in the fused projection's slot, and every task's slot is
as wide as the widest (zero columns elsewhere).
"""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import ops
from ..errors import InvalidModel, ModelFolderMissing
from ..json_files import read_json
from . import config_args

EMBEDDING_DEFAULTS = {"pooling": "mean"}
log = logging.getLogger("mlx_embed")


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
    # transformers' JinaEmbeddingsV3Config.default_theta; the remote
    # layout's (from_dict) is XLMRobertaFlashConfig's 10000.
    rotary_emb_base: Optional[float] = None
    rope_parameters: Optional[dict] = None
    rotary_emb_interleaved: bool = False
    rotary_emb_scale_base: Optional[float] = None
    rotary_emb_dim: Optional[float] = None
    lora_adaptations: list = field(default_factory=list)
    lora_rank: int = 4
    lora_alpha: float = 1.0
    load_trained_adapters: bool = True
    # The prompt the remote code's encode(task=) puts before a task's texts.
    task_instructions: Optional[dict] = None
    # Set by folder_adapters (native layout): the tasks of its PEFT
    # subfolders and their slot width, with each scaling folded into B.
    peft_tasks: list = field(default_factory=list)
    peft_rank: int = 0
    # The remote code's encode() (XLMRobertaFlashConfig): how it pools
    # ("cls": the first token; anything else: mean) and the Matryoshka
    # dimension it cuts every vector to before normalizing, one of
    # matryoshka_dimensions (with none listed it warns and does not cut).
    # sentence-transformers reads neither: a folder's own pipeline wins.
    emb_pooler: Optional[str] = None
    truncate_dim: Optional[int] = None
    matryoshka_dimensions: Optional[list] = None

    @classmethod
    def from_dict(cls, params: dict) -> "ModelArgs":
        args = config_args(cls, params)
        if params.get("model_type") == "jina_embeddings_v3":
            # transformers' native model: rotary by construction, and no
            # adapters in its weights (an XLM-R config key it inherits
            # would say "absolute"); its adapters are the folder's PEFT ones.
            # Nor does it have the remote code's encode(), which alone reads
            # emb_pooler and truncate_dim.
            native_drops = ("position_embedding_type", "lora_adaptations", "lora_rank", "lora_alpha",
                            "task_instructions", "emb_pooler", "truncate_dim", "matryoshka_dimensions")
            for key in native_drops:
                args.pop(key, None)
            if args.get("peft_tasks"):
                args["lora_adaptations"] = list(args["peft_tasks"])
                args["lora_rank"] = args["peft_rank"]
        else:
            args.pop("peft_tasks", None)
            args.pop("peft_rank", None)
            # A key the remote config leaves out is XLMRobertaFlashConfig's
            # default there, not the native model's.
            args.setdefault("rotary_emb_base", 10000.0)
            args.setdefault("load_trained_adapters", False)
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
        prompts = self.task_instructions or {}
        if not isinstance(prompts, dict) or not all(t in tasks and isinstance(p, str) for t, p in prompts.items()):
            raise ValueError(
                f"{arch}: task_instructions must map tasks of lora_adaptations to prompts, got {prompts!r}"
            )
        self.encode_defaults = self._encode_defaults()
        if not tasks:
            self.lora_scaling = 0.0
        elif self.peft_rank:
            self.lora_scaling = 1.0  # folded into each adapter's B
        else:
            self.lora_scaling = float(self.lora_alpha) / int(self.lora_rank)


    def _encode_defaults(self) -> dict:
        """The engine's defaults (models/__init__.py) for what the remote
        code's encode() reads from the config: its pooling and its default
        Matryoshka cut, for a folder whose own files do not say (no
        sentence-transformers pipeline)."""
        arch = self.model_type
        out = {}
        if self.emb_pooler == "cls":
            out["pooling"] = "cls"
        elif self.emb_pooler not in (None, "mean"):
            log.warning("%s: emb_pooler=%r is mean pooling, as the remote code's encode() runs it "
                        "(only 'cls' pools otherwise)", arch, self.emb_pooler)
        dims = self.matryoshka_dimensions or []
        if not self.truncate_dim:
            return out
        if isinstance(self.truncate_dim, bool) or not isinstance(self.truncate_dim, int):
            raise ValueError(f"{arch}: truncate_dim must be a whole number, got {self.truncate_dim!r}")
        if not dims:
            log.warning("%s: truncate_dim=%d with no matryoshka_dimensions: the vectors are not cut, as the "
                        "remote code's encode() leaves them", arch, self.truncate_dim)
        elif self.truncate_dim not in dims:
            raise ValueError(f"{arch}: truncate_dim={self.truncate_dim} is not one of matryoshka_dimensions "
                             f"{dims} (the remote code's encode() refuses it)")
        else:
            out["truncate_dim"] = int(self.truncate_dim)
        return out


def _low_rank(x: mx.array, down: Optional[mx.array], up: mx.array, select: mx.array, owner) -> mx.array:
    """The rows' LoRA updates: ``x`` [.., in] through every task's ``down``
    ([tasks*rank, in]; None: ``x`` is that product already), the other
    tasks' columns zeroed and the row's scaled by ``select`` ([..,
    tasks*rank], broadcast over tokens), then ``up`` ([tasks*rank, out]).
    The products by the native kernel on the CPU's native path
    (``ops.rows_times``: a row's bits whatever the batch)."""
    low = x if down is None else ops.rows_times(x, down, owner=owner, key="lora_a")
    return ops.rows_times(low * select, up.T, owner=owner, key="lora_b", source=up)


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
        return y + _low_rank(x, self.lora_a, self.lora_b, select, self)


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
        return x + _low_rank(self.lora_a[ids], None, self.lora_b, select, self)


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
        self.embedding_defaults = dict(args.encode_defaults)
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

    @property
    def task_prompts(self) -> dict:
        """config.json's prompt per task (``task_instructions``); the
        folder's sentence-transformers prompts of the same names win."""
        return dict(self.args.task_instructions or {})

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

    def sanitize(self, weights: dict) -> dict:
        tasks, rank = len(self.args.tasks), int(self.args.lora_rank)
        out, lora, peft = {}, {}, {}
        for name, w in weights.items():
            if name.startswith(PEFT_PREFIX):
                peft[name] = w
                continue
            name = _our_name(name)
            if name is None:
                continue
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
        out = {re.sub(_LORA_MODULES, r"\1.base.\4", k): v for k, v in out.items()}
        if self.args.peft_rank:
            out.update(self._peft_stacks(peft))
            return out
        if peft:
            raise ValueError(f"{self.model_type}: PEFT adapters are read for the native layout only")
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

    def _peft_stacks(self, peft: dict) -> dict:
        """The folder's PEFT adapters (``folder_adapters``' entries) as the
        stacks: task t's slot is columns ``t*R .. t*R + r``; q, k and v's
        adapters follow each other in the fused projection's slot, each
        ``B`` in its own third of the outputs."""
        a = self.args
        R, dim = int(a.lora_rank), a.hidden_size
        stacks = {}

        def stack(module: str, kind: str, rows: int, cols: int) -> np.ndarray:
            key = f"{module}.{kind}"
            if key not in stacks:
                stacks[key] = np.zeros((rows, cols), dtype=np.float32)
            return stacks[key]

        shapes = {"embeddings.word_embeddings": a.vocab_size, "embeddings.token_type_embeddings": a.type_vocab_size}
        for emb, rows in shapes.items():
            stack(emb, "lora_a", rows, len(a.tasks) * R), stack(emb, "lora_b", len(a.tasks) * R, dim)
        for i in range(a.num_hidden_layers):
            for mod, fan_in, fan_out in (
                ("mixer.Wqkv", dim, 3 * dim),
                ("mixer.out_proj", dim, dim),
                ("mlp.fc1", dim, a.intermediate_size),
                ("mlp.fc2", a.intermediate_size, dim),
            ):
                stack(f"layers.{i}.{mod}", "lora_a", len(a.tasks) * R, fan_in)
                stack(f"layers.{i}.{mod}", "lora_b", len(a.tasks) * R, fan_out)
        used: dict = {}  # (task, fused module) -> columns of its slot taken
        for task, module, A, B in _peft_entries(peft):
            t = a.tasks.index(task)
            qkv = re.match(r"^layers\.(\d+)\.self_attn\.([qkv])_proj$", module)
            target = f"layers.{qkv.group(1)}.mixer.Wqkv" if qkv else module
            r = A.shape[0]
            at = t * R + used.get((t, target), 0)
            used[(t, target)] = used.get((t, target), 0) + r
            if target.startswith("embeddings."):
                # PEFT: A [r, rows], B [dim, r]; ours: A^T's rows per id, B^T.
                stacks[target + ".lora_a"][:, at : at + r] = A.T
                stacks[target + ".lora_b"][at : at + r] = B.T
            elif target + ".lora_a" in stacks:
                stacks[target + ".lora_a"][at : at + r] = A
                third = "qkv".index(qkv.group(2)) * dim if qkv else 0
                stacks[target + ".lora_b"][at : at + r, third : third + B.shape[0]] = B.T
            else:
                raise ValueError(
                    f"{self.model_type}: a PEFT adapter of {task!r} targets {module}, "
                    "which the model does not run (supported: the encoder's linears and embeddings)"
                )
        return {k: mx.array(v) for k, v in stacks.items()}


# Native (transformers' jina_embeddings_v3) names -> the remote code's,
# which are ours; conversion_mapping.py maps the other way.
_NATIVE = (
    (r"^embeddings\.LayerNorm\.", "emb_ln."),
    (r"^layers\.(\d+)\.self_attn\.o_proj\.", r"layers.\1.mixer.out_proj."),
    (r"^layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.norm1."),
    (r"^layers\.(\d+)\.post_mlp_layernorm\.", r"layers.\1.norm2."),
)
_LORA_MODULES = r"^(embeddings\.\w+_embeddings|layers\.\d+\.(mixer\.(Wqkv|out_proj)|mlp\.fc[12]))\.(weight|bias)$"


def _our_name(name: str) -> Optional[str]:
    """A checkpoint name (either layout) as ours; None for what the
    embedding does not run (pooler, LM head, buffers)."""
    # XLMRobertaLoRA and *ForMaskedLM keep the encoder under "roberta.".
    name = name.removeprefix("roberta.")
    if name.startswith(("pooler.", "lm_head.")) or name.endswith(("position_ids", "inv_freq")):
        return None
    name = re.sub(r"^encoder\.layers\.", "layers.", name)
    for pat, rep in _NATIVE:
        name = re.sub(pat, rep, name)
    return name


# transformers' documented subfolder names (its model doc) -> Jina's task
# names, which the original layout and Jina's API use; in this order.
PEFT_SUBFOLDERS = {
    "retrieval_query": "retrieval.query",
    "retrieval_passage": "retrieval.passage",
    "separation": "separation",
    "classification": "classification",
    "text_matching": "text-matching",
}
PEFT_PREFIX = "peft::"

# adapter_config.json settings whose adapters are not a plain LoRA update of
# the base weights, each with the value that is.
_PEFT_PLAIN = {
    "peft_type": "LORA",
    "use_dora": False,
    "fan_in_fan_out": False,
    "bias": "none",
    "lora_bias": False,
    "modules_to_save": None,
    "trainable_token_indices": None,
    "target_parameters": None,
    "alora_invocation_tokens": None,
    "layer_replication": None,
    "use_qalora": False,
}


def _pattern_value(pattern: dict, module: str, default):
    """PEFT's ``rank_pattern``/``alpha_pattern`` lookup: the first key that
    matches the end of the module's name (``get_pattern_key``)."""
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def folder_adapters(path: str, config: dict) -> tuple[dict, dict]:
    """The native layout's task adapters: each PEFT subfolder of ``path``
    (transformers' ``load_adapter(path, subfolder=...)``) as config keys
    (``peft_tasks``, ``peft_rank``) and weights for ``sanitize``, each
    adapter's scaling folded into its ``B``. Other layouts, or no such
    subfolder: ``(config, {})``."""
    if config.get("model_type") != "jina_embeddings_v3":
        return config, {}
    found = sorted(d for d in os.listdir(path) if os.path.isfile(os.path.join(path, d, "adapter_config.json")))
    # The documented five in their order, then any other by name.
    found.sort(key=lambda d: list(PEFT_SUBFOLDERS).index(d) if d in PEFT_SUBFOLDERS else len(PEFT_SUBFOLDERS))
    weights, widest = {}, 0
    tasks = []
    for sub in found:
        task = PEFT_SUBFOLDERS.get(sub, sub)
        tasks.append(task)
        folder = os.path.join(path, sub)
        # Read by the one JSON reader: one that is not JSON is InvalidModel
        # naming this file (the caller's wrap would name config.json).
        cfg = read_json(os.path.join(folder, "adapter_config.json"))
        if not isinstance(cfg, dict):
            raise InvalidModel(f"{folder}/adapter_config.json is not a JSON object")
        for key, plain in _PEFT_PLAIN.items():
            value = cfg.get(key, plain)
            if value != plain and not (plain is None and value in ([], {})):
                raise InvalidModel(
                    f"{folder}/adapter_config.json: {key}={cfg[key]!r} is not supported "
                    f"(only plain LoRA adapters: {key}={plain!r})"
                )
        file = os.path.join(folder, "adapter_model.safetensors")
        if not os.path.isfile(file):
            raise ModelFolderMissing(f"{folder} has adapter_config.json but no adapter_model.safetensors")
        try:
            tensors = mx.load(file)
        except RuntimeError as e:
            raise InvalidModel(f"{file} cannot be read as safetensors weights: {e}") from e
        modules: dict = {}
        for key, w in tensors.items():
            m = re.match(r"^(?:base_model\.model\.)?(.+)\.(lora_A|lora_B)\.weight$", key) or re.match(
                r"^(?:base_model\.model\.)?(.+)\.(lora_embedding_A|lora_embedding_B)$", key
            )
            if m is None:
                raise InvalidModel(f"{file}: {key} is not a LoRA weight (lora_A/lora_B, lora_embedding_A/B)")
            modules.setdefault(m.group(1), {})[m.group(2)[-1]] = w
        fused: dict = {}
        for module, ab in sorted(modules.items()):
            if set(ab) != {"A", "B"}:
                raise InvalidModel(f"{file}: {module} has {sorted(ab)} of LoRA's A and B")
            r = int(_pattern_value(cfg.get("rank_pattern"), module, cfg.get("r", 8)))
            alpha = float(_pattern_value(cfg.get("alpha_pattern"), module, cfg.get("lora_alpha", 8)))
            a, b = ab["A"].astype(mx.float32), ab["B"].astype(mx.float32)
            if a.shape[0] != r or b.shape[-1] != r:
                raise InvalidModel(f"{file}: {module}'s A {a.shape} and B {b.shape} are not of rank r={r}")
            scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
            ours = _our_name(module + ".weight")
            if ours is None:
                continue  # the pooler: not run for embeddings
            ours = ours.removesuffix(".weight")
            weights[f"{PEFT_PREFIX}{task}::{ours}::A"] = a
            weights[f"{PEFT_PREFIX}{task}::{ours}::B"] = b * scaling
            qkv = re.match(r"^(layers\.\d+)\.self_attn\.[qkv]_proj$", ours)
            group = qkv.group(1) if qkv else ours
            fused[group] = fused.get(group, 0) + r
        widest = max([widest, *fused.values()])
    if not tasks:
        # Said at load, as a `task` refused later would not say why.
        log.info(
            "%s: no PEFT adapter subfolders (%s): the base network, without tasks",
            path,
            ", ".join(PEFT_SUBFOLDERS),
        )
        return config, {}
    # At least 1: adapters of the pooler only leave every slot empty.
    return {**config, "peft_tasks": tasks, "peft_rank": max(widest, 1)}, weights


def _peft_entries(weights: dict):
    """(task, module, A, B) of ``folder_adapters``' weights."""
    for key in sorted(k for k in weights if k.endswith("::A")):
        _, task, module, _ = key.split("::")
        yield task, module, np.array(weights[key]), np.array(weights[key[:-1] + "B"])
