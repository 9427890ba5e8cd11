//! mlx-embed-core: many concurrent callers, one model on one thread.
//!
//! [`Batcher::embed`] takes a request through these steps:
//!
//! 1. **Tokenize** on tokio's blocking pool with the model's [`Tokenize`]:
//!    exact token ids, special tokens included, truncated to
//!    [`ModelInfo::max_input_tokens`] on the side the request chose. With
//!    `truncate: false` an input over that maximum is refused here
//!    ([`CoreError::InputTooLong`]), before any compute.
//! 2. **Admit**: a fair tokio semaphore counted in inputs
//!    ([`BatcherConfig::max_concurrent_requests`]); past `max_waiting` inputs
//!    or `max_queue_wait` a caller is told [`CoreError::Overloaded`].
//! 3. **Collect**: one collector thread decides which inputs share a model
//!    call, FIFO with round-robin between requests, under two exact budgets:
//!    `max_batch_size` inputs and `max_batch_tokens` padded tokens (longest
//!    input's tokens x inputs).
//! 4. **Compute**: one [`Embedder::embed_batch`] per batch on the one model
//!    thread, which lives as long as the model.
//!
//! How one model call is cut into device passes is the model's own business,
//! on its own budget ([`ModelInfo::device_batch_tokens`], padded tokens per
//! pass; the Python engine's `batch_tokens`). The core never re-plans it, and
//! the model never regroups requests.
//!
//! Nothing here knows HTTP or Python, so a Rust program can link it and embed
//! in-process.

mod admission;
mod batcher;
mod collector;
pub mod config;
pub mod embedder;
pub mod error;
pub mod metrics;
mod model_thread;
mod queue;
mod recorder;
mod request;
mod shared;
mod tokenize;

pub use batcher::{Batcher, Embeddings};
pub use config::BatcherConfig;
pub use embedder::{
    l2_normalize, BatchOutput, EmbedInput, EmbedOptions, Embedder, EmbedderError,
    EmbedderErrorKind, Encoded, ModelInfo, ModelKind, Priority, Prompt, TokenSpan, Tokenize,
    TruncationDirection,
};
pub use error::{CoreError, OverloadReason};
pub use metrics::{Histogram, MetricsSnapshot};
