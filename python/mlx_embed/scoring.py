"""The Python library's cross-encoder API: ``predict``, ``score`` and
``rerank`` on a model loaded as a classifier or reranker (``heads.py``).

The engine returns raw logits; turning them into scores is the Rust core's
function (``mlx_embed_core::activate``, the server's too), which this module
calls, with TEI's rule:
sigmoid for one label, softmax over several, nothing with ``raw_scores``;
a multi-label classifier's labels get a sigmoid each (transformers' rule).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from . import ops
from .errors import InputTooLong, InvalidInput, check_switches
from .pairs import PairEncoder, pairs_only


def activate(logits: np.ndarray, multi_label: bool = False) -> np.ndarray:
    """[n, labels] raw logits -> scores: sigmoid (1 label, or each label of a
    multi-label classifier) or softmax; a new float32 array. The server's
    (``mlx_embed_core::activate`` through the extension), so a score is the server's
    to the last bit; without the extension its arithmetic in NumPy (float64,
    each score rounded once; NumPy's exp, not the C library's, may differ
    in a float64 last bit)."""
    out = np.array(logits, dtype=np.float32, order="C")
    native = getattr(ops._native, "scores_", None)
    if native is not None and out.ndim == 2:
        native(out, bool(multi_label))
        return out
    x = out.astype(np.float64)
    if x.shape[1] == 1 or multi_label:
        return (1.0 / (1.0 + np.exp(-x))).astype(np.float32)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    total = np.zeros((len(e), 1))
    for label in range(e.shape[1]):  # the server's order
        total += e[:, label : label + 1]
    return (e / total).astype(np.float32)


class ScoringMixin:
    """Methods for scorer models; mixed into ``EmbeddingModel``, which
    provides ``kind``, ``labels``, ``max_length``, ``tokenizer``, ``encode``
    and ``scheduler``."""

    kind: str
    labels: list
    multi_label: bool

    def _require_scorer(self, what: str) -> None:
        if self.kind == "embedding":
            raise InvalidInput(
                f"{self.name} is an embedding model; {what} needs a classifier or reranker "
                "(a *ForSequenceClassification checkpoint, or a Qwen3 reranker)"
            )

    @property
    def pair_encoder(self) -> PairEncoder:
        enc = getattr(self, "_pair_encoder", None)
        if enc is None:
            pair = self.tokenizer.pair
            if pair is None:
                raise InvalidInput(f"{self.name}'s tokenizer has no pair template")
            enc = PairEncoder.from_file(self.tokenizer.path, pair, self.max_length)
            self._pair_encoder = enc
        return enc

    def encode_pairs(
        self,
        pairs: Sequence,
        *,
        truncate: bool = True,
        truncation_direction: Optional[str] = None,
        instruction: Optional[str] = None,
    ) -> tuple[list, Optional[list], list]:
        """(ids, type ids or None, tokens before truncation) per pair: what
        ``embed_ids`` takes."""
        check_switches(truncate=truncate)
        ids, types, before = self.pair_encoder.encode(
            pairs,
            truncation_direction=self.truncation_side if truncation_direction is None else truncation_direction,
            instruction=instruction, truncate=truncate,
        )
        if not truncate:
            for i, b in enumerate(before):
                if b > self.max_length:
                    raise InputTooLong("pair", i, b, self.max_length)
        return ids, types, before

    def score(
        self,
        pairs: Sequence,
        *,
        raw_scores: bool = False,
        truncate: bool = True,
        truncation_direction: Optional[str] = None,
        instruction: Optional[str] = None,
    ) -> np.ndarray:
        """Scores [len(pairs), labels] of (query, document) pairs."""
        self._require_scorer("score()")
        check_switches(raw_scores=raw_scores)
        ids, types, _ = self.encode_pairs(
            pairs, truncate=truncate, truncation_direction=truncation_direction,
            instruction=instruction,
        )
        logits, _ = self.scheduler.run(ids, types)
        return logits if raw_scores else activate(logits, self.multi_label)

    def rerank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        top_n: Optional[int] = None,
        raw_scores: bool = False,
        truncate: bool = True,
        truncation_direction: Optional[str] = None,
        instruction: Optional[str] = None,
    ) -> list[tuple[int, float]]:
        """(document index, score) pairs, best first; ``top_n`` keeps that many."""
        if self.kind != "reranker":
            kind = "an embedding model" if self.kind == "embedding" else f"a {self.kind}"
            raise InvalidInput(f"{self.name} is {kind}, not a reranker")
        if not isinstance(query, str):
            raise TypeError(f"query must be a str, got {type(query).__name__}")
        if isinstance(documents, (str, bytes)) or not hasattr(documents, "__iter__"):
            raise TypeError("documents must be a list of str")
        documents = list(documents)
        for i, d in enumerate(documents):
            if not isinstance(d, str):
                raise TypeError(f"documents[{i}] must be a str, got {type(d).__name__}")
        if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, (int, np.integer))):
            raise TypeError(f"top_n must be a whole number, got {top_n!r}")
        if top_n is not None and top_n < 1:
            raise InvalidInput(f"top_n must be >= 1, got {top_n}")
        s = self.score(
            [(query, d) for d in documents], raw_scores=raw_scores, truncate=truncate,
            truncation_direction=truncation_direction, instruction=instruction,
        )[:, 0]
        # Stable: equal scores keep the documents' order.
        order = np.argsort(-s, kind="stable")
        if top_n is not None:
            order = order[:top_n]
        return [(int(i), float(s[i])) for i in order]

    def predict(
        self,
        inputs: Sequence,
        *,
        raw_scores: bool = False,
        truncate: bool = True,
        truncation_direction: Optional[str] = None,
    ) -> np.ndarray:
        """Label scores [n, labels] for texts or (text, text) pairs (a
        classifier's single texts or NLI-style pairs); labels in ``labels``."""
        self._require_scorer("predict()")
        check_switches(raw_scores=raw_scores)
        if isinstance(inputs, (str, bytes)):
            # list("ab") would score "a" and "b".
            raise TypeError(f"inputs must be a list of texts or of (text, text) pairs, got {type(inputs).__name__}")
        inputs = list(inputs)
        singles = [isinstance(x, str) for x in inputs]
        if any(singles) and not all(singles):
            raise TypeError("give all texts or all pairs, not a mix")
        if not all(singles) and not all(isinstance(x, (tuple, list)) and len(x) == 2 for x in inputs):
            raise TypeError("inputs must be a list of texts or of (text, text) pairs")
        if inputs and all(singles):
            if pairs_only(self.tokenizer.pair):
                raise InvalidInput(f"{self.name} scores (query, document) pairs, not single texts")
            ids, _ = self.encode(inputs, truncate=truncate, truncation_direction=truncation_direction)
            logits, _ = self.scheduler.run(ids)
            return logits if raw_scores else activate(logits, self.multi_label)
        return self.score(
            inputs, raw_scores=raw_scores, truncate=truncate, truncation_direction=truncation_direction
        )
