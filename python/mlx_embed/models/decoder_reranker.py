"""Causal decoders as yes/no rerankers: Qwen3-Reranker (Qwen3),
mixedbread's mxbai-rerank-base/large-v2 (Qwen2) and BAAI's
bge-reranker-v2-gemma (Gemma).

A causal LM reads one prompt holding the query and the document (and an
instruction), and the relevance is the log-odds of its next token being the
"true" token rather than the "false" one: ``logit[true] - logit[false]`` at
the last position, as sentence-transformers' ``LogitScore``, the
Qwen3-Reranker model card (``yes``/``no``; its ``softmax([no, yes])[1]`` is
the sigmoid of that difference) and the mxbai-rerank library (``1``/``0``,
its raw score) compute it, or the true token's logit alone, as FlagEmbedding
scores bge-reranker-v2-gemma (``Yes``). Only those vocabulary rows of the LM
head are kept and multiplied, not the whole head.

The backbone is the decoder's own embedding module's (``qwen3.py``,
``qwen2.py``, ``gemma.py``: mlx-lm's transformer with this engine's kernels,
config checks and packing); right padding is exact for the same reason as
there (causal attention never looks ahead), and the score is read at each
row's last real token. Each decoder has a default prompt, its reranker's
card (:data:`CARDS`); a folder's own (sentence-transformers 6's
``LogitScore`` and chat template) replaces it (``reranker_prompt.py``),
except in a folder named as a model whose library scores it with its own
(:data:`NAMED_CARDS`: mxbai-rerank v2, bge-reranker-v2-gemma).
"""

from __future__ import annotations

import logging
import re
from typing import Callable, Optional, Union

import mlx.core as mx
import mlx.nn as nn

from .. import hub, ops, st_modules
from ..reranker_prompt import RerankerPrompt, chat_template
from . import DECODER_SIBLINGS, gemma, qwen2, qwen3

log = logging.getLogger("mlx_embed")

# config.json model_type -> the decoder module whose backbone scores.
DECODERS = {"qwen3": qwen3, "qwen2": qwen2, "gemma": gemma}

# Queries/keys/values and gate/up as one matmul each (sibling_linears.py).
JOINED_LINEARS = DECODER_SIBLINGS

# The Qwen3-Reranker model card's prompt, verbatim.
QWEN3_RERANKER = RerankerPrompt(
    prefix=(
        "<|im_start|>system\nJudge whether the Document meets the requirements based on "
        'the Query and the Instruct provided. Note that the answer can only be "yes" or '
        '"no".<|im_end|>\n<|im_start|>user\n'
    ),
    suffix="<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    template="<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}",
    default_instruction=(
        "Given a web search query, retrieve relevant passages that answer the query"
    ),
)

# mxbai-rerank v2 as the mxbai-rerank library (0.1.6, MxbaiRerankV2) builds
# its input: each piece tokenized on its own, without special tokens, and the
# ids joined: chat prefix + ("instruction: {i}\n" when given + "query: {q}",
# cut to 3/4 of max_length) + "\n" + ("document: {d}", cut to what is left)
# + "\n" + task prompt + chat suffix; no padding on the right (it pads left),
# the score logit("1") - logit("0") at the last position.
MXBAI_TASK = (
    "You are a search relevance expert who evaluates how well documents match search queries. "
    "For each query-document pair, carefully analyze the semantic relationship between them, "
    "then provide your binary relevance judgment (0 for not relevant, 1 for relevant).\nRelevance:"
)
MXBAI_RERANK_V2 = RerankerPrompt(
    prefix=("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
            "assistant.<|im_end|>\n<|im_start|>user\n",),
    middle=("\n",),
    suffix=("\n", MXBAI_TASK, "<|im_end|>\n<|im_start|>assistant\n"),
    template=None,
    default_instruction=None,
    query_prompt="query: ",
    document_prompt="document: ",
    instruction_prompt="instruction: {instruction}\n",
    query_share=(3, 4),
    # Its max_length counts the query, the separator and the document.
    uncounted=(1, 1),
    true_token="1",
    false_token="0",
)

# bge-reranker-v2-gemma as FlagEmbedding (1.4, FlagLLMReranker:
# BaseLLMReranker.compute_score_single_gpu) builds its input, each piece
# tokenized on its own without special tokens: [bos] + "A: {query}" (cut to
# max_length * 3 // 4) + "\n" + "B: {passage}" (cut to max_length, then to
# what is left of max_length + the separator and prompt, only_second) + "\n"
# + its default prompt; the score is logit("Yes") at the last position, raw
# (its normalize=True is the sigmoid). Its default max_length is 512, where
# a folder states none. A call's instruction is FlagEmbedding's prompt=: it
# replaces the default prompt after the "\n" (an empty one is a prompt of no
# tokens: only None takes the default), and moves the uncounted tokens with
# it, so the engine's max_length still bounds the whole input and a longer
# prompt leaves the pair less (FlagEmbedding run at max_length - 2 x (1 +
# the prompt's tokens)).
BGE_GEMMA_PROMPT = (
    "Given a query A and a passage B, determine whether the passage contains an answer to the "
    "query by providing a prediction of either 'Yes' or 'No'."
)
BGE_RERANKER_V2_GEMMA = RerankerPrompt(
    prefix=("<bos>",),
    middle=("\n",),
    suffix=("\n", BGE_GEMMA_PROMPT),
    template=None,
    default_instruction=None,
    query_prompt="A: ",
    document_prompt="B: ",
    query_share=(3, 4),
    # [bos] q \n d is cut to max_length + len(\n + prompt), and \n + prompt
    # is appended after that cut: the input reaches max_length + twice them.
    uncounted=(0, 2),
    instruction_suffix=("\n",),
    default_max_length=512,
    true_token="Yes",
    false_token=None,
)

# Each decoder's default prompt: its reranker's card.
CARDS = {"qwen3": QWEN3_RERANKER, "qwen2": MXBAI_RERANK_V2, "gemma": BGE_RERANKER_V2_GEMMA}

# Models whose own library scores them with its prompt and tokens whatever
# their folder carries, by model_type: (folder name, card, library). Names
# match conversions and the Hugging Face cache's models--org--name too.
NAMED_CARDS = {
    "qwen2": (re.compile(r"mxbai-rerank-[a-z0-9]+-v2", re.IGNORECASE), MXBAI_RERANK_V2,
              "the mxbai-rerank library"),
    "gemma": (re.compile(r"bge-reranker-v2-gemma", re.IGNORECASE), BGE_RERANKER_V2_GEMMA,
              "FlagEmbedding"),
}


def folder_name(path: str) -> str:
    """A folder's model name: its own, or the Hugging Face cache's repo name."""
    return hub.repo_name(path)


def named_card(model_type: str, path: str) -> Optional[tuple]:
    """(card, library) where the folder is named as a model of
    :data:`NAMED_CARDS`, else None."""
    named = NAMED_CARDS.get(model_type)
    if named is None or not named[0].search(folder_name(path)):
        return None
    return named[1], named[2]


def prompt_for(model_type: str, path: str) -> tuple[RerankerPrompt, bool]:
    """The default prompt of a ``model_type`` reranker at ``path``, and
    whether the folder's own prompt and tokens (``reranker_prompt.from_folder``)
    may replace it: not for a folder named as a model of :data:`NAMED_CARDS`
    (mxbai-rerank v2, bge-reranker-v2-gemma), which its library scores with
    its own whatever the folder carries."""
    named = named_card(model_type, path)
    if named is not None:
        card, library = named
        ignored = [what for what, there in (
            ("LogitScore", st_modules.read_logit_score(path) is not None),
            ("chat template", chat_template(path) is not None),
        ) if there]
        if ignored:
            log.info("%s: scored with %s's prompt and tokens; its %s is not read",
                     path, library, " and ".join(ignored))
        return card, False
    return CARDS[model_type], True


class ModelArgs:
    """The decoder's own arguments (and its refusals: sliding windows, ...)."""

    @classmethod
    def from_dict(cls, params: dict):
        model_type = params.get("model_type")
        if model_type not in DECODERS:
            raise ValueError(
                f"yes/no rerankers are supported on {', '.join(DECODERS)}, not model_type {model_type!r}"
            )
        return DECODERS[model_type].ModelArgs.from_dict(params)


class Model(nn.Module):
    # A decoder has no token types: a folder whose pairs take the tokenizer's
    # pair encoding (reranker_prompt.renders_messages) sends none, whatever
    # types the tokenizer gives the document (Qwen's 1).
    reads_type_ids = False

    def __init__(self, args):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        # The embedding module's backbone (Qwen3Model, Qwen2Model).
        self.model = DECODERS[args.model_type].Model(args).model
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        # Plain ints, not a tuple: an nn.Module stores tuples as children.
        # No false token: the true token's logit alone is the score.
        self._yes_id: Optional[int] = None
        self._no_id: Optional[int] = None

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def num_labels(self) -> int:
        return 1

    @property
    def labels(self) -> list:
        return ["score"]

    def bind_tokenizer(self, token_id: Callable[[str], Optional[int]], prompt: RerankerPrompt) -> None:
        """Resolve the prompt's true/false tokens (words with the folder's
        tokenizer, or ids); called once after the weights are loaded. Keeps
        only their rows of the LM head (a 4B model's untied head is 1.5 GB
        in fp32)."""
        self._yes_id = self._token(token_id, prompt.true_token)
        self._no_id = None if prompt.false_token is None else self._token(token_id, prompt.false_token)
        head = self.get("lm_head")
        table = self.model.embed_tokens if head is None else head
        if not hasattr(table, "scales"):
            ids = [self._yes_id] if self._no_id is None else [self._yes_id, self._no_id]
            rows = mx.take(table.weight, mx.array(ids), axis=0)
            # (w_yes - w_no) . h is the logit difference in one product.
            self.score_rows = rows[0:1] if self._no_id is None else rows[0:1] - rows[1:2]
            # Evaluated here: a lazy graph built on this thread's stream
            # cannot be evaluated by the engine's worker threads.
            mx.eval(self.score_rows)
            if head is not None:
                self.pop("lm_head")

    def _token(self, token_id: Callable[[str], Optional[int]], token: Union[str, int]) -> int:
        if isinstance(token, str):
            found = token_id(token)
            if found is None:
                raise ValueError(f"{self.model_type} reranker: the tokenizer has no single token for {token!r}")
            return int(found)
        if not 0 <= token < self.args.vocab_size:
            raise ValueError(
                f"{self.model_type} reranker: score token id {token} is outside the vocabulary "
                f"(0..{self.args.vocab_size - 1})"
            )
        return int(token)

    def __call__(
        self,
        input_ids: mx.array,
        attention_mask: mx.array,
        token_type_ids: Optional[mx.array] = None,
    ) -> mx.array:
        """logit(true) - logit(false) (or logit(true) alone) at each row's
        last real token, [B, 1]."""
        if self._yes_id is None:
            raise RuntimeError(f"{self.model_type} reranker: bind_tokenizer() was not called")
        with ops.packed_feed_forwards(ops.KeyMask(attention_mask, mx.float32)):
            h = self.model(input_ids)
        last = attention_mask.astype(mx.int32).sum(axis=1) - 1
        h = mx.take_along_axis(h, last[:, None, None], axis=1)[:, 0]
        rows = self.get("score_rows")
        if rows is not None:
            # By the native kernel on the CPU's native path: each row's score
            # the same bits whatever the batch (ops.rows_times).
            return ops.rows_times(h, rows, owner=self, key="score_rows")
        # Quantized head: the full projection, then the two columns.
        head = self.get("lm_head")
        logits = head(h) if head is not None else self.model.embed_tokens.as_linear(h)
        yes, no = self._yes_id, self._no_id
        if no is None:
            return logits[:, yes : yes + 1]
        return logits[:, yes : yes + 1] - logits[:, no : no + 1]

    def sanitize(self, weights: dict) -> dict:
        out = {}
        for name, w in weights.items():
            if "rotary_emb.inv_freq" in name:
                continue
            if name.startswith("lm_head."):
                if self.args.tie_word_embeddings:
                    continue
                out[name] = w
                continue
            if not name.startswith("model."):
                name = "model." + name
            out[name] = w
        return out
