"""Llama decoder as an embedding model (``LlamaModel`` / ``LlamaForCausalLM``
folders: Llama 2 / 3 / 3.1 / 3.2 fine-tunes pooled at their last token), and
the network under mistral.py and eurobert.py (EuroBERT loops these blocks
under a bidirectional mask).

The transformer is mlx-lm's ``LlamaModel`` as is: RMSNorm, GQA with
``head_dim`` from the config where it says, rotate-half RoPE, SwiGLU, and
the biases ``attention_bias`` (q/k/v and o) and ``mlp_bias`` (gate, up and
down) put there, as transformers' Llama puts them. This file adds the
embedding wrapper, the config checks and the weight names. Attention is
causal, as the checkpoints run under transformers and sentence-transformers,
so right padding needs no mask: a real token never attends to the padding
after it, and pooling takes each row's last real token.

RoPE scaling. transformers computes a ``linear`` or ``llama3`` (Llama 3.1 /
3.2: ``factor``, ``low_freq_factor``, ``high_freq_factor``,
``original_max_position_embeddings``) scaling once, as fixed frequencies,
whatever the input's length; mlx-lm's ``nn.RoPE(scale=1/factor)`` and
``Llama3RoPE`` compute the same frequencies (the tiny-llama fixture checks
llama3 against transformers in float64). ``dynamic`` depends on the padded
length of each batch, ``yarn`` and ``longrope`` rescale the attention too,
each in its own way: they are refused by name rather than run approximately.

``pretraining_tp`` is accepted whatever it says: transformers 4 split the
feed-forward's matmuls into that many slices and summed them, the same
product up to rounding, and transformers 5 no longer reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from .. import ops
from . import DECODER_SIBLINGS, decoder_weights, mlx_lm_model

_lm = mlx_lm_model("llama")

# The attention by the native kernel on the CPU's native path, long inputs in
# query blocks elsewhere (ops.engine_attention); the feed-forward's SiLU by
# the native kernel on the CPU (ops.native_swiglu).
ops.engine_attention(_lm)
ops.native_swiglu(_lm)
# Its feed-forward on each pass's real tokens where the engine packs rows.
ops.packs_feed_forward(_lm.MLP)
# A pass may be evaluated after each block (ops.EvaluationPoints).
ops.layer_boundary(_lm.TransformerBlock)

# Last-token pooling over what the folder's tokenizer makes of a text, with
# nothing appended: Llama 3's tokenizer adds "<|begin_of_text|>" and no EOS,
# and sentence-transformers, which trains and runs these folders, appends
# none (a folder whose tokenizer adds an EOS keeps it). Queries may carry an
# instruction in the e5 / SFR template.
EMBEDDING_DEFAULTS = {
    "pooling": "last",
    "instruction_template": "Instruct: {instruction}\nQuery: ",
}

# Queries/keys/values and gate/up as one matmul each (sibling_linears.py).
JOINED_LINEARS = DECODER_SIBLINGS

# RoPE scalings mlx-lm computes exactly as transformers does (module docstring).
EXACT_ROPE_SCALINGS = ("default", "linear", "llama3")


def llama_params(params: dict, arch: str, scalings=EXACT_ROPE_SCALINGS) -> dict:
    """``params`` (config.json) for mlx-lm's Llama network, checked:
    transformers 5's ``rope_parameters`` read as the flat keys, a RoPE
    scaling outside ``scalings`` or another activation than SiLU refused,
    and transformers' ``LlamaConfig`` / ``MistralConfig`` defaults (they
    agree) for the keys a config leaves out."""
    params = dict(params)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"):
        if key not in params:
            raise ValueError(f"{arch}: config.json lacks {key!r}")
    # transformers >= 5 writes rope settings as rope_parameters only.
    rope = params.get("rope_parameters")
    if isinstance(rope, dict):
        if "rope_theta" in rope:
            params.setdefault("rope_theta", rope["rope_theta"])
        if (rope.get("rope_type") or rope.get("type") or "default") != "default":
            params.setdefault("rope_scaling", rope)
    scaling = params.get("rope_scaling")
    if scaling is not None:
        if not isinstance(scaling, dict):
            raise ValueError(f"{arch}: rope_scaling={scaling!r} is not a mapping")
        kind = scaling.get("rope_type") or scaling.get("type") or "default"
        if kind not in scalings:
            raise ValueError(
                f"{arch}: rope_scaling type {kind!r} is not supported (only {', '.join(map(repr, scalings))})"
            )
        if kind == "llama3":
            missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor",
                                   "original_max_position_embeddings") if k not in scaling]
            if missing:
                # transformers requires every one of them; mlx-lm would guess.
                raise ValueError(f"{arch}: rope_scaling type 'llama3' lacks {', '.join(missing)}")
        if kind == "linear" and "factor" not in scaling:
            raise ValueError(f"{arch}: rope_scaling type 'linear' lacks 'factor'")
        if kind == "default":
            params["rope_scaling"] = None
    for source in (params, rope if isinstance(rope, dict) else {}, scaling or {}):
        partial = source.get("partial_rotary_factor", 1.0)
        if partial not in (None, 1, 1.0):
            raise ValueError(f"{arch}: partial_rotary_factor={partial!r} is not supported (Llama rotates whole heads)")
    act = params.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{arch}: hidden_act={act!r} is not supported (only 'silu')")
    # Absent or null: one key/value head per query head, as LlamaConfig sets it.
    if params.get("num_key_value_heads") is None:
        params["num_key_value_heads"] = params["num_attention_heads"]
    params.setdefault("rms_norm_eps", 1e-6)
    params.setdefault("rope_theta", 10000.0)
    params.setdefault("attention_bias", False)
    params.setdefault("mlp_bias", False)
    params.setdefault("tie_word_embeddings", False)
    # Every layer full causal (Mistral's window: mistral.py caps max_length
    # inside it; transformers' Llama has none).
    params["layer_types"] = ["full_attention"] * int(params["num_hidden_layers"])
    return params


@dataclass
class ModelArgs(_lm.ModelArgs):
    @classmethod
    def from_dict(cls, params: dict) -> "ModelArgs":
        params = llama_params(params, "llama")
        # transformers' LlamaConfig has no sliding window: a stray key is
        # not read there, nor here.
        params["sliding_window"] = None
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
        position limit, capped at a Mistral's ``sliding_window`` (mistral.py)."""
        caps = [n for n in (self.args.max_position_embeddings, self.args.sliding_window) if n]
        return min(caps) if caps else None

    def __call__(self, input_ids: mx.array, attention_mask: mx.array) -> mx.array:
        # attention_mask unused on purpose (module docstring); the final
        # RMSNorm is applied inside LlamaModel.
        with ops.packed_feed_forwards(ops.KeyMask(attention_mask, mx.float32)):
            return self.model(input_ids)

    def sanitize(self, weights: dict) -> dict:
        # LlamaModel / MistralModel save without the "model." prefix,
        # *ForCausalLM (and mlx-lm conversions) with it plus an LM head
        # that embeddings never use.
        return decoder_weights(weights)
