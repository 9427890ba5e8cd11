"""ColBERT late interaction (PyLate's multi-vector models), as
``pylate.models.ColBERT.encode(is_query=...)`` computes it.

st_modules.py reads the folder's settings (:class:`~.st_modules.ColbertSettings`);
this module turns them into token ids against the model's tokenizer once at
load (:func:`resolve`), and after each call keeps the rows PyLate keeps and
projects them (:meth:`MultiVector.finish`). What PyLate does, step by step:

* Tokenize: the Transformer's max_seq_length is set to the mode's length
  less one (for the prefix), the text is tokenized with the specials and cut
  to it, then the prefix token id is inserted after the first token
  (``[CLS]``). A query with ``do_query_expansion`` is padded to the length
  with the tokenizer's pad id, which PyLate set to the mask token's
  (``[MASK]``; else EOS, else the pad token). The Rust tokenizer and
  ``TextTokenizer`` do this from :class:`~.spec.InputModeSpec`.
* Attention: the expansion tokens are not attended to (their attention mask
  is 0) unless ``attend_to_expansion_tokens``; their own rows are computed all
  the same (every row attends to the real tokens) and kept. So the engine runs
  a query whose keys end before its rows do (``attend`` in the scheduler).
* Kept rows: every row of a query (expansion or not: without expansion a
  query has no padding to drop); a document's rows less those whose token
  id is in the skiplist (``convert_tokens_to_ids`` of each skiplist word: a
  word outside the vocabulary names the unknown token, so unknown tokens are
  dropped too).
* Each kept row goes through the Dense layers; the caller normalizes each
  row (PyLate's ``normalize_embeddings=True``), as the engine leaves vectors
  unnormalized.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .json_files import read_json
from .pairs import _cut
from .spec import InputModeSpec
from .st_modules import ColbertPipeline

QUERY, DOCUMENT = "multi_vector_query", "multi_vector_document"
OUTPUTS = (QUERY, DOCUMENT)


@dataclass(frozen=True)
class MultiVector:
    """A ColBERT model's two input modes as ids, and what its rows keep."""

    query: InputModeSpec
    document: InputModeSpec
    # Ids whose rows a document leaves out (the skiplist), as the array
    # np.isin reads on every call.
    skiplist_ids: np.ndarray
    # Whether a query's expansion tokens are attended to.
    attend_to_expansion: bool
    pipeline: ColbertPipeline

    def mode(self, output: str) -> InputModeSpec:
        return self.query if output == QUERY else self.document

    def attended(self, ids: list[list[int]], output: str) -> Optional[list[int]]:
        """Per input, the keys it attends to (its rows less the trailing
        expansion tokens), or None when every row is a key. The expansion is
        the run of the expansion id after the last special token, which the
        content (cut before it) never reaches."""
        expand = self.query.expand_id
        if output != QUERY or expand is None or self.attend_to_expansion:
            return None
        out = []
        for row in ids:
            n = len(row)
            while n > 1 and row[n - 1] == expand:
                n -= 1
            out.append(n)
        return out if any(a < len(r) for a, r in zip(out, ids)) else None

    def finish(self, hidden: np.ndarray, ids: list[list[int]], output: str) -> tuple[np.ndarray, list[int]]:
        """The flat last hidden states [sum of lengths, hidden] of a call ->
        the kept rows projected by the Dense layers [sum of kept, dim]
        float32, and the kept count per input."""
        lengths = [len(r) for r in ids]
        if output == DOCUMENT and self.skiplist_ids.size and hidden.shape[0]:
            flat = np.fromiter((t for r in ids for t in r), dtype=np.int64, count=sum(lengths))
            keep = ~np.isin(flat, self.skiplist_ids)
            hidden = hidden[keep]
            at = np.cumsum([0, *lengths])
            rows = [int(keep[a:b].sum()) for a, b in zip(at[:-1], at[1:])]
        else:
            rows = lengths
        x = hidden.astype(np.float32, copy=False)
        for layer in self.pipeline.dense:
            x = _dense_on_host(layer, x)
        return np.ascontiguousarray(x, dtype=np.float32), rows


def _dense_on_host(layer, x: np.ndarray) -> np.ndarray:
    """One Dense layer on host rows (float32, as the pooled path's Dense runs)."""
    import mlx.core as mx

    return np.array(layer(mx.array(x)), dtype=np.float32)


def _special(folder: str, key: str) -> Optional[str]:
    """A special token's text as transformers reads it: tokenizer_config.json,
    special_tokens_map.json over it."""
    found = None
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        cfg = read_json(os.path.join(folder, name))
        value = cfg.get(key) if isinstance(cfg, dict) else None
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            found = value
    return found


def resolve(pipeline: ColbertPipeline, token_id, unknown_id: Optional[int], tokenizer_files: str,
            max_length: int, model_name: str) -> MultiVector:
    """The folder's ColBERT settings as ids of its tokenizer (``token_id``:
    a token's id, or None), checked against the model's ``max_length``."""
    s = pipeline.colbert

    def prefix(token: str, side: str) -> list[int]:
        if token == "":
            return []
        tid = token_id(token)
        if tid is None:
            # PyLate adds it to the tokenizer and grows the embedding table
            # with a freshly initialized row: nothing a saved folder holds.
            raise ValueError(
                f"{model_name}: the {side} prefix {token!r} is not a token of its tokenizer "
                "(PyLate would add it with an untrained embedding)"
            )
        return [int(tid)]

    expand = None
    if s.do_query_expansion:
        for key in ("mask_token", "eos_token", "pad_token"):
            text = _special(tokenizer_files, key)
            tid = token_id(text) if text else None
            if tid is not None:
                expand = int(tid)
                break
        if expand is None:
            raise ValueError(f"{model_name}: query expansion needs a mask, EOS or pad token; the tokenizer has none")
    for side, length in (("query_length", s.query_length), ("document_length", s.document_length)):
        if length > max_length:
            raise ValueError(f"{model_name}: {side} {length} is over the model's {max_length} positions")
    skip = set()
    for word in s.skiplist_words:
        tid = token_id(word)
        tid = unknown_id if tid is None else tid
        if tid is not None:
            skip.add(int(tid))
    return MultiVector(
        query=InputModeSpec(prefix(s.query_prefix, "query"), s.query_length, expand),
        document=InputModeSpec(prefix(s.document_prefix, "document"), s.document_length, None),
        skiplist_ids=np.array(sorted(skip), dtype=np.int64),
        attend_to_expansion=s.attend_to_expansion_tokens,
        pipeline=pipeline,
    )


def apply_mode(prefix: list[int], content: list[int], suffix: list[int], mode: InputModeSpec,
               direction: str) -> tuple[list[int], int]:
    """One text's ids in a mode (see :class:`~.spec.InputModeSpec`): the
    content cut to the room the mode leaves, the insert after the first
    token, the expansion; and the count before the cut (insert included)."""
    room = mode.max_length - len(mode.insert_ids) - len(prefix) - len(suffix)
    if room < 0:
        raise ValueError(f"a mode of {mode.max_length} tokens has no room for the specials")
    before = len(prefix) + len(content) + len(suffix) + len(mode.insert_ids)
    full = prefix + _cut(content, room, direction == "left") + suffix
    ids = full[:1] + list(mode.insert_ids) + full[1:]
    if mode.expand_id is not None and len(ids) < mode.max_length:
        ids = ids + [mode.expand_id] * (mode.max_length - len(ids))
    return ids, before
