"""Query/document pairs for cross-encoders: how a pair becomes one input.

Two styles, described by a :class:`PairSpec` that the Rust tokenizer reads
too (so the server and the Python library cut pairs identically):

* ``segments`` (BERT, XLM-RoBERTa cross-encoders): the tokenizer's own pair
  template, e.g. ``[CLS] q [SEP] d [SEP]`` with token types 0/1, or
  ``<s> q </s></s> d </s>``. The special tokens and their types are read from
  the tokenizer's post-processor by encoding a probe pair, so any template
  works. Over the limit, HF's ``longest_first`` rule cuts the longer side
  (``truncate_pair_lengths``), as ``tokenizer(q, d, truncation=True)`` and
  sentence-transformers' CrossEncoder do.
* ``template`` (decoder rerankers such as Qwen3-Reranker): the pair is written
  into one text (``template`` with ``{instruction}``, ``{query}``,
  ``{document}``), encoded without specials, truncated like any single text,
  and wrapped in ``prefix_ids``/``suffix_ids`` (the chat prompt around it, each
  encoded on its own as the model card does).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from tokenizers import Tokenizer

_FIELD = re.compile(r"\{(instruction|query|document)\}")

SEGMENTS = "segments"
TEMPLATE = "template"


@dataclass(frozen=True)
class PairSpec:
    """How a pair becomes token ids (see the module docstring)."""

    style: str
    # Ids before the first segment / between the two / after the second
    # (segments), or the prompt around the pair text (template).
    prefix_ids: list = field(default_factory=list)
    middle_ids: list = field(default_factory=list)
    suffix_ids: list = field(default_factory=list)
    # Token type of each special id above and of each segment's content;
    # ``None`` when the model takes no token types (RoBERTa, decoders).
    prefix_type_ids: Optional[list] = None
    middle_type_ids: Optional[list] = None
    suffix_type_ids: Optional[list] = None
    first_type_id: int = 0
    second_type_id: int = 1
    # template style only
    template: Optional[str] = None
    default_instruction: Optional[str] = None

    @property
    def n_special(self) -> int:
        return len(self.prefix_ids) + len(self.middle_ids) + len(self.suffix_ids)

    @property
    def uses_type_ids(self) -> bool:
        return self.style == SEGMENTS and self.prefix_type_ids is not None

    def format(self, query: str, document: str, instruction: Optional[str] = None) -> str:
        """The pair text of the template style."""
        if self.template is None:
            raise ValueError("format() is for template-style pairs")
        if instruction is None:
            instruction = self.default_instruction or ""
        # One pass over the template, not str.format or chained replace: a
        # query may itself contain braces or "{document}".
        values = {"instruction": instruction, "query": query, "document": document}
        return _FIELD.sub(lambda m: values[m.group(1)], self.template)


def segments_spec(tokenizer: Tokenizer, *, type_ids: bool) -> PairSpec:
    """Probe the tokenizer's pair template. ``type_ids``: whether the model
    has a token-type table to feed (BERT: ``type_vocab_size`` 2)."""
    enc = tokenizer.encode("hello", "world", add_special_tokens=True)
    seq = enc.sequence_ids
    ids, types = enc.ids, enc.type_ids
    first = [i for i, s in enumerate(seq) if s == 0]
    second = [i for i, s in enumerate(seq) if s == 1]
    if not first or not second or first[-1] >= second[0]:
        raise ValueError("the tokenizer's post-processor has no pair template")
    a0, a1, b0, b1 = first[0], first[-1] + 1, second[0], second[-1] + 1
    if any(s is not None for s in seq[:a0] + seq[a1:b0] + seq[b1:]):
        raise ValueError("unexpected pair template layout")
    return PairSpec(
        style=SEGMENTS,
        prefix_ids=ids[:a0],
        middle_ids=ids[a1:b0],
        suffix_ids=ids[b1:],
        prefix_type_ids=types[:a0] if type_ids else None,
        middle_type_ids=types[a1:b0] if type_ids else None,
        suffix_type_ids=types[b1:] if type_ids else None,
        first_type_id=types[a0] if type_ids else 0,
        second_type_id=types[b0] if type_ids else 0,
    )


def template_spec(
    tokenizer: Tokenizer, *, prefix: str, suffix: str, template: str, default_instruction: str
) -> PairSpec:
    return PairSpec(
        style=TEMPLATE,
        prefix_ids=tokenizer.encode(prefix, add_special_tokens=False).ids,
        suffix_ids=tokenizer.encode(suffix, add_special_tokens=False).ids,
        template=template,
        default_instruction=default_instruction,
    )


def truncate_pair_lengths(n1: int, n2: int, budget: int) -> tuple[int, int]:
    """Content lengths kept by HF tokenizers' ``longest_first`` truncation
    (tokenizers' ``truncate_encodings``): the longer side gives up tokens
    until both fit; when both are long they share the budget, the second
    getting the odd token."""
    if n1 + n2 <= budget:
        return n1, n2
    swap = n1 > n2
    if swap:
        n1, n2 = n2, n1
    # n1 <= n2 from here
    if n1 > budget:
        n2 = n1
    else:
        n2 = max(n1, budget - n1)
    if n1 + n2 > budget:
        n1 = budget // 2
        n2 = n1 + budget % 2
    return (n2, n1) if swap else (n1, n2)


def _cut(ids: list, n: int, left: bool) -> list:
    if len(ids) <= n:
        return ids
    return ids[len(ids) - n :] if left else ids[:n]


class PairEncoder:
    """Encodes pairs per a :class:`PairSpec` within ``max_length`` tokens."""

    def __init__(self, tokenizer: Tokenizer, spec: PairSpec, max_length: int):
        self._tok = tokenizer
        self.spec = spec
        self.max_length = int(max_length)
        self.max_content = self.max_length - spec.n_special
        if self.max_content < 1:
            raise ValueError(
                f"max_length={self.max_length} leaves no room for a pair "
                f"({spec.n_special} special tokens)"
            )

    def encode(
        self,
        pairs: list,
        *,
        truncation_direction: str = "right",
        instruction: Optional[str] = None,
    ) -> tuple[list, Optional[list], list]:
        """(ids per pair, type ids per pair or None, tokens before truncation)."""
        if truncation_direction not in ("right", "left"):
            raise ValueError(
                f"truncation_direction must be 'right' or 'left', got {truncation_direction!r}"
            )
        left = truncation_direction == "left"
        s = self.spec
        if not pairs:
            return [], ([] if s.uses_type_ids else None), []
        if s.style == TEMPLATE:
            texts = [s.format(q, d, instruction) for q, d in pairs]
            contents = [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]
            ids = [s.prefix_ids + _cut(c, self.max_content, left) + s.suffix_ids for c in contents]
            before = [len(c) + s.n_special for c in contents]
            return ids, None, before

        flat = [x for q, d in pairs for x in (q, d)]
        enc = [e.ids for e in self._tok.encode_batch(flat, add_special_tokens=False)]
        ids, types, before = [], ([] if s.uses_type_ids else None), []
        for k in range(len(pairs)):
            a, b = enc[2 * k], enc[2 * k + 1]
            before.append(len(a) + len(b) + s.n_special)
            n1, n2 = truncate_pair_lengths(len(a), len(b), self.max_content)
            a, b = _cut(a, n1, left), _cut(b, n2, left)
            ids.append(s.prefix_ids + a + s.middle_ids + b + s.suffix_ids)
            if types is not None:
                types.append(
                    s.prefix_type_ids
                    + [s.first_type_id] * len(a)
                    + s.middle_type_ids
                    + [s.second_type_id] * len(b)
                    + s.suffix_type_ids
                )
        return ids, types, before
