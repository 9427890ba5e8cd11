"""A decoder reranker's prompt and score tokens, as its folder states them.

A yes/no reranker (Qwen3-Reranker) writes a (query, document) pair into a
chat prompt and scores two vocabulary tokens' logits at the last position.
Its model file holds the model card's prompt and tokens
(``models/decoder_reranker.py``: ``CARDS``). A folder saved by sentence-transformers 6 may state
its own, and then they win, because sentence-transformers' CrossEncoder
scores with them:

* ``modules.json``'s ``LogitScore`` names the true and false token ids (a
  fine-tune may score other tokens, or the true token's logit alone);
* a chat template that renders the ``query`` and ``document`` roles
  (``chat_template.jinja``, else ``tokenizer_config.json``'s
  ``chat_template``) is the prompt: a fine-tune may carry another
  instruction or other wording;
* a ``LogitScore`` folder whose Transformer is text only (no ``message`` in
  its ``modality_config``: :func:`renders_messages`) has no prompt at all:
  sentence-transformers encodes its pairs as ``tokenizer(query, document)``.

A chat template that renders neither role (Qwen's own chat template, in the
original Qwen3-Reranker folders) leaves the card's prompt.

A sequence-classification cross-encoder has no card prompt: sentence-transformers
6 encodes its pair with the tokenizer's pair encoding, unless the folder's chat
template renders both roles and its Transformer module may take chat
messages (:func:`cross_encoder_prompt`).

The template is rendered once at load, with marker strings for the
instruction, the query and the document, and turned into the engine's pair
template (``spec.PairSpec``): the prefix is the prompt up to its last added
token before the first marker (``...<|im_start|>``), where a tokenizer
always splits, so its ids are those of the whole rendered prompt; the pair
text runs from there to the document; the suffix is everything after the
document. sentence-transformers tokenizes the rendered prompt as one text,
so the suffix is encoded with the pair text (a document ending in ")" or "."
merges with a tail that starts with "\n"), and a cut ends with the ids
sentence-transformers writes back over it (``pairs.template_spec``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Optional, Union

from . import st_modules
from .json_files import read_json

log = logging.getLogger("mlx_embed")

CHAT_TEMPLATE_FILE = "chat_template.jinja"
# The roles sentence-transformers gives a pair's two texts.
QUERY_ROLE, DOCUMENT_ROLE = "query", "document"
# Private-use characters: no template writes them, and no filter that keeps
# text as it is changes them.
_MARKS = {
    "instruction": "\ue000instruction\ue001",
    "query": "\ue000query\ue001",
    "document": "\ue000document\ue001",
}
_FIELDS = re.compile(r"\{(instruction|query|document)\}")


@dataclass(frozen=True)
class RerankerPrompt:
    """How a (query, document) pair becomes a decoder reranker's input, and
    which logits score it."""

    # Text around the pair, encoded on its own (as the model card does) and
    # placed before/after the encoded pair text; a tuple's pieces are each
    # encoded on their own and their ids joined (mxbai-rerank v2's library).
    prefix: Union[str, tuple]
    suffix: Union[str, tuple]
    # The pair text; "{instruction}", "{query}" and "{document}" are
    # replaced. None: the query and the document are encoded apart (below).
    template: Optional[str]
    # None: the prompt has no instruction slot.
    default_instruction: Optional[str]
    # The tokens whose logit difference is the score: a vocabulary word, or
    # an id where the folder names one; no false token scores the true
    # token's logit alone.
    true_token: Union[str, int] = "yes"
    false_token: Union[str, int, None] = "no"
    # No template (mxbai-rerank v2): query_prompt + query and document_prompt
    # + document encoded apart, ``middle``'s ids between them;
    # instruction_prompt goes before the query's prompt when a call gives an
    # instruction; the cut keeps the query to query_share of the room
    # (spec.PairSpec), in the library's own max_length, which leaves out
    # ``a * len(prefix) + b * len(suffix)`` of the input's tokens for
    # uncounted = (a, b).
    middle: Union[str, tuple] = ""
    query_prompt: Optional[str] = None
    document_prompt: Optional[str] = None
    instruction_prompt: Optional[str] = None
    query_share: Optional[tuple] = None
    uncounted: Optional[tuple] = None
    # A call's instruction replaces the task prompt that ends the suffix:
    # the suffix becomes these pieces, then the instruction, each encoded on
    # its own (FlagEmbedding's ``prompt=``). None: the instruction goes
    # before the query (``instruction_prompt``), or the card takes none.
    instruction_suffix: Optional[tuple] = None
    # The library's default max_length (in its own count), which the engine
    # cuts at where neither the call nor the folder states a limit.
    default_max_length: Optional[int] = None
    # A chat template's prompt: sentence-transformers tokenizes the render
    # as one text (pairs.template_spec's ``whole``).
    whole: bool = False
    # No prompt: the tokenizer's own pair encoding, as sentence-transformers
    # encodes the pairs of a folder it reads as text only (the score tokens
    # above still apply).
    tokenizer_pair: bool = False


def from_folder(card: RerankerPrompt, folder: str, tokenizer_files: str,
                added_tokens: list[str]) -> RerankerPrompt:
    """``card`` with what the folder states instead: its ``LogitScore``
    tokens and its chat template's prompt, or, for a ``LogitScore`` folder
    that sentence-transformers reads as text only (:func:`renders_messages`),
    no prompt at all. ``added_tokens`` are the tokenizer's added tokens
    (where the prompt may be cut)."""
    prompt = card
    score = st_modules.read_logit_score(folder)
    if score is not None:
        prompt = dataclasses.replace(
            prompt, true_token=score.true_token_id, false_token=score.false_token_id
        )
    if score is not None and not renders_messages(folder):
        # Only a LogitScore folder: without one sentence-transformers does
        # not score the folder as a yes/no reranker, and the card stays.
        log.info("%s: sentence-transformers reads this folder as text only (its modality_config has no "
                 "message): pairs take the tokenizer's pair encoding, without a prompt", folder)
        return dataclasses.replace(prompt, tokenizer_pair=True)
    source = chat_template(tokenizer_files) or chat_template(folder)
    if source is not None:
        parts = pair_prompt(source, added_tokens, _special_token_values(tokenizer_files))
        if parts is not None:
            # The template's prompt whole: none of a segment card's pieces stay.
            prompt = dataclasses.replace(prompt, **parts, middle="", query_prompt=None,
                                         document_prompt=None, instruction_prompt=None,
                                         instruction_suffix=None,
                                         query_share=None, uncounted=None,
                                         default_max_length=None, whole=True)
    return prompt


def renders_messages(folder: str) -> bool:
    """Whether sentence-transformers 6.2 may render this folder's pairs
    through its chat template (it does where the template renders the
    ``query`` and ``document`` roles). In a folder it saved (one with
    ``modules.json``) only where ``sentence_bert_config.json``'s
    ``modality_config`` has ``message``: one without ``modality_config`` (or
    without the file) was saved before chat messages existed and reads as
    text only (``Transformer.load_config``), and a text-only Transformer
    encodes a pair as ``tokenizer(query, document)``; ``CrossEncoder`` writes
    a text-only one when it saves a classifier. A plain transformers folder
    may (a stray ``sentence_bert_config.json`` there is not read)."""
    if not os.path.isfile(os.path.join(folder, "modules.json")):
        return True
    bert_cfg = st_modules.transformer_config(folder)
    modality = bert_cfg.get("modality_config") if isinstance(bert_cfg, dict) else None
    return isinstance(modality, dict) and "message" in modality


def cross_encoder_prompt(folder: str, tokenizer_files: str,
                         added_tokens: list[str]) -> Optional[RerankerPrompt]:
    """The prompt a sequence-classification cross-encoder's pair is written
    into, or None for the tokenizer's own pair encoding; as
    sentence-transformers 6.2's ``CrossEncoder.predict`` decides it: through
    the chat template where the folder may take chat messages
    (:func:`renders_messages`) and the template renders the ``query`` and
    ``document`` roles. A template that renders neither role (Qwen3's own)
    makes sentence-transformers 6.2 refuse the pair; it runs here as the
    tokenizer's pair encoding, as sentence-transformers 5 and vLLM encode it
    (tokenizer(query, document))."""
    if not renders_messages(folder):
        return None
    source = chat_template(tokenizer_files) or chat_template(folder)
    if source is None:
        return None
    parts = pair_prompt(source, added_tokens, _special_token_values(tokenizer_files))
    if parts is None:
        log.info("%s: the chat template renders no query/document role: pairs take the "
                 "tokenizer's pair encoding", folder)
        return None
    return RerankerPrompt(**parts, whole=True)


def chat_template(folder: str) -> Optional[str]:
    """The folder's chat template: ``chat_template.jinja`` (transformers 5
    writes it and reads it first), else ``tokenizer_config.json``'s (a
    string, or the one named "default" of a list)."""
    path = os.path.join(folder, CHAT_TEMPLATE_FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    cfg = read_json(os.path.join(folder, "tokenizer_config.json"))
    value = cfg.get("chat_template") if isinstance(cfg, dict) else None
    if isinstance(value, list):
        value = next((t.get("template") for t in value
                      if isinstance(t, dict) and t.get("name") == "default"), None)
    return value if isinstance(value, str) else None


def _special_token_values(folder: str) -> dict:
    """bos_token, eos_token and the like, as transformers passes them to a template."""
    cfg = read_json(os.path.join(folder, "tokenizer_config.json"))
    out = {}
    for key, value in (cfg.items() if isinstance(cfg, dict) else ()):
        if key.endswith("_token") and value is not None:
            out[key] = value.get("content") if isinstance(value, dict) else value
    return out


def _environment():
    """A sandbox like transformers' for chat templates (its filters and
    globals that a template may call)."""
    import datetime

    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


def pair_prompt(source: str, added_tokens: list[str], variables: dict) -> Optional[dict]:
    """The prompt a chat template gives a query/document pair, as
    ``RerankerPrompt`` fields (prefix, template, suffix, default_instruction),
    or None when the template renders neither role (or cannot be rendered
    here). A template that renders one role only is refused: it would score
    every pair by half of it."""
    messages = [{"role": QUERY_ROLE, "content": _MARKS["query"]},
                {"role": DOCUMENT_ROLE, "content": _MARKS["document"]}]
    try:
        template = _environment().from_string(source)
        given = template.render(messages=messages, add_generation_prompt=False,
                                instruction=_MARKS["instruction"], **variables)
        plain = template.render(messages=messages, add_generation_prompt=False, **variables)
    except Exception as e:  # noqa: BLE001  (any template's own error)
        log.debug("chat template not rendered for a pair (%s: %s); the card's prompt stays",
                  type(e).__name__, e)
        return None
    counts = {role: given.count(_MARKS[role]) for role in (QUERY_ROLE, DOCUMENT_ROLE)}
    if counts == {QUERY_ROLE: 0, DOCUMENT_ROLE: 0}:
        return None
    if counts != {QUERY_ROLE: 1, DOCUMENT_ROLE: 1}:
        raise ValueError(
            "the folder's chat template renders a query/document pair with the query "
            f"{counts[QUERY_ROLE]} and the document {counts[DOCUMENT_ROLE]} times; a reranker's "
            "prompt holds each once"
        )
    if _FIELDS.search(given.replace(_MARKS["query"], "").replace(_MARKS["document"], "")
                      .replace(_MARKS["instruction"], "")):
        raise ValueError(
            "the folder's chat template writes a literal {instruction}, {query} or {document}, "
            "which the engine's pair template cannot hold"
        )
    text, default = given, None
    mark = _MARKS["instruction"]
    if given.count(mark) == 1:
        at = given.index(mark)
        before, after = given[:at], given[at + len(mark):]
        if plain.startswith(before) and plain.endswith(after) and len(plain) >= len(before) + len(after):
            default = plain[len(before):len(plain) - len(after)]
        else:
            # With no instruction the template writes another prompt (an
            # {% if instruction %} line), not a default in the same place:
            # the pair runs as it renders without one, and takes none.
            text = plain
    elif mark in given:
        raise ValueError("the folder's chat template writes the instruction more than once")
    if mark not in text:
        default = None
    for field, value in _MARKS.items():
        text = text.replace(value, "{" + field + "}")
    first = min(m.start() for m in _FIELDS.finditer(text))
    last = max(m.end() for m in _FIELDS.finditer(text))
    # The prefix ends at the last added token before the pair (a tokenizer
    # always splits there, so its ids are the whole render's); the suffix is
    # everything after the pair's last field, so a right cut never takes the
    # template's own closing text (sentence-transformers puts it back too).
    cut_before = 0
    for token in (t for t in added_tokens if t):
        for m in re.finditer(re.escape(token), text[:first]):
            cut_before = max(cut_before, m.end())
    cut_after = last
    return {
        "prefix": text[:cut_before],
        "template": text[cut_before:cut_after],
        "suffix": text[cut_after:],
        "default_instruction": default,
    }
