//! mlx-embed-core: many concurrent callers, one model on one thread.
//!
//! Admission is a fair tokio semaphore counted per input; a collector forms
//! batches FIFO under size and token budgets; the model lives on one dedicated
//! OS thread for its whole life. Nothing here knows HTTP or Python, so a Rust
//! program can link it and embed in-process.

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

pub use batcher::{Batcher, Embeddings};
pub use config::BatcherConfig;
pub use embedder::{l2_normalize, BatchOutput, EmbedInput, Embedder, EmbedderError, ModelInfo};
pub use error::{CoreError, OverloadReason};
pub use metrics::{Histogram, MetricsSnapshot};
