//! The model as the batcher sees it.

use std::collections::BTreeMap;
use std::time::Duration;

/// One input to embed: raw text, or token ids of the model's own tokenizer
/// (the OpenAI API allows pre-tokenized input).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EmbedInput {
    Text(String),
    Tokens(Vec<u32>),
}

impl EmbedInput {
    /// Cheap token estimate used for the batch token budget. Text uses
    /// chars/4 + 2 special tokens: the real tokenizer lives in Python and running
    /// it twice per text would cost more than the estimate saves; the estimate
    /// only shapes batches, it never decides truncation.
    pub fn estimated_tokens(&self) -> usize {
        match self {
            EmbedInput::Text(text) => text.len() / 4 + 2,
            EmbedInput::Tokens(ids) => ids.len() + 2,
        }
    }
}

/// What the model reports about itself once loaded.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelInfo {
    /// Name the model serves under.
    pub name: String,
    /// Embedding dimension.
    pub dim: usize,
    /// Longest input in tokens (special tokens included); longer inputs are truncated.
    pub max_input_tokens: usize,
    /// Padded tokens per forward pass the model itself works best with, if it knows.
    pub preferred_batch_tokens: Option<usize>,
    /// Free-form facts for `/info` (dtype, BLAS library, pooling, ...).
    pub details: BTreeMap<String, String>,
}

/// The result of one model call on a batch.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BatchOutput {
    /// Pooled, NOT normalized vectors, row-major: `inputs.len() * dim` floats in input order.
    pub vectors: Vec<f32>,
    /// Tokens the model actually ran per input (after truncation, special tokens included).
    pub token_counts: Vec<u32>,
    /// Tokens per input before truncation, so callers that asked not to truncate can be refused.
    pub untruncated_token_counts: Vec<u32>,
    /// Padded tokens the forward passes processed (for the padding ratio metric).
    pub padded_tokens: u64,
    /// Time spent waiting to enter the Python interpreter (zero for non-Python models).
    pub gil_wait: Duration,
}

/// A failure inside the model, with the message the model gave.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct EmbedderError {
    pub message: String,
}

impl EmbedderError {
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
        }
    }
}

/// An embedding model driven by the batcher from one dedicated OS thread.
///
/// It is created on that thread (see [`crate::Batcher::start`]) and never moves,
/// so implementations need not be `Send` (MLX streams are per thread).
pub trait Embedder {
    /// Facts about the loaded model.
    fn info(&self) -> ModelInfo;
    /// Embeds a batch in one model call. `inputs` is never empty.
    fn embed_batch(&mut self, inputs: &[EmbedInput]) -> Result<BatchOutput, EmbedderError>;
}

/// Scales `v` to unit L2 norm (a zero vector stays zero), like sentence-transformers.
pub fn l2_normalize(v: &mut [f32]) {
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
    v.iter_mut().for_each(|x| *x /= norm);
}
