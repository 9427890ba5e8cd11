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
* A document asked to be pooled (``pool_factor`` > 1) is pooled here, on
  its normalized rows as PyLate pools them (:func:`pool_rows`), and
  answered so: the means are not normalized again (PyLate's).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .errors import InvalidModel, InvalidOption
from .json_files import read_json
from .pairs import _cut
from .pooling import unit_rows
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

    def finish(self, hidden: np.ndarray, ids: list[list[int]], output: str,
               pooling: Optional[tuple[list[int], list[int]]] = None) -> tuple[np.ndarray, list[int]]:
        """The flat last hidden states [sum of lengths, hidden] of a call ->
        the kept rows projected by the Dense layers [sum of kept, dim]
        float32, and the kept count per input. ``pooling``: per input its
        pool factor and protected tokens (documents only): an input whose
        factor is over 1 is answered pooled (:func:`pool_documents`)."""
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
        if pooling is not None:
            x, rows = pool_documents(x, rows, *pooling)
        return np.ascontiguousarray(x, dtype=np.float32), rows


def pool_documents(flat: np.ndarray, rows: list[int], factors: list[int],
                   protected: list[int]) -> tuple[np.ndarray, list[int]]:
    """A call's flat rows [sum of rows, dim] with each input whose factor
    is over 1 replaced by its pooled rows: normalized first, as PyLate's
    ``encode(pool_factor=...)`` pools the normalized rows, then
    :func:`pool_rows`; the others as they are. -> the flat rows and the
    count per input."""
    parts, counts, at = [], [], 0
    for n, factor, keep in zip(rows, factors, protected):
        part = flat[at : at + n]
        at += n
        if factor > 1:
            part = pool_rows(unit_rows(part), factor, keep)
        parts.append(part)
        counts.append(len(part))
    if not parts:
        return flat, rows
    return np.concatenate(parts), counts


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
            max_length: int, model_name: str, *, max_length_given: bool = False,
            positions: Optional[int] = None) -> MultiVector:
    """The folder's ColBERT settings as ids of its tokenizer (``token_id``:
    a token's id, or None), checked against the model's ``max_length``
    (``max_length_given``: the load's own ``max_length=``, so a mode past
    it is that option's fault, not the folder's, unless it is past the
    model's ``positions`` too: then no ``max_length=`` could fit it)."""
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
            if max_length_given and (positions is None or length <= positions):
                # The load's max_length= cut below the folder's own mode.
                raise InvalidOption(f"max_length {max_length} is under {model_name}'s {side} {length}")
            raise InvalidModel(f"{model_name}: {side} {length} is over the model's {max_length} positions")
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


def pool_rows(rows: np.ndarray, pool_factor: int, protected: int = 1) -> np.ndarray:
    """PyLate's ``pool_embeddings_hierarchical`` of one document's rows: the
    first ``protected`` rows kept, the others grouped by Ward clustering on
    ``1 - cosine`` (their dot products: rows PyLate normalized) into at most
    ``len // pool_factor`` clusters (at least one), each replaced by its
    mean, in the order scipy's ``fcluster(..., criterion="maxclust")``
    numbers them. The merges, ties included, are scipy's ``linkage(...,
    method="ward")`` (its nearest-neighbour chain, which breaks a tie for the
    chain's previous cluster, then for the lowest index) and the flat cut
    scipy's; the distances are taken in the rows' dtype (float32 here and in
    a float32 PyLate model), then float64, as PyLate hands them to scipy."""
    kept, to_pool = rows[:protected], rows[protected:]
    n = len(to_pool)
    clusters = max(n // pool_factor, 1)
    if clusters >= n:
        return rows
    # Two equal rows can be a rounding under 0 apart, where scipy refuses
    # the linkage (PyLate fails on such a document): they are 0 apart here.
    dist = np.maximum((1 - to_pool @ to_pool.T).astype(np.float64), 0.0)
    labels = _maxclust(_ward_linkage(dist), n, clusters)
    sums = np.zeros((clusters, rows.shape[1]), dtype=rows.dtype)
    np.add.at(sums, labels - 1, to_pool)
    counts = np.bincount(labels - 1, minlength=clusters)
    # fcluster can answer fewer clusters than asked: no empty ones.
    pooled = sums[counts > 0] / counts[counts > 0, None].astype(rows.dtype)
    return np.concatenate([kept, pooled.astype(rows.dtype)])


def _ward_linkage(dist: np.ndarray) -> np.ndarray:
    """scipy's ``linkage(condensed, method="ward")`` of the full [n, n]
    distance matrix (only its upper triangle is read, as the condensed form
    holds it): the nearest-neighbour chain, the Lance-Williams update as
    scipy evaluates it, the merges sorted stably by distance and relabelled."""
    n = len(dist)
    D = np.triu(dist, 1)
    D = D + D.T
    size = np.ones(n, dtype=np.int64)
    Z = np.empty((n - 1, 4))
    chain: list[int] = []
    y = 0
    for k in range(n - 1):
        if not chain:
            chain.append(int(np.flatnonzero(size > 0)[0]))
        while True:
            x = chain[-1]
            active = size > 0
            active[x] = False
            candidates = np.flatnonzero(active)
            row = D[x, candidates]
            # scipy's strict "<" scan from the previous cluster's distance:
            # a tie keeps the previous cluster, else the lowest index; a NaN
            # (equal rows' rounding in the update) never wins.
            if len(chain) > 1:
                y = chain[-2]
            best = float(D[x, y]) if len(chain) > 1 else np.inf
            below = row < best
            if below.any():
                best = float(row[below].min())
                y = int(candidates[np.flatnonzero(below & (row == best))[0]])
            if len(chain) > 1 and y == chain[-2]:
                break
            chain.append(y)
        chain = chain[:-2]
        x, y = min(x, y), max(x, y)
        nx, ny = int(size[x]), int(size[y])
        Z[k] = (x, y, best, nx + ny)
        size[x] = 0
        size[y] = nx + ny
        others = np.flatnonzero(size > 0)
        others = others[others != y]
        ni = size[others].astype(np.float64)
        t = 1.0 / (nx + ny + ni)
        dxi, dyi = D[others, x], D[others, y]
        new = np.sqrt((ni + nx) * t * dxi * dxi + (ni + ny) * t * dyi * dyi - ni * t * best * best)
        D[others, y] = new
        D[y, others] = new
    Z = Z[np.argsort(Z[:, 2], kind="mergesort")]
    # Relabel as scipy does: each merge joins the clusters its two points
    # are in by then (equal distances can come in another order than they
    # merged), the new cluster numbered n + its row, its size theirs.
    parent = np.arange(2 * n - 1)
    sizes = np.ones(2 * n - 1, dtype=np.int64)

    def find(a: int) -> int:
        while parent[a] != a:
            a = parent[a]
        return a

    for i in range(n - 1):
        a, b = find(int(Z[i, 0])), find(int(Z[i, 1]))
        Z[i, 0], Z[i, 1] = min(a, b), max(a, b)
        parent[a] = parent[b] = n + i
        sizes[n + i] = sizes[a] + sizes[b]
        Z[i, 3] = sizes[n + i]
    return Z


def _maxclust(Z: np.ndarray, n: int, max_clusters: int) -> np.ndarray:
    """scipy's ``fcluster(Z, max_clusters, criterion="maxclust")``: the
    lowest merge height whose cut leaves at most ``max_clusters`` clusters
    (a binary search over each subtree's highest merge, as scipy searches),
    and the clusters numbered from 1 in the tree's depth-first order."""
    if max_clusters >= n:
        return np.arange(1, n + 1)
    # Each merge's highest merge below it (itself included): rows come in
    # merge order, children before parents.
    highest = Z[:, 2].copy()
    for i in range(n - 1):
        for child in (int(Z[i, 0]), int(Z[i, 1])):
            if child >= n:
                highest[i] = max(highest[i], highest[child - n])

    def count(thresh: float) -> int:
        """Clusters the cut at ``thresh`` leaves."""
        found, stack = 0, [2 * n - 2]
        while stack:
            node = stack.pop() - n
            if highest[node] <= thresh:
                found += 1
                continue
            for child in (int(Z[node, 1]), int(Z[node, 0])):
                if child >= n:
                    stack.append(child)
                else:
                    found += 1
        return found

    lower, upper = -1, n - 1
    while upper - lower > 1:
        mid = (lower + upper) >> 1
        if count(highest[mid]) > max_clusters:
            lower = mid
        else:
            upper = mid
    cutoff = highest[upper]
    # Numbered as scipy's cluster_monocrit walks the tree: a node's
    # internal children first (left, then right), its leaf children when it
    # is returned to; a subtree under the cut is one cluster, numbered when
    # it is entered, a leaf above it its own.
    labels = np.zeros(n, dtype=np.int64)
    numbered, leader = 0, -1
    visited = np.zeros(2 * n - 1, dtype=bool)
    stack = [2 * n - 2]
    while stack:
        root = stack[-1] - n
        left, right = int(Z[root, 0]), int(Z[root, 1])
        if leader == -1 and highest[root] <= cutoff:
            leader = root
            numbered += 1
        if left >= n and not visited[left]:
            visited[left] = True
            stack.append(left)
            continue
        if right >= n and not visited[right]:
            visited[right] = True
            stack.append(right)
            continue
        for leaf in (left, right):
            if leaf < n:
                if leader == -1:
                    numbered += 1
                labels[leaf] = numbered
        if leader == root:
            leader = -1
        stack.pop()
    return labels
