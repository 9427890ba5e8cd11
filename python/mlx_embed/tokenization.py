"""Tokenization with HF ``tokenizers``, truncation done by us.

We encode *without* special tokens and without truncation, then truncate the
content and wrap it in the post-processor's prefix/suffix ourselves. That gives,
from a single ``encode_batch`` call, both the token count before truncation
(which the server reports) and the truncated ids, and lets pre-tokenized
(token id) input go through exactly the same path as text.

For a single sequence this is what HF's truncation does too: it trims the
content to ``max_length - num_special_tokens`` and then applies the template.
"""

from __future__ import annotations

from typing import Optional, Sequence

from tokenizers import Tokenizer


def _find_sub(hay: list[int], needle: list[int]) -> int:
    n = len(needle)
    for i in range(len(hay) - n + 1):
        if hay[i : i + n] == needle:
            return i
    return -1


class TextTokenizer:
    def __init__(
        self,
        path: str,
        max_length: int,
        *,
        append_ids: Sequence[int] = (),
    ):
        tok = Tokenizer.from_file(path)
        # Some tokenizer.json files bake in truncation/fixed padding (MiniLM has
        # truncation=128 and padding=Fixed(128)); both would change results.
        tok.no_truncation()
        tok.no_padding()
        self._tok = tok
        self.max_length = int(max_length)
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

        probe = "hello world"
        content = tok.encode(probe, add_special_tokens=False).ids
        full = tok.encode(probe, add_special_tokens=True).ids
        i = _find_sub(full, content) if content else -1
        if i < 0:
            # Post-processor we cannot split (should not happen for template,
            # BERT/RoBERTa or byte-level processors): treat as no specials.
            self.prefix, self.suffix = [], []
        else:
            self.prefix = full[:i]
            self.suffix = full[i + len(content) :]
        # Decoder embedders (Qwen3-Embedding) pool the last token and expect it
        # to be EOS; older tokenizer.json files do not append it themselves.
        if append_ids and self.suffix[-len(append_ids):] != list(append_ids):
            self.suffix = self.suffix + list(append_ids)
        self.n_special = len(self.prefix) + len(self.suffix)
        if self.n_special >= self.max_length:
            raise ValueError(
                f"max_length={self.max_length} leaves no room for content "
                f"({self.n_special} special tokens)"
            )
        self.max_content = self.max_length - self.n_special

    def token_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)

    def encode_contents(self, texts: list[str]) -> list[list[int]]:
        """Content ids (no special tokens, untruncated) for each text."""
        if not texts:
            return []
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def finish(self, content: list[int]) -> tuple[list[int], int]:
        """Truncate and add special tokens; returns (ids, count_before_truncation)."""
        before = len(content) + self.n_special
        if len(content) > self.max_content:
            content = content[: self.max_content]
        return self.prefix + content + self.suffix, before
