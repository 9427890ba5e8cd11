//! The model as the batcher sees it: what callers send ([`EmbedInput`],
//! [`EmbedOptions`]), how an input becomes token ids ([`Tokenize`]), and the
//! model itself ([`Embedder`]), with its typed facts ([`ModelInfo`]) and
//! typed failures ([`EmbedderError`]).

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

/// Per-request choices that change how inputs are tokenized and queued.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct EmbedOptions {
    pub priority: Priority,
    /// `false`: an input over [`ModelInfo::max_input_tokens`] is refused
    /// ([`crate::CoreError::InputTooLong`]) before any compute, instead of cut.
    pub truncate: bool,
    pub truncation_direction: TruncationDirection,
    pub prompt: Prompt,
}

impl Default for EmbedOptions {
    fn default() -> Self {
        Self {
            priority: Priority::Normal,
            truncate: true,
            truncation_direction: TruncationDirection::Right,
            prompt: Prompt::Default,
        }
    }
}

/// One input to embed.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum EmbedInput {
    Text(String),
    /// Token ids of the model's own tokenizer, without special tokens (the
    /// OpenAI API allows pre-tokenized input); specials and truncation are
    /// applied as for text.
    Tokens(Vec<u32>),
    /// A query/document pair for cross-encoders (rerankers).
    Pair {
        query: String,
        document: String,
    },
}

/// An input as the model runs it: exact token ids, special tokens included,
/// already truncated.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Encoded {
    pub ids: Vec<u32>,
    /// Segment ids, for models that take them (pairs); `None`: all zero.
    pub type_ids: Option<Vec<u32>>,
    /// Tokens before truncation, special tokens included.
    pub untruncated_len: u32,
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
    /// Encodes one input under `options` (prompt, truncation side), truncated
    /// to the model's maximum. Errors are [`EmbedderErrorKind::InvalidInput`]
    /// and describe the input (the core names its index).
    fn encode(&self, input: &EmbedInput, options: &EmbedOptions) -> Result<Encoded, EmbedderError>;
}

/// The result of one model call on a batch.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BatchOutput {
    /// Pooled, NOT normalized vectors, row-major: `inputs.len() * dim` floats in input order.
    pub vectors: Vec<f32>,
    /// Padded tokens the model's device passes processed (for the padding metric).
    pub padded_tokens: u64,
    /// Time spent waiting to enter the Python interpreter (zero for non-Python models).
    pub gil_wait: Duration,
}

/// What kind of failure an [`EmbedderError`] is; decides who is told what.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EmbedderErrorKind {
    /// The input cannot be embedded (HTTP 400); the model is fine.
    InvalidInput,
    /// The model failed on this batch (HTTP 500); it may work on the next.
    ModelFailure,
    /// The model can never answer again (HTTP 503): the batcher turns unhealthy.
    ModelGone,
}

/// A failure inside the model or its tokenizer, with the message it gave.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct EmbedderError {
    pub kind: EmbedderErrorKind,
    pub message: String,
}

impl EmbedderError {
    pub fn new(kind: EmbedderErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    pub fn invalid_input(message: impl Into<String>) -> Self {
        Self::new(EmbedderErrorKind::InvalidInput, message)
    }

    pub fn model_failure(message: impl Into<String>) -> Self {
        Self::new(EmbedderErrorKind::ModelFailure, message)
    }

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
    /// One score per label.
    Classifier { labels: Vec<String> },
    /// One relevance score per query/document pair.
    Reranker,
}

/// What the model reports about itself once loaded.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelInfo {
    /// Name the model serves under.
    pub name: String,
    pub kind: ModelKind,
    /// Output width: floats per input in [`BatchOutput::vectors`].
    pub dim: usize,
    /// Longest input in tokens, special tokens included; longer ones are
    /// truncated (or refused with `truncate: false`).
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
    /// Free-form facts for display only (dtype, BLAS library, pooling, ...).
    pub details: BTreeMap<String, String>,
}

/// An embedding model driven by the batcher from one dedicated OS thread.
///
/// It is created on that thread (see [`crate::Batcher::start`]) and never moves,
/// so implementations need not be `Send` (MLX streams are per thread).
pub trait Embedder {
    /// Facts about the loaded model.
    fn info(&self) -> ModelInfo;
    /// The tokenizer callers' inputs go through before they queue. `None`:
    /// the model takes token ids only, which run as given (truncated to
    /// `max_input_tokens`); text is invalid input.
    fn tokenizer(&self) -> Option<Arc<dyn Tokenize>>;
    /// Embeds a batch in one model call. `inputs` is never empty.
    fn embed_batch(&mut self, inputs: &[Encoded]) -> Result<BatchOutput, EmbedderError>;
}

/// Scales `v` to unit L2 norm (a zero vector stays zero), like sentence-transformers.
pub fn l2_normalize(v: &mut [f32]) {
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
    v.iter_mut().for_each(|x| *x /= norm);
}
