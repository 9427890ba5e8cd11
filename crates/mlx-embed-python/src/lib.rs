//! mlx-embed-python: the Python `mlx_embed` model behind the core's [`Embedder`] trait.
//!
//! Works both inside a Python process (the `mlx-embed serve` command) and in a
//! plain Rust program, which starts its own interpreter and finds the project's
//! virtualenv (see [`interpreter::ensure_python`]).
//!
//! ```no_run
//! use mlx_embed_core::{Batcher, BatcherConfig, EmbedInput, EmbedOptions};
//! use mlx_embed_python::{PythonEmbedder, PythonModelOptions};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let options = PythonModelOptions::default(); // all-MiniLM-L6-v2
//! let batcher = Batcher::start(BatcherConfig::default(), move || PythonEmbedder::load_for_batcher(&options))?;
//! let out = batcher.embed(vec![EmbedInput::Text("hello".into())], EmbedOptions::default()).await?;
//! assert_eq!(out.vectors[0].len(), batcher.model_info().dim);
//! # Ok(()) }
//! ```
//!
//! [`Embedder`]: mlx_embed_core::Embedder

mod embedder;
mod error;
pub mod interpreter;
mod spec;

pub use embedder::{EngineOptions, PythonEmbedder, PythonModelOptions};
pub use error::BridgeError;
