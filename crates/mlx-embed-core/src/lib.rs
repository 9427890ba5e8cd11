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
//! in-process. Any model goes behind the [`Embedder`] trait (the Python MLX
//! model is `mlx-embed-python`'s); here, a toy one whose tokens are bytes:
//!
//! ```
//! use std::sync::Arc;
//! use mlx_embed_core::{
//!     l2_normalize, BatchOutput, Batcher, BatcherConfig, EmbedInput, EmbedOptions, Embedder,
//!     EmbedderError, Encoded, ModelInfo, Output, Priority, Tokenize,
//! };
//!
//! /// Token ids are a text's bytes.
//! struct Bytes;
//!
//! impl Tokenize for Bytes {
//!     fn encode(&self, input: &EmbedInput, _: &EmbedOptions) -> Result<Encoded, EmbedderError> {
//!         let EmbedInput::Text(text) = input else {
//!             return Err(EmbedderError::invalid_input("text only"));
//!         };
//!         let ids: Vec<u32> = text.bytes().map(u32::from).take(16).collect();
//!         Ok(Encoded { untruncated_len: text.len() as u32, ids, ..Encoded::default() })
//!     }
//! }
//!
//! /// A vector is [token count, sum of ids]; pooled output only.
//! struct Toy;
//!
//! impl Embedder for Toy {
//!     fn info(&self) -> ModelInfo {
//!         ModelInfo { name: "toy".into(), dim: 2, max_input_tokens: 16, vocab_size: 256, ..Default::default() }
//!     }
//!     fn tokenizer(&self) -> Option<Arc<dyn Tokenize>> {
//!         Some(Arc::new(Bytes))
//!     }
//!     fn embed_batch(&mut self, inputs: &[Encoded], output: Output) -> Result<BatchOutput, EmbedderError> {
//!         if output != Output::Pooled {
//!             return Err(EmbedderError::invalid_input("pooled vectors only"));
//!         }
//!         let longest = inputs.iter().map(Encoded::len).max().unwrap_or(0);
//!         Ok(BatchOutput {
//!             vectors: inputs
//!                 .iter()
//!                 .flat_map(|e| [e.len() as f32, e.ids.iter().sum::<u32>() as f32])
//!                 .collect(),
//!             rows: vec![1; inputs.len()],
//!             padded_tokens: (longest * inputs.len()) as u64,
//!             ..Default::default()
//!         })
//!     }
//! }
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let runtime = tokio::runtime::Runtime::new()?;
//! // Loading blocks (a real model takes seconds): outside async code.
//! let batcher = Batcher::start(BatcherConfig::default(), || Ok(Toy))?;
//! let query = EmbedOptions { priority: Priority::High, ..Default::default() };
//! let out = runtime.block_on(batcher.embed(vec![EmbedInput::Text("ab".into())], query))?;
//! assert_eq!(out.vectors, [[2.0, 195.0]]); // b'a' + b'b'
//! assert_eq!(out.token_counts, [2]);
//! let mut v = out.vectors[0].clone();
//! l2_normalize(&mut v);
//! // The same ids again: answered from the embedding cache, not the model.
//! let again = runtime.block_on(batcher.embed(vec![EmbedInput::Text("ab".into())], EmbedOptions::default()))?;
//! assert_eq!(again.cache_hits, 1);
//! # Ok(()) }
//! ```

// Every public item is documented: clippy's -D warnings holds the line.
#![warn(missing_docs)]

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

pub use batcher::{Batcher, Embeddings, Timings};
pub use cache::CacheMetrics;
pub use config::{BatcherConfig, DeviceKind};
pub use embedder::{
    activate, l2_normalize, lexical_entries, sigmoid_each, span_means, sparse_entries, BatchOutput,
    DeviceMemory, EmbedInput, EmbedOptions, Embedder, EmbedderError, EmbedderErrorKind, Encoded,
    InputLimit, LiveStats, ModelInfo, ModelKind, MultiVectorLengths, Output, Prompt, Replica, Side,
    Submitted, Ticket, TokenPooling, TokenSpan, Tokenize, TruncationDirection, WeightsInfo,
    MAX_PAIR_TEXT_BYTES,
};
pub use error::{CoreError, OverloadReason};
pub use metrics::{Histogram, LaneMetrics, MetricsSnapshot};
pub use priority::{ParsePriorityError, Priority};
pub use tokenize::{reading_room, task_adapter};
