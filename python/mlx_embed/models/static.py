"""Static embeddings: one trained vector per vocabulary entry, averaged.

Two folder kinds carry them:

* a sentence-transformers ``StaticEmbedding`` folder (static-retrieval-mrl-en-v1,
  static-similarity-mrl-multilingual-v1): ``modules.json`` starts with the
  StaticEmbedding module (usually ``0_StaticEmbedding/``: ``model.safetensors``
  with ``embedding.weight`` [vocab, dim] and ``tokenizer.json``) and there is no
  config.json; the loader builds it as ``model_type`` ``static_embedding``.
  sentence-transformers encodes without special tokens and without truncation
  and takes ``nn.EmbeddingBag``'s mean of the rows;
* a Model2Vec folder (potion-base-8M, potion-retrieval-32M, M2V_base_output):
  config.json ``model_type`` ``model2vec``, ``model.safetensors`` with
  ``embeddings`` and, once vocabulary-quantized, ``mapping`` (token id -> row)
  and per-token ``weights``. model2vec's ``StaticModel.encode`` (0.10) cuts
  each text to ``max_length`` x the vocabulary's median token length in
  characters, encodes it without special tokens, truncates to ``max_length``
  tokens (config.json's, 512 when it has none), drops the unknown token
  (after the cut), and averages what is left.

Both averages are mean pooling over the real tokens, so the network is only
the table lookup; the engine pools. An input with no tokens left (an empty
text, or only unknown words in Model2Vec) is the zero vector in both
libraries, and normalizing keeps it at zero, so such inputs are accepted
(``empty_inputs``) rather than refused as they are for transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

EMBEDDING_DEFAULTS = {
    "pooling": "mean",
    "special_tokens": False,
    "empty_inputs": True,
    # A pass is one [tokens, dim] gather and a mean, not attention: the
    # per-pass overhead is what costs, and the CPU's 256-token passes ran
    # 9.7k texts/s on a 256-wide table where 1024-16384 ran 15-17k (4,000
    # golden texts, this 2-core machine; docs/benchmarks.md).
    "batch_tokens": 8192,
    # Both libraries read the tokenizer.json alone, never tokenizer_config.json
    # (its model_max_length, truncation_side) or sentence-transformers'
    # tokenizer settings: sentence-transformers' StaticEmbedding cuts where and
    # from the side its baked truncation says (none: it does not cut),
    # Model2Vec as its own config says (embedding_defaults).
    "tokenizer_json_only": True,
}

MODEL2VEC = "model2vec"
# model2vec's StaticModel default when config.json names no max_length.
MODEL2VEC_MAX_LENGTH = 512
# Neither library bounds a StaticEmbedding input (nor a Model2Vec one whose
# config says max_length null); the server must, so these models take the
# loader's usual cap for folders that declare none (8192 tokens: an input of
# that length costs one [8192, dim] gather, milliseconds on a CPU), and an
# explicit max_length may go up to this.
MAX_POSITIONS = 1 << 16
DEFAULT_CAP = 8192


@dataclass
class ModelArgs:
    model_type: str
    # Model2Vec's truncation: tokens per input (None: it does not truncate).
    max_length: Optional[int] = None

    @classmethod
    def from_dict(cls, config: dict) -> "ModelArgs":
        model_type = str(config.get("model_type"))
        if model_type != MODEL2VEC:
            return cls(model_type=model_type)
        max_length = config.get("max_length", MODEL2VEC_MAX_LENGTH)
        if max_length is not None and (not isinstance(max_length, int) or max_length < 1):
            raise ValueError(f"config.json max_length must be a positive integer or null, got {max_length!r}")
        return cls(model_type=model_type, max_length=max_length)


class Model(nn.Module):
    # No position table: the longest input is a choice (see MAX_POSITIONS).
    max_length = MAX_POSITIONS

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        # Sized by sanitize(): a StaticEmbedding folder has no config.json, so
        # the table's shape is only known from its weights.
        self.embeddings = nn.Embedding(1, 1)
        # What the folder decides beyond the module's EMBEDDING_DEFAULTS.
        self.embedding_defaults: dict = {}
        if args.model_type == MODEL2VEC:
            self.embedding_defaults = {
                "drop_unknown": True,
                "truncate_chars": args.max_length is not None,
                "max_length": args.max_length or DEFAULT_CAP,
                # StaticModel.encode cuts the start's characters and then
                # enable_truncation(max_length) (right), over any direction
                # the folder's tokenizer.json or tokenizer_config.json says.
                "truncation_side": "right",
            }

    @property
    def vocab_size(self) -> int:
        return int(self.embeddings.weight.shape[0])

    @property
    def hidden_size(self) -> int:
        table = self.embeddings
        if isinstance(table, nn.QuantizedEmbedding):
            # `load(quantize=)` packs the rows: bits-wide values in uint32 words.
            return int(table.weight.shape[1]) * 32 // int(table.bits)
        return int(table.weight.shape[1])

    def __call__(self, input_ids: mx.array, attention_mask: mx.array) -> mx.array:
        # Padding rows are looked up too; the mean pooling masks them out.
        return self.embeddings(input_ids)

    def sanitize(self, weights: dict) -> dict:
        """One row per token id: sentence-transformers' ``embedding.weight`` as
        is, or Model2Vec's ``embeddings[mapping[id]] * weights[id]`` (the row
        model2vec averages for that token)."""
        if "embedding.weight" in weights:
            table = weights["embedding.weight"]
            extra = sorted(k for k in weights if k != "embedding.weight")
        elif "embeddings" in weights:
            table = weights["embeddings"]
            if table.dtype not in (mx.float32, mx.float16, mx.bfloat16):
                # int8 tables (model2vec quantize_to="int8") average as floats.
                table = table.astype(mx.float32)
            mapping = weights.get("mapping")
            if mapping is not None:
                if mapping.ndim != 1:
                    raise ValueError(f"model.safetensors: mapping must be 1-D, got {tuple(mapping.shape)}")
                table = mx.take(table, mapping.astype(mx.int32), axis=0)
            scale = weights.get("weights")
            if scale is not None:
                if tuple(scale.shape) != (table.shape[0],):
                    raise ValueError(
                        f"model.safetensors: weights is {tuple(scale.shape)}, one per token id "
                        f"({table.shape[0]}) expected"
                    )
                table = table.astype(mx.float32) * scale.astype(mx.float32)[:, None]
            extra = sorted(k for k in weights if k not in ("embeddings", "mapping", "weights"))
        else:
            raise ValueError(
                "a static model's model.safetensors holds 'embedding.weight' (sentence-transformers) "
                f"or 'embeddings' (Model2Vec); found {sorted(weights)}"
            )
        if extra:
            raise ValueError(f"unexpected tensors in a static model's weights: {extra}")
        if table.ndim != 2:
            raise ValueError(f"the embedding table must be [vocab, dim], got {tuple(table.shape)}")
        self.embeddings = nn.Embedding(*table.shape)
        return {"embeddings.weight": table}
