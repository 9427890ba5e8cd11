"""Query/document pairs for cross-encoders: the Python library's copy of the
pair rules in ``spec.PairSpec`` (the server applies the same rules in Rust).

Two styles:

* segments (BERT, XLM-RoBERTa cross-encoders): the tokenizer's own pair
  template, e.g. ``[CLS] q [SEP] d [SEP]`` with token types 0/1, or
  ``<s> q </s></s> d </s>``, read from its post-processor by
  ``TextTokenizer``. Over the limit, HF's ``longest_first`` rule cuts the
  longer side (:func:`truncate_pair_lengths`), as ``tokenizer(q, d,
  truncation=True)`` and sentence-transformers' CrossEncoder do.
* template (decoder rerankers such as Qwen3-Reranker): the pair is written
  into one text, encoded without specials, truncated like any single text and
  wrapped in the prompt's own ids (each side encoded on its own, as the model
  card does); a chat template's closing text is encoded with the pair text
  instead and written back over a cut, as sentence-transformers 6 encodes a
  rendered chat template (``spec.PairSpec.suffix_text``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

from tokenizers import Tokenizer

from .errors import InvalidInput, InvalidOption
from .spec import PairSpec
from .tokenization import check_direction, content_ids, read_tokenizer

_FIELD = re.compile(r"\{(instruction|query|document)\}")


def template_spec(
    tokenizer: Tokenizer, *, prefix: str, suffix: str, template: str, default_instruction: str,
    whole: bool = False,
) -> PairSpec:
    """A template-style pair spec (see ``spec.PairSpec``). ``whole``: the
    prompt is a chat template's render, which sentence-transformers tokenizes
    as one text: the suffix is encoded with the pair text and written back
    over a cut (:func:`restored_suffix`); otherwise (a model card's prompt)
    each part is encoded on its own."""
    prefix_ids = tokenizer.encode(prefix, add_special_tokens=False).ids
    if not whole:
        suffix_ids, suffix_text = tokenizer.encode(suffix, add_special_tokens=False).ids, None
    else:
        suffix_text = suffix

        def render(filler: str) -> list:
            values = {"instruction": default_instruction or "", "query": filler, "document": filler}
            text = _FIELD.sub(lambda m: values[m.group(1)], template)
            return tokenizer.encode(prefix + text + suffix, add_special_tokens=False).ids

        suffix_ids = restored_suffix(render)
    return PairSpec(
        prefix_ids=prefix_ids,
        middle_ids=[],
        suffix_ids=suffix_ids,
        template=template,
        default_instruction=default_instruction,
        suffix_text=suffix_text,
    )


def restored_suffix(render) -> list:
    """The ids sentence-transformers 6 writes back over the end of a
    truncated chat-template input (``Transformer._chat_template_suffix_ids``):
    the longest common ending of the prompt's ids rendered with "0" and with
    "1 2 3 4" as every message's text, or none when one render ends the
    other. ``render(filler)`` gives the whole prompt's ids."""
    first, second = render("0"), render("1 2 3 4")
    count = 0
    for a, b in zip(reversed(first), reversed(second)):
        if a != b:
            break
        count += 1
    return first[len(first) - count:] if 0 < count < min(len(first), len(second)) else []


def _piece_ids(tokenizer: Tokenizer, text) -> list:
    """A prompt's ids: a string encoded whole, a tuple's pieces each on
    their own (without special tokens)."""
    pieces = (text,) if isinstance(text, str) else tuple(text)
    return [i for p in pieces if p for i in tokenizer.encode(p, add_special_tokens=False).ids]


def segment_spec(tokenizer: Tokenizer, prompt) -> PairSpec:
    """A segment pair spec from a template-less ``RerankerPrompt``
    (mxbai-rerank v2, bge-reranker-v2-gemma): its prefix, middle and suffix
    as ids, its query and document prompts and its cut."""
    prefix_ids = _piece_ids(tokenizer, prompt.prefix)
    suffix_ids = _piece_ids(tokenizer, prompt.suffix)
    return PairSpec(
        prefix_ids=prefix_ids,
        middle_ids=_piece_ids(tokenizer, prompt.middle),
        suffix_ids=suffix_ids,
        query_prompt=prompt.query_prompt,
        document_prompt=prompt.document_prompt,
        instruction_prompt=prompt.instruction_prompt,
        query_share=tuple(prompt.query_share) if prompt.query_share is not None else None,
        uncounted=_uncounted(prompt, prefix_ids, suffix_ids),
        instruction_suffix_ids=(None if prompt.instruction_suffix is None
                                else _piece_ids(tokenizer, prompt.instruction_suffix)),
        suffix_uncounted=prompt.uncounted[1] if prompt.uncounted is not None else 0,
    )


def with_instruction_suffix(spec: PairSpec, instruction_ids: list) -> PairSpec:
    """``spec`` for a call whose instruction ends the input in place of the
    task prompt (``spec.instruction_suffix_ids``; FlagEmbedding's
    ``prompt=``): the suffix is the lead ids and the instruction's, and
    the library's uncounted tokens move with it."""
    suffix = list(spec.instruction_suffix_ids) + list(instruction_ids)
    uncounted = spec.uncounted + spec.suffix_uncounted * (len(suffix) - len(spec.suffix_ids))
    return dataclasses.replace(spec, suffix_ids=suffix, uncounted=uncounted)


def _uncounted(prompt, prefix_ids: list, suffix_ids: list) -> int:
    """The input's tokens a reranker library's ``max_length`` leaves out:
    ``prompt.uncounted`` = (a, b) weighs the prefix's and the suffix's."""
    if prompt.uncounted is None:
        return 0
    a, b = prompt.uncounted
    return a * len(prefix_ids) + b * len(suffix_ids)


def format_pair(spec: PairSpec, query: str, document: str, instruction: Optional[str] = None) -> str:
    """The pair text of a template-style spec. One pass over the template,
    not ``str.format`` or chained replaces: a query may itself contain braces
    or ``{document}``."""
    if spec.template is None:
        raise ValueError("format_pair() is for template-style pairs")
    if instruction is None:
        instruction = spec.default_instruction or ""
    values = {"instruction": instruction, "query": query, "document": document}
    return _FIELD.sub(lambda m: values[m.group(1)], spec.template)


def pairs_only(spec: Optional[PairSpec]) -> bool:
    """A decoder reranker's spec (a template, prompted segments, or the
    tokenizer's pair marked ``pairs_only``) has no meaning for a lone text."""
    return spec is not None and (
        spec.pairs_only or spec.template is not None or spec.query_prompt is not None
        or spec.query_share is not None
    )


def uses_type_ids(spec: PairSpec) -> bool:
    return spec.template is None and (spec.first_type_id != 0 or spec.second_type_id != 0)


def n_special(spec: PairSpec) -> int:
    return len(spec.prefix_ids) + len(spec.middle_ids) + len(spec.suffix_ids)


def truncate_pair_lengths(n1: int, n2: int, budget: int) -> tuple[int, int]:
    """Content lengths kept by HF tokenizers' ``longest_first`` truncation
    (``truncate_encodings`` in the tokenizers crate): the longer side gives
    up tokens until both fit; when both are long they share the budget, the
    second getting the odd token."""
    if n1 + n2 <= budget:
        return n1, n2
    swap = n1 > n2
    if swap:
        n1, n2 = n2, n1
    # From here n1 <= n2.
    n2 = n1 if n1 > budget else max(n1, budget - n1)
    if n1 + n2 > budget:
        n1 = budget // 2
        n2 = n1 + budget % 2
    return (n2, n1) if swap else (n1, n2)


def query_first_lengths(n1: int, n2: int, budget: int, room: int, share: tuple[int, int]) -> tuple[int, int]:
    """Content lengths kept by a reranker library's query-first cut, in its
    own ``max_length`` (``room``): the query (its prompt included) keeps at
    most ``room * n // d`` tokens (``max_length * 3 // 4`` in mxbai-rerank v2
    and FlagEmbedding), the document at most ``room`` and what the budget
    leaves."""
    num, den = share
    room = max(room, 0)
    n1 = min(n1, room * num // den, budget)
    return n1, min(n2, room, budget - n1)


def segment_prompts(spec: PairSpec, instruction: Optional[str]) -> tuple[str, str]:
    """The text written before a segment pair's query and its document."""
    query = spec.query_prompt or ""
    if instruction is not None and spec.instruction_prompt is None:
        raise InvalidInput("instructions are only defined for prompt-template rerankers")
    if instruction:
        # An empty one is none, as the mxbai-rerank library reads it.
        query = spec.instruction_prompt.replace("{instruction}", instruction) + query
    return query, spec.document_prompt or ""


def cut_document_start(content: list, frame: list, budget: int) -> list:
    """A template pair's ``content`` ids cut to ``budget`` from the start of
    its document, so the instruction and the query stay and the document
    keeps its end: what left truncation means for a pair. ``frame`` is the
    same pair text with an empty document; the document is where the two
    differ. Only when the frame alone is over the budget is the rest cut
    from the left too. (The Rust tokenizer's ``cut_document_start``.)"""
    if len(content) <= budget:
        return content
    head = 0
    for a, b in zip(content, frame):
        if a != b:
            break
        head += 1
    tail = 0
    for a, b in zip(reversed(content[head:]), reversed(frame[head:])):
        if a != b:
            break
        tail += 1
    document_end = len(content) - tail
    overflow = len(content) - budget
    if overflow <= document_end - head:
        return content[:head] + content[head + overflow:]
    rest = content[:head] + content[document_end:]
    return rest[len(rest) - budget:]


def _cut(ids: list, n: int, left: bool) -> list:
    if len(ids) <= n:
        return ids
    return ids[len(ids) - n :] if left else ids[:n]


class PairEncoder:
    """Encodes pairs per a :class:`~mlx_embed.spec.PairSpec` within
    ``max_length`` tokens (specials included)."""

    def __init__(self, tokenizer: Tokenizer, spec: PairSpec, max_length: int):
        self._tok = tokenizer
        self.spec = spec
        self.max_length = int(max_length)
        self.n_special = n_special(spec)
        self.max_content = self.max_length - self.n_special
        self.type_ids = uses_type_ids(spec)
        if self.max_content < 1:
            raise InvalidOption(
                f"max_length={self.max_length} leaves no room for a pair "
                f"({self.n_special} special tokens)"
            )

    @classmethod
    def from_file(cls, path: str, spec: PairSpec, max_length: int) -> "PairEncoder":
        tok = read_tokenizer(path)
        # As in TextTokenizer: nothing baked into tokenizer.json may cut or pad.
        tok.no_truncation()
        tok.no_padding()
        return cls(tok, spec, max_length)

    def encode(
        self,
        pairs: list,
        *,
        truncation_direction: str = "right",
        instruction: Optional[str] = None,
        truncate: bool = True,
    ) -> tuple[list, Optional[list], list]:
        """(ids per pair, type ids per pair or None, tokens before truncation).
        ``truncate=False``: no library's query-first cut either (it can
        shorten a pair within ``max_length``); the caller refuses a pair
        over it."""
        left = check_direction(truncation_direction) == "left"
        pairs = _check_pairs(pairs)
        s = self.spec
        if s.template is not None:
            if instruction is not None and "{instruction}" not in s.template:
                raise InvalidInput("this reranker's prompt takes no instruction")
            tail = s.suffix_text or ""
            contents = self._contents([format_pair(s, q, d, instruction) + tail for q, d in pairs])
            if s.suffix_text is None:
                room, restore = self.max_content, None
            else:
                # The template's tail is in the content: sentence-transformers
                # cuts the whole render once it reaches max_length and writes
                # the tail's ids back over the cut's end.
                room, restore = self.max_length - len(s.prefix_ids), s.suffix_ids
            if instruction is not None and any(len(c) >= room for c in contents):
                self._check_instruction_room(instruction, tail, room)
            if left:
                # Cut from the pair text's start, the instruction and the
                # query would go first and every document score alike.
                over = [k for k, c in enumerate(contents) if len(c) > room]
                frames = dict(zip(over, self._contents(
                    [format_pair(s, pairs[k][0], "", instruction) + tail for k in over])))
            cut = []
            for k, c in enumerate(contents):
                if left:
                    c = cut_document_start(c, frames[k], room) if k in frames else c
                elif restore is None:
                    c = _cut(c, room, left=False)
                elif len(c) >= room:
                    c = c[:room - len(restore)] + restore
                cut.append(c)
            suffix = s.suffix_ids if restore is None else []
            ids = [s.prefix_ids + c + suffix for c in cut]
            return ids, None, [len(s.prefix_ids) + len(c) + len(suffix) for c in contents]
        max_content, specials = self.max_content, self.n_special
        if instruction is not None and s.instruction_suffix_ids is not None:
            s = with_instruction_suffix(s, self._contents([instruction])[0] if instruction else [])
            instruction, specials = None, n_special(s)
            max_content = self.max_length - specials
            if max_content < 1 or self.max_length - s.uncounted < 1:
                raise InvalidInput(
                    f"the instruction leaves the pair no room within max_length {self.max_length} "
                    f"(it ends the input and counts twice, as FlagEmbedding's prompt: "
                    f"{len(s.suffix_ids) - len(s.instruction_suffix_ids)} tokens)"
                )
        qp, dp = segment_prompts(s, instruction)
        enc = self._contents([x for q, d in pairs for x in (qp + q, dp + d)])
        ids, before = [], []
        types: Optional[list] = [] if self.type_ids else None
        for k in range(len(pairs)):
            a, b = enc[2 * k], enc[2 * k + 1]
            before.append(len(a) + len(b) + specials)
            if s.query_share is None or not truncate:
                n1, n2 = truncate_pair_lengths(len(a), len(b), max_content)
            else:
                n1, n2 = query_first_lengths(len(a), len(b), max_content,
                                             self.max_length - s.uncounted, s.query_share)
            a, b = _cut(a, n1, left), _cut(b, n2, left)
            ids.append(s.prefix_ids + a + s.middle_ids + b + s.suffix_ids)
            if types is not None:
                first = len(s.prefix_ids) + len(a) + len(s.middle_ids)
                types.append([s.first_type_id] * first + [s.second_type_id] * (len(b) + len(s.suffix_ids)))
        return ids, types, before

    def _check_instruction_room(self, instruction: str, tail: str, room: int) -> None:
        """A call's instruction on a template reranker must leave a document
        at least one token: the pair text with an empty query and document
        (the instruction and the prompt's own text) below ``room``. Whichever
        end is cut, that frame is kept before any of the document, so past it
        every document is cut away whole and all score alike. A long query is
        the query's own matter. (The Rust tokenizer's ``check_instruction_room``.)"""
        used = len(self._contents([format_pair(self.spec, "", "", instruction) + tail])[0])
        if used >= room:
            raise InvalidInput(
                f"the instruction leaves the documents no room within max_length {self.max_length} "
                f"(with the reranker's prompt it takes {used} of the {room} tokens the pair text may use; "
                f"instruction: {len(instruction)} characters)"
            )

    def _contents(self, texts: list) -> list:
        if not texts:
            return []
        return content_ids(self._tok, texts)


def _check_pairs(pairs) -> list:
    if isinstance(pairs, (str, bytes)) or not hasattr(pairs, "__iter__"):
        raise TypeError(f"pairs must be a list of (query, document), got {type(pairs).__name__}")
    out = []
    for i, p in enumerate(pairs):
        if isinstance(p, (str, bytes)) or len(p) != 2:
            raise TypeError(f"pairs[{i}] must be a (query, document) pair")
        q, d = p
        if not isinstance(q, str) or not isinstance(d, str):
            raise TypeError(f"pairs[{i}] must hold two str")
        out.append((q, d))
    return out
