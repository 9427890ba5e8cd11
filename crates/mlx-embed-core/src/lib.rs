//! mlx-embed-core: many concurrent callers, one model on its own thread(s).
//!
//! [`Batcher::embed`] takes a request through these steps:
//!
//! 1. **Tokenize** on tokio's blocking pool with the model's [`Tokenize`]:
//!    exact token ids, special tokens included, truncated to
//!    [`ModelInfo::max_input_tokens`] on the side the request chose. With
//!    `truncate: false` an input over that maximum is refused here
//!    ([`CoreError::InputTooLong`]), before any compute.
//! 2. **Cache**: inputs whose exact ids were embedded before are answered
//!    from the embedding cache ([`BatcherConfig::cache_bytes`]) without
//!    admission or model; concurrent misses of one input compute it once.
//! 3. **Admit** the misses into their [`Priority`] lane: a fair tokio
//!    semaphore per lane counted in inputs
//!    ([`BatcherConfig::max_concurrent_requests`]); past `max_waiting` inputs
//!    or `max_queue_wait` a caller is told [`CoreError::Overloaded`].
//! 4. **Collect**: each time the model thread is free it cuts its next batch
//!    from the lanes (`queue.rs`): high > normal > low with aging, FIFO with
//!    round-robin between requests inside a lane, under two exact budgets:
//!    `max_batch_size` inputs and `max_batch_tokens` padded tokens (longest
//!    input's tokens x inputs).
//! 5. **Compute**: one [`Embedder::embed_batch`] per batch on a model
//!    thread, which lives as long as the model (one by default;
//!    [`BatcherConfig::model_threads`] runs more, each on its own handle).
//!
//! The batcher's lifecycle (open, closed, stopped; each model thread
//! starting, waiting or busy; the model dead) and every wake-up are in one
//! place, `shared.rs`.
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
mod cache;
pub mod config;
pub mod embedder;
pub mod error;
pub mod metrics;
mod model_thread;
pub mod priority;
mod queue;
mod recorder;
mod request;
mod shared;
mod threads;
mod tokenize;

pub use batcher::{Batcher, Embeddings};
pub use cache::CacheMetrics;
pub use config::{BatcherConfig, DeviceKind};
pub use embedder::{
    l2_normalize, sparse_entries, BatchOutput, DeviceMemory, EmbedInput, EmbedOptions, Embedder,
    EmbedderError, EmbedderErrorKind, Encoded, LiveStats, ModelInfo, ModelKind, Output, Prompt,
    Replica, Submitted, Ticket, TokenSpan, Tokenize, TruncationDirection, WeightsInfo,
};
pub use error::{CoreError, OverloadReason};
pub use metrics::{Histogram, LaneMetrics, MetricsSnapshot};
pub use priority::{ParsePriorityError, Priority};
