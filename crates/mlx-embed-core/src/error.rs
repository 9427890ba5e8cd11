//! The core's one error type.

use std::time::Duration;

use crate::EmbedderError;

/// Why a caller was turned away instead of queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OverloadReason {
    /// More than `max_waiting` inputs were already waiting.
    QueueFull,
    /// The caller waited longer than `max_queue_wait`.
    QueueTimeout,
}

/// Errors a caller of [`crate::Batcher`] can get.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CoreError {
    /// Refused by admission, before anything was computed: the lane's
    /// waiting line was full or the wait passed `max_queue_wait`. Retry.
    #[error("overloaded ({reason:?}); retry after {retry_after:?}")]
    Overloaded {
        /// Which bound refused it.
        reason: OverloadReason,
        /// When to come back: the work ahead at the model's recent
        /// throughput, 1 to 60 s.
        retry_after: Duration,
    },
    /// The model raised on this request's own inputs (the message is the model's).
    #[error("model error: {0}")]
    Model(String),
    /// The model thread is gone: it died or the batcher stopped.
    #[error("model unavailable: {0}")]
    ModelUnavailable(String),
    /// [`crate::Batcher::start`] could not load the model or start its
    /// threads. The kind says what to do, each but the last two a setup
    /// to fix (a retry will not help): `EngineUnavailable`, the model's
    /// engine cannot start (no Python package `mlx_embed` where the embedder
    /// looks); `InvalidModel`, no such model, or its files make none;
    /// `InvalidOption`, a load option the engine cannot take;
    /// `InvalidInput`, another refusal of what was given (an embedder's
    /// own); `ModelFailure`, loading failed (a retry may load it);
    /// `ModelGone`, the load panicked or its thread died.
    #[error("cannot load the model: {0}")]
    LoadFailed(EmbedderError),
    /// [`crate::Batcher::close`] was called: no new work is taken (work
    /// already admitted still completes).
    #[error("shutting down")]
    ShuttingDown,
    /// The request cannot be embedded as sent: no inputs, an unknown prompt
    /// name, a token id outside the vocabulary, or input the model itself
    /// rejected as invalid. The message names the input where there is one.
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// The request's per-request cut
    /// ([`EmbedOptions::truncate_to`](crate::EmbedOptions::truncate_to)) is
    /// too short for the model's own tokens, so no input could fit
    /// ([`EmbedderErrorKind::CutTooShort`](crate::EmbedderErrorKind::CutTooShort));
    /// the message says the cut that fits.
    #[error("invalid input: {0}")]
    CutTooShort(String),
    /// Input `index` has `tokens` tokens (special tokens included), more than
    /// `max` (the model's maximum, a multi-vector model's query or document
    /// length, or the request's shorter
    /// [`EmbedOptions::truncate_to`](crate::EmbedOptions::truncate_to): which
    /// one, `limit`), and the caller asked not to truncate. Raised after
    /// tokenization, before the request is admitted: nothing was computed.
    #[error("input {index} has {tokens} tokens, more than {limit} of {max}")]
    InputTooLong {
        /// The input's position in the request.
        index: usize,
        /// Its tokens before truncation, special tokens included.
        tokens: usize,
        /// The most it may have.
        max: usize,
        /// Which limit `max` is.
        limit: crate::InputLimit,
    },
    /// Per-token output of `rows` token rows in all, more than the request's
    /// [`EmbedOptions::max_token_rows`](crate::EmbedOptions::max_token_rows).
    /// Raised after tokenization, before the request is admitted.
    #[error("these inputs have {rows} tokens in all, more than the {max} token rows one request may have")]
    TooManyTokenRows {
        /// Token rows the request's inputs have in all.
        rows: usize,
        /// The request's bound.
        max: usize,
    },
    /// [`crate::Batcher::embed`] was polled outside a tokio runtime (by
    /// another executor, or `block_on` of a crate other than tokio's). It
    /// tokenizes on tokio's blocking pool and waits with tokio's timer.
    #[error(
        "Batcher::embed must run inside a tokio runtime with its time driver and blocking \
         pool (Builder::enable_all, #[tokio::main], or Runtime::block_on); none is running here"
    )]
    NoRuntime,
}
