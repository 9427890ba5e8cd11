"""Qwen3 decoder as a yes/no reranker (Qwen3-Reranker).

A causal LM reads one prompt holding the instruction, the query and the
document, and the relevance is the log-odds of its next token being "yes"
rather than "no": ``logit[yes] - logit[no]`` at the last position, as
sentence-transformers' ``LogitScore`` and the model card compute it (the
model card's ``softmax([no, yes])[1]`` is the sigmoid of that difference).
Only the two vocabulary rows are ever multiplied, not the whole LM head.

The transformer is mlx-lm's ``Qwen3Model`` as in ``qwen3.py``; right padding
is exact for the same reason (causal attention never looks ahead), and the
score is read at each row's last real token.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import mlx.core as mx
import mlx.nn as nn

from .. import ops
from ..reranker_prompt import RerankerPrompt
from . import DECODER_SIBLINGS, mlx_lm_model, qwen3

_lm = mlx_lm_model("qwen3")

# The attention's softmax by the native kernel on the CPU, long inputs in
# query blocks (ops.engine_attention); the feed-forward's SiLU by the native
# kernel on the CPU (ops.native_swiglu).
ops.engine_attention(_lm)
ops.native_swiglu(_lm)
# Its feed-forward on each pass's real tokens where the engine packs rows.
ops.packs_feed_forward(_lm.MLP)
# A pass may be evaluated after each block (ops.EvaluationPoints).
ops.layer_boundary(_lm.TransformerBlock)

# Queries/keys/values and gate/up as one matmul each (sibling_linears.py).
JOINED_LINEARS = DECODER_SIBLINGS


# The Qwen3-Reranker model card's prompt, verbatim; a folder's own
# (sentence-transformers 6's LogitScore and chat template) replaces it
# (reranker_prompt.py).
RERANKER_DEFAULTS = RerankerPrompt(
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


class ModelArgs(qwen3.ModelArgs):
    """Qwen3's, with its refusals (sliding-window attention)."""


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = _lm.Qwen3Model(args)
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

    def bind_tokenizer(
        self, token_id: Callable[[str], Optional[int]], prompt: RerankerPrompt = RERANKER_DEFAULTS
    ) -> None:
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
                raise ValueError(f"qwen3 reranker: the tokenizer has no single token for {token!r}")
            return int(found)
        if not 0 <= token < self.args.vocab_size:
            raise ValueError(
                f"qwen3 reranker: score token id {token} is outside the vocabulary "
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
            raise RuntimeError("qwen3 reranker: bind_tokenizer() was not called")
        with ops.packed_feed_forwards(ops.KeyMask(attention_mask, mx.float32)):
            h = self.model(input_ids)
        last = attention_mask.astype(mx.int32).sum(axis=1) - 1
        h = mx.take_along_axis(h, last[:, None, None], axis=1)[:, 0]
        rows = self.get("score_rows")
        if rows is not None:
            return h @ rows.T
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
