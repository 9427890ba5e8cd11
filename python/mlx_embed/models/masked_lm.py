"""The masked-language-model head on BERT or DistilBERT, for SPLADE sparse
embeddings.

SPLADE models (naver/splade-*, prithivida/Splade_PP_en_v1,
opensearch-neural-sparse-encoding-v1) are transformers'
``BertForMaskedLM``: the encoder, then ``cls.predictions``, which maps every
token's hidden state to one logit per vocabulary entry:

    transform.dense -> the config's activation -> transform.LayerNorm
    -> decoder (tied to the word embeddings unless the checkpoint has its own)
    + bias

The DistilBERT ones (opensearch-neural-sparse-encoding-v2-distill, the
document side of ...-doc-v2-distill) are ``DistilBertForMaskedLM``: the same
head under other names, ``vocab_transform`` -> ``activation`` ->
``vocab_layer_norm`` (eps 1e-12) -> ``vocab_projector`` (tied, with its bias).

The model returns the last hidden state like every embedding architecture;
the SPLADE head (``st_modules.SpladePipeline``) calls :meth:`Model.mlm_scores`
on it and pools the activations, so the engine's scheduler stays generic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from .. import ops
from . import bert, distilbert

EMBEDDING_DEFAULTS = {"pooling": "splade"}

# config.json model_type values this head is built on.
MODEL_TYPES = ("bert", "distilbert")

_PREFIX = "cls.predictions."

# DistilBertForMaskedLM's head names -> ours.
_DISTILBERT_HEAD = {
    "vocab_transform.weight": "lm_head.transform.weight",
    "vocab_transform.bias": "lm_head.transform.bias",
    "vocab_layer_norm.weight": "lm_head.norm.weight",
    "vocab_layer_norm.bias": "lm_head.norm.bias",
    "vocab_projector.bias": "lm_head.bias",
}


@dataclass
class ModelArgs:
    # The whole config.json: the encoder reads its own fields from it.
    config: dict
    hidden_size: int
    vocab_size: int
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-12
    tie_word_embeddings: bool = True

    @classmethod
    def from_dict(cls, params: dict) -> "ModelArgs":
        if params.get("model_type") not in MODEL_TYPES:
            raise ValueError(
                f"SPLADE needs a masked-LM checkpoint of {', '.join(MODEL_TYPES)} "
                f"(BertForMaskedLM, DistilBertForMaskedLM); got model_type {params.get('model_type')!r}"
            )
        if params.get("model_type") == "distilbert":
            return cls(
                config=dict(params),
                hidden_size=int(params.get("dim", 768)),
                vocab_size=int(params["vocab_size"]),
                hidden_act=str(params.get("activation", "gelu")),
                layer_norm_eps=distilbert.LAYER_NORM_EPS,
                tie_word_embeddings=bool(params.get("tie_word_embeddings", True)),
            )
        return cls(
            config=dict(params),
            hidden_size=int(params["hidden_size"]),
            vocab_size=int(params["vocab_size"]),
            hidden_act=str(params.get("hidden_act", "gelu")),
            layer_norm_eps=float(params.get("layer_norm_eps", 1e-12)),
            tie_word_embeddings=bool(params.get("tie_word_embeddings", True)),
        )


class LMHead(nn.Module):
    """``cls.predictions``: transform, then scores against the vocabulary;
    the logits are those scores plus ``bias``, which the caller adds where it
    is cheapest (SPLADE's max pooling: once per text, after the max)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.transform = nn.Linear(args.hidden_size, args.hidden_size)
        self.norm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.bias = mx.zeros((args.vocab_size,))
        if not args.tie_word_embeddings:
            self.decoder = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self._tanh_gelu = args.hidden_act != "gelu"

    def __call__(self, h: mx.array, embeddings: nn.Module) -> mx.array:
        """The logits before the vocabulary bias."""
        x = self.transform(h)
        # Its input sits in GELU's negative tail in trained heads and random ones alike
        # (ops.gelu_precise says why that needs more than MLX's erf).
        x = nn.gelu_approx(x) if self._tanh_gelu else ops.gelu_precise(x)
        x = self.norm(x)
        # Tied: scores against the word-embedding table itself (quantized or
        # not: both embedding classes score through as_linear).
        if "decoder" in self:
            return self.decoder(x)
        if type(embeddings) is nn.Embedding:
            # By the native kernel on the CPU's native path, each row's
            # logits the same bits whatever the batch (ops.rows_times; a
            # packed copy of the table beside MLX's, which the embedding
            # lookup reads).
            return ops.rows_times(x, embeddings.weight, owner=self, key="tied")
        return embeddings.as_linear(x)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.config.get("model_type")
        if self.model_type == "distilbert":
            self.encoder = distilbert.Model(distilbert.ModelArgs.from_dict(args.config))
        else:
            self.encoder = bert.Model(bert.ModelArgs.from_dict(args.config))
        self.lm_head = LMHead(args)

    @property
    def vocab_size(self) -> int:
        return self.encoder.vocab_size

    @property
    def max_length(self) -> int:
        return self.encoder.max_length

    @property
    def hidden_size(self) -> int:
        """The encoder's width (DistilBERT's config calls it ``dim``)."""
        return self.args.hidden_size

    def __call__(
        self,
        input_ids: mx.array,
        attention_mask: mx.array,
        token_type_ids: Optional[mx.array] = None,
    ) -> mx.array:
        """Last hidden state [B, L, D], as the encoder's."""
        if token_type_ids is None:
            return self.encoder(input_ids, attention_mask)
        return self.encoder(input_ids, attention_mask, token_type_ids)

    def mlm_scores(self, h: mx.array) -> mx.array:
        """[..., D] hidden states -> [..., vocab] masked-LM logits before
        :attr:`mlm_bias` is added."""
        return self.lm_head(h, self.encoder.embeddings.word_embeddings)

    @property
    def mlm_bias(self) -> mx.array:
        """The per-vocabulary-entry bias of the logits, [vocab]."""
        return self.lm_head.bias

    def sanitize(self, weights: dict) -> dict:
        if self.model_type == "distilbert":
            return self._sanitize_distilbert(weights)
        head, rest = {}, {}
        for name, w in weights.items():
            bare = name[len("bert.") :] if name.startswith("bert.") else name
            if not bare.startswith(_PREFIX):
                rest[bare] = w
                continue
            part = bare[len(_PREFIX) :]
            if part.startswith("transform.dense."):
                head["lm_head.transform." + part[len("transform.dense.") :]] = w
            elif part.startswith("transform.LayerNorm."):
                leaf = part[len("transform.LayerNorm.") :]
                head["lm_head.norm." + {"gamma": "weight", "beta": "bias"}.get(leaf, leaf)] = w
            elif part in ("bias", "decoder.bias"):
                # transformers keeps one bias under both names (tied).
                head["lm_head.bias"] = w
            elif part == "decoder.weight" and not self.args.tie_word_embeddings:
                head["lm_head.decoder.weight"] = w
        missing = [
            n for n in ("lm_head.transform.weight", "lm_head.norm.weight", "lm_head.bias")
            if n not in head
        ]
        if missing:
            raise ValueError(
                "SPLADE needs the masked-LM head (cls.predictions.*), which these weights "
                f"lack ({', '.join(missing)}): is this a BertForMaskedLM checkpoint?"
            )
        out = {"encoder." + k: v for k, v in self.encoder.sanitize(rest).items()}
        out.update(head)
        return out

    def _sanitize_distilbert(self, weights: dict) -> dict:
        head, rest = {}, {}
        for name, w in weights.items():
            if name in _DISTILBERT_HEAD:
                head[_DISTILBERT_HEAD[name]] = w
            elif name == "vocab_projector.weight":
                if not self.args.tie_word_embeddings:
                    head["lm_head.decoder.weight"] = w
            else:
                rest[name] = w
        missing = [
            n for n, ours in _DISTILBERT_HEAD.items() if ours not in head
        ]
        if not self.args.tie_word_embeddings and "lm_head.decoder.weight" not in head:
            missing.append("vocab_projector.weight")
        if missing:
            raise ValueError(
                "SPLADE needs the masked-LM head (vocab_transform, vocab_layer_norm, "
                f"vocab_projector), which these weights lack ({', '.join(missing)}): "
                "is this a DistilBertForMaskedLM checkpoint?"
            )
        out = {"encoder." + k: v for k, v in self.encoder.sanitize(rest).items()}
        out.update(head)
        return out
