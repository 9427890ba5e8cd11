//! mlx-embed-core: many concurrent callers, one model on one thread.
//!
//! Admission is a fair tokio semaphore per priority lane, counted per input;
//! the model lives on one dedicated OS thread for its whole life and, each
//! time it is free, cuts its next batch from the lanes (high > normal > low
//! with aging; FIFO with round-robin inside a lane) under size and token
//! budgets (`queue.rs`). The lifecycle and every wake-up are in `shared.rs`. Nothing here knows HTTP or Python, so a Rust
//! program can link it and embed in-process.

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

pub use batcher::{Batcher, Embeddings};
pub use cache::CacheMetrics;
pub use config::BatcherConfig;
pub use embedder::{l2_normalize, BatchOutput, EmbedInput, Embedder, EmbedderError, ModelInfo};
pub use error::{CoreError, OverloadReason};
pub use metrics::{Histogram, LaneMetrics, MetricsSnapshot};
pub use priority::{ParsePriorityError, Priority};
