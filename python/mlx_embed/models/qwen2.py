"""Qwen2 decoder as an embedding model (gte-Qwen2-1.5B/7B-instruct).

The transformer is mlx-lm's ``Qwen2Model`` as is; this file adds the
embedding wrapper, the config checks and the weight names. Attention is
causal, as the checkpoints run under transformers and sentence-transformers,
so right padding needs no mask: a real token never attends to the padding
after it, and pooling takes each row's last real token.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .. import ops
from . import DECODER_SIBLINGS, checked_decoder_params, decoder_weights, mlx_lm_model

_lm = mlx_lm_model("qwen2")

# The attention by the native kernel on the CPU's native path, long inputs in
# query blocks elsewhere (ops.engine_attention); the feed-forward's SiLU by
# the native kernel on the CPU (ops.native_swiglu).
ops.engine_attention(_lm)
ops.native_swiglu(_lm)
# Its feed-forward on each pass's real tokens where the engine packs rows.
ops.packs_feed_forward(_lm.MLP)
# A pass may be evaluated after each block (ops.EvaluationPoints).
ops.layer_boundary(_lm.TransformerBlock)

# gte-Qwen2: last-token pooling over "... <|endoftext|>"; queries carry an
# instruction in the same template as Qwen3-Embedding.
EMBEDDING_DEFAULTS = {
    "pooling": "last",
    "eos_token": "<|endoftext|>",
    "instruction_template": "Instruct: {instruction}\nQuery: ",
}

# Queries/keys/values and gate/up as one matmul each (sibling_linears.py).
JOINED_LINEARS = DECODER_SIBLINGS


@dataclass
class ModelArgs(_lm.ModelArgs):
    @classmethod
    def from_dict(cls, params: dict) -> "ModelArgs":
        params = dict(params)
        # transformers >= 5 writes rope settings as rope_parameters only.
        rope = params.get("rope_parameters")
        if "rope_theta" not in params and isinstance(rope, dict) and "rope_theta" in rope:
            params["rope_theta"] = rope["rope_theta"]
            if rope.get("rope_type", "default") != "default":
                params.setdefault("rope_scaling", rope)
        if params.get("use_sliding_window"):
            raise ValueError(
                "qwen2: use_sliding_window=true is not supported (only full causal attention)"
            )
        # Qwen2 always has query/key/value biases: attention_bias does not apply.
        params = checked_decoder_params({**params, "attention_bias": None}, "qwen2")
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if key not in params:
                raise ValueError(f"qwen2: config.json lacks {key!r}")
        params.setdefault("num_key_value_heads", params["num_attention_heads"])
        params.setdefault("rms_norm_eps", 1e-6)
        return super().from_dict(params)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = _lm.Qwen2Model(args)

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def max_length(self) -> int:
        return self.args.max_position_embeddings

    def __call__(self, input_ids: mx.array, attention_mask: mx.array) -> mx.array:
        # attention_mask unused on purpose (module docstring); the final
        # RMSNorm is applied inside Qwen2Model.
        with ops.packed_feed_forwards(ops.KeyMask(attention_mask, mx.float32)):
            return self.model(input_ids)

    def sanitize(self, weights: dict) -> dict:
        # Qwen2Model saves without the "model." prefix, Qwen2ForCausalLM with
        # it plus an LM head that embeddings never use.
        return decoder_weights(weights)
