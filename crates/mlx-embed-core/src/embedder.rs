//! The model as the batcher sees it: what callers send ([`EmbedInput`],
//! [`EmbedOptions`]), how an input becomes token ids ([`Tokenize`]), and the
//! model itself ([`Embedder`]), with its typed facts ([`ModelInfo`]) and
//! typed failures ([`EmbedderError`]).

use std::any::Any;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use crate::Priority;

/// Which end of an over-long input survives truncation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum TruncationDirection {
    /// Keep the first tokens (cut the end).
    #[default]
    Right,
    /// Keep the last tokens (cut the start).
    Left,
}

impl TruncationDirection {
    /// Its name as transformers' `truncation_side` and the Python engine
    /// write it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Right => "right",
            Self::Left => "left",
        }
    }

    /// The direction [`Self::name`] gives `name`; `None` for any other text.
    pub fn from_name(name: &str) -> Option<Self> {
        [Self::Right, Self::Left]
            .into_iter()
            .find(|d| d.name() == name)
    }
}

/// Text prepended to every text input before tokenization.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub enum Prompt {
    /// The model's default prompt ([`ModelInfo::default_prompt_name`]), if it has one.
    #[default]
    Default,
    /// One of the model's named prompts ([`ModelInfo::prompts`]); an unknown
    /// name is invalid input.
    Named(String),
    /// This exact text (may be empty: no prompt at all).
    Raw(String),
}

/// What the model returns per input.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Output {
    /// One pooled vector (the model's pooling and any Dense layers), not normalized.
    #[default]
    Pooled,
    /// The last hidden state of every token the model ran, special tokens
    /// included: one row per token, no pooling, no normalization (TEI's
    /// `/embed_all`). Never cached: the cache holds pooled vectors.
    Tokens,
    /// The model's lexical weights ([`ModelInfo::lexical_weights`]: BGE-M3's
    /// sparse head): per input, one `[token id, weight]` row for each distinct
    /// token id it weighs above 0, ids increasing, the id a float (exact: a
    /// vocabulary is under 2^24 tokens). [`lexical_entries`] reads them.
    /// Never cached.
    Sparse,
    /// A multi-vector (ColBERT) model's vectors ([`ModelInfo::multi_vector`]):
    /// per input one `dim`-wide row for each token it keeps, not normalized,
    /// its text tokenized in the given [`Side`]'s mode (the model's
    /// tokenizer: a query is cut to its length and padded with expansion
    /// tokens, a document cut to its own); with
    /// [`EmbedOptions::token_pooling`], a document's pooled rows instead
    /// ([`TokenPooling`]). Never cached.
    MultiVector(Side),
}

/// PyLate's hierarchical pooling of a multi-vector document's rows
/// (`ColBERT.encode(pool_factor=, protected_tokens=)`): the rows are
/// L2-normalized, the first `protected` kept as they are, the others
/// clustered (Ward on `1 - cosine`) into at most `len / factor` clusters,
/// each answered as its members' mean. The means are not scaled back to
/// unit length (PyLate leaves them so), and the engine pools: the rows it
/// answers for such an input are the pooled ones, normalized as above.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TokenPooling {
    /// About one row in `factor` is left (2 or more: 1 pools nothing).
    pub factor: u32,
    /// Leading rows never pooled (PyLate's default 1: `[CLS]`).
    pub protected: u32,
}

/// Whether a multi-vector model's input is a query or a document: each has
/// its own tokenization and keeps its own rows (PyLate's `is_query`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Side {
    /// A search query: cut to the model's query length and expanded.
    Query,
    /// A document to index: cut to the model's document length.
    #[default]
    Document,
}

impl Output {
    /// As the Python engine's `embed_ids(output=)` takes it: "pooled",
    /// "tokens", "sparse", "multi_vector_query" or "multi_vector_document".
    pub fn as_str(self) -> &'static str {
        match self {
            Output::Pooled => "pooled",
            Output::Tokens => "tokens",
            Output::Sparse => "sparse",
            Output::MultiVector(Side::Query) => "multi_vector_query",
            Output::MultiVector(Side::Document) => "multi_vector_document",
        }
    }

    /// Whether an input's answer is one row per token (or fewer) rather than
    /// one vector: [`Output::Tokens`] and [`Output::MultiVector`].
    pub fn per_token(self) -> bool {
        matches!(self, Output::Tokens | Output::MultiVector(_))
    }
}

/// Per-request choices that change how inputs are tokenized, queued and computed.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct EmbedOptions {
    /// The lane the request waits in ([`Priority::Normal`] by default).
    pub priority: Priority,
    /// `false`: an input over [`ModelInfo::max_input_tokens`] is refused
    /// ([`crate::CoreError::InputTooLong`]) before any compute, instead of cut.
    pub truncate: bool,
    /// Which end of an over-long input is kept. `None`: the model's own
    /// ([`ModelInfo::truncation_side`]: a folder's `truncation_side`, else
    /// right), which is what sentence-transformers cuts by.
    pub truncation_direction: Option<TruncationDirection>,
    /// Cut (or with `truncate: false` refuse) every input at this many
    /// tokens, special tokens included, instead of at the model's maximum
    /// (Cohere's `max_tokens`, vLLM's `truncate_prompt_tokens`, Ollama's
    /// `num_ctx`); a value over the model's maximum is the maximum. `None`:
    /// the model's maximum. It must leave room for the model's special
    /// tokens and one more (invalid input otherwise).
    pub truncate_to: Option<usize>,
    /// What goes before each text input ([`Prompt::Default`]: the model's
    /// default prompt, if it has one); token-id inputs take none.
    pub prompt: Prompt,
    /// Pooled vectors or per-token rows; a model call computes one kind only.
    pub output: Output,
    /// With [`Output::Tokens`], a request whose inputs have more tokens than
    /// this in all, after truncation, is refused before any compute
    /// ([`crate::CoreError::TooManyTokenRows`]): a server bounds its answers
    /// so. `None`: no bound.
    pub max_token_rows: Option<usize>,
    /// Token-id inputs must begin and end with the model's own special
    /// tokens, as its tokenizer wraps a text (invalid input otherwise). An
    /// API whose clients tokenize with another tokenizer unasked (OpenAI's:
    /// LangChain sends tiktoken's ids) asks for it: such ids run as given
    /// would get a wrong vector with a 200.
    pub wrapped_token_ids: bool,
    /// With [`Output::MultiVector`]`(`[`Side::Document`]`)` only (invalid
    /// input otherwise, as PyLate pools documents only): each input's rows
    /// pooled ([`TokenPooling`]). Requests with and without it share
    /// batches; each input carries its own ([`Encoded::token_pooling`]).
    pub token_pooling: Option<TokenPooling>,
    /// The task adapter to run with, by name (one of [`ModelInfo::tasks`]):
    /// it also selects the model's prompt of that name when `prompt` is
    /// [`Prompt::Default`]. `None`: none, unless a [`Prompt::Named`] names a
    /// task. A task on a model without adapters is invalid input.
    pub task: Option<String>,
}

impl Default for EmbedOptions {
    fn default() -> Self {
        Self {
            priority: Priority::Normal,
            truncate: true,
            truncation_direction: None,
            truncate_to: None,
            prompt: Prompt::Default,
            output: Output::Pooled,
            max_token_rows: None,
            wrapped_token_ids: false,
            token_pooling: None,
            task: None,
        }
    }
}

impl EmbedOptions {
    /// Most tokens an input runs with, special tokens included, for a model
    /// whose own maximum is `model_max` (0: none): the smaller of it and
    /// [`EmbedOptions::truncate_to`].
    pub fn input_limit(&self, model_max: usize) -> usize {
        match (self.truncate_to, model_max) {
            (Some(n), 0) => n,
            (Some(n), max) => n.min(max),
            (None, max) => max,
        }
    }
}

/// Most text one request's query/document pairs may hold, each pair's query
/// counted again: a reranker request repeats its query in every pair, so a
/// 2 MB query beside 2,048 short documents made 4 GB of pairs (and a
/// template reranker reads the query again in each). 8 times the server's
/// default 2 MiB body: any request whose query is at most an eighth of its
/// body passes.
pub const MAX_PAIR_TEXT_BYTES: usize = 16 << 20;

/// One input to embed.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum EmbedInput {
    /// A text, tokenized by the model's tokenizer (prompt and special
    /// tokens added, cut to the model's maximum). May be empty.
    Text(String),
    /// Token ids of the model's own tokenizer, run as given (the OpenAI and
    /// TEI APIs take pre-tokenized input, and vLLM and TEI add nothing to
    /// it): special tokens are the caller's, as `/tokenize` lists them; only
    /// the cut to the model's maximum applies (inside the model's specials
    /// when the ids begin and end with them, as for text).
    Tokens(Vec<u32>),
    /// A query/document pair for cross-encoders (rerankers).
    Pair {
        /// The query, the first text of the pair.
        query: String,
        /// The document scored against it, the second text.
        document: String,
    },
}

/// An input as the model runs it: exact token ids, special tokens included,
/// already truncated.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Encoded {
    /// The token ids the model runs.
    pub ids: Vec<u32>,
    /// Segment ids, for models that take them (pairs); `None`: all zero.
    pub type_ids: Option<Vec<u32>>,
    /// Tokens before truncation, special tokens included.
    pub untruncated_len: u32,
    /// Leading tokens the pooling leaves out (they still run through the
    /// model): the prompt of a model that pools without it
    /// (sentence-transformers' `include_prompt: false`, INSTRUCTOR); 0 for
    /// every other input.
    pub pool_start: u32,
    /// A multi-vector document's pooling ([`EmbedOptions::token_pooling`]),
    /// set by the batcher from its request's options: the engine pools the
    /// input's rows before it answers them. `None` for every other input.
    pub token_pooling: Option<TokenPooling>,
    /// The task adapter the input runs with, an index into
    /// [`ModelInfo::tasks`] (jina-embeddings-v3's LoRA); `None`: the model's
    /// base weights. Inputs of different tasks share a batch.
    pub adapter: Option<u32>,
}

impl Encoded {
    /// Tokens the model runs for this input.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// True for an input of no tokens at all (no model produces one).
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

/// Turns inputs into the model's token ids. Runs on tokio's blocking pool,
/// concurrently with the model, so it must be cheap to share.
pub trait Tokenize: Send + Sync {
    /// Encodes one input under `options` (prompt, truncation side: `None` is
    /// the model's own side, which the implementation knows), truncated
    /// to [`EmbedOptions::input_limit`] of the model's maximum (its maximum,
    /// or the request's shorter `truncate_to`). Errors are [`EmbedderErrorKind::InvalidInput`]
    /// and describe the input (the core names its index). It always cuts:
    /// [`EmbedOptions::truncate`] `false` is the caller's to apply, from
    /// [`Encoded::untruncated_len`] ([`crate::Batcher::embed`] refuses such an
    /// input with [`crate::CoreError::InputTooLong`]).
    fn encode(&self, input: &EmbedInput, options: &EmbedOptions) -> Result<Encoded, EmbedderError>;

    /// Encodes one request's inputs, each as [`Tokenize::encode`] would, in
    /// order; stops at the first that fails, with its index. A tokenizer
    /// overrides it to share work between the inputs (a reranker's query,
    /// the same in every pair, tokenized once) or to bound what a request may
    /// make it read. Default: `encode` each.
    fn encode_request(
        &self,
        inputs: &[EmbedInput],
        options: &EmbedOptions,
    ) -> Result<Vec<Encoded>, (usize, EmbedderError)> {
        inputs
            .iter()
            .enumerate()
            .map(|(i, input)| self.encode(input, options).map_err(|e| (i, e)))
            .collect()
    }

    /// The tokens of one text as the model would see them (prompt applied,
    /// not truncated), with the model's special tokens when `add_special_tokens`
    /// (TEI's `/tokenize`). Default: not supported.
    fn tokens(
        &self,
        text: &str,
        add_special_tokens: bool,
        options: &EmbedOptions,
    ) -> Result<Vec<TokenSpan>, EmbedderError> {
        let _ = (text, add_special_tokens, options);
        Err(EmbedderError::invalid_input(
            "this model's tokenizer cannot list tokens",
        ))
    }

    /// The prompt [`Tokenize::tokens`] puts before `text` under `options`:
    /// its offsets count these bytes first. Default: none.
    fn prompt_before(&self, text: &str, options: &EmbedOptions) -> Result<String, EmbedderError> {
        let _ = (text, options);
        Ok(String::new())
    }

    /// Token ids back to text (TEI's `/decode`). Default: not supported.
    fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, EmbedderError> {
        let _ = (ids, skip_special_tokens);
        Err(EmbedderError::invalid_input(
            "this model's tokenizer cannot decode",
        ))
    }
}

/// One token of a text (TEI's `/tokenize` item).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenSpan {
    /// The token's id in the model's vocabulary.
    pub id: u32,
    /// The token's text: the slice of the input it covers, or the special
    /// token's own text.
    pub text: String,
    /// A special token the model adds (not from the input).
    pub special: bool,
    /// Byte offsets of the token in the input (`start == stop` for specials).
    pub start: usize,
    /// Byte offset just past the token's end in the input.
    pub stop: usize,
}

/// The result of one model call on a batch.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BatchOutput {
    /// NOT normalized rows, row-major, inputs in order: for [`Output::Pooled`]
    /// one `dim`-wide vector per input; for [`Output::Tokens`] each input's
    /// token rows (the model's hidden width each), in token order.
    pub vectors: Vec<f32>,
    /// Rows per input, in input order: 1 each for [`Output::Pooled`], the
    /// input's token count for [`Output::Tokens`]. The model thread checks
    /// it, so a model can never hand one input another's rows.
    pub rows: Vec<u32>,
    /// Padded tokens the model's device passes processed (for the padding metric).
    pub padded_tokens: u64,
    /// Time spent waiting to enter the Python interpreter (zero for non-Python models).
    pub gil_wait: Duration,
}

/// What kind of failure an [`EmbedderError`] is; decides who is told what.
///
/// `#[non_exhaustive]`: kinds are added as the engine tells more failures
/// apart, so a `match` outside this crate needs a wildcard arm (`_ =>`,
/// best treated as the nearest of [`ModelFailure`](Self::ModelFailure) or,
/// where [`is_load_only`](Self::is_load_only), a load to give up on).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EmbedderErrorKind {
    /// The input cannot be embedded (HTTP 400); the model is fine.
    InvalidInput,
    /// A per-request cut ([`EmbedOptions::truncate_to`]) too short for the
    /// model's own tokens (its special tokens, prompt or instruction): the
    /// request's cut is at fault, not any input (every input fails alike),
    /// and the message says the cut that fits (HTTP 400).
    CutTooShort,
    /// The model failed on this batch (HTTP 500); it may work on the next.
    ModelFailure,
    /// The model can never answer again (HTTP 503): the batcher turns unhealthy.
    ModelGone,
    /// A load only ([`crate::CoreError::LoadFailed`]): the model's engine
    /// cannot start here, its code missing or not importable (the Python
    /// package `mlx_embed`, or MLX under it, where the embedder looks; a
    /// package only some models need is [`InvalidModel`](Self::InvalidModel)).
    /// A setup to fix: install it, or point the program at the environment
    /// that has it.
    EngineUnavailable,
    /// A load only: the model named is not there (no such folder, no repo
    /// of that name) or its files make no model the engine runs (an
    /// architecture it does not know, a file it must have missing, a
    /// tokenizer that cannot be read, a weights file that cannot be read
    /// or whose tensors are missing, extra or of another shape than its
    /// config makes them), or it needs a Python package this installation
    /// cannot import (`mlx_lm` for a decoder: the engine itself imports,
    /// and runs other models; the message names the package). Another
    /// model, its files fixed, or the package installed.
    InvalidModel,
    /// A load only: a load option the engine cannot take (out of its
    /// range, as more workers than the cores run, or a `max_length` past
    /// the model's positions; the wrong type, from a dynamic caller). The
    /// message names the option.
    InvalidOption,
}

impl EmbedderErrorKind {
    /// Whether only a load gives this kind: a model never raises it on a
    /// batch (one that did is a failure of that batch).
    pub fn is_load_only(self) -> bool {
        matches!(
            self,
            Self::EngineUnavailable | Self::InvalidModel | Self::InvalidOption
        )
    }
}

/// A failure inside the model or its tokenizer, with the message it gave.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct EmbedderError {
    /// Whose fault it is and what the batcher does about it.
    pub kind: EmbedderErrorKind,
    /// The model's or tokenizer's own words.
    pub message: String,
}

impl EmbedderError {
    /// An error of `kind` saying `message`.
    pub fn new(kind: EmbedderErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// [`EmbedderErrorKind::InvalidInput`].
    pub fn invalid_input(message: impl Into<String>) -> Self {
        Self::new(EmbedderErrorKind::InvalidInput, message)
    }

    /// [`EmbedderErrorKind::CutTooShort`].
    pub fn cut_too_short(message: impl Into<String>) -> Self {
        Self::new(EmbedderErrorKind::CutTooShort, message)
    }

    /// [`EmbedderErrorKind::ModelFailure`].
    pub fn model_failure(message: impl Into<String>) -> Self {
        Self::new(EmbedderErrorKind::ModelFailure, message)
    }

    /// [`EmbedderErrorKind::ModelGone`].
    pub fn model_gone(message: impl Into<String>) -> Self {
        Self::new(EmbedderErrorKind::ModelGone, message)
    }
}

/// What a model computes per input.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum ModelKind {
    /// One vector per input.
    #[default]
    Embedding,
    /// One score per label (several labels; `labels` in logit order).
    /// `multi_label` (config.json's `problem_type` is
    /// `multi_label_classification`): the labels are independent yes/no
    /// answers, each scored by a sigmoid, not one choice among them.
    Classifier {
        /// The labels' names (`id2label`), in logit order.
        labels: Vec<String>,
        /// Independent labels, a sigmoid each (see above).
        multi_label: bool,
    },
    /// One relevance score per query/document pair; `labels` has the one
    /// name TEI's `/predict` reports for it (`id2label`, e.g. "LABEL_0").
    Reranker {
        /// The one label's name.
        labels: Vec<String>,
    },
}

impl ModelKind {
    /// Label names of a scoring model, in output order (empty for embeddings).
    pub fn labels(&self) -> &[String] {
        match self {
            ModelKind::Embedding => &[],
            ModelKind::Classifier { labels, .. } | ModelKind::Reranker { labels } => labels,
        }
    }

    /// A multi-label classifier: each label's score stands alone (a sigmoid
    /// per label) rather than the labels sharing one softmax.
    pub fn multi_label(&self) -> bool {
        matches!(
            self,
            ModelKind::Classifier {
                multi_label: true,
                ..
            }
        )
    }

    /// One input's logits (its row of a scoring model's output) as its
    /// scores, in place: [`sigmoid_each`] for a multi-label classifier,
    /// else [`activate`] (a reranker's sigmoid, a classifier's softmax).
    pub fn activate(&self, row: &mut [f32]) {
        if self.multi_label() {
            sigmoid_each(row);
        } else {
            activate(row);
        }
    }

    /// "embedding", "classifier" or "reranker", as the APIs report it.
    pub fn as_str(&self) -> &'static str {
        match self {
            ModelKind::Embedding => "embedding",
            ModelKind::Classifier { .. } => "classifier",
            ModelKind::Reranker { .. } => "reranker",
        }
    }
}

/// What the model reports about itself once loaded.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelInfo {
    /// Name the model serves under.
    pub name: String,
    /// An embedding model, a classifier or a reranker (whose vectors are logits).
    pub kind: ModelKind,
    /// Output width: floats per input in [`BatchOutput::vectors`].
    pub dim: usize,
    /// SPLADE: each vector spans the vocabulary (`dim == vocab_size`), is
    /// non-negative and mostly zero; [`sparse_entries`] lists what is set
    /// (TEI's `/embed_sparse`).
    pub sparse: bool,
    /// Beside its dense vectors, the model weighs each input's tokens (BGE-M3's
    /// lexical weights): [`Output::Sparse`] computes them.
    pub lexical_weights: bool,
    /// An input may have no tokens at all (a static embedding's empty text:
    /// its vector is zeros); otherwise one with none is refused.
    pub empty_inputs: bool,
    /// A multi-vector (ColBERT) model, with its two modes' lengths: it
    /// answers [`Output::MultiVector`] only (`dim`-wide rows per token),
    /// never a pooled vector.
    pub multi_vector: Option<MultiVectorLengths>,
    /// Longest input in tokens, special tokens included; longer ones are
    /// truncated (or refused with `truncate: false`). A multi-vector
    /// model's modes cut shorter ([`ModelInfo::input_max`]).
    pub max_input_tokens: usize,
    /// Token ids are below this.
    pub vocab_size: usize,
    /// Padded tokens per device pass the engine cuts a model call into, if it
    /// does (its own budget; the collector's is `max_batch_tokens`).
    pub device_batch_tokens: Option<usize>,
    /// Named prompts (sentence-transformers `prompts`): name -> text prepended.
    pub prompts: BTreeMap<String, String>,
    /// The prompt [`Prompt::Default`] means, if any.
    pub default_prompt_name: Option<String>,
    /// The end an over-long input loses when a request names none
    /// ([`EmbedOptions::truncation_direction`] `None`): the folder's own
    /// (transformers' `truncation_side`), or the `load()` override.
    pub truncation_side: TruncationDirection,
    /// Task adapters an input may run with ([`EmbedOptions::task`]), in the
    /// model's order ([`Encoded::adapter`] indexes them); empty for most models.
    pub tasks: Vec<String>,
    /// Dense layers after the pooling (sentence-transformers' `Dense`
    /// modules): the vector is a projection of the token states' pooled
    /// value, not that value, so a span's mean (late chunking) is not in the
    /// vectors' space. 0 for most models.
    pub dense_layers: usize,
    /// The Matryoshka width the model cuts its pooled value to (a folder's
    /// `truncate_dim`), when it does: always [`ModelInfo::dim`] then, with
    /// token states wider than it. `None`: no cut.
    pub truncate_dim: Option<usize>,
    /// Free-form facts for display only (dtype, BLAS library, pooling, ...);
    /// never parsed back ([`ModelInfo::shown_details`] adds the typed facts
    /// shown beside them).
    pub details: BTreeMap<String, String>,
    /// What the weights are, where the model says (the Python engine does).
    pub weights: Option<WeightsInfo>,
}

/// A multi-vector (ColBERT) model's input lengths, special tokens and the
/// mode's inserted prefix included: a query is cut (and expanded) to
/// `query`, a document cut to `document` (PyLate's `query_length` /
/// `document_length`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MultiVectorLengths {
    /// Tokens of a query, expansion tokens included.
    pub query: usize,
    /// Most tokens of a document.
    pub document: usize,
}

impl ModelInfo {
    /// [`ModelInfo::details`] with the typed facts that are shown among
    /// them (`dense_layers`, `truncate_dim`, where set): what `/info` and
    /// the start-up line print.
    pub fn shown_details(&self) -> BTreeMap<String, String> {
        let mut out = self.details.clone();
        // The typed fields alone say these, whatever the details hold.
        out.remove("dense_layers");
        out.remove("truncate_dim");
        if self.dense_layers > 0 {
            out.insert("dense_layers".into(), self.dense_layers.to_string());
        }
        if let Some(width) = self.truncate_dim {
            out.insert("truncate_dim".into(), width.to_string());
        }
        out
    }

    /// Longest input an `output` runs with, special tokens included: a
    /// multi-vector mode's length, else [`ModelInfo::max_input_tokens`].
    /// What `truncate: false` holds an input to.
    pub fn input_max(&self, output: Output) -> usize {
        match (output, self.multi_vector) {
            (Output::MultiVector(Side::Query), Some(m)) => m.query,
            (Output::MultiVector(Side::Document), Some(m)) => m.document,
            _ => self.max_input_tokens,
        }
    }
}

/// Which limit an input was held to ([`crate::CoreError::InputTooLong`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputLimit {
    /// The model's maximum ([`ModelInfo::max_input_tokens`]).
    Model,
    /// The request's own cut ([`EmbedOptions::truncate_to`]), below the model's.
    Request,
    /// A multi-vector model's query or document length ([`MultiVectorLengths`]).
    Mode(Side),
}

impl std::fmt::Display for InputLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            InputLimit::Model => "the model's maximum",
            InputLimit::Request => "the request's cut",
            InputLimit::Mode(Side::Query) => "the model's query length",
            InputLimit::Mode(Side::Document) => "the model's document length",
        })
    }
}

/// A loaded model's weights: what model listings (Ollama's `/api/tags`,
/// `/api/show`) and `/info` report.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WeightsInfo {
    /// The architecture, `config.json`'s `model_type` ("bert", "qwen3", ...).
    pub architecture: String,
    /// The float type the forward pass runs in ("float32", "bfloat16", ...).
    pub dtype: String,
    /// Bits of the quantized weights the forward pass runs, if it runs any.
    pub quantization_bits: Option<u32>,
    /// Parameter count; a quantized layer counts the values it packs.
    pub parameters: u64,
    /// Bytes the weights take in memory.
    pub bytes: u64,
    /// The files the weights were read from: `safetensors`, or `pytorch`
    /// (`pytorch_model.bin`).
    pub format: String,
    /// The model's folder (weights, config, tokenizer), where it was read
    /// from one: Ollama's listings hash its files for the model's digest.
    pub folder: Option<std::path::PathBuf>,
    /// The commit of the Hugging Face cache snapshot `folder` is, where it
    /// is one (a model named by its repo id): TEI's `model_sha`.
    pub revision: Option<String>,
}

/// The device memory of the model's runtime (MLX: active, cache, peak), in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Bytes held by live arrays.
    pub active_bytes: u64,
    /// Freed buffers the runtime keeps for reuse.
    pub cache_bytes: u64,
    /// The highest `active_bytes` since the process started.
    pub peak_bytes: u64,
    /// The cap on `cache_bytes`, if one was set.
    pub cache_limit_bytes: Option<u64>,
}

/// Figures a model reports while it runs, read from any thread (HTTP
/// handlers, metrics scrapes) without a round trip through the model thread,
/// which may be busy with a batch for a long time.
///
/// Both calls may block briefly (a Python model waits for the interpreter):
/// async callers should run them on a blocking pool.
pub trait LiveStats: Send + Sync {
    /// The device memory now.
    fn memory(&self) -> Result<DeviceMemory, EmbedderError>;
    /// Display facts that change while the model runs or cost time to get,
    /// as of now; shown over [`ModelInfo::details`], which are fixed at load.
    fn details(&self) -> Result<BTreeMap<String, String>, EmbedderError>;
}

/// A batch an [`Embedder`] has queued and not yet answered (see
/// [`Embedder::submit`]). What it holds is the model's own business.
pub struct Ticket(Box<dyn Any>);

impl Ticket {
    /// Wraps whatever the model needs to collect the batch later.
    pub fn new<T: Any>(pending: T) -> Self {
        Self(Box::new(pending))
    }

    /// What [`Ticket::new`] wrapped, if it was a `T` (else the ticket back).
    pub fn into_inner<T: Any>(self) -> Result<T, Self> {
        self.0.downcast::<T>().map(|b| *b).map_err(Self)
    }
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Ticket")
    }
}

/// What one [`Embedder::submit`] step did.
#[derive(Debug)]
pub struct Submitted {
    /// The new batch's ticket, or why it could not even be queued.
    pub next: Result<Ticket, EmbedderError>,
    /// The output of the batch submitted before, when one was given.
    pub running: Option<Result<BatchOutput, EmbedderError>>,
}

/// Builds another handle on an already loaded model, on the model thread
/// that will use it (see [`Embedder::replica`]).
pub type Replica<E> = Box<dyn FnOnce() -> Result<E, EmbedderError> + Send>;

/// An embedding model driven by the batcher from dedicated OS threads.
///
/// It is created on its thread (see [`crate::Batcher::start`]) and never moves,
/// so implementations need not be `Send` (MLX streams are per thread). With
/// [`crate::BatcherConfig::model_threads`] above one, each further thread
/// gets its own handle from [`Embedder::replica`].
pub trait Embedder {
    /// Facts about the loaded model.
    fn info(&self) -> ModelInfo;
    /// The tokenizer callers' inputs go through before they queue. `None`:
    /// the model takes token ids only, which run as given (truncated to
    /// `max_input_tokens`); text is invalid input.
    fn tokenizer(&self) -> Option<Arc<dyn Tokenize>>;
    /// Live figures (device memory...), taken once after load like
    /// [`Embedder::tokenizer`]. `None` (the default): the model has none.
    fn live_stats(&self) -> Option<Arc<dyn LiveStats>> {
        None
    }

    /// Embeds a batch in one model call. `inputs` is never empty, and all of
    /// them want `output`: the queue never mixes kinds in one call. A model
    /// that cannot give per-token rows answers [`Output::Tokens`] with
    /// [`EmbedderErrorKind::InvalidInput`].
    fn embed_batch(
        &mut self,
        inputs: &[Encoded],
        output: Output,
    ) -> Result<BatchOutput, EmbedderError>;

    /// A builder for another handle on this loaded model, for another model
    /// thread: it runs on that thread, and both handles then embed
    /// concurrently (the weights are shared, not loaded again). `None` (the
    /// default): the model serves from one thread only, and asking for more
    /// fails `Batcher::start`.
    fn replica(&self) -> Option<Replica<Self>>
    where
        Self: Sized,
    {
        None
    }

    /// A builder for a query thread's handle
    /// ([`crate::BatcherConfig::query_threads`]): as [`Embedder::replica`]
    /// (the default), for a model that runs a query thread's short calls
    /// some other way, such as beside a running long call instead of after
    /// it. `None`: no query thread runs, and the batcher starts without one.
    fn query_replica(&self) -> Option<Replica<Self>>
    where
        Self: Sized,
    {
        self.replica()
    }

    /// True when consecutive batches overlap on the model's device: the
    /// model thread then queues batch k+1 with [`Embedder::submit`] before it
    /// collects batch k. `false` (the default): one `embed_batch` per batch.
    fn pipelines(&self) -> bool {
        false
    }

    /// Queues `next` (never empty, all wanting `output`) and, in the same
    /// step, collects `running`, the batch submitted just before, so a model
    /// behind an interpreter crosses into it once per batch. The default
    /// computes `next` at once with `embed_batch`, after collecting `running`.
    fn submit(&mut self, next: &[Encoded], output: Output, running: Option<Ticket>) -> Submitted {
        let running = running.map(|ticket| self.collect(ticket));
        let result = self.embed_batch(next, output);
        Submitted {
            next: Ok(Ticket::new(result)),
            running,
        }
    }

    /// Waits for a submitted batch and returns its output (when no next
    /// batch is there to submit with it). The default reads what the default
    /// `submit` stored.
    fn collect(&mut self, ticket: Ticket) -> Result<BatchOutput, EmbedderError> {
        ticket
            .into_inner::<Result<BatchOutput, EmbedderError>>()
            .unwrap_or_else(|_| {
                Err(EmbedderError::model_failure(
                    "a ticket this model did not issue",
                ))
            })
    }
}

/// The non-zero entries of `v` as `(index, value)`, in index order: a
/// An input's [`Output::Sparse`] rows as `(token id, weight)` entries.
/// The model thread has checked them: whole ids below the vocabulary size,
/// increasing.
pub fn lexical_entries(rows: &[f32]) -> Vec<(u32, f32)> {
    rows.chunks_exact(2).map(|r| (r[0] as u32, r[1])).collect()
}

/// SPLADE vector as sparse indexes (Qdrant, Elasticsearch, TEI) take it.
pub fn sparse_entries(v: &[f32]) -> Vec<(u32, f32)> {
    v.iter()
        .enumerate()
        .filter(|(_, &x)| x != 0.0)
        .map(|(i, &x)| (i as u32, x))
        .collect()
}

/// Scores from a scoring model's logits (one input's row, one logit per
/// label), in place, as TEI and sentence-transformers' `CrossEncoder` make
/// them: the sigmoid of a lone logit (a reranker), else the softmax over the
/// labels (a classifier). In float64, each score rounded to float32 once.
/// The one activation of every score the server and the Python library give
/// (the library calls it through `mlx_embed._native.scores_`), so a Rust
/// program that runs a reranker through a [`crate::Batcher`] gets their
/// scores to the bit; [`ModelKind::activate`] picks it or [`sigmoid_each`]
/// by the model's kind.
pub fn activate(row: &mut [f32]) {
    if let [x] = row {
        *x = (1.0 / (1.0 + (-f64::from(*x)).exp())) as f32;
        return;
    }
    let max = f64::from(row.iter().copied().fold(f32::NEG_INFINITY, f32::max));
    let exps: Vec<f64> = row.iter().map(|&x| (f64::from(x) - max).exp()).collect();
    let sum = exps.iter().fold(0.0, |sum, e| sum + e);
    for (x, e) in row.iter_mut().zip(exps) {
        *x = (e / sum) as f32;
    }
}

/// A sigmoid of each logit, in place: a multi-label classifier's labels,
/// each scored alone (transformers' rule), as [`activate`] scores one.
pub fn sigmoid_each(row: &mut [f32]) {
    row.iter_mut()
        .for_each(|x| activate(std::slice::from_mut(x)));
}

/// Partial sums [`l2_normalize`] keeps: lane `j` adds the squares of
/// components `j`, `j + NORM_LANES`, ... (`pooling.unit_rows`'s fallback
/// in the library repeats this order).
const NORM_LANES: usize = 8;

/// Scales `v` to unit L2 norm (a zero vector stays zero), like
/// sentence-transformers (`x / max(|x|, 1e-12)`): the one normalization of
/// every vector the server and the Python library answer (the library calls
/// it through `mlx_embed._native.unit_rows_`), so both give the same bits.
///
/// In float64: the squares are exact, their sum (in 8 lanes,
/// added lane 0 first, an order fixed whatever the CPU) is off by ~1e-16 of
/// the norm, and each `x / norm` is rounded to float32 once, so a component
/// is the float32 nearest the exact quotient but in rare ties (a float32
/// sum is ~1e-6 off at 1024 components, and its value depends on the order
/// each path adds in). The lanes keep the sum a vector add, not one add
/// after another.
pub fn l2_normalize(v: &mut [f32]) {
    let mut lanes = [0.0f64; NORM_LANES];
    let chunks = v.chunks_exact(NORM_LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane += f64::from(x) * f64::from(x);
        }
    }
    for (lane, &x) in lanes.iter_mut().zip(tail) {
        *lane += f64::from(x) * f64::from(x);
    }
    let norm = lanes.iter().fold(0.0, |sum, lane| sum + lane).sqrt();
    // Not `f64::max`, which drops a NaN: a row with a NaN component would be
    // divided by 1e-12, its other components answered as ~1e12 instead of
    // NaN (sentence-transformers' clamp_min, NumPy's maximum and MLX's all
    // keep the NaN).
    let norm = if norm < 1e-12 { 1e-12 } else { norm };
    v.iter_mut()
        .for_each(|x| *x = (f64::from(*x) / norm) as f32);
}

/// The mean of each span of `rows` (row-major, `width` floats a row): late
/// chunking's chunk vectors (Günther et al. 2024, Jina's `late_chunking`),
/// each chunk the mean of its own tokens' last hidden states. One row added
/// after another in float64, then divided and rounded to float32 once: the
/// Python library's `pooling.span_means` adds in the same order (NumPy's
/// reduction over rows), so both give the same bits. A span must be
/// non-empty and inside `rows`.
pub fn span_means(rows: &[f32], width: usize, spans: &[std::ops::Range<usize>]) -> Vec<Vec<f32>> {
    spans
        .iter()
        .map(|span| {
            let mut sum = vec![0.0f64; width];
            for row in rows[span.start * width..span.end * width].chunks_exact(width) {
                for (s, &x) in sum.iter_mut().zip(row) {
                    *s += f64::from(x);
                }
            }
            let n = span.len() as f64;
            sum.into_iter().map(|s| (s / n) as f32).collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_loads_own_kinds_are_load_only() {
        use EmbedderErrorKind::*;
        for kind in [EngineUnavailable, InvalidModel, InvalidOption] {
            assert!(kind.is_load_only(), "{kind:?}");
        }
        // What a batch can fail with (a load can too: ModelFailure, ModelGone).
        for kind in [InvalidInput, CutTooShort, ModelFailure, ModelGone] {
            assert!(!kind.is_load_only(), "{kind:?}");
        }
    }

    #[test]
    fn sparse_entries_keep_every_non_zero_in_index_order() {
        let v = [0.0, 1.5, 0.0, -0.0, 2.0e-7, 0.25];
        assert_eq!(sparse_entries(&v), vec![(1, 1.5), (4, 2.0e-7), (5, 0.25)]);
        assert!(sparse_entries(&[0.0; 4]).is_empty());
    }

    #[test]
    fn span_means_average_each_span_in_float64() {
        // Rows of width 2: [1, 2], [3, 4], [5, 6], [1e8, 1].
        let rows = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 1.0e8, 1.0];
        let got = span_means(&rows, 2, &[0..2, 2..4, 1..2]);
        assert_eq!(
            got,
            vec![
                vec![2.0, 3.0],
                vec![(5.0 + 1.0e8) / 2.0, 3.5],
                vec![3.0, 4.0]
            ]
        );
        // Divided in float64 and rounded once, not rounded twice.
        let whole = vec![std::ops::Range { start: 0, end: 3 }];
        let thirds = span_means(&[1.0, 0.0, 0.0], 1, &whole);
        assert_eq!(thirds[0][0], (1.0f64 / 3.0) as f32);
    }

    #[test]
    fn sigmoid_and_softmax() {
        let mut one = [0.0f32];
        activate(&mut one);
        assert_eq!(one, [0.5]);
        let mut one = [2.0f32];
        activate(&mut one);
        assert!((one[0] - 0.880_797_1).abs() < 1e-6);
        let mut three = [1.0f32, 2.0, 3.0];
        activate(&mut three);
        let want = [0.090_030_57, 0.244_728_48, 0.665_240_94];
        for (a, b) in three.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{three:?}");
        }
        // One rounding: the float64 sigmoid's nearest float32.
        for logit in [-3.7f32, -0.1, 0.3, 1.9, 7.25] {
            let mut one = [logit];
            activate(&mut one);
            assert_eq!(one[0], (1.0 / (1.0 + (-f64::from(logit)).exp())) as f32);
        }
        // Large logits do not overflow.
        let mut big = [1000.0f32, 0.0];
        activate(&mut big);
        assert_eq!(big, [1.0, 0.0]);
        // By kind: a multi-label classifier's labels each get a sigmoid.
        let logits = [0.5f32, -1.0];
        let (mut softmax, mut sigmoids) = (logits, logits);
        ModelKind::Classifier {
            labels: vec![],
            multi_label: false,
        }
        .activate(&mut softmax);
        ModelKind::Classifier {
            labels: vec![],
            multi_label: true,
        }
        .activate(&mut sigmoids);
        let sigmoid = |x: f32| (1.0 / (1.0 + (-f64::from(x)).exp())) as f32;
        assert_eq!(sigmoids, logits.map(sigmoid));
        assert!((softmax[0] + softmax[1] - 1.0).abs() < 1e-6, "{softmax:?}");
        assert_ne!(softmax, sigmoids);
    }

    /// The float64 quotient of each component by the float64 norm, rounded
    /// once: what `l2_normalize` promises, whatever its summation order.
    fn nearest_unit(v: &[f32]) -> Vec<f32> {
        let norm = v
            .iter()
            .map(|&x| f64::from(x) * f64::from(x))
            .sum::<f64>()
            .sqrt()
            .max(1e-12);
        v.iter().map(|&x| (f64::from(x) / norm) as f32).collect()
    }

    #[test]
    fn l2_normalize_rounds_each_component_once() {
        // Widths around the lanes (tails of 0..7) and a model's width, with
        // components of very different sizes.
        let mut seed = 0x9e37_79b9_u32;
        for width in [1, 3, 7, 8, 9, 16, 17, 384, 1025] {
            let v: Vec<f32> = (0..width)
                .map(|i| {
                    seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    let unit = f32::from(u16::try_from(seed >> 16).unwrap()) / 65536.0 - 0.5;
                    unit * if i % 5 == 0 { 1e3 } else { 1e-2 }
                })
                .collect();
            let mut got = v.clone();
            l2_normalize(&mut got);
            assert_eq!(got, nearest_unit(&v), "width {width}");
            let norm: f64 = got.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
            assert!((norm - 1.0).abs() < 1e-6, "width {width}: |v|^2 = {norm}");
        }
    }

    #[test]
    fn l2_normalize_leaves_a_nan_row_nan() {
        let mut v = [f32::NAN, 1.0, 2.0];
        l2_normalize(&mut v);
        assert!(v.iter().all(|x| x.is_nan()), "{v:?}");
        let mut v = [f32::INFINITY, 1.0];
        l2_normalize(&mut v);
        assert!(v[0].is_nan() && v[1] == 0.0, "{v:?}");
    }

    #[test]
    fn l2_normalize_leaves_a_zero_vector_zero() {
        let mut v = [0.0f32; 12];
        l2_normalize(&mut v);
        assert_eq!(v, [0.0; 12]);
        let mut tiny = [1e-30f32, 0.0];
        l2_normalize(&mut tiny);
        assert_eq!(tiny, [(1e-30f64 / 1e-12) as f32, 0.0]);
    }

    #[test]
    fn only_a_classifier_marked_multi_label_is_one() {
        let labels = |n: usize| (0..n).map(|i| format!("L{i}")).collect::<Vec<_>>();
        let classifier = |n, multi_label| ModelKind::Classifier {
            labels: labels(n),
            multi_label,
        };
        assert!(!classifier(3, false).multi_label());
        assert!(classifier(3, true).multi_label());
        assert!(!classifier(1, false).multi_label());
        let reranker = ModelKind::Reranker { labels: labels(1) };
        assert!(!reranker.multi_label());
        assert!(!ModelKind::Embedding.multi_label());
    }
}
