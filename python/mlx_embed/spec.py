"""The typed values that cross the Rust/Python seam (docs/architecture.md).

The bridge reads these attributes by name; every field is plain data (str,
int, list, dict, bytes) so nothing on the Rust side depends on Python types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class PairSpec:
    """How a (query, document) pair is wrapped in special tokens:
    ``prefix + a + middle + b + suffix``, each part with its own token type id
    (BERT: ``[CLS] a [SEP]`` type 0, ``b [SEP]`` type 1)."""

    prefix_ids: list[int]
    middle_ids: list[int]
    suffix_ids: list[int]
    first_type_id: int = 0
    second_type_id: int = 0


@dataclass(frozen=True)
class TokenizerSpec:
    """Everything a second tokenizer implementation needs to produce the
    engine's ids from the same ``tokenizer.json``.

    An input is encoded without special tokens as ``prompt + text``, the
    content is truncated to ``max_length - len(prefix_ids) - len(suffix_ids)``
    tokens (from the end for ``right``, from the start for ``left``), then
    wrapped as ``prefix_ids + content + suffix_ids``.

    The prompt: a request's raw prompt if it gives one, else the named one
    from ``prompts`` (unknown name: invalid input), else ``instruction`` when
    the model was loaded with one, else ``prompts[default_prompt_name]``,
    else none.
    """

    path: str
    prefix_ids: list[int]
    suffix_ids: list[int]
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: Optional[str] = None
    instruction: Optional[str] = None
    pair: Optional[PairSpec] = None


@dataclass(frozen=True)
class ModelSpec:
    """What a loaded model is and how to call it; ``model.spec()``."""

    name: str
    model_type: str
    dim: int
    max_length: int
    vocab_size: int
    pad_id: int
    pooling: str
    dtype: str
    quantization: Optional[int]
    device: str
    batch_tokens: int
    workers: int
    elementwise_ops: str
    tokenizer: TokenizerSpec
    kind: str = "embedding"
    # Display only (the server's /info): never parsed back.
    details: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class EmbedResult:
    """One ``embed_ids`` call's answer: ``vectors`` is little-endian float32
    ``[n, dim]``, pooled and *unnormalized*, rows in input order;
    ``padded_tokens`` is the work the device did (sum over sub-batches of
    longest x rows)."""

    vectors: bytes
    padded_tokens: int
