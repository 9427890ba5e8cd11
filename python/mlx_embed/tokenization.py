"""Tokenization with HF ``tokenizers``, truncation done by us.

We encode *without* special tokens and without truncation, then truncate the
content and wrap it in the post-processor's prefix/suffix ourselves. That gives,
from a single ``encode_batch`` call, both the token count before truncation
and the truncated ids. (Token ids, the server's pre-tokenized input, run as
given: ``embed_ids`` takes finished ids.)

For a single sequence this is what HF's truncation does too: it trims the
content to ``max_length - num_special_tokens`` and then applies the template.
The server tokenizes in Rust by the same rules (``spec.TokenizerSpec``); this
module is the Python library's copy of them.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from tokenizers import Tokenizer, normalizers

from .errors import CutTooShort, InvalidInput, InvalidModel, InvalidOption
from .json_files import read_json
from .spec import PairSpec

TRUNCATION_DIRECTIONS = ("right", "left")


def read_tokenizer(path: str) -> Tokenizer:
    """``path``'s tokenizer; one the library cannot read fails naming the file
    (the library's own message gives a line and column only)."""
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # the tokenizers library raises bare Exception
        raise InvalidModel(f"{path} cannot be read as a tokenizer: {e}") from None


def _find_sub(hay: list[int], needle: list[int], start: int = 0) -> int:
    n = len(needle)
    for i in range(start, len(hay) - n + 1):
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
        special_tokens: bool = True,
        drop_unknown: bool = False,
        truncate_chars: bool = False,
        lowercase: bool = False,
        flag_specials: Optional["FlagSpecials"] = None,
    ):
        """``special_tokens=False``: no prefix or suffix, whatever the
        post-processor would add (static embeddings encode without them).
        ``flag_specials``: what :func:`flag_specials` found; refused unless
        the post-processor puts the same tokens around a text.
        ``drop_unknown``: the unknown token is left out of every input after
        truncation, ``truncate_chars``: a text is cut to ``max_length`` x the
        vocabulary's median token length in characters before it is
        tokenized, when truncating (both as Model2Vec's ``encode``).
        ``lowercase``: sentence-transformers' ``do_lower_case``, done as it
        does it: a ``Lowercase`` normalizer in front of the tokenizer's own, so
        each character (of prompt and text) is lower-cased alone."""
        tok = read_tokenizer(path)
        # The side a baked-in truncation cuts from is still the folder's
        # default side, as transformers reads it (see truncation_side).
        self.file_truncation_side: Optional[str] = (tok.truncation or {}).get("direction")
        # Some tokenizer.json files bake in truncation/fixed padding (MiniLM has
        # truncation=128 and padding=Fixed(128)); both would change results.
        tok.no_truncation()
        tok.no_padding()
        if lowercase:
            _lowercase_first(tok)
        self._tok = tok
        self.path = path
        self.max_length = int(max_length)
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.lowercase = bool(lowercase)

        probe = "hello world"
        content = tok.encode(probe, add_special_tokens=False).ids
        full = tok.encode(probe, add_special_tokens=True).ids
        i = _find_sub(full, content) if content else -1
        if not special_tokens:
            self.prefix, self.suffix = [], []
        elif i < 0:
            # Post-processor we cannot split (should not happen for template,
            # BERT/RoBERTa or byte-level processors): treat as no specials.
            self.prefix, self.suffix = [], []
        else:
            self.prefix = full[:i]
            self.suffix = full[i + len(content) :]
        if flag_specials is not None and special_tokens:
            flag_specials.check(tok, self.prefix, self.suffix)
        # Decoder embedders (Qwen3-Embedding) pool the last token and expect it
        # to be EOS; older tokenizer.json files do not append it themselves.
        if append_ids and self.suffix[-len(append_ids):] != list(append_ids):
            self.suffix = self.suffix + list(append_ids)
        self.n_special = len(self.prefix) + len(self.suffix)
        if self.n_special >= self.max_length:
            raise InvalidOption(
                f"max_length={self.max_length} leaves no room for content "
                f"({self.n_special} special tokens)"
            )
        self.max_content = self.max_length - self.n_special
        self.pair = self._probe_pair() if special_tokens else None
        unk = unknown_id(tok) if drop_unknown else None
        self.drop_ids: list[int] = [unk] if unk is not None else []
        self.char_limit: Optional[int] = None
        if truncate_chars:
            lengths = [len(t) for t in tok.get_vocab(with_added_tokens=True)]
            self.char_limit = self.max_length * int(statistics.median(lengths))

    def _probe_pair(self) -> Optional[PairSpec]:
        """Where the post-processor puts special tokens around a pair, found
        the way the single-sequence split is; None when it cannot be split."""
        a = self._tok.encode("hello", add_special_tokens=False).ids
        b = self._tok.encode("world", add_special_tokens=False).ids
        try:
            enc = self._tok.encode("hello", "world", add_special_tokens=True)
        except Exception:
            return None
        full, types = enc.ids, enc.type_ids
        i = _find_sub(full, a) if a else -1
        j = _find_sub(full, b, i + len(a)) if i >= 0 and b else -1
        if i < 0 or j < 0:
            return None
        return PairSpec(
            prefix_ids=full[:i],
            middle_ids=full[i + len(a) : j],
            suffix_ids=full[j + len(b) :],
            first_type_id=int(types[i]),
            second_type_id=int(types[j]),
        )

    def token_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)

    def added_tokens(self) -> list[str]:
        """The added tokens' texts (special or not): the tokenizer matches
        them before it splits anything else."""
        return [t.content for t in self._tok.get_added_tokens_decoder().values()]

    def content_room(self, max_length: int) -> int:
        """Content tokens a cut at ``max_length`` leaves beside the specials
        (at least one, else the cut is invalid input)."""
        if max_length <= self.n_special:
            raise CutTooShort(
                f"a cut at {max_length} tokens leaves no room for text: the model adds "
                f"{self.n_special} special tokens, so cut at {self.n_special + 1} or more"
            )
        return max_length - self.n_special

    def encode_contents(
        self, texts: list[str], *, truncate: bool = False, direction: str = "right"
    ) -> list[list[int]]:
        """Content ids (no special tokens, not cut to tokens) for each text;
        with ``truncate`` a text over ``char_limit`` characters is cut first
        (its start kept for ``right``, its end for ``left``)."""
        if not texts:
            return []
        limit = self.char_limit
        if truncate and limit is not None:
            texts = [
                t if len(t) <= limit else (t[len(t) - limit :] if direction == "left" else t[:limit])
                for t in texts
            ]
        return content_ids(self._tok, texts)

    def finish(
        self, content: list[int], direction: str = "right", max_length: Optional[int] = None
    ) -> tuple[list[int], int]:
        """Truncate to ``max_length`` tokens with the specials (the model's
        maximum when None or larger), keeping the start for ``right``, the end
        for ``left``; leave out ``drop_ids`` and add special tokens; returns
        (ids, count_before_truncation), which counts the dropped ids too."""
        before = len(content) + self.n_special
        room = self.max_content if max_length is None else min(self.max_content, self.content_room(max_length))
        if len(content) > room:
            if direction == "left":
                content = content[len(content) - room :]
            else:
                content = content[:room]
        if self.drop_ids:
            content = [t for t in content if t not in self.drop_ids]
        return self.prefix + content + self.suffix, before

    def pool_starts(self, prompts: Sequence[str], rows: Sequence[list[int]]) -> list[int]:
        """For each text, the leading positions of its ids (``rows``) that a model with sentence-transformers'
        ``include_prompt: false`` leaves out of the pool, as
        sentence-transformers counts them: its prompt (``prompts``) tokenized
        alone with the specials and cut to the input's room, less the closing
        special if there is one (a prompt that fills the input leaves that
        special pooled; one of no tokens leaves out ``[CLS]``); 0 without a
        prompt. A left cut that took some or all of the prompt changes
        nothing: sentence-transformers 6.2 masks the input's first positions
        by the prompt's own length, whatever the cut kept there."""
        closing = 1 if self.suffix else 0
        counts: dict[str, int] = {}
        out = []
        for prompt, row in zip(prompts, rows):
            if not prompt:
                out.append(0)
                continue
            if prompt not in counts:
                counts[prompt] = len(content_ids(self._tok, [prompt])[0])
            whole = counts[prompt]
            kept = len(row) - self.n_special
            out.append(min(len(self.prefix) + min(whole, kept) + len(self.suffix) - closing, len(row)))
        return out


def _lowercase_first(tok: Tokenizer) -> None:
    """A ``Lowercase`` normalizer in front of ``tok``'s own unless that one
    lower-cases already: what sentence-transformers does for
    ``do_lower_case`` (one character at a time, so a word-final capital sigma
    becomes σ there, not ``str.lower``'s ς)."""
    current = tok.normalizer
    chain = list(current) if isinstance(current, normalizers.Sequence) else [current]
    chain = [n for n in chain if n is not None]
    if any(isinstance(n, normalizers.Lowercase) for n in chain):
        return
    tok.normalizer = normalizers.Sequence([normalizers.Lowercase(), *chain])


def content_ids(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text's ids without special tokens. ``encode_batch_fast`` skips
    the character offsets nothing here reads (the same ids, ~25% less
    tokenizer time); tokenizers < 0.21 lack it."""
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    return [e.ids for e in encode(texts, add_special_tokens=False)]


def unknown_id(tok: Tokenizer) -> Optional[int]:
    """The tokenizer's unknown-token id, found as Model2Vec finds it: the
    model's ``unk_token`` (WordPiece, BPE, WordLevel), or a Unigram model's
    ``unk_id``; None when it has none."""
    model = tok.model
    if hasattr(model, "unk_token"):
        token = model.unk_token
        return tok.token_to_id(token) if token is not None else None
    unk = json.loads(tok.to_str()).get("model", {}).get("unk_id")
    return int(unk) if isinstance(unk, int) else None


# sentence_bert_config.json keys whose object sentence-transformers passes to
# the tokenizer as keyword arguments, over tokenizer_config.json. It renames
# the old one over the new (tokenizer_args replaces processor_kwargs when both
# are there), so the first one present is the one that counts.
ST_TOKENIZER_KEYS = ("tokenizer_args", "processor_kwargs")


def st_tokenizer_kwargs(folder: str) -> tuple[str, dict]:
    """What sentence-transformers passes to the folder's tokenizer from its
    ``sentence_bert_config.json`` (see :data:`ST_TOKENIZER_KEYS`), and where
    it says so; ``("", {})`` when nothing."""
    st = read_json(os.path.join(folder, "sentence_bert_config.json")) if folder else None
    if isinstance(st, dict):
        for key in ST_TOKENIZER_KEYS:
            if key in st:
                value = st[key]
                return f"sentence_bert_config.json {key}", value if isinstance(value, dict) else {}
    return "", {}


def resolve_truncation_side(folder: str, file_side: Optional[str] = None, override: Optional[str] = None) -> str:
    """The end a folder's tokenizer cuts an over-long input from, as
    transformers and sentence-transformers cut: ``override`` (``load(
    truncation_side=)``, as sentence-transformers' ``tokenizer_kwargs``),
    else what sentence-transformers passes to the tokenizer
    (:func:`st_tokenizer_kwargs`), else ``tokenizer_config.json``'s
    ``truncation_side``, else the direction of the truncation baked into
    ``tokenizer.json`` (``file_side``, which transformers takes as the
    default side), else right."""
    if override is not None:  # load() checked it
        return override
    found = []
    if folder:
        where, kwargs = st_tokenizer_kwargs(folder)
        if "truncation_side" in kwargs:
            found.append((where, kwargs["truncation_side"]))
        cfg = read_json(os.path.join(folder, "tokenizer_config.json"))
        if isinstance(cfg, dict) and "truncation_side" in cfg:
            found.append(("tokenizer_config.json", cfg["truncation_side"]))
    if file_side is not None:
        found.append(("tokenizer.json truncation", file_side))
    if not found:
        return "right"
    where, side = found[0]
    if side not in TRUNCATION_DIRECTIONS:
        raise InvalidModel(f"{folder}/{where}: truncation_side must be 'right' or 'left', got {side!r}")
    return side


SPECIAL_FLAGS = (("add_bos_token", "bos_token"), ("add_eos_token", "eos_token"))


@dataclass(frozen=True)
class FlagSpecials:
    """``add_bos_token`` / ``add_eos_token`` as sentence-transformers passes
    them to the tokenizer: the tokens they put around a text (None: that end
    gets none) and the file that says so."""

    bos: Optional[str]
    eos: Optional[str]
    where: str

    def check(self, tok: Tokenizer, prefix: list[int], suffix: list[int]) -> None:
        """Refuse the folder unless tokenizer.json's template already puts
        these tokens around a text. Where the two differ, the ids
        sentence-transformers runs depend on the tokenizer class transformers
        picks: ``TokenizersBackend`` and the classes that keep its template
        (Llama, Gemma, Qwen2) rebuild it from the flags
        (``update_post_processor``), the one not passed counting as false (so
        ``{"add_eos_token": true}`` alone drops a Mistral folder's ``<s>``);
        BERT, XLM-RoBERTa, RoBERTa and T5 put their own template over both."""
        ids = []
        for token in (self.bos, self.eos):
            token_id = tok.token_to_id(token) if token else None
            if token and token_id is None:
                raise ValueError(f"{self.where}: the special token {token!r} is not in the tokenizer's vocabulary")
            ids.append([token_id] if token_id is not None else [])
        if (ids[0], ids[1]) != (list(prefix), list(suffix)):
            raise ValueError(
                f"{self.where}: add_bos_token / add_eos_token put {ids[0]} before and {ids[1]} after each "
                f"text, but tokenizer.json's template puts {list(prefix)} and {list(suffix)}: "
                "transformers rebuilds the template from these flags for some tokenizer classes "
                "and not for others, which is not supported here (leave the flags out, or make "
                "tokenizer.json's template agree with them)"
            )


def flag_specials(folder: str) -> Optional[FlagSpecials]:
    """The special-token flags sentence-transformers passes to this folder's
    tokenizer (:func:`st_tokenizer_kwargs`), None when it passes neither.

    Only those flags count: transformers 5 drops ``add_bos_token`` and
    ``add_eos_token`` from tokenizer_config.json whenever the folder has a
    tokenizer.json (``PreTrainedTokenizerBase._from_pretrained``), whatever
    the tokenizer class, so tokenizer.json's template is what runs there
    even where the two disagree (tests/python/test_special_flags.py). Flags
    a caller passes are kept (:meth:`FlagSpecials.check`). A token named
    null (Qwen2's ``bos_token``) turns its flag off, as there; one named
    nowhere would be the tokenizer class's default, which this does not
    guess: refused. Tokens are read as transformers reads them: the
    caller's, then special_tokens_map.json (only when tokenizer_config.json
    has no ``added_tokens_decoder``), then tokenizer_config.json."""
    where, kwargs = st_tokenizer_kwargs(folder)
    if not any(flag in kwargs for flag, _ in SPECIAL_FLAGS):
        return None
    where = f"{folder}/{where}"
    cfg = read_json(os.path.join(folder, "tokenizer_config.json"))
    cfg = cfg if isinstance(cfg, dict) else {}
    legacy = None if "added_tokens_decoder" in cfg else read_json(os.path.join(folder, "special_tokens_map.json"))
    tokens: list[Optional[str]] = []
    for flag, key in SPECIAL_FLAGS:
        if not kwargs.get(flag):
            tokens.append(None)
            continue
        source = next((s for s in (kwargs, legacy, cfg) if isinstance(s, dict) and key in s), None)
        if source is None:
            raise ValueError(
                f"{where}: {flag} is set but no file names the {key} (tokenizer_config.json, "
                "special_tokens_map.json): transformers would take its tokenizer class's default"
            )
        token = source[key]
        tokens.append(token.get("content") if isinstance(token, dict) else token)
    return FlagSpecials(tokens[0], tokens[1], where)


def check_direction(direction: str) -> str:
    if direction not in TRUNCATION_DIRECTIONS:
        raise InvalidInput(
            f"truncation_direction must be 'right' or 'left', got {direction!r}"
        )
    return direction


def with_prompt(prefix: str, text: str, default_of: Optional[Mapping[str, str]] = None) -> str:
    """``text`` under ``prefix``. When ``prefix`` is the model's default prompt
    (``default_of``: the model's prompts), a text that already begins with one
    of them keeps no other: a client that writes ``search_query: `` itself
    would otherwise get ``search_document: search_query: ...`` (the server's
    tokenizer follows the same rule)."""
    if default_of and any(begins_with_prompt(text, p) for p in default_of.values()):
        return text
    return prefix + text


def begins_with_prompt(text: str, prompt: str) -> bool:
    """Whether ``text`` already begins with ``prompt`` as a client writes it:
    all of it, ending where a word ends (a prompt ``"quer"`` is not written
    at the start of ``"query about rivers"``)."""
    if not prompt or not text.startswith(prompt):
        return False
    rest = text[len(prompt):]
    return not prompt[-1].isalnum() or not rest[:1].isalnum()


def prompt_in_effect(prefix: str, text: str, default_of: Optional[Mapping[str, str]] = None) -> str:
    """The prompt ``text`` runs under: ``prefix``, or, where :func:`with_prompt`
    leaves the default off, the longest of the model's prompts the text
    already begins with (a model that pools without its prompt leaves that
    out, as it would have left the default out)."""
    if default_of and prefix:
        written = [p for p in default_of.values() if begins_with_prompt(text, p)]
        if written:
            return max(written, key=len)
    return prefix


def resolve_prompt(
    *,
    prompt_name: Optional[str],
    prompt: Optional[str],
    prompts: Mapping[str, str],
    default_prompt_name: Optional[str],
) -> str:
    """The text put before every input (see ``spec.TokenizerSpec``)."""
    for key, value in (("prompt", prompt), ("prompt_name", prompt_name)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{key} must be a string, got {value!r}")
    if prompt is not None and prompt_name is not None:
        raise InvalidInput("give prompt or prompt_name, not both")
    if prompt is not None:
        return prompt
    if prompt_name is not None:
        if prompt_name not in prompts:
            known = ", ".join(sorted(prompts)) or "none"
            raise InvalidInput(f"unknown prompt name {prompt_name!r} (this model has: {known})")
        return prompts[prompt_name]
    if default_prompt_name is not None:
        return prompts.get(default_prompt_name, "")
    return ""
