"""Sequence-classification heads on the encoders: cross-encoder rerankers
(ms-marco-MiniLM, bge-reranker) and text classifiers.

transformers' ``BertForSequenceClassification`` and
``XLMRobertaForSequenceClassification`` (and RoBERTa's) put a small head on
the first token's hidden state:

* BERT: the pooler (``dense`` + tanh on [CLS]) then ``classifier`` (Linear to
  ``num_labels``);
* (XLM-)RoBERTa: ``classifier.dense`` + tanh then ``classifier.out_proj``; no
  pooler.
* DeBERTa-v2/v3: ``pooler.dense`` + ``pooler_hidden_act`` (GELU) then
  ``classifier``.
* Alibaba GTE (``NewForSequenceClassification``): BERT's head, the encoder
  under ``new.``.
* JinaBERT (``JinaBertForSequenceClassification``): BERT's head, the ALiBi
  encoder (models/jina_bert.py) under ``bert.``.
* ModernBERT (``ModernBertForSequenceClassification``, gte-reranker-modernbert):
  ``classifier(head.norm(act(head.dense(pooled))))``, where ``pooled`` is
  [CLS] or the mean over real tokens (``classifier_pooling``); encoder under
  ``model.``.
* EuroBERT (``EuroBertForSequenceClassification``): ``classifier(gelu(
  dense(x)))`` with the exact GELU, where ``classifier_pooling`` says what
  ``x`` is: the first token's state (``bos``), the mean over real tokens
  (``mean``), or every token's state, the logits then averaged over the real
  tokens (``late``, the default); encoder under ``model.``.
* DistilBERT (``DistilBertForSequenceClassification``): ``classifier(relu(
  pre_classifier([CLS])))``; encoder under ``distilbert.``.
* ELECTRA (``ElectraForSequenceClassification``, ms-marco-electra-base):
  RoBERTa's head names with GELU for tanh, ``classifier.out_proj(gelu(
  classifier.dense([CLS])))``; encoder under ``electra.``.
* Decoders (transformers' ``GenericForSequenceClassification``: Qwen3's,
  Qwen2's, Mistral's, Llama's and Gemma 2's ``*ForSequenceClassification``
  are that class and nothing more; Qwen3-Reranker-*-seq-cls, whose one
  ``score`` row is the yes/no reranker's ``lm_head[yes] - lm_head[no]``,
  reward models such as Skywork-Reward-Llama-3.1-8B):
  ``score`` (no bias) on the state of the last token that is not
  ``pad_token_id`` (:func:`last_token`); decoder under ``model.``. The
  decoder is the embedding file's (its sliding window, Gemma 2's attention
  soft-cap); Gemma 2's ``final_logit_softcapping`` belongs to its LM head,
  and transformers' score never applies it.

The encoder underneath is the embedding architecture's own module, chosen by
``model_type``, so every encoder file gains classification without a copy.
The head returns raw logits (``[B, num_labels]``): whether to apply a sigmoid
or a softmax is the caller's decision (TEI's ``raw_scores``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from . import reads_type_ids
from ..errors import InvalidModel

# config.json ``architectures`` entries this module serves: the encoder's
# module, the head style and the prefix the checkpoint keeps the encoder under.
ARCHITECTURES = {
    "BertForSequenceClassification": ("bert", "pooler", "bert."),
    "XLMRobertaForSequenceClassification": ("xlm_roberta", "roberta", "roberta."),
    "RobertaForSequenceClassification": ("xlm_roberta", "roberta", "roberta."),
    # French cross-encoders: RoBERTa's encoder and head under "roberta.".
    "CamembertForSequenceClassification": ("xlm_roberta", "roberta", "roberta."),
    # MPNetClassificationHead is RoBERTa's (dense + tanh on <s>, out_proj).
    "MPNetForSequenceClassification": ("mpnet", "roberta", "mpnet."),
    "DebertaV2ForSequenceClassification": ("deberta_v2", "context_pooler", "deberta."),
    # Alibaba GTE (gte-multilingual-reranker-base): NewPooler is BERT's pooler.
    "NewForSequenceClassification": ("gte_new", "pooler", "new."),
    # JinaBERT (jina-reranker-v1-*): BertForSequenceClassification's head
    # (pooler + classifier) on the ALiBi encoder under "bert.".
    "JinaBertForSequenceClassification": ("jina_bert", "pooler", "bert."),
    "ModernBertForSequenceClassification": ("modernbert", "modernbert", "model."),
    "EuroBertForSequenceClassification": ("eurobert", "eurobert", "model."),
    "DistilBertForSequenceClassification": ("distilbert", "distilbert", "distilbert."),
    "ElectraForSequenceClassification": ("electra", "electra", "electra."),
    # transformers' GenericForSequenceClassification on each decoder.
    "Qwen3ForSequenceClassification": ("qwen3", "decoder", "model."),
    "Qwen2ForSequenceClassification": ("qwen2", "decoder", "model."),
    "MistralForSequenceClassification": ("mistral", "decoder", "model."),
    "LlamaForSequenceClassification": ("llama", "decoder", "model."),
    "Gemma2ForSequenceClassification": ("gemma2", "decoder", "model."),
}


def architecture(config: dict) -> Optional[str]:
    """The sequence-classification architecture ``config`` names, if any."""
    for a in config.get("architectures") or ():
        if a in ARCHITECTURES:
            return a
    return None


@dataclass
class ModelArgs:
    # The whole config.json: the encoder reads its own fields from it.
    config: dict
    architecture: str
    num_labels: int
    labels: list = field(default_factory=list)
    hidden_size: int = 0

    @classmethod
    def from_dict(cls, params: dict) -> "ModelArgs":
        arch = architecture(params)
        if arch is None:
            raise InvalidModel(
                f"config.json names no supported sequence-classification architecture "
                f"(got {params.get('architectures')!r}; supported: {', '.join(ARCHITECTURES)})"
            )
        labels = labels_from_config(params)
        return cls(
            config=dict(params),
            architecture=arch,
            num_labels=len(labels),
            labels=labels,
            # DistilBERT's config.json says "dim".
            hidden_size=int(params.get("hidden_size") or params["dim"]),
        )


def labels_from_config(config: dict) -> list:
    """Label names in logit order, from ``id2label`` (keys are strings in
    config.json) or ``num_labels``; transformers' default is two labels."""
    id2label = config.get("id2label")
    if isinstance(id2label, dict) and id2label:
        try:
            ordered = sorted(((int(k), str(v)) for k, v in id2label.items()))
        except (TypeError, ValueError) as e:
            raise InvalidModel(f"config.json id2label has a non-integer key: {e}") from e
        if [k for k, _ in ordered] != list(range(len(ordered))):
            raise InvalidModel("config.json id2label keys must be 0..n-1")
        return [v for _, v in ordered]
    n = int(config.get("num_labels", 2))
    if n < 1:
        raise InvalidModel(f"config.json num_labels must be >= 1, got {n}")
    return [f"LABEL_{i}" for i in range(n)]


class PoolerHead(nn.Module):
    """BERT: tanh(dense([CLS])) then the classifier."""

    def __init__(self, hidden: int, num_labels: int):
        super().__init__()
        self.pooler = nn.Linear(hidden, hidden)
        self.classifier = nn.Linear(hidden, num_labels)

    def __call__(self, first: mx.array) -> mx.array:
        return self.classifier(mx.tanh(self.pooler(first)))

    @staticmethod
    def rename(name: str) -> Optional[str]:
        if name.startswith("pooler.dense."):
            return "pooler." + name[len("pooler.dense.") :]
        if name.startswith("classifier."):
            return name
        return None


class RobertaHead(nn.Module):
    """(XLM-)RoBERTa: out_proj(tanh(dense(<s>)))."""

    def __init__(self, hidden: int, num_labels: int):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, num_labels)

    def __call__(self, first: mx.array) -> mx.array:
        return self.out_proj(mx.tanh(self.dense(first)))

    @staticmethod
    def rename(name: str) -> Optional[str]:
        for part in ("dense.", "out_proj."):
            if name.startswith("classifier." + part):
                return name[len("classifier.") :]
        return None


class ElectraHead(RobertaHead):
    """ELECTRA: out_proj(gelu(dense([CLS]))). transformers fixes the exact
    (erf) GELU here whatever ``hidden_act`` says (ElectraClassificationHead:
    ``get_activation("gelu")``, "it seems Electra authors used gelu here")."""

    def __call__(self, first: mx.array) -> mx.array:
        return self.out_proj(nn.gelu(self.dense(first)))


class ContextPoolerHead(PoolerHead):
    """DeBERTa's ContextPooler: ``pooler_hidden_act`` (GELU by default, not
    tanh) of dense([CLS]), then the classifier; BERT's weight names."""

    def __init__(self, hidden: int, num_labels: int, act):
        super().__init__(hidden, num_labels)
        self._act = act

    def __call__(self, first: mx.array) -> mx.array:
        return self.classifier(self._act(self.pooler(first)))


def _context_pooler(args: "ModelArgs") -> ContextPoolerHead:
    from .deberta_v2 import activation

    act = activation(args.config.get("pooler_hidden_act", "gelu"), "pooler_hidden_act")
    return ContextPoolerHead(args.hidden_size, args.num_labels, act)


class ModernBertHead(nn.Module):
    """ModernBERT: ``classifier(norm(act(dense(pooled))))``; the pooled
    state is [CLS] or the mean over real tokens (``classifier_pooling``)."""

    def __init__(self, args: "ModelArgs"):
        super().__init__()
        from .deberta_v2 import activation

        cfg, hidden = args.config, args.hidden_size
        self.mean_pooling = _modernbert_pooling(cfg) == "mean"
        self.dense = nn.Linear(hidden, hidden, bias=bool(cfg.get("classifier_bias", False)))
        self.norm = nn.LayerNorm(hidden, eps=float(cfg.get("norm_eps", 1e-5)), bias=bool(cfg.get("norm_bias", False)))
        self.classifier = nn.Linear(hidden, args.num_labels)
        self._act = activation(cfg.get("classifier_activation", "gelu"), "classifier_activation")

    def __call__(self, pooled: mx.array) -> mx.array:
        return self.classifier(self.norm(self._act(self.dense(pooled))))

    @staticmethod
    def rename(name: str) -> Optional[str]:
        if name.startswith(("head.dense.", "head.norm.")):
            return name[len("head.") :]
        if name.startswith("classifier."):
            return name
        return None


def _modernbert_pooling(config: dict) -> str:
    pooling = config.get("classifier_pooling", "cls")
    if pooling not in ("cls", "mean"):
        raise InvalidModel(f"ModernBERT: classifier_pooling={pooling!r} is not supported (only 'cls', 'mean')")
    return pooling


class EuroBertHead(nn.Module):
    """EuroBERT: ``classifier(gelu(dense(x)))`` pooled as ``classifier_pooling``
    says (:func:`_eurobert_pooling`); it takes the whole sequence, since
    ``late`` pools the logits rather than the states."""

    # Model.__call__ reads it: the head gets every state and the mask.
    takes_sequence = True

    def __init__(self, args: "ModelArgs"):
        super().__init__()
        hidden = args.hidden_size
        self.pooling = _eurobert_pooling(args.config)
        self.dense = nn.Linear(hidden, hidden)
        self.classifier = nn.Linear(hidden, args.num_labels)

    def _logits(self, x: mx.array) -> mx.array:
        # transformers' nn.GELU(): the exact (erf) one.
        return self.classifier(nn.gelu(self.dense(x)))

    def __call__(self, h: mx.array, attention_mask: mx.array) -> mx.array:
        if self.pooling == "bos":
            return self._logits(h[:, 0])
        m = attention_mask.astype(h.dtype)[..., None]
        if self.pooling == "mean":
            return self._logits((h * m).sum(axis=1) / m.sum(axis=1))
        return (self._logits(h) * m).sum(axis=1) / m.sum(axis=1)

    @staticmethod
    def rename(name: str) -> Optional[str]:
        return name if name.startswith(("dense.", "classifier.")) else None


EUROBERT_POOLINGS = ("bos", "mean", "late")


def _eurobert_pooling(config: dict) -> str:
    """``classifier_pooling``, as transformers 5 reads it (default ``late``).
    EuroBERT's remote code read ``clf_pooling`` instead, which transformers 5
    ignores: a folder that sets only that, to another pooling than ``late``,
    was trained with one pooling and runs in transformers with another, so
    it is refused rather than guessed."""
    if "classifier_pooling" in config:
        pooling = config["classifier_pooling"]
    else:
        legacy = config.get("clf_pooling", "late")
        if legacy != "late":
            raise InvalidModel(
                f"EuroBERT: config.json sets clf_pooling={legacy!r} (the remote code's key) but no "
                "classifier_pooling: transformers 5 reads only classifier_pooling and would pool 'late'; "
                f"set classifier_pooling to the pooling the model was trained with ({', '.join(EUROBERT_POOLINGS)})"
            )
        pooling = "late"
    if pooling not in EUROBERT_POOLINGS:
        raise InvalidModel(
            f"EuroBERT: classifier_pooling={pooling!r} is not supported (only {', '.join(map(repr, EUROBERT_POOLINGS))})"
        )
    return pooling


class DistilBertHead(nn.Module):
    """DistilBERT: ``classifier(relu(pre_classifier([CLS])))``."""

    def __init__(self, hidden: int, num_labels: int):
        super().__init__()
        self.pre_classifier = nn.Linear(hidden, hidden)
        self.classifier = nn.Linear(hidden, num_labels)

    def __call__(self, first: mx.array) -> mx.array:
        return self.classifier(nn.relu(self.pre_classifier(first)))

    @staticmethod
    def rename(name: str) -> Optional[str]:
        return name if name.startswith(("pre_classifier.", "classifier.")) else None


class DecoderScoreHead(nn.Module):
    """transformers' ``GenericForSequenceClassification`` (Qwen3, Qwen2,
    Mistral, Llama, Gemma 2): ``score``,
    a Linear without bias, on the last token's state (:func:`last_token`).
    transformers applies it at every position and then picks one; picking
    first is the same product."""

    # Model.__call__ reads it: the head takes the last token, not the first.
    last_token = True

    def __init__(self, hidden: int, num_labels: int):
        super().__init__()
        self.score = nn.Linear(hidden, num_labels, bias=False)

    def __call__(self, last: mx.array) -> mx.array:
        return self.score(last)

    @staticmethod
    def rename(name: str) -> Optional[str]:
        return name if name.startswith("score.") else None


def last_token(input_ids: mx.array, attention_mask: mx.array, pad_id: Optional[int]) -> mx.array:
    """Each right-padded row's scored position, as transformers' generic
    decoder head chooses it on the row alone: the rightmost token that is not
    ``pad_id`` (so an input that holds the pad token, as text that writes
    ``<|endoftext|>`` does, is scored before it), position 0 when every token
    is ``pad_id``; the last token where the config has no pad id (transformers
    takes position -1 then, and refuses batches, which would hold padding)."""
    keep = attention_mask.astype(mx.bool_)
    if pad_id is not None:
        keep = mx.logical_and(keep, input_ids != pad_id)
    positions = mx.arange(input_ids.shape[1], dtype=mx.int32)
    return mx.max(mx.where(keep, positions, 0), axis=1)


def _pad_token_id(config: dict) -> Optional[int]:
    pad = config.get("pad_token_id")
    if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int)):
        raise InvalidModel(f"config.json pad_token_id must be an integer or null, got {pad!r}")
    return pad


# Head style -> its class (whose ``rename`` tells its weights' names) and
# how to build it from the classifier's ModelArgs.
_HEADS = {
    "pooler": (PoolerHead, lambda a: PoolerHead(a.hidden_size, a.num_labels)),
    "roberta": (RobertaHead, lambda a: RobertaHead(a.hidden_size, a.num_labels)),
    "context_pooler": (ContextPoolerHead, _context_pooler),
    "modernbert": (ModernBertHead, ModernBertHead),
    "eurobert": (EuroBertHead, EuroBertHead),
    "distilbert": (DistilBertHead, lambda a: DistilBertHead(a.hidden_size, a.num_labels)),
    "electra": (ElectraHead, lambda a: ElectraHead(a.hidden_size, a.num_labels)),
    "decoder": (DecoderScoreHead, lambda a: DecoderScoreHead(a.hidden_size, a.num_labels)),
}


def encoder_weights(config: dict, weights: dict) -> dict:
    """A classifier checkpoint's encoder weights alone, named as the
    encoder's own checkpoints name them: what an embedding model built from
    it reads (sentence-transformers' ``AutoModel`` drops the head too)."""
    _module, style, prefix = ARCHITECTURES[architecture(config)]
    is_head = _HEADS[style][0].rename
    out = {}
    for name, w in weights.items():
        bare = name[len(prefix) :] if name.startswith(prefix) else name
        if is_head(bare) is None and not bare.startswith("pooler."):
            out[bare] = w
    return out


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.config.get("model_type")
        module, style, self._prefix = ARCHITECTURES[args.architecture]
        arch = importlib.import_module(f"{__package__}.{module}")
        self.encoder = arch.Model(arch.ModelArgs.from_dict(args.config))
        self.head = _HEADS[style][1](args)
        # The token the decoder head scores is found by the pad id (last_token).
        self._pad_id = _pad_token_id(args.config) if getattr(self.head, "last_token", False) else None
        # Whether pairs carry token types to the encoder (ModernBERT and
        # DistilBERT have no type table; the engine then sends none).
        self.reads_type_ids = reads_type_ids(self.encoder)

    @property
    def vocab_size(self) -> int:
        return self.encoder.vocab_size

    @property
    def max_length(self) -> Optional[int]:
        """The encoder's own limit where it has one (Mistral's is capped at
        its sliding window, RoBERTa's table holds 2 positions fewer)."""
        return getattr(self.encoder, "max_length", None)

    @property
    def hidden_size(self) -> int:
        return self.args.hidden_size

    @property
    def num_labels(self) -> int:
        return self.args.num_labels

    @property
    def labels(self) -> list:
        return list(self.args.labels)

    def __call__(
        self,
        input_ids: mx.array,
        attention_mask: mx.array,
        token_type_ids: Optional[mx.array] = None,
    ) -> mx.array:
        """Raw logits [B, num_labels] for right-padded rows."""
        if token_type_ids is None or not self.reads_type_ids:
            h = self.encoder(input_ids, attention_mask)
        else:
            h = self.encoder(input_ids, attention_mask, token_type_ids)
        if getattr(self.head, "takes_sequence", False):
            return self.head(h, attention_mask)
        if getattr(self.head, "last_token", False):
            at = last_token(input_ids, attention_mask, self._pad_id)
            return self.head(mx.take_along_axis(h, at[:, None, None], axis=1)[:, 0])
        if getattr(self.head, "mean_pooling", False):
            m = attention_mask.astype(h.dtype)[..., None]
            return self.head((h * m).sum(axis=1) / m.sum(axis=1))
        return self.head(h[:, 0])

    def sanitize(self, weights: dict) -> dict:
        head, rest = {}, {}
        prefix = self._prefix
        for name, w in weights.items():
            bare = name[len(prefix) :] if name.startswith(prefix) else name
            new = self.head.rename(bare)
            if new is not None:
                head["head." + new] = w
            elif bare.startswith("pooler."):
                # A pooler the head does not use (RoBERTa checkpoints may carry one).
                continue
            else:
                rest[bare] = w
        self._check_head(head)
        out = {"encoder." + k: v for k, v in self.encoder.sanitize(rest).items()}
        out.update(head)
        return out

    def _check_head(self, head: dict) -> None:
        """The head's weights against config.json's layout: a label count
        (``num_labels`` / ``id2label``) that is not the checkpoint's is
        refused by name, not as MLX's shape error on ``head.*``."""
        from mlx.utils import tree_flatten

        want = {"head." + k: v.shape for k, v in tree_flatten(self.head.parameters())}
        missing = sorted(k for k in want if k not in head)
        if missing:
            raise InvalidModel(
                f"{self.args.architecture}: the checkpoint has no {', '.join(m[len('head.'):] for m in missing)} "
                "(a classification head config.json names but the weights lack)"
            )
        for name, w in head.items():
            shape = want.get(name)
            # Rows are the output axis, the labels' for the last layer;
            # pre-quantized weights pack the input axis, so only rows compare.
            if shape is None or (w.shape[0] == shape[0] and (w.dtype == mx.uint32 or w.shape == shape)):
                continue
            raise InvalidModel(
                f"{self.args.architecture}: the checkpoint's {name[len('head.'):]} has shape {tuple(w.shape)}, "
                f"config.json's layout wants {tuple(shape)} ({self.args.num_labels} label(s) from "
                f"num_labels/id2label, hidden_size {self.args.hidden_size}): they do not match"
            )
