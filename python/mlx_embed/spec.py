"""The typed values that cross the Rust/Python seam (docs/architecture.md).

The bridge reads these attributes by name; every field is plain data (str,
int, list, dict, bytes) so nothing on the Rust side depends on Python types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class PairSpec:
    """How a (query, document) pair becomes one input (cross-encoders).

    Segments (``template`` is None; BERT, XLM-RoBERTa): both texts encoded
    without specials, cut by HF's ``longest_first`` rule to
    ``max_length - len(prefix_ids + middle_ids + suffix_ids)`` tokens
    (``mlx_embed.pairs.truncate_pair_lengths``), then
    ``prefix + a + middle + b + suffix``. Token types: ``first_type_id`` for
    ``prefix + a + middle``, ``second_type_id`` for ``b + suffix`` (BERT:
    ``[CLS] a [SEP]`` 0, ``b [SEP]`` 1); none are sent when both are 0.

    Template (decoder rerankers): the pair is written into one text,
    ``template`` with ``{instruction}`` (``default_instruction`` unless the
    request gives one), ``{query}`` and ``{document}`` replaced in one pass;
    that text is encoded without specials, truncated like a single text and
    wrapped as ``prefix_ids + text + suffix_ids`` (``middle_ids`` is empty).
    With ``suffix_text`` (a chat template's prompt, which sentence-transformers
    6 tokenizes as one rendered text) the closing text is encoded with the
    pair text instead, so a document's last characters merge with it as they
    do in the whole render: the pair is ``prefix_ids + encode(text +
    suffix_text)``, and where that reaches ``max_length`` tokens its first
    ``max_length - len(suffix_ids)`` tokens then ``suffix_ids``, the
    template's tail as sentence-transformers writes it back over a cut
    (:func:`mlx_embed.pairs.restored_suffix`). Cut from the left, the
    document gives up its start instead and the tail stays as encoded.

    Segments may carry text prompts (mxbai-rerank v2, whose library encodes
    ``"query: " + q`` and ``"document: " + d`` apart and joins the ids):
    ``query_prompt`` and ``document_prompt`` are written before each text and
    encoded with it; ``instruction_prompt`` (its ``{instruction}`` replaced)
    goes before ``query_prompt`` when a call gives an instruction (segments
    without it take none). ``query_share`` ``(n, d)`` replaces
    ``longest_first`` with a reranker library's cut, stated in that
    library's ``max_length``, which leaves ``uncounted`` of the input's
    tokens out: with ``room = max_length - uncounted``, the query keeps at
    most ``room * n // d`` tokens and the document at most ``room`` and what
    the budget leaves (:func:`mlx_embed.pairs.query_first_lengths`).
    mxbai-rerank's ``max_length`` counts the pair and its separator
    (``uncounted`` = prefix + suffix); FlagEmbedding's LLM reranker bounds
    ``[bos] q \\n d`` by ``max_length`` + the separator and task prompt it
    then appends (``uncounted`` = twice the suffix).

    ``instruction_suffix_ids`` (FlagEmbedding's ``prompt=``): a call's
    instruction, encoded alone without specials, goes after these ids in
    place of ``suffix_ids`` (an empty one leaves them alone), and
    ``uncounted`` grows by ``suffix_uncounted`` times the suffix's change:
    ``max_length`` still bounds the whole input
    (:func:`mlx_embed.pairs.with_instruction_suffix`)."""

    prefix_ids: list[int]
    middle_ids: list[int]
    suffix_ids: list[int]
    first_type_id: int = 0
    second_type_id: int = 0
    template: Optional[str] = None
    default_instruction: Optional[str] = None
    suffix_text: Optional[str] = None
    query_prompt: Optional[str] = None
    document_prompt: Optional[str] = None
    instruction_prompt: Optional[str] = None
    query_share: Optional[tuple[int, int]] = None
    uncounted: int = 0
    instruction_suffix_ids: Optional[list[int]] = None
    suffix_uncounted: int = 0
    # A decoder reranker's pairs in the tokenizer's own pair encoding (a
    # text-only LogitScore folder): a lone text has no meaning for it either.
    pairs_only: bool = False


@dataclass(frozen=True)
class InputModeSpec:
    """How a multi-vector (ColBERT) model's query or document text becomes
    ids, as PyLate's ``ColBERT.tokenize(is_query=...)`` makes them: the text
    is encoded as any input (prompt, specials), its content cut so that the
    whole, ``insert_ids`` included, holds at most ``max_length`` tokens;
    ``insert_ids`` (the ``[Q]`` / ``[D]`` marker) go in after the sequence's
    first token (``[CLS]``); then, with ``expand_id`` set, the sequence is
    padded with it to ``max_length`` (query expansion with ``[MASK]``)."""

    insert_ids: list[int]
    max_length: int
    expand_id: Optional[int] = None


@dataclass(frozen=True)
class TokenizerSpec:
    """Everything a second tokenizer implementation needs to produce the
    engine's ids from the same ``tokenizer.json``.

    An input is encoded without special tokens as ``prompt + text``, the
    content is truncated to ``max_length - len(prefix_ids) - len(suffix_ids)``
    tokens (from the end for ``right``, from the start for ``left``), then
    wrapped as ``prefix_ids + content + suffix_ids``.

    The prompt: a request's raw prompt if it gives one, else the named one
    from ``prompts`` (unknown name: invalid input), else
    ``prompts[default_prompt_name]``, else none; the default is left off a
    text that already begins with one of ``prompts`` (a client that wrote the
    prefix itself). (A model loaded with an ``instruction`` has it as its
    ``query`` prompt and default.)

    Static embeddings (Model2Vec) add two rules: with ``char_limit`` set, a
    text (prompt included) longer than that many characters is cut to it
    before it is encoded (its start kept for ``right``, its end for
    ``left``), when truncating; ids in ``drop_ids`` are left out of the
    content after the token truncation (Model2Vec drops its unknown token).

    ``lowercase`` (``do_lower_case`` in ``sentence_bert_config.json``): a
    ``Lowercase`` normalizer goes in front of the tokenizer's own, as
    sentence-transformers puts it, so prompt and text are lower-cased one
    character at a time (scorers never set it).

    ``include_prompt`` False (sentence-transformers' Pooling
    ``include_prompt: false``, INSTRUCTOR): the prompt runs through the model
    but the pooling leaves it out. Each input then carries a ``pool_start``
    to ``embed_ids``: its prompt in effect (the one a default was left off
    for, if so) tokenized alone with the specials, less the closing special
    if there is one, as sentence-transformers counts it; less what a left
    cut took of the prompt; 0 without a prompt. Token-id inputs and pairs
    carry 0. The pooling then reads the positions the pool mask keeps:
    ``cls`` the first of them, ``lasttoken`` the last.
    """

    path: str
    prefix_ids: list[int]
    suffix_ids: list[int]
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: Optional[str] = None
    pair: Optional[PairSpec] = None
    drop_ids: list[int] = field(default_factory=list)
    char_limit: Optional[int] = None
    lowercase: bool = False
    include_prompt: bool = True
    # The end an over-long input loses when a request names none: the
    # folder's side as transformers and sentence-transformers read it
    # (tokenization.resolve_truncation_side), or load(truncation_side=).
    truncation_side: str = "right"
    # A multi-vector model's two input modes (``embed_ids(output=
    # "multi_vector_query" / "multi_vector_document")``); None for any other.
    query: Optional[InputModeSpec] = None
    document: Optional[InputModeSpec] = None


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
    # What runs after the pooling, which late chunking (a mean per chunk)
    # must repeat or refuse; typed, never read from ``details``.
    # ``dense_layers``: sentence-transformers Dense modules after the pooling
    # (0: none). ``truncate_dim``: the Matryoshka width the pooled value is
    # cut to when the model cuts it (then always ``dim``), else None.
    dense_layers: int
    truncate_dim: Optional[int]
    # "embedding" (dim-wide vectors), "classifier" or "reranker" (raw logits,
    # one per label: dim == len(labels); the caller applies sigmoid/softmax).
    kind: str = "embedding"
    labels: list[str] = field(default_factory=list)
    # A classifier whose labels are independent (config.json's problem_type
    # multi_label_classification): a sigmoid per label, not one softmax.
    multi_label: bool = False
    # SPLADE: the ``dim == vocab_size`` vectors are non-negative and mostly
    # zero; TEI's /embed_sparse lists their non-zero entries.
    sparse: bool = False
    # Beside its dense vectors the model has BGE-M3's lexical weights:
    # ``embed_ids(output="sparse")`` gives, per input, (token id, weight)
    # rows, ids in increasing order, as float32 pairs (lexical.py).
    lexical_weights: bool = False
    # An input may have no tokens at all (static embeddings: the empty bag's
    # vector is zeros); otherwise one with none is refused.
    empty_inputs: bool = False
    # A multi-vector (ColBERT) model: ``dim``-wide unnormalized rows per
    # token, through ``output="multi_vector_query"`` or
    # ``"multi_vector_document"`` only (a pooled vector is refused); the
    # tokenizer's ``query`` / ``document`` modes say how its texts are cut.
    multi_vector: bool = False
    # Task adapters an input may run with (``embed_ids(adapter=)`` indexes
    # them: jina-embeddings-v3's LoRA tasks); empty for most models.
    tasks: list[str] = field(default_factory=list)
    # Display only (the server's /info): never parsed back.
    details: dict[str, str] = field(default_factory=dict)
    # The weights as loaded: parameter count (a quantized layer counts the
    # values it packs) and bytes in memory.
    parameters: Optional[int] = None
    weights_bytes: Optional[int] = None
    # The weights' files as read: "safetensors" or "pytorch" (pytorch_model.bin).
    weights_format: str = "safetensors"
    # The folder the model was read from, if any: the server's model
    # listings (Ollama's digest) hash its files.
    path: Optional[str] = None
    # The commit of a Hugging Face cache snapshot the folder is (TEI's
    # model_sha), else None.
    revision: Optional[str] = None


@dataclass(frozen=True)
class EmbedResult:
    """One ``embed_ids`` call's answer: ``vectors`` is little-endian float32,
    *unnormalized*, inputs in order: ``[n, dim]`` pooled vectors, or with
    ``output="tokens"`` each input's last hidden state rows (one per token,
    specials included; ``[sum(rows), hidden]``). ``rows`` is the row count
    of each input (1 each for pooled output); ``padded_tokens`` is the work
    the device did (sum over sub-batches of longest x rows)."""

    vectors: bytes
    padded_tokens: int
    rows: list[int] = field(default_factory=list)
