"""A model folder's ``tokenizer.json``, converted from the slow files when it
has none.

Everything that tokenizes (``TextTokenizer``, pair encoding for cross-encoders,
the Rust server through ``TokenizerSpec.path``) reads one ``tokenizer.json``.
Older BERT-style folders carry only the slow WordPiece files: ``vocab.txt`` and
``tokenizer_config.json`` (and maybe ``special_tokens_map.json`` and
``added_tokens.json``). For those tokenizer classes (:data:`WORDPIECE_CLASSES`)
we build the fast tokenizer the way transformers' slow-to-fast conversion does
for BERT (its ``BertConverter``, then ``PreTrainedTokenizerFast`` adding the
added and special tokens), and write it to a cache file of our own, named by a
hash of the source files' contents; the model folder is never written (it may
be read-only). Other tokenizer kinds without ``tokenizer.json`` (sentencepiece
``*.model``, BPE ``vocab.json`` + ``merges.txt``) are refused, naming what is
missing.

:func:`tokenizer_file` is the one answer to "where is this folder's tokenizer".
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from typing import Any, Optional

from .errors import InvalidModel, ModelFolderMissing
from .json_files import read_json

log = logging.getLogger("mlx_embed")

# Bump when the conversion changes, so cached files made by an older one are
# not reused.
CONVERSION_VERSION = "1"

# Slow tokenizer classes that are BERT WordPiece with [CLS] A [SEP] (B [SEP])
# and types 0/1: transformers converts each with its BertConverter.
WORDPIECE_CLASSES = frozenset({
    "BertTokenizer",
    "DistilBertTokenizer",
    "ElectraTokenizer",
    "ConvBertTokenizer",
    "MobileBertTokenizer",
    "SqueezeBertTokenizer",
    "LayoutLMTokenizer",
    "RetriBertTokenizer",
})
# config.json model types whose folders mean BertTokenizer when
# tokenizer_config.json names no class.
WORDPIECE_MODEL_TYPES = frozenset({"bert", "distilbert"})

SPECIAL_KEYS = ("unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
DEFAULT_SPECIALS = {
    "unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]",
    "cls_token": "[CLS]", "mask_token": "[MASK]",
}
# The slow WordpieceTokenizer's fixed limit: a longer word is the unknown token.
MAX_INPUT_CHARS_PER_WORD = 100

SOURCE_FILES = ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")
SENTENCEPIECE_FILES = ("tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "sentencepiece.model")


def _base_class(name: Any) -> Optional[str]:
    return name.removesuffix("Fast") if isinstance(name, str) and name else None


def tokenizer_file(files: str, model_type: Optional[str] = None) -> str:
    """The ``tokenizer.json`` for the model files in ``files``: the folder's
    own, else one converted from its slow BERT WordPiece files (cached).
    ``model_type`` (config.json's) decides when tokenizer_config.json names
    no tokenizer class. Raises FileNotFoundError naming what is missing."""
    own = os.path.join(files, "tokenizer.json")
    if os.path.exists(own):
        return own
    tc = read_json(os.path.join(files, "tokenizer_config.json"))
    tc = tc if isinstance(tc, dict) else {}
    cls = _base_class(tc.get("tokenizer_class"))
    has_vocab = os.path.isfile(os.path.join(files, "vocab.txt"))
    supported = (f"mlx-embed reads tokenizer.json, and builds it itself only from a BERT WordPiece "
                 f"vocab.txt ({', '.join(sorted(WORDPIECE_CLASSES))}); save the tokenizer with a fast "
                 "tokenizer (transformers' AutoTokenizer.from_pretrained(folder).save_pretrained(folder)) "
                 "to write one")
    if has_vocab and (cls in WORDPIECE_CLASSES or (cls is None and model_type in WORDPIECE_MODEL_TYPES)):
        return _converted(files, tc, model_type)
    found = [n for n in SENTENCEPIECE_FILES if os.path.isfile(os.path.join(files, n))]
    if not found:
        found = [n for n in ("vocab.json", "merges.txt", "vocab.txt") if os.path.isfile(os.path.join(files, n))]
    what = f" (it has {' + '.join(found)}" if found else " (nor any slow tokenizer files"
    if cls is not None:
        what += f"; tokenizer_config.json names {tc['tokenizer_class']}"
    elif has_vocab:
        what += f"; tokenizer_config.json names no tokenizer class and model_type is {model_type!r}"
    raise ModelFolderMissing(f"{files} has no tokenizer.json{what}): {supported}")


# ------------------------------------------------------------------ cache


def _cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mlx-embed", "tokenizers")


def _temp_root() -> str:
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return os.path.join(tempfile.gettempdir(), f"mlx-embed-{uid}", "tokenizers")


def source_hash(files: str, model_type: Optional[str] = None) -> str:
    """A hash of what the conversion reads: the slow files' contents, the
    model type it may fall back on and the conversion's version."""
    h = hashlib.sha256(f"mlx-embed wordpiece v{CONVERSION_VERSION}\0{model_type}\0".encode())
    for name in SOURCE_FILES:
        path = os.path.join(files, name)
        if os.path.isfile(path):
            h.update(f"{name}\0".encode())
            with open(path, "rb") as f:
                data = f.read()
            h.update(f"{len(data)}\0".encode())
            h.update(data)
    return h.hexdigest()[:32]


def _write_atomically(root: str, digest: str, text: str) -> str:
    folder = os.path.join(root, digest)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "tokenizer.json")
    fd, tmp = tempfile.mkstemp(prefix=".tokenizer-", suffix=".json.tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


# Converted tokenizers kept per cache folder (a BERT vocabulary's is about
# 700 KB); the least recently used go when one more is written, files made
# by an older conversion among them.
MAX_CACHED = 32


def _prune(root: str, keep: str) -> None:
    """Leaves the ``MAX_CACHED`` most recently used entries of ``root``
    (``keep`` among them), removing the others; best effort."""
    try:
        entries = []
        for name in os.listdir(root):
            path = os.path.join(root, name, "tokenizer.json")
            try:
                entries.append((os.stat(path).st_mtime_ns, name))
            except OSError:
                continue
        entries.sort(reverse=True)
        for _, name in entries[MAX_CACHED:]:
            if name != keep:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    except OSError:
        pass


def _converted(files: str, tc: dict, model_type: Optional[str]) -> str:
    digest = source_hash(files, model_type)
    for root in (_cache_root(), _temp_root()):
        cached = os.path.join(root, digest, "tokenizer.json")
        if os.path.isfile(cached):
            try:
                os.utime(cached)  # recently used: the last to be pruned
            except OSError:
                pass
            log.info("tokenizer of %s converted from vocab.txt (cached): %s", files, cached)
            return cached
    text = build_wordpiece(files, tc).to_str(pretty=True)
    errors = []
    for root in (_cache_root(), _temp_root()):
        try:
            path = _write_atomically(root, digest, text)
        except OSError as e:
            errors.append(f"{root}: {e}")
            continue
        _prune(root, digest)
        log.info("tokenizer of %s converted from vocab.txt: %s", files, path)
        return path
    raise OSError(f"cannot write the tokenizer converted from {files}/vocab.txt: {'; '.join(errors)}")


# ------------------------------------------------------------- conversion


def _content(value: Any) -> Optional[str]:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _added_token(value: Any, *, special: Optional[bool] = None):
    """A ``tokenizers.AddedToken`` from a string or a serialized one (the
    ``{"content": ..., "lstrip": ...}`` of tokenizer_config.json)."""
    from tokenizers import AddedToken

    if isinstance(value, dict):
        kw = {k: value[k] for k in ("single_word", "lstrip", "rstrip", "normalized", "special") if k in value}
        if special is not None:
            kw["special"] = special
        return AddedToken(str(value["content"]), **kw)
    return AddedToken(str(value), special=bool(special))


def read_vocab(path: str) -> dict[str, int]:
    """vocab.txt as transformers' ``load_vocab`` reads it: one token a line
    (universal newlines, only the newline stripped), ids by line number; a
    repeated token keeps its last line."""
    vocab: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        for index, line in enumerate(f):
            vocab[line.rstrip("\n")] = index
    return vocab


def _settings(files: str, tc: dict) -> tuple[dict[str, Any], list[Any], list[tuple[int, Any]]]:
    """The special tokens (by key), the additional special tokens and the
    added tokens ``(id, token)``, as transformers' ``from_pretrained`` reads
    them: tokenizer_config.json; and, only when it has no
    ``added_tokens_decoder`` (files saved before transformers 4.34),
    special_tokens_map.json over it and added_tokens.json."""
    specials = {k: tc.get(k, DEFAULT_SPECIALS[k]) for k in SPECIAL_KEYS}
    additional = list(tc.get("additional_special_tokens") or [])
    added: list[tuple[int, Any]] = []
    if isinstance(tc.get("added_tokens_decoder"), dict):
        for idx, tok in tc["added_tokens_decoder"].items():
            if not isinstance(tok, dict) or "content" not in tok:
                raise InvalidModel(f"{files}/tokenizer_config.json: added_tokens_decoder[{idx!r}] "
                                 "is not a token ({\"content\": ...})")
            added.append((int(idx), tok))
    else:
        stm = read_json(os.path.join(files, "special_tokens_map.json"))
        for key, value in (stm if isinstance(stm, dict) else {}).items():
            if key in SPECIAL_KEYS:
                specials[key] = dict(value, special=True) if isinstance(value, dict) else value
            elif key == "additional_special_tokens" and isinstance(value, list):
                for tok in value:
                    tok = dict(tok, special=True) if isinstance(tok, dict) else tok
                    if _content(tok) not in [_content(t) for t in additional]:
                        additional.append(tok)
        at = read_json(os.path.join(files, "added_tokens.json"))
        if isinstance(at, dict):
            names = {_content(v) for v in specials.values()} | {_content(t) for t in additional}
            for content, idx in at.items():
                special = content in names
                added.append((int(idx), {"content": content, "lstrip": False, "rstrip": False,
                                         "normalized": not special, "special": special}))
    added.sort(key=lambda item: item[0])
    return specials, additional, added


def build_wordpiece(files: str, tc: Optional[dict] = None):
    """The fast ``tokenizers.Tokenizer`` equivalent of the slow BERT WordPiece
    tokenizer in ``files`` (vocab.txt, tokenizer_config.json and the rest)."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    if tc is None:
        tc = read_json(os.path.join(files, "tokenizer_config.json")) or {}
    vocab = read_vocab(os.path.join(files, "vocab.txt"))
    specials, additional, added = _settings(files, tc)
    unk = _content(specials["unk_token"]) or DEFAULT_SPECIALS["unk_token"]
    tok = Tokenizer(WordPiece(vocab, unk_token=unk, continuing_subword_prefix="##",
                              max_input_chars_per_word=MAX_INPUT_CHARS_PER_WORD))
    # As BertTokenizerFast sets its normalizer: from these settings, even
    # when do_basic_tokenize is false (the slow tokenizer then neither
    # lowercases nor splits punctuation; the fast one always does).
    strip_accents = tc.get("strip_accents")
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True,
        handle_chinese_chars=bool(tc.get("tokenize_chinese_chars", True)),
        # None: strip accents when lowercasing, as the slow tokenizer does.
        strip_accents=None if strip_accents is None else bool(strip_accents),
        lowercase=bool(tc.get("do_lower_case", True)),
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")

    # The added tokens, in id order, then every special token not among them
    # (as PreTrainedTokenizerFast.__init__ adds them); a token is special when
    # it says so or is one of the special tokens.
    special_names = [c for c in (_content(v) for v in list(specials.values()) + additional) if c is not None]
    tokens, seen = [], set()
    for _, value in added:
        t = _added_token(value)
        t.special = bool(value.get("special", False)) or t.content in special_names
        tokens.append(t)
        seen.add(t.content)
    for value in [specials[k] for k in SPECIAL_KEYS] + additional:
        content = _content(value)
        if content is None or content in seen:
            continue
        tokens.append(_added_token(value, special=True))
        seen.add(content)
    if tokens:
        tok.add_tokens(tokens)

    cls = _content(specials["cls_token"]) or DEFAULT_SPECIALS["cls_token"]
    sep = _content(specials["sep_token"]) or DEFAULT_SPECIALS["sep_token"]
    ids = {}
    for name in (cls, sep):
        i = tok.token_to_id(name)
        ids[name] = i if i is not None else vocab.get(unk, 0)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls}:0 $A:0 {sep}:0",
        pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
        special_tokens=[(cls, ids[cls]), (sep, ids[sep])],
    )
    return tok
