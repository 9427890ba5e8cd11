"""Mistral decoder as an embedding model (intfloat/e5-mistral-7b-instruct,
Salesforce/SFR-Embedding-Mistral and SFR-Embedding-2_R,
Linq-AI-Research/Linq-Embed-Mistral).

Mistral is Llama's network (RMSNorm, GQA, rotate-half RoPE, SwiGLU, no
biases) with sliding-window attention; mlx-lm runs "mistral" checkpoints as
llama, and so does this file: the transformer is mlx-lm's ``LlamaModel``,
this file adds the embedding wrapper, the config checks and the weight
names. Attention is causal, as the checkpoints run under transformers and
sentence-transformers, so right padding needs no mask: a real token never
attends to the padding after it, and pooling takes each row's last real
token.

Sliding window. transformers lets token i see tokens j with
``i - sliding_window < j <= i``. For an input of at most ``sliding_window``
tokens that is every earlier token, i.e. exactly full causal attention; past
it the two differ (the fixture's README measures how much). The usable max
length is therefore capped at ``sliding_window`` (``max_length`` below, which
the loader treats as the model's position limit): every input accepted is
computed exactly as transformers computes it, longer texts are truncated
like any text over the max length (or refused with ``truncate: false``), and
an explicit ``max_length`` above the window is refused at load. Capping,
rather than refusing every input past the window, keeps the behaviour
sentence-transformers users get from e5-mistral's folder, whose inputs are
truncated, and the models were trained on far shorter inputs than 4096
anyway (e5-mistral's card: "inputs longer than 4096 tokens are not
recommended"). A config with ``sliding_window: null`` (full attention) keeps
``max_position_embeddings``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from .. import ops
from . import DECODER_SIBLINGS, decoder_weights, mlx_lm_model

_lm = mlx_lm_model("llama")

# The attention's softmax by the native kernel on the CPU, long inputs in
# query blocks (ops.engine_attention); the feed-forward's SiLU by the native
# kernel on the CPU (ops.native_swiglu).
ops.engine_attention(_lm)
ops.native_swiglu(_lm)
# Its feed-forward on each pass's real tokens where the engine packs rows.
ops.packs_feed_forward(_lm.MLP)
# A pass may be evaluated after each block (ops.EvaluationPoints).
ops.layer_boundary(_lm.TransformerBlock)

# e5-mistral / SFR / Linq: last-token pooling over "<s> ... </s>" (the model
# card's code appends EOS by hand; older tokenizer.json files do not add it),
# queries carry an instruction, documents none.
EMBEDDING_DEFAULTS = {
    "pooling": "last",
    "eos_token": "</s>",
    "instruction_template": "Instruct: {instruction}\nQuery: ",
}

# Queries/keys/values and gate/up as one matmul each (sibling_linears.py).
JOINED_LINEARS = DECODER_SIBLINGS


@dataclass
class ModelArgs(_lm.ModelArgs):
    @classmethod
    def from_dict(cls, params: dict) -> "ModelArgs":
        params = dict(params)
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                    "intermediate_size"):
            if key not in params:
                raise ValueError(f"mistral: config.json lacks {key!r}")
        # transformers >= 5 writes rope settings as rope_parameters only.
        rope = params.get("rope_parameters")
        if "rope_theta" not in params and isinstance(rope, dict) and "rope_theta" in rope:
            params["rope_theta"] = rope["rope_theta"]
            if rope.get("rope_type", "default") != "default":
                params.setdefault("rope_scaling", rope)
        # No Mistral embedder scales RoPE and no fixture backs it: refused,
        # not guessed.
        scaling = params.get("rope_scaling")
        if scaling and (scaling.get("rope_type") or scaling.get("type") or "default") != "default":
            raise ValueError(f"mistral: rope_scaling={scaling!r} is not supported (only plain RoPE)")
        act = params.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"mistral: hidden_act={act!r} is not supported (only 'silu')")
        window = params.get("sliding_window")
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"mistral: sliding_window={window!r} is not a positive integer")
        params.setdefault("num_key_value_heads", params["num_attention_heads"])
        params.setdefault("rms_norm_eps", 1e-5)
        params.setdefault("rope_theta", 10000.0)
        # transformers' Mistral has no biases and, by default, an untied head.
        params.setdefault("attention_bias", False)
        params.setdefault("mlp_bias", False)
        params.setdefault("tie_word_embeddings", False)
        # Every layer full causal: identical to the sliding window for the
        # inputs max_length admits (module docstring).
        params["layer_types"] = ["full_attention"] * int(params["num_hidden_layers"])
        return super().from_dict(params)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = _lm.LlamaModel(args)

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def max_length(self) -> Optional[int]:
        """The longest input computed exactly as transformers does: the
        position limit, capped at ``sliding_window`` (module docstring)."""
        caps = [n for n in (self.args.max_position_embeddings, self.args.sliding_window) if n]
        return min(caps) if caps else None

    def __call__(self, input_ids: mx.array, attention_mask: mx.array) -> mx.array:
        # attention_mask unused on purpose (module docstring); the final
        # RMSNorm is applied inside LlamaModel.
        with ops.packed_feed_forwards(ops.KeyMask(attention_mask, mx.float32)):
            return self.model(input_ids)

    def sanitize(self, weights: dict) -> dict:
        # MistralModel saves without the "model." prefix, MistralForCausalLM
        # (and mlx-lm conversions) with it plus an LM head that embeddings
        # never use.
        return decoder_weights(weights)
