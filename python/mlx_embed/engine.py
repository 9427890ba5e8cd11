"""The public model API: :func:`load` and :class:`EmbeddingModel`.

Thin on purpose: loading is ``loading.py``, device scheduling is
``scheduler.py``, tokenization rules are ``tokenization.py``. This module
validates what callers pass and puts the pieces together.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
import operator
import os
import time
from typing import Optional, Sequence, Union

import numpy as np

try:
    import mlx.core  # noqa: F401
except ImportError as e:  # the `mlx` wheel alone has no backend on Linux
    # Named, so a load tells the engine's own package missing from a
    # model's dependency (errors.as_missing_dependency).
    raise ImportError(
        f"MLX cannot load ({e}); on Linux install a backend with it: "
        "pip install 'mlx-embed[cpu]' (or 'mlx-embed[cuda]' on an NVIDIA GPU)",
        name="mlx",
    ) from e

from . import workers as workers_module
from . import (
    _blas, device, hub, lexical, loading, multi_vector, ops, pooling, precision, reranker_prompt, st_modules,
    startup,
)
from .errors import (
    InputTooLong, InvalidInput, InvalidModel, InvalidOption, InvalidOptionType, MlxEmbedError, ModelFolderMissing,
    as_missing_dependency, check_switches,
)
from .loading import DEFAULT_MODEL_NAME, DEFAULT_MODEL_NAMES, default_model_path  # noqa: F401  (re-exported)
from .models import reads_type_ids
from .pairs import segment_spec, template_spec
from .scheduler import Scheduler
from .scoring import ScoringMixin
from .spec import EmbedResult, ModelSpec, TokenizerSpec
from .tokenization import (
    TRUNCATION_DIRECTIONS, TextTokenizer, check_direction, flag_specials, prompt_in_effect, read_tokenizer,
    resolve_prompt, resolve_truncation_side, unknown_id, with_prompt,
)

log = logging.getLogger("mlx_embed")

# What joins late chunking's chunks (the server's `LATE_CHUNK_SEPARATOR`).
LATE_CHUNK_SEPARATOR = " "



class EmbeddingModel(ScoringMixin):
    """A loaded model. Build with :func:`mlx_embed.load`. An embedding model
    embeds; a classifier or reranker (``kind``) scores, see ``scoring.py``."""

    def __init__(
        self,
        path: str,
        *,
        dtype: str = "float32",
        quantize: Optional[int] = None,
        group_size: int = 32,
        instruction: Optional[str] = None,
        pooling: Optional[str] = None,
        max_length: Optional[int] = None,
        batch_tokens: Optional[int] = None,
        name: Optional[str] = None,
        workers: Optional[int] = None,
        fast_ops: Optional[str] = None,
        cache_limit_mb: Optional[int] = None,
        pipeline: Optional[bool] = None,
        streams: int = 1,
        fused_attention: Optional[bool] = None,
        shape_buckets: Optional[bool] = None,
        dequantize: Optional[bool] = None,
        kind: Optional[str] = None,
        joined_linears: bool = False,
        packed_rows: bool = False,
        eval_chunk_mb: Optional[int] = None,
        truncation_side: Optional[str] = None,
        _is_default: bool = False,
    ):
        t0 = time.perf_counter()
        device.claim_thread_streams()
        _check_settings(
            quantize=quantize, group_size=group_size, max_length=max_length, batch_tokens=batch_tokens,
            workers=workers, streams=streams, pipeline=pipeline, fused_attention=fused_attention,
            shape_buckets=shape_buckets, dequantize=dequantize, joined_linears=joined_linears, name=name,
            packed_rows=packed_rows, eval_chunk_mb=eval_chunk_mb, cache_limit_mb=cache_limit_mb,
            pooling=pooling, fast_ops=fast_ops, kind=kind, instruction=instruction,
            truncation_side=truncation_side,
        )
        # Before the weights: their buffers then obey the limit too.
        self.cache_limit_mb = device.apply_cache_limit(cache_limit_mb)
        try:
            ck = loading.load_checkpoint(
                os.fspath(path), dtype=dtype, quantize=quantize, group_size=group_size,
                max_length=max_length, pooling=pooling, name=name, is_default=_is_default,
                dequantize=dequantize, backend=device.backend(), kind=kind,
                joined_linears=joined_linears,
            )
        except FileNotFoundError as e:
            # Every file a load opens is the folder's (a Dense module's
            # config, its weights): one the folder lacks is the folder's
            # fault, typed as such for the bridge.
            if isinstance(e, ModelFolderMissing):
                raise
            raise ModelFolderMissing(str(e)) from e
        self.path = ck.path
        self.name = ck.name
        # The commit of the Hugging Face cache's snapshot it was read from.
        snapshot = hub.snapshot_of(ck.path)
        self.revision: Optional[str] = snapshot[1] if snapshot else None
        self.model_type = ck.model_type
        self.model = ck.model
        self.dtype = ck.dtype
        self.quantization = ck.quantization
        self.checkpoint_quantization = ck.checkpoint_quantization
        self.dequantized_because = ck.dequantized_because
        self.joined_groups = ck.joined_groups
        self.dim = ck.dim
        self.vocab_size = ck.vocab_size
        self.pad_id = ck.pad_id
        self.max_length = ck.max_length
        self.pooling = ck.pooling
        self.prompts = ck.prompts
        self.default_prompt_name = ck.default_prompt_name
        # Task adapters a row may run with (jina-embeddings-v3's LoRA), by
        # name; a call's task selects one and its prompt.
        self.tasks: tuple = tuple(getattr(ck.model, "adapters", ()) or ())
        self.kind = ck.kind
        self.labels = ck.labels
        self.multi_label = ck.multi_label
        self.sparse = ck.sparse
        self.weights_format = ck.weights_format
        # sentence-transformers' include_prompt: false (INSTRUCTOR): the
        # prompt runs through the model but is left out of the pool.
        self.include_prompt = bool(getattr(ck.head, "include_prompt", True))
        # What lies between the pooling and the vector, which late chunking
        # (chunk means of the token states) must apply as the head does: a
        # Matryoshka cut (truncate_dim: each mean's first dim values) it can,
        # a Dense projection it cannot (no such layer runs on a chunk mean).
        self._dense_layers = len(getattr(ck.head, "dense", ()) or ())
        # Only a cut that is the vector's width (one past the hidden size cuts nothing).
        truncate_dim = getattr(ck.head, "truncate_dim", None) or None
        self._truncate_dim = truncate_dim if truncate_dim == self.dim else None
        self.device = device.device_name()
        self.parameter_count, self.weights_bytes = loading.weight_stats(
            self.model,
            [a for d in ck.head.dense for a in (d.weight, d.bias) if a is not None],
        )
        self._template: Optional[str] = ck.defaults.get("instruction_template")
        tokenizer_folder = ck.tokenizer_files or os.path.dirname(ck.tokenizer_path)
        self._type_vocab_size = int(ck.config.get("type_vocab_size") or 1)

        try:
            reads_types = self._read_tokenizer_files(ck, tokenizer_folder, truncation_side, max_length is not None)
        except MlxEmbedError:
            raise
        except ValueError as e:
            # The folder's tokenizer files and the model's own prompts and
            # score tokens, read against each other: the model's to fix.
            # Only this reading is wrapped, so a ValueError from building
            # or running the network is not blamed on the folder.
            raise InvalidModel(f"{ck.path}: {e}") from e
        if instruction is not None:
            try:
                query = self._format_instruction(instruction)
            except InvalidInput as e:
                # The load's instruction=, not a call's: an option refused.
                raise InvalidOption(f"instruction: {e}") from None
        self.instruction = instruction
        if instruction is not None:
            # The load's instruction is the model's query prompt, and the
            # default for a call that names none (as it was before it had a
            # name); documents keep the folder's document prompt, else none,
            # so routes that say what an input is (Cohere's search_document,
            # prompt_name="document") embed them without it.
            self.prompts = {**self.prompts, "query": query}
            if "document" not in self.prompts and "passage" not in self.prompts:
                self.prompts["document"] = ""
            self.default_prompt_name = "query"

        self._blas_threads = _blas.own_num_threads()
        self.context = ops.make_context(
            fast_ops, kernel_threads=self._blas_threads, fused_attention=fused_attention,
            dtype=self.dtype, packed_rows=packed_rows,
        )
        ops.prepare(self.model, self.context)
        # BGE-M3's sparse head, where the folder has one (lexical.py).
        self.lexical = None
        if self.kind == "embedding" and not self.sparse:
            try:
                self.lexical = lexical.read(
                    ck.path, ck.tokenizer_files,
                    int(getattr(self.model, "hidden_size", None) or ck.config["hidden_size"]),
                    self.vocab_size, self.tokenizer.token_id,
                    default_skips=[*self.tokenizer.prefix, *self.tokenizer.suffix, self.pad_id],
                    model_type=self.model_type,
                )
            except MlxEmbedError:
                raise
            except ValueError as e:
                raise InvalidModel(str(e)) from e
        self.scheduler = Scheduler(
            self.model,
            head=ck.head,
            dim=self.dim,
            pad_id=self.pad_id,
            max_length=self.max_length,
            context=self.context,
            batch_tokens=batch_tokens or ck.defaults.get("batch_tokens"),
            workers=workers,
            pipeline=pipeline,
            streams=streams,
            shape_buckets=shape_buckets,
            takes_type_ids=reads_types,
            eval_chunk_mb=eval_chunk_mb,
            token_head=self.lexical,
        )
        self.load_timings = {**ck.timings, "total": time.perf_counter() - t0}
        for stage in ("read_weights", "build"):
            startup.record(stage, ck.timings[stage])
        startup.record("load_total", self.load_timings["total"])
        log.info("mlx_embed startup: %s", startup.describe())

    def _read_tokenizer_files(self, ck, tokenizer_folder: str, truncation_side: Optional[str],
                              max_length_given: bool) -> bool:
        """The tokenizer, its pair template and truncation side, a ColBERT
        model's modes and a reranker's prompt and score tokens, from the
        folder's files (part of ``__init__``); whether the model reads
        token type ids."""
        append: Sequence[int] = ()
        eos = ck.defaults.get("eos_token")
        if eos:
            eos_id = TextTokenizer(ck.tokenizer_path, self.max_length).token_id(eos)
            if eos_id is not None:
                append = (eos_id,)

        def text_tokenizer(max_length: int) -> TextTokenizer:
            return TextTokenizer(
                ck.tokenizer_path, max_length, append_ids=append,
                special_tokens=ck.defaults.get("special_tokens", True),
                drop_unknown=ck.defaults.get("drop_unknown", False),
                truncate_chars=ck.defaults.get("truncate_chars", False),
                lowercase=ck.head.lowercase, flag_specials=flag_specials(tokenizer_folder),
            )

        self.tokenizer = text_tokenizer(self.max_length)
        # The end an input loses when a call names none: the folder's own
        # (or the caller's truncation_side, else the side a model's library
        # always cuts), decided here alone; spec() carries it to the Rust
        # tokenizer and /info.
        self.truncation_side = resolve_truncation_side(
            # A library that reads the tokenizer.json alone: its baked side.
            "" if ck.defaults.get("tokenizer_json_only") else tokenizer_folder,
            self.tokenizer.file_truncation_side,
            truncation_side if truncation_side is not None else ck.defaults.get("truncation_side"),
        )
        # A ColBERT model (PyLate's layout): its query and document modes as
        # ids of this tokenizer, and the rows it keeps (multi_vector.py).
        self.multi_vector = None
        if isinstance(ck.head, st_modules.ColbertPipeline):
            self.multi_vector = multi_vector.resolve(
                ck.head, self.tokenizer.token_id, unknown_id(self.tokenizer._tok),
                tokenizer_folder, self.max_length, self.name, max_length_given=max_length_given,
                positions=ck.positions,
            )
        # Whether an input may run with no tokens at all (its vector is what
        # the pooling makes of nothing: zeros for the mean).
        self.empty_inputs = bool(ck.defaults.get("empty_inputs", False))
        reads_types = reads_type_ids(self.model)
        if (ck.config.get("type_vocab_size") == 0 or not reads_types) and self.tokenizer.pair is not None:
            # No token-type table (DeBERTa-v3, ModernBERT): the tokenizer may
            # still mark the second segment 1, which transformers never reads,
            # so pairs go without type ids rather than fail the range check.
            self.tokenizer.pair = dataclasses.replace(self.tokenizer.pair, first_type_id=0, second_type_id=0)
        # Decoder rerankers write a pair into their prompt instead of the
        # tokenizer's pair template: the model card's, unless the folder
        # states its own (reranker_prompt.py).
        rr, own = None, False
        prompt_for = getattr(ck.module, "prompt_for", None)
        if prompt_for is not None:
            rr, own = prompt_for(ck.model_type, ck.path)
        if own:
            rr = reranker_prompt.from_folder(
                rr, ck.path, ck.tokenizer_files or ck.path, self.tokenizer.added_tokens()
            )
        elif prompt_for is None and self.kind != "embedding":
            # A sequence-classification cross-encoder's folder may write its
            # pair into a chat template, as sentence-transformers 6 does.
            rr = reranker_prompt.cross_encoder_prompt(
                ck.path, ck.tokenizer_files or ck.path, self.tokenizer.added_tokens()
            )
        # Scorers that read vocabulary rows (yes/no rerankers) resolve them
        # with the folder's tokenizer.
        bind = getattr(self.model, "bind_tokenizer", None)
        if bind is not None:
            bind(self.tokenizer.token_id, rr)
        if rr is None:
            pass
        elif rr.tokenizer_pair:
            if self.tokenizer.pair is not None:
                self.tokenizer.pair = dataclasses.replace(self.tokenizer.pair, pairs_only=True)
        elif rr.template is None:
            self.tokenizer.pair = segment_spec(read_tokenizer(ck.tokenizer_path), rr)
        else:
            self.tokenizer.pair = template_spec(
                read_tokenizer(ck.tokenizer_path), prefix=rr.prefix, suffix=rr.suffix,
                template=rr.template, default_instruction=rr.default_instruction, whole=rr.whole,
            )
        pair = self.tokenizer.pair
        library = getattr(rr, "default_max_length", None)
        if library is not None and pair is not None and not ck.max_length_stated:
            # Cut where the reranker's library cuts by default (FlagEmbedding:
            # 512 in its own count), not at the generic 8192, when neither
            # the call nor the folder states a limit.
            self.max_length = min(library + pair.uncounted, ck.positions)
            log.info("%s: max_length %d: the reranker's library cuts at %d in its own count "
                     "by default", self.name, self.max_length, library)
            self.tokenizer = text_tokenizer(self.max_length)
            self.tokenizer.pair = pair
        if self.kind != "embedding" and pair is not None and pair.template is None and reads_types:
            if max(pair.first_type_id, pair.second_type_id) >= self._type_vocab_size:
                # Every pair would fail; transformers fails on them too.
                raise InvalidModel(
                    f"{self.name}: the tokenizer gives a pair's texts token types "
                    f"{pair.first_type_id} and {pair.second_type_id}, but config.json's "
                    f"type_vocab_size is {self._type_vocab_size}"
                )
        return reads_types
    # ------------------------------------------------------------ settings

    @property
    def batch_tokens(self) -> int:
        """Padded tokens per device pass (the scheduler's budget)."""
        return self.scheduler.batch_tokens

    @property
    def workers(self) -> int:
        return self.scheduler.workers

    @property
    def max_seq_length(self) -> int:
        """sentence-transformers' name for ``max_length``. Read-only: set there,
        it was taken silently and cut nothing."""
        return self.max_length

    @max_seq_length.setter
    def max_seq_length(self, value) -> None:
        raise AttributeError(
            f"max_seq_length cannot be set here (it is {self.max_length}): "
            "load(..., max_length=N) sets the model's cut, embed(..., truncate_to=N) one call's"
        )

    def _format_instruction(self, instruction: Optional[str]) -> Optional[str]:
        if instruction is None:
            return None
        if self._template is None:
            raise InvalidInput(
                f"instruction prefixes are not defined for {self.model_type} models "
                "(their model file has no instruction template)"
            )
        return self._template.format(instruction=instruction)

    # ------------------------------------------------------------ the seam

    def spec(self) -> ModelSpec:
        """What this model is and how to tokenize for it (read by the bridge)."""
        tok = self.tokenizer
        return ModelSpec(
            name=self.name,
            model_type=self.model_type,
            dim=self.dim,
            max_length=self.max_length,
            vocab_size=tok.vocab_size,
            pad_id=self.pad_id,
            pooling=self.pooling,
            dtype=self.dtype,
            quantization=self.quantization,
            device=self.device,
            batch_tokens=self.batch_tokens,
            workers=self.workers,
            elementwise_ops=self.context.describe(),
            kind=self.kind,
            labels=list(self.labels),
            multi_label=self.multi_label,
            sparse=self.sparse,
            lexical_weights=self.lexical is not None,
            empty_inputs=self.empty_inputs,
            multi_vector=self.multi_vector is not None,
            tasks=list(self.tasks),
            dense_layers=self._dense_layers,
            truncate_dim=self._truncate_dim,
            tokenizer=TokenizerSpec(
                path=tok.path,
                prefix_ids=list(tok.prefix),
                suffix_ids=list(tok.suffix),
                prompts=dict(self.prompts),
                default_prompt_name=self.default_prompt_name,
                # An embedding model embeds single texts: a pair is a
                # scorer's input, so the bridge refuses one here.
                pair=tok.pair if self.kind != "embedding" else None,
                drop_ids=list(tok.drop_ids),
                char_limit=tok.char_limit,
                lowercase=tok.lowercase,
                include_prompt=self.include_prompt,
                truncation_side=self.truncation_side,
                query=self.multi_vector.query if self.multi_vector else None,
                document=self.multi_vector.document if self.multi_vector else None,
            ),
            details=self._details(),
            parameters=self.parameter_count,
            weights_bytes=self.weights_bytes,
            weights_format=self.weights_format,
            path=os.fspath(self.path) if os.path.isdir(self.path) else None,
            revision=self.revision,
        )

    def embed_ids(
        self,
        ids: Sequence[Sequence[int]],
        type_ids: Optional[Sequence[Sequence[int]]] = None,
        *,
        output: str = "pooled",
        pool_start: Optional[Sequence[int]] = None,
        pool_factor: Optional[Sequence[int]] = None,
        protected_tokens: Optional[Sequence[int]] = None,
        adapter: Optional[Sequence[int]] = None,
    ) -> EmbedResult:
        """Embed complete token sequences (prompt, specials and truncation
        already applied by the caller). Vectors are unnormalized; bad ids
        raise :class:`~mlx_embed.errors.InvalidInput`. ``output="tokens"``
        (embedding models only) returns every token's last hidden state
        instead of the pooled vector: no pooling, no Dense head.
        ``output="sparse"`` (a model with lexical weights, BGE-M3's) returns
        per input its (token id, weight) rows, ids increasing
        (``lexical.entries``); ``rows`` counts them.
        ``pool_start``: per input, the leading tokens the pooling leaves out
        (a prompt the model pools without, sentence-transformers'
        ``include_prompt: false``, counted as ``TextTokenizer.pool_starts``
        counts it); ignored for ``output="tokens"``. ``pool_factor`` and
        ``protected_tokens`` (``output="multi_vector_document"`` only, both
        or neither): per input, PyLate's pooling of its rows (1: none); a
        pooled input's rows are answered normalized and pooled
        (:func:`multi_vector.pool_documents`), the others unnormalized.
        ``adapter``: per input, the index of its task in ``tasks`` (-1:
        none, the base weights), for a model with task adapters."""
        return self.submit_ids(
            ids, type_ids, output=output, pool_start=pool_start, pool_factor=pool_factor,
            protected_tokens=protected_tokens, adapter=adapter,
        ).result()

    def submit_ids(
        self,
        ids: Sequence[Sequence[int]],
        type_ids: Optional[Sequence[Sequence[int]]] = None,
        *,
        output: str = "pooled",
        pool_start: Optional[Sequence[int]] = None,
        pool_factor: Optional[Sequence[int]] = None,
        protected_tokens: Optional[Sequence[int]] = None,
        adapter: Optional[Sequence[int]] = None,
    ) -> "PendingResult":
        """:meth:`embed_ids` in two steps, for callers that overlap
        consecutive calls: this validates and queues the call (on a GPU it
        returns once the device has the work), ``.result()`` collects it. A
        model thread can submit batch k+1, then collect batch k, in one
        interpreter crossing, so the device never waits for the host
        between batches."""
        self._check_output(output)
        ids = self._check_ids(ids)
        if type_ids is not None:
            type_ids = self._check_type_ids(type_ids, ids)
        if pool_start is not None:
            pool_start = self._check_pool_start(pool_start, ids)
        pooling = self._check_token_pooling(pool_factor, protected_tokens, ids, output)
        if adapter is not None:
            adapter = self._check_adapter(adapter, ids)
            # The adapter changes the model's hidden states, so a per-token
            # answer (and late chunking's means of it) runs it too; the
            # sparse and multi-vector heads of other models have no tasks.
            if adapter is not None and output not in ("pooled", "tokens"):
                raise InvalidInput(
                    f"a task adapter applies to pooled or per-token embeddings only, not output={output!r}"
                )
        if output in multi_vector.OUTPUTS:
            mv = self.multi_vector
            attend = mv.attended(ids, output)
            pending = self.scheduler.submit(ids, type_ids, output="tokens", attend=attend)
            return PendingResult(pending, multi_vector=(mv, ids, output, pooling, self.context))
        if output == "sparse":
            pending = self.scheduler.submit(ids, type_ids, output="token_weights")
            return PendingResult(pending, lexical_ids=ids, skipped=self.lexical.skipped_ids)
        return PendingResult(
            self.scheduler.submit(ids, type_ids, output=output, pool_start=pool_start, adapter=adapter)
        )

    def embed_tokens(
        self,
        texts: list[str],
        *,
        truncate: bool = True,
        truncation_direction: Optional[str] = None,
        prompt_name: Optional[str] = None,
        prompt: Optional[str] = None,
        instruction: Optional[str] = None,
        truncate_to: Optional[int] = None,
        task: Optional[str] = None,
    ) -> list[np.ndarray]:
        """Each text's per-token vectors: float32 [tokens, hidden] per text
        (specials included, unnormalized), in input order, the server's
        ``/embed_all`` rows. Keyword arguments as :meth:`encode` takes them;
        ``task`` (or a ``prompt_name`` that names one) runs the task's
        adapter, as :meth:`embed` does."""
        self._check_output("tokens")
        index, prompt_name = self._task_and_prompt(task, prompt_name, prompt, instruction)
        ids, _ = self.encode(
            texts, truncate=truncate, truncation_direction=truncation_direction,
            prompt_name=prompt_name, prompt=prompt, instruction=instruction, truncate_to=truncate_to,
        )
        if not ids:
            # np.split of nothing is one empty piece, not none.
            return []
        adapter = None if index is None else [index] * len(ids)
        flat, _ = self.scheduler.run(ids, output="tokens", adapter=adapter)
        return np.split(flat, np.cumsum([len(x) for x in ids])[:-1])

    def embed_late_chunks(
        self,
        chunks: list[str],
        *,
        normalize: bool = True,
        prompt_name: Optional[str] = None,
        prompt: Optional[str] = None,
        task: Optional[str] = None,
    ) -> np.ndarray:
        """Late chunking (Jina's ``late_chunking``; Günther et al., "Late
        Chunking", 2024): ``chunks``, the pieces of one text in order, are
        joined by a space and run as one input; each chunk's vector is the
        mean of its own tokens' last hidden states (a token belongs to the
        last chunk it overlaps: the one holding its last character, or the one
        before a separator it ends in; specials, prompt and a lone separator
        to none), unit length unless ``normalize`` is False: float32 [len(chunks),
        dim], the server's ``late_chunking: true`` vectors bit for bit. A
        mean-pooling model only; the joined text must fit ``max_length``
        (InputTooLong otherwise: a chunk cut away would have no vector).
        ``task``: as :meth:`embed` takes it (the task's adapter runs for the
        whole text, and its prompt leads it unless a prompt is given; a
        ``prompt_name`` that names a task runs its adapter too)."""
        self._check_output("tokens")
        check_switches(normalize=normalize)
        if self.pooling != "mean":
            raise InvalidInput(
                f"late chunking pools each chunk's tokens by their mean; {self.name} pools by "
                f"{self.pooling}, so chunk means would not be its vectors"
            )
        if self._dense_layers:
            raise InvalidInput(
                f"late chunking needs a model whose vector is the mean of its token states; {self.name} "
                "has a Dense projection after its pooling, which no chunk mean runs through"
            )
        chunks = self._check_texts(chunks)
        if not chunks:
            raise InvalidInput("late chunking needs at least one chunk")
        joined, ranges = "", []
        for i, chunk in enumerate(chunks):
            if not chunk:
                raise InvalidInput(f"chunk {i} is an empty string")
            joined += LATE_CHUNK_SEPARATOR if i else ""
            ranges.append((len(joined), len(joined) + len(chunk)))
            joined += chunk
        index, prompt_name = self._task_and_prompt(task, prompt_name, prompt, None)
        prefix = self._prompt(prompt_name, prompt, None)
        default = prompt_name is None and prompt is None
        full = with_prompt(prefix, joined, self.prompts if default else None)
        skip = len(full) - len(joined)
        tok = self.tokenizer
        encoding = tok._tok.encode(full, add_special_tokens=False)
        ids, spans = list(tok.prefix), [None] * len(chunks)
        starts = [start for start, _ in ranges]
        for token_id, (start, stop) in zip(encoding.ids, encoding.offsets):
            if token_id in tok.drop_ids:
                continue
            if stop > start and stop > skip:
                # The last chunk the token overlaps (the server's chunk_spans).
                i = bisect.bisect_left(starts, stop - skip) - 1
                if i >= 0 and ranges[i][1] > start - skip:
                    spans[i] = (spans[i][0] if spans[i] else len(ids), len(ids) + 1)
            ids.append(token_id)
        ids += tok.suffix
        if len(ids) > self.max_length:
            err = InputTooLong("joined text", 0, len(ids), self.max_length)
            # truncate does not apply: a chunk cut away would have no vector.
            err.args = (
                f"the joined chunks have {len(ids)} tokens, more than max_length={self.max_length}: "
                "late chunking needs the whole text in one context; send fewer or shorter chunks",
            )
            raise err
        for i, span in enumerate(spans):
            if span is None:
                raise InvalidInput(
                    f"chunk {i} has no tokens of its own (only whitespace, or all its text in tokens that "
                    "end in the next chunk)"
                )
        adapter = None if index is None else [index]
        rows, _ = self.scheduler.run([ids], output="tokens", adapter=adapter)
        # A Matryoshka cut (truncate_dim) takes each mean's first dim values,
        # as the head cuts the pooled mean, before normalizing.
        cut = self._truncate_dim is not None and rows.shape[1] > self.dim
        if rows.shape[1] != self.dim and not cut:
            raise InvalidInput(
                f"late chunking needs a model whose vector is the mean of its token states; "
                f"{self.name}'s are {rows.shape[1]} wide and its vectors {self.dim}"
            )
        vecs = np.ascontiguousarray(pooling.span_means(rows, spans)[:, : self.dim])
        return pooling.unit_rows(vecs) if normalize else vecs

    def embed_multi_vector(
        self,
        texts: list[str],
        *,
        is_query: bool = False,
        normalize: bool = True,
        truncate: bool = True,
        truncation_direction: Optional[str] = None,
        prompt_name: Optional[str] = None,
        prompt: Optional[str] = None,
        pool_factor: int = 1,
        protected_tokens: int = 1,
    ) -> list[np.ndarray]:
        """A ColBERT model's vectors, as PyLate's ``encode(texts,
        is_query=...)`` gives them: per text a float32 [tokens, dim] array
        (a query's ``query_length`` rows with its expansion, a document's rows
        less its skiplist tokens), each row L2-normalized unless
        ``normalize`` is False. ``truncate=False``: a text over the mode's
        length (:meth:`encode_multi_vector`) raises InputTooLong.
        ``pool_factor`` > 1: a document's rows after its first
        ``protected_tokens`` are pooled to about 1/pool_factor of them
        (PyLate's hierarchical pooling, :func:`multi_vector.pool_rows`); a
        query's never are, as in PyLate."""
        output = multi_vector.QUERY if is_query else multi_vector.DOCUMENT
        self._check_output(output)
        for key, value, least in (("pool_factor", pool_factor, 1), ("protected_tokens", protected_tokens, 0)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
                raise InvalidInput(f"{key} must be a whole number, at least {least}, not {value!r}")
        ids = self.encode_multi_vector(
            texts, is_query=is_query, truncate=truncate, truncation_direction=truncation_direction,
            prompt_name=prompt_name, prompt=prompt,
        )
        if not ids:
            return []
        pooled = pool_factor > 1 and not is_query
        # Normalized rows are pooled by the engine, as the server asks for
        # them; PyLate pools unnormalized rows as they are.
        engine_pools = pooled and normalize
        token_pooling = {}
        if engine_pools:
            token_pooling = {"pool_factor": [int(pool_factor)] * len(ids),
                             "protected_tokens": [int(protected_tokens)] * len(ids)}
        res = self.embed_ids(ids, output=output, **token_pooling)
        flat = np.frombuffer(res.vectors, dtype="<f4").reshape(-1, self.dim)
        if normalize and not engine_pools:
            flat = pooling.unit_rows(flat)
        rows = np.split(flat.astype(np.float32), np.cumsum(res.rows)[:-1])
        if pooled and not normalize:
            rows = [multi_vector.pool_rows(r, int(pool_factor), int(protected_tokens)) for r in rows]
        return rows

    def encode_multi_vector(
        self,
        texts: list[str],
        *,
        is_query: bool = False,
        truncate: bool = True,
        truncation_direction: Optional[str] = None,
        prompt_name: Optional[str] = None,
        prompt: Optional[str] = None,
    ) -> list[list[int]]:
        """The ids a ColBERT model runs for each text as a query or a
        document (``multi_vector.apply_mode``): cut to the mode's length,
        the prefix token after the first, a query's expansion.
        ``truncate=False``: a text over the mode's length (``query_length``
        or ``document_length``: its tokens, the specials and the prefix
        token counted, the expansion not) raises InputTooLong instead."""
        if self.multi_vector is None:
            raise InvalidInput(f"{self.name} is not a multi-vector (ColBERT) model")
        texts = self._check_texts(texts)
        check_switches(truncate=truncate)
        direction = check_direction(self.truncation_side if truncation_direction is None else truncation_direction)
        mode = self.multi_vector.query if is_query else self.multi_vector.document
        prefix = self._prompt(prompt_name, prompt, None)
        default = prompt_name is None and prompt is None
        contents = self.tokenizer.encode_contents(
            [with_prompt(prefix, t, self.prompts if default else None) for t in texts] if prefix else texts,
        )
        out = [multi_vector.apply_mode(self.tokenizer.prefix, c, self.tokenizer.suffix, mode, direction)
               for c in contents]
        if not truncate:
            for i, (_, before) in enumerate(out):
                if before > mode.max_length:
                    raise InputTooLong("text", i, before, mode.max_length,
                                       "query_length" if is_query else "document_length")
        return [ids for ids, _ in out]

    def _check_output(self, output) -> None:
        if output not in OUTPUTS:
            raise InvalidInput(f"output must be one of {', '.join(OUTPUTS)}, got {output!r}")
        if output in multi_vector.OUTPUTS and self.multi_vector is None:
            raise InvalidInput(
                f"{self.name} is not a multi-vector model: output={output!r} needs a ColBERT "
                "folder (PyLate's layout)"
            )
        if output == "pooled" and self.multi_vector is not None:
            raise InvalidInput(
                f"{self.name} is a ColBERT model: it gives one vector per token "
                "(output='multi_vector_query' or 'multi_vector_document'), not a pooled vector"
            )
        if output == "tokens" and self.kind != "embedding":
            raise InvalidInput(
                f"{self.name} is a {self.kind}: per-token vectors come from embedding models"
            )
        if output == "sparse" and self.lexical is None:
            raise InvalidInput(
                f"{self.name} has no lexical weights: output='sparse' needs a BGE-M3 folder "
                f"(its {lexical.FILE})"
            )

    def memory(self) -> dict[str, int]:
        """MLX's active, cache and peak memory and the cache limit, in bytes
        (process-wide figures: cheap to poll, e.g. for /metrics)."""
        return device.memory()

    def live_details(self) -> dict[str, str]:
        """Display figures that change or cost time to get, for ``/info`` at
        request time (``spec().details`` is fixed at load): MLX memory, and
        the CPU BLAS's GFLOP/s, measured on the first call (~0.1 s) rather
        than on the start path."""
        out = {k.removesuffix("_bytes") + "_mb": f"{v / 2**20:.1f}" for k, v in self.memory().items()
               if v >= 0}
        if device.is_cpu():
            out["blas_gflops"] = f"{_blas.info(measure=True)['gflops']:.1f}"
        return out

    def _check_ids(self, ids) -> list:
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise InvalidInput(f"ids must be a list of token id lists, got {type(ids).__name__}")
        rows = list(ids)
        for i, row in enumerate(rows):
            if isinstance(row, (str, bytes)) or not isinstance(row, (Sequence, np.ndarray)):
                raise InvalidInput(f"input {i}: expected a list of token ids, got {type(row).__name__}")
            if len(row) == 0 and not self.empty_inputs:
                raise InvalidInput(f"input {i}: empty sequence (it needs at least one token)")
            if len(row) > self.max_length:
                raise InvalidInput(
                    f"input {i} has {len(row)} tokens, more than max_length={self.max_length}"
                )
        if not rows:
            return rows
        # One conversion for the whole call; a mixed or non-integer row turns
        # the dtype to object/float/str/bool, and only then do we look for it.
        try:
            flat = np.array(list(itertools.chain.from_iterable(rows)))
        except ValueError:
            flat = None  # ragged: a row holds lists of different lengths
        if flat is None or flat.ndim != 1:
            # A row of lists, not ids.
            raise InvalidInput("token ids must be a list of lists of int (one list per input)")
        if flat.size == 0:
            # Every row empty (a model that takes empty inputs): no id to check.
            return rows
        if flat.dtype.kind not in "iu":
            for i, row in enumerate(rows):
                for v in row:
                    if not isinstance(v, (int, np.integer)) or isinstance(v, (bool, np.bool_)):
                        raise InvalidInput(
                            f"input {i}: token ids must be int, got {type(v).__name__}"
                        )
            try:
                flat = flat.astype(np.int64)
            except OverflowError:
                raise InvalidInput(
                    f"a token id is out of range [0, {self.tokenizer.vocab_size})"
                ) from None
        lo, hi = int(flat.min()), int(flat.max())
        vocab = self.tokenizer.vocab_size
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            for i, row in enumerate(rows):
                if bad in np.asarray(row, dtype=np.int64):
                    raise InvalidInput(f"input {i}: token id {bad} out of range [0, {vocab})")
        return rows

    def _check_type_ids(self, type_ids, rows) -> list:
        if isinstance(type_ids, (str, bytes)) or not isinstance(type_ids, Sequence):
            raise InvalidInput("type_ids must be a list of lists like ids")
        types = list(type_ids)
        if len(types) != len(rows):
            raise InvalidInput(f"{len(types)} type id lists for {len(rows)} inputs")
        for i, (t, r) in enumerate(zip(types, rows)):
            if len(t) != len(r):
                raise InvalidInput(f"input {i}: {len(t)} type ids for {len(r)} tokens")
            a = np.asarray(t)
            if a.dtype.kind not in "iu" or (len(a) and (a.min() < 0 or a.max() >= self._type_vocab_size)):
                raise InvalidInput(
                    f"input {i}: type ids must be ints in [0, {self._type_vocab_size})"
                )
            if not self.scheduler.takes_type_ids and len(a) and a.any():
                raise InvalidInput(f"{self.model_type} models take no token type ids")
        return types

    def _check_pool_start(self, pool_start, rows) -> list[int]:
        if isinstance(pool_start, (str, bytes)) or not isinstance(pool_start, (Sequence, np.ndarray)):
            raise InvalidInput("pool_start must be a list of ints, one per input")
        starts = list(pool_start)
        if len(starts) != len(rows):
            raise InvalidInput(f"{len(starts)} pool starts for {len(rows)} inputs")
        if any(starts) and self.kind != "embedding":
            raise InvalidInput(f"{self.name} is a {self.kind}: pool_start is for embedding models")
        for i, (s, r) in enumerate(zip(starts, rows)):
            if not isinstance(s, (int, np.integer)) or isinstance(s, (bool, np.bool_)) or not 0 <= s <= len(r):
                raise InvalidInput(f"input {i}: pool_start must be an int in [0, {len(r)}], got {s!r}")
        return [int(s) for s in starts]

    def _check_token_pooling(self, pool_factor, protected_tokens, rows, output):
        """``embed_ids``' per-input pooling lists -> (factors, protected),
        or None when no input is pooled."""
        if pool_factor is None and protected_tokens is None:
            return None
        if pool_factor is None or protected_tokens is None:
            raise InvalidInput("pool_factor and protected_tokens go together, one entry per input each")
        if output != multi_vector.DOCUMENT:
            raise InvalidInput(f"pool_factor is for output={multi_vector.DOCUMENT!r} (PyLate pools documents only)")
        lists = []
        for key, values, least in (("pool_factor", pool_factor, 1), ("protected_tokens", protected_tokens, 0)):
            if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
                raise InvalidInput(f"{key} must be a list of ints, one per input")
            values = list(values)
            if len(values) != len(rows):
                raise InvalidInput(f"{len(values)} {key} entries for {len(rows)} inputs")
            for i, v in enumerate(values):
                if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < least:
                    raise InvalidInput(f"input {i}: {key} must be a whole number, at least {least}, not {v!r}")
            lists.append([int(v) for v in values])
        return tuple(lists) if any(f > 1 for f in lists[0]) else None

    def _check_adapter(self, adapter, rows) -> Optional[list[int]]:
        """Per-input adapter indices, checked; None where no input has one."""
        if isinstance(adapter, (str, bytes)) or not isinstance(adapter, (Sequence, np.ndarray)):
            raise InvalidInput("adapter must be a list of ints, one per input")
        out = list(adapter)
        if len(out) != len(rows):
            raise InvalidInput(f"{len(out)} adapters for {len(rows)} inputs")
        for i, a in enumerate(out):
            if not isinstance(a, (int, np.integer)) or isinstance(a, (bool, np.bool_)) or not -1 <= a < len(self.tasks):
                if not self.tasks:
                    raise InvalidInput(f"{self.name} has no task adapters (adapter must be -1, got {a!r})")
                raise InvalidInput(f"input {i}: adapter must be an int in [-1, {len(self.tasks)}), got {a!r}")
        out = [int(a) for a in out]
        return out if any(a >= 0 for a in out) else None

    def _task_and_prompt(self, task, prompt_name, prompt, instruction) -> tuple[Optional[int], Optional[str]]:
        """The adapter index a pooled or per-token call runs and the prompt
        name it reads: the server's rule (``task_adapter`` in the core,
        ``pick_task`` in the server). ``task`` runs its adapter and, unless a
        prompt is given, the folder's prompt of its name; a ``prompt_name``
        that is a task's name runs that task's adapter too (jina-embeddings-v3
        names its prompts after its tasks, and its documented call passes
        both, ``encode(task=t, prompt_name=t)``: the prompt without its
        adapter is no vector its own code is shown making); a ``prompt_name``
        naming another task than ``task`` is refused."""
        index = self.task_index(task)
        named = prompt_name if isinstance(prompt_name, str) and prompt_name in self.tasks else None
        if index is None:
            return (None if named is None else self.tasks.index(named)), prompt_name
        if named is not None and named != task:
            raise InvalidInput(
                f"prompt_name {prompt_name!r} picks task {named!r} on this model, but task is {task!r}: "
                "give one of them (or both the same)"
            )
        if prompt_name is None and prompt is None and instruction is None:
            # The task's prompt, as the folder names it after the task.
            prompt_name = task if task in self.prompts else None
        return index, prompt_name

    def task_index(self, task: Optional[str]) -> Optional[int]:
        """The adapter index of a task name (None: no task); an unknown
        task, or any task for a model without adapters, is refused with
        the valid ones."""
        if task is None:
            return None
        if not isinstance(task, str):
            raise InvalidInput(f"task must be a string, got {type(task).__name__}")
        if not self.tasks:
            raise InvalidInput(
                f"task={task!r}: {self.name} has no task adapters (task selects a LoRA adapter of a "
                "model that has them, such as jina-embeddings-v3)"
            )
        if task not in self.tasks:
            raise InvalidInput(f"unknown task {task!r}; valid tasks: {', '.join(self.tasks)}")
        return self.tasks.index(task)

    # --------------------------------------------------- the Python library

    def _check_texts(self, texts) -> list:
        if isinstance(texts, np.ndarray) and texts.ndim == 1:
            # sentence-transformers takes an array of strings; its items are
            # np.str_, a str (an array of objects is checked item by item).
            texts = texts.tolist()
        if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence):
            raise TypeError(
                f"texts must be a list of str, got {type(texts).__name__}"
                + (" (one text: [text])" if isinstance(texts, str) else "")
            )
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise TypeError(f"texts[{i}] must be str, got {type(t).__name__}")
        return list(texts)

    def _prompt(self, prompt_name, prompt, instruction) -> str:
        if instruction is not None:
            if prompt is not None or prompt_name is not None:
                raise InvalidInput("give one of instruction, prompt or prompt_name")
            prompt = self._format_instruction(instruction)
        return resolve_prompt(
            prompt_name=prompt_name,
            prompt=prompt,
            prompts=self.prompts,
            default_prompt_name=self.default_prompt_name,
        )

    def encode(
        self,
        texts: list[str],
        *,
        truncate: bool = True,
        truncation_direction: Optional[str] = None,
        prompt_name: Optional[str] = None,
        prompt: Optional[str] = None,
        instruction: Optional[str] = None,
        truncate_to: Optional[int] = None,
    ) -> tuple[list[list[int]], list[int]]:
        """Token ids each text runs as (prompt, specials and truncation
        applied: what ``embed_ids`` takes), and each count before truncation.
        ``truncate_to``: cut (or with ``truncate=False`` refuse) at this many
        tokens, special tokens included, instead of the model's maximum."""
        ids, before, _ = self._encode(
            texts, truncate=truncate, truncation_direction=truncation_direction, prompt_name=prompt_name,
            prompt=prompt, instruction=instruction, truncate_to=truncate_to,
        )
        return ids, before

    def _encode(
        self,
        texts: list[str],
        *,
        truncate: bool,
        truncation_direction: Optional[str],
        prompt_name: Optional[str],
        prompt: Optional[str],
        instruction: Optional[str],
        truncate_to: Optional[int],
    ) -> tuple[list[list[int]], list[int], Optional[list[int]]]:
        """:meth:`encode`, and each text's ``pool_start`` for a model that
        pools without its prompt (None for one that pools with it)."""
        texts = self._check_texts(texts)
        check_switches(truncate=truncate)
        if truncation_direction is None:
            truncation_direction = self.truncation_side
        check_direction(truncation_direction)
        limit = self.max_length
        if truncate_to is not None:
            try:
                # operator.index: any integer type (NumPy's too), never a float or a str.
                cut = None if isinstance(truncate_to, bool) else operator.index(truncate_to)
            except TypeError:
                cut = None
            if cut is None or cut < 1:
                raise InvalidInput(f"truncate_to must be a whole number of tokens, at least 1, not {truncate_to!r}")
            limit = min(limit, cut)
            self.tokenizer.content_room(limit)
        prefix = self._prompt(prompt_name, prompt, instruction)
        default = prompt_name is None and prompt is None and instruction is None
        try:
            contents = self.tokenizer.encode_contents(
                [with_prompt(prefix, t, self.prompts if default else None) for t in texts] if prefix else texts,
                truncate=truncate, direction=truncation_direction,
            )
        except TypeError:
            _refuse_lone_surrogates(texts)
            raise
        out = [self.tokenizer.finish(c, truncation_direction, limit) for c in contents]
        ids, before = [o[0] for o in out], [o[1] for o in out]
        if not truncate:
            limit_name = "max_length" if limit == self.max_length else "truncate_to"
            for i, b in enumerate(before):
                if b > limit:
                    raise InputTooLong("text", i, b, limit, limit_name)
        starts = None
        if not self.include_prompt and prefix:
            defaults = self.prompts if default else None
            starts = self.tokenizer.pool_starts([prompt_in_effect(prefix, t, defaults) for t in texts], ids)
        return ids, before, starts

    def embed_with_counts(
        self,
        texts: list[str],
        *,
        normalize: bool = True,
        truncate: bool = True,
        truncation_direction: Optional[str] = None,
        prompt_name: Optional[str] = None,
        prompt: Optional[str] = None,
        instruction: Optional[str] = None,
        truncate_to: Optional[int] = None,
        task: Optional[str] = None,
    ) -> tuple[np.ndarray, list[int]]:
        """Like :meth:`embed`, also returning the tokens run per text
        (special tokens included, after truncation)."""
        self._check_output("pooled")
        if self.kind != "embedding":
            raise InvalidInput(
                f"{self.name} is a {self.kind}: use predict(), score() or rerank(), not embed()"
            )
        check_switches(normalize=normalize)
        index, prompt_name = self._task_and_prompt(task, prompt_name, prompt, instruction)
        ids, _, starts = self._encode(
            texts, truncate=truncate, truncation_direction=truncation_direction,
            prompt_name=prompt_name, prompt=prompt, instruction=instruction, truncate_to=truncate_to,
        )
        adapter = None if index is None else [index] * len(ids)
        vecs, _ = self.scheduler.run(ids, pool_start=starts, adapter=adapter)
        return (pooling.unit_rows(vecs) if normalize else vecs), [len(x) for x in ids]

    def embed(
        self,
        texts: list[str],
        *,
        normalize: bool = True,
        truncate: bool = True,
        truncation_direction: Optional[str] = None,
        prompt_name: Optional[str] = None,
        prompt: Optional[str] = None,
        instruction: Optional[str] = None,
        truncate_to: Optional[int] = None,
        task: Optional[str] = None,
    ) -> np.ndarray:
        """Embed ``texts``; float32 [len(texts), dim], rows in input order.

        Keyword arguments: ``normalize`` (True; False: the vectors before
        normalization, as TEI answers ``normalize: false``, where
        sentence-transformers' ``normalize_embeddings=False`` still runs a
        folder's ``Normalize`` module), ``truncate`` (True),
        ``truncation_direction`` ("right" or "left"; None: the folder's
        ``truncation_side``, else right), ``truncate_to`` (cut at
        this many tokens, special tokens included, instead of the model's
        maximum), ``prompt_name`` (one of the folder's sentence-transformers
        prompts; one named after a task, as jina-embeddings-v3's are, runs
        that task's adapter too, as the server's ``prompt_name`` does),
        ``prompt`` (a raw prefix), ``instruction`` (formatted by the
        model's template), ``task`` (one of ``tasks``, a model with task
        adapters: jina-embeddings-v3's ``retrieval.query`` ...; it runs the
        task's LoRA adapter and, unless a prompt is given, the folder's
        prompt of that name; a ``prompt_name`` naming another task is
        refused; None: the base weights, as the model's remote code runs
        without a task). Spelled out rather than passed on, so a wrong
        keyword's error names this method."""
        return self.embed_with_counts(
            texts, normalize=normalize, truncate=truncate, truncation_direction=truncation_direction,
            prompt_name=prompt_name, prompt=prompt, instruction=instruction, truncate_to=truncate_to,
            task=task,
        )[0]

    @property
    def has_sparse_output(self) -> bool:
        """Whether :meth:`embed_sparse` serves this model: a SPLADE model, or
        a BGE-M3 folder's lexical weights."""
        return self.sparse or self.lexical is not None

    def embed_sparse(self, texts: list[str], **kwargs) -> list[tuple[np.ndarray, np.ndarray]]:
        """A SPLADE model's vectors, or a BGE-M3 model's lexical weights, as
        ``(indices, values)`` per text: the non-zero vocabulary entries in
        increasing index order (int32, float32), unnormalized (TEI's
        ``/embed_sparse``). Keyword arguments as :meth:`embed` takes them,
        except ``normalize``."""
        return self.embed_sparse_with_counts(texts, **kwargs)[0]

    def embed_sparse_with_counts(
        self, texts: list[str], **kwargs
    ) -> tuple[list[tuple[np.ndarray, np.ndarray]], list[int]]:
        """Like :meth:`embed_sparse`, also returning the tokens run per text
        (as :meth:`embed_with_counts` does)."""
        if not self.has_sparse_output:
            raise InvalidInput(
                f"{self.name} has no sparse output: sparse vectors need pooling='splade' "
                f"on a masked-LM checkpoint, a SparseEncoder folder, or a BGE-M3 folder (its {lexical.FILE})"
            )
        if "normalize" in kwargs:
            raise InvalidInput("embed_sparse returns the raw sparse weights: no normalize")
        if self.lexical is not None:
            ids, _ = self.encode(texts, **kwargs)
            res = self.submit_ids(ids, output="sparse").result()
            pairs = np.frombuffer(res.vectors, dtype="<f4").reshape(-1, 2)
            bounds = np.cumsum([0, *res.rows])
            entries = [
                (pairs[a:b, 0].astype(np.int32), pairs[a:b, 1].copy())
                for a, b in zip(bounds[:-1], bounds[1:])
            ]
            return entries, [len(x) for x in ids]
        dense, counts = self.embed_with_counts(texts, normalize=False, **kwargs)
        out = []
        for row in dense:
            (nz,) = np.nonzero(row)
            out.append((nz.astype(np.int32), row[nz]))
        return out, counts

    def count_tokens(self, texts: list[str], **kwargs) -> list[int]:
        """Tokens each text would run as (after truncation, specials included);
        with ``truncate=False`` an over-long text raises ``InputTooLong``, as
        :meth:`embed` would (its count before truncation is the error's
        ``tokens``, and :meth:`encode`'s second list)."""
        return [len(x) for x in self.encode(texts, **kwargs)[0]]

    # ------------------------------------------------------------- reports

    def _details(self) -> dict[str, str]:
        b = _blas.info(measure=False)
        out = {
            "model_type": self.model_type,
            "kind": self.kind,
            "dtype": self.dtype,
            "pooling": self.pooling,
            "device": self.device,
            "elementwise_ops": self.context.describe(),
            "workers": str(self.workers),
            "device_batch_tokens": str(self.batch_tokens),
            "pipeline": str(self.scheduler.pipeline).lower(),
            "attention": "fused" if self.context.fused_attention else "matmul",
            "shape_buckets": str(self.scheduler.shape_buckets).lower(),
            "cache_limit_mb": str(self.cache_limit_mb),
            # TF32 is off unless MLX_ENABLE_TF32 says otherwise (precision.py).
            "float32_matmul": precision.float32_matmul(device.is_cpu()),
            "blas": b["library"],
            # Where this process's start went, up to the model being built.
            "startup": startup.describe(),
        }
        # Where a name (a repo id) led: the folder, and the snapshot's commit.
        out["folder"] = os.fspath(self.path)
        if self.revision:
            out["revision"] = self.revision
        if self.quantization:
            out["quantization"] = f"{self.quantization}-bit"
        elif self.checkpoint_quantization:
            out["quantization"] = (
                f"{self.checkpoint_quantization}-bit checkpoint dequantized to {self.dtype} "
                f"at load ({self.dequantized_because})"
            )
        if not self.include_prompt:
            out["include_prompt"] = "false"
        if self.lexical is not None:
            out["lexical_weights"] = "true"
        if self.scheduler.streams > 1:
            out["streams"] = str(self.scheduler.streams)
        graphs = device.cuda_graphs()
        if graphs is not None:
            out["cuda_graphs"] = graphs
        if self.joined_groups:
            out["joined_linears"] = str(self.joined_groups)
        if self.context.packed_rows:
            out["packed_rows"] = "true"
        if self.scheduler.eval_chunk_mb:
            out["eval_chunk_mb"] = str(self.scheduler.eval_chunk_mb)
        return out

    def info(self) -> dict:
        """What the model is and how it runs, for logs and bug reports: name,
        dim, max_length, dtype, pooling, kind and labels, quantization, the
        device, the BLAS MLX uses (with its measured matmul GFLOP/s), the
        engine's settings, MLX memory and start-up timings."""
        b = _blas.info(measure=True)
        return {
            "name": self.name,
            "folder": os.fspath(self.path),
            "revision": self.revision,
            "dim": self.dim,
            "max_length": self.max_length,
            "dtype": self.dtype,
            "pooling": self.pooling,
            "model_type": self.model_type,
            "kind": self.kind,
            "labels": list(self.labels),
            "sparse": self.sparse,
            "lexical_weights": self.lexical is not None,
            "parameters": self.parameter_count,
            "weights_bytes": self.weights_bytes,
            "device": self.device,
            "blas": b["library"],
            "blas_gflops": b["gflops"],
            "device_batch_tokens": self.batch_tokens,
            # Which element-wise path runs (see ops.py); "native" names the
            # SIMD level the kernels picked on this CPU.
            "elementwise_ops": self.context.describe(),
            "workers": self.workers,
            "pipeline": self.scheduler.pipeline,
            "quantization": self.quantization,
            "checkpoint_quantization": self.checkpoint_quantization,
            "dequantized": self.dequantized_because,
            # Groups of sibling projections run as one matmul each.
            "joined_linears": self.joined_groups,
            # An encoder's layers, a decoder's feed-forward, on the real tokens alone (ops.PackedRows).
            "packed_rows": self.context.packed_rows,
            "cache_limit_mb": self.cache_limit_mb,
            # Layer outputs (MB) between a pass's evaluation points; 0: none (ops.EvaluationPoints).
            "eval_chunk_mb": self.scheduler.eval_chunk_mb,
            "float32_matmul": precision.float32_matmul(device.is_cpu()),
            # On CUDA: "on" (MLX's default) or "off" (MLX_USE_CUDA_GRAPHS=0); None elsewhere.
            "cuda_graphs": device.cuda_graphs(),
            "memory": self.memory(),
            "startup": startup.describe(),
            # The server checks token-id input against it before queueing.
            "vocab_size": self.tokenizer.vocab_size,
        }

    def __repr__(self) -> str:
        q = f", quantization={self.quantization}" if self.quantization else ""
        return (
            f"EmbeddingModel(name={self.name!r}, model_type={self.model_type!r}, "
            f"dim={self.dim}, max_length={self.max_length}, pooling={self.pooling!r}{q})"
        )


class PendingResult:
    """A call queued by :meth:`EmbeddingModel.submit_ids`; for lexical
    weights, with the call's ids and the ids never weighed."""

    def __init__(self, pending, *, lexical_ids=None, skipped: frozenset = frozenset(), multi_vector=None):
        self._pending = pending
        self._lexical_ids = lexical_ids
        # (MultiVector, ids, output, pooling, the model's ForwardContext) of
        # a ColBERT call: its rows kept, projected (in the model's context:
        # the native path's Dense layers run in the native kernel, so a
        # text's rows do not follow its call's) and (documents asked to be)
        # pooled here.
        self._multi_vector = multi_vector
        self._skipped = skipped

    def result(self) -> EmbedResult:
        vecs, padded = self._pending.result()
        if self._lexical_ids is not None:
            return self._lexical_result(vecs, padded)
        if self._multi_vector is not None:
            mv, ids, output, pooling, context = self._multi_vector
            with ops.forward_context(context):
                flat, rows = mv.finish(vecs, ids, output, pooling)
            return EmbedResult(vectors=flat.astype("<f4", copy=False).tobytes(), padded_tokens=padded, rows=rows)
        return EmbedResult(
            vectors=vecs.astype("<f4", copy=False).tobytes(),
            padded_tokens=padded,
            rows=self._pending.rows,
        )

    def _lexical_result(self, weights: np.ndarray, padded: int) -> EmbedResult:
        """Each input's token weights ([sum of lengths, 1]) as its sparse
        entries: (id, weight) float32 pairs, ids exact (below 2^24)."""
        parts, rows, at = [], [], 0
        for ids in self._lexical_ids:
            idx, w = lexical.entries(weights[at : at + len(ids), 0], ids, self._skipped)
            at += len(ids)
            parts.append(np.stack([idx.astype(np.float32), w], axis=1))
            rows.append(len(idx))
        flat = np.concatenate(parts) if parts else np.empty((0, 2), dtype=np.float32)
        return EmbedResult(vectors=flat.astype("<f4", copy=False).tobytes(), padded_tokens=padded, rows=rows)


def _refuse_lone_surrogates(texts: list[str]) -> None:
    """The tokenizer refuses a str that is not UTF-8 without saying which:
    name the text (looked for only once the tokenizer has failed)."""
    for i, t in enumerate(texts):
        try:
            t.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidInput(
                f"texts[{i}] is not text: a lone surrogate at position {e.start} (one half of a UTF-16 pair)"
            ) from None


# What embed_ids returns per input: a pooled vector, every token's hidden
# state, or lexical weights (a BGE-M3 model's sparse head).
OUTPUTS = ("pooled", "tokens", "sparse", *multi_vector.OUTPUTS)

# Whole-number settings and their least value (0 turns the feature off).
_WHOLE_NUMBERS = {
    **dict.fromkeys(("quantize", "group_size", "max_length", "batch_tokens", "workers", "streams"), 1),
    **dict.fromkeys(("eval_chunk_mb", "cache_limit_mb"), 0),
}
# The most of a whole-number setting a load takes (the server's flags say the
# same before Python starts). Workers: workers.py owns their bound, which
# the server's --workers and MLX_EMBED_WORKERS ask too. MLX takes the cache
# limit in bytes as a size_t, which a bigger value overflowed
# (set_cache_limit's TypeError).
MAX_CACHE_LIMIT_MB = 1 << 24


def _too_many(key: str, value: int) -> Optional[str]:
    """Why a whole-number setting is past its most, where it has one."""
    if key == "workers":
        return workers_module.refusal(key, int(value))
    if key == "cache_limit_mb" and value > MAX_CACHE_LIMIT_MB:
        return f"{key} must be at most {MAX_CACHE_LIMIT_MB} (16 TiB), got {value!r}"
    return None


# Text settings.
_TEXTS = ("name", "fast_ops", "kind", "instruction", "truncation_side")
_SWITCHES = ("pipeline", "fused_attention", "shape_buckets", "dequantize", "joined_linears", "packed_rows")


def _check_settings(**settings) -> None:
    """Refuse a load() setting of the wrong type or below 1, naming it:
    ``pipeline="no"`` would have switched pipelining on, ``workers=0`` quietly
    become 1, ``max_length=2.5`` become 2 and ``quantize=4.0`` failed inside
    MLX. None keeps a setting's default. The refusals are
    :class:`~mlx_embed.errors.InvalidOption` (its ``InvalidOptionType``
    where the type is wrong), the bridge's ``InvalidOption`` kind."""
    for key, value in settings.items():
        if value is None:
            continue
        if key in _WHOLE_NUMBERS:
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise InvalidOptionType(f"{key} must be a whole number, got {value!r}")
            if value < _WHOLE_NUMBERS[key]:
                least = "at least 1" if _WHOLE_NUMBERS[key] else "0 or more"
                raise InvalidOption(f"{key} must be {least}, got {value!r}")
            why = _too_many(key, value)
            if why is not None:
                raise InvalidOption(why)
        elif key in _SWITCHES:
            if not isinstance(value, (bool, np.bool_)):
                raise InvalidOptionType(f"{key} must be True, False or None, got {value!r}")
        elif key in _TEXTS and not isinstance(value, str):
            raise InvalidOptionType(f"{key} must be a string, got {value!r}")
        elif key == "truncation_side" and value not in TRUNCATION_DIRECTIONS:
            raise InvalidOption(f"truncation_side must be 'right' or 'left', got {value!r}")
        elif key == "name" and (not value.strip() or value.strip() != value):
            # What --served-model-name refuses: "" once fell back to the
            # folder's name, and " x " was a name no client would send.
            raise InvalidOption(
                f"name {value!r} cannot be a model's name: it must be non-empty, "
                "with no whitespace at either end"
            )
        elif key == "pooling" and not (
            isinstance(value, str)
            or (isinstance(value, (list, tuple)) and all(isinstance(m, str) for m in value))
        ):
            # A list of modes is concatenated, as sentence-transformers' Pooling does.
            raise InvalidOptionType(f"pooling must be a string or a list of strings, got {value!r}")


def load(
    path: Optional[Union[str, os.PathLike]] = None,
    *,
    dtype: str = "float32",
    quantize: Optional[int] = None,
    instruction: Optional[str] = None,
    revision: Optional[str] = None,
    cache_dir: Optional[Union[str, os.PathLike]] = None,
    **kwargs,
) -> EmbeddingModel:
    """See :func:`mlx_embed.load`."""
    _blas.warn_if_slow()
    # The default model's name (what `--model`'s help and /v1/models show)
    # names the bundled model too, unless a folder of that name is here.
    is_default = path is None or loading.is_default_name(os.fspath(path))
    if is_default and path is not None:
        kwargs.setdefault("name", loading.served_name(path))
    what = "the default model" if is_default else os.fspath(path)
    try:
        if is_default:
            path = default_model_path()
        else:
            path = hub.resolve_model(os.fspath(path), revision, None if cache_dir is None else os.fspath(cache_dir))
        return EmbeddingModel(
            os.fspath(path),
            dtype=dtype,
            quantize=quantize,
            instruction=instruction,
            _is_default=is_default,
            **kwargs,
        )
    except ImportError as e:
        # The engine imported (this module runs), so a package missing now
        # is one this model needs (mlx_lm for a decoder's layers), unless
        # it is the engine's own: see errors.as_missing_dependency.
        typed = as_missing_dependency(e, what)
        if typed is e:
            raise
        raise typed from e
