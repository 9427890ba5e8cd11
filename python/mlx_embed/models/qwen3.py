"""Qwen3 decoder as an embedding model (Qwen3-Embedding).

The transformer itself is mlx-lm's ``Qwen3Model``, used as is: we only add the
embedding-specific wrapper (no LM head, weight-name normalization). Pooling of
the last real token happens in the engine.

Right padding is exact here without any padding mask: attention is causal, so
a real token never attends to the padding that follows it, and the engine
gathers each row's last *real* position.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .. import ops
from . import DECODER_SIBLINGS, checked_decoder_params, decoder_weights, mlx_lm_model

_lm = mlx_lm_model("qwen3")

# The attention by the native kernel on the CPU's native path, long inputs in
# query blocks elsewhere (ops.engine_attention); the feed-forward's SiLU by
# the native kernel on the CPU (ops.native_swiglu).
ops.engine_attention(_lm)
ops.native_swiglu(_lm)
# Its feed-forward on each pass's real tokens where the engine packs rows.
ops.packs_feed_forward(_lm.MLP)
# A pass may be evaluated after each block (ops.EvaluationPoints).
ops.layer_boundary(_lm.TransformerBlock)

# Qwen3-Embedding pools the last token and was trained with EOS there (older
# tokenizer.json files do not append it); queries carry an instruction, in
# the model card's template: no space after "Query:" (its byte-level BPE would
# make the query's first word another token; gte-Qwen2 and e5-mistral have one).
EMBEDDING_DEFAULTS = {
    "pooling": "last",
    "eos_token": "<|endoftext|>",
    "instruction_template": "Instruct: {instruction}\nQuery:",
}

# Queries/keys/values and gate/up as one matmul each (sibling_linears.py).
JOINED_LINEARS = DECODER_SIBLINGS


def sliding_layers(params: dict) -> list:
    """The layers a Qwen3 config runs with sliding-window attention, as
    transformers reads it: its ``layer_types``, else every layer from
    ``max_window_layers`` on when ``use_sliding_window`` and a window are set."""
    layer_types = params.get("layer_types")
    if isinstance(layer_types, list):
        return [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    if params.get("use_sliding_window") and params.get("sliding_window"):
        layers = int(params.get("num_hidden_layers", 0))
        return list(range(int(params.get("max_window_layers", layers)), layers))
    return []


class ModelArgs(_lm.ModelArgs):
    @classmethod
    def from_dict(cls, params: dict) -> "ModelArgs":
        # mlx-lm's Qwen3 attends to every earlier token: a sliding layer would
        # run as full attention and every input past the window would be wrong.
        params = checked_decoder_params(params, "qwen3")
        sliding = sliding_layers(params)
        if sliding:
            raise ValueError(
                f"qwen3: sliding-window attention (window {params.get('sliding_window')}, layers "
                f"{sliding[0]}-{sliding[-1]}) is not supported (only full causal attention; "
                "Qwen3-Embedding's configs have use_sliding_window false)"
            )
        return super().from_dict(params)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = _lm.Qwen3Model(args)

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    def __call__(self, input_ids: mx.array, attention_mask: mx.array) -> mx.array:
        # attention_mask is unused on purpose (see module docstring); the
        # final RMSNorm is applied inside Qwen3Model.
        with ops.packed_feed_forwards(ops.KeyMask(attention_mask, mx.float32)):
            return self.model(input_ids)

    def sanitize(self, weights: dict) -> dict:
        # Embedding checkpoints may carry an LM head (tied or not) that we
        # never use; Qwen3Model (HF "Qwen3Model" saves) has no "model."
        # prefix, Qwen3ForCausalLM and mlx-lm conversions do.
        return decoder_weights(weights, drop=("lm_head.",))
