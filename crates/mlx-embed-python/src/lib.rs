//! mlx-embed-python: the Python `mlx_embed` model behind the core's [`Embedder`] trait.
//!
//! Works both inside a Python process (the `mlx-embed serve` command) and in a
//! plain Rust program, which starts its own interpreter and finds the
//! virtualenv named by `VIRTUAL_ENV`, or the first one beside or above the
//! binary (see [`interpreter::ensure_python`]). A crate outside this workspace
//! builds with `PYO3_PYTHON` set to that virtualenv's python and calls
//! `pyo3_build_config::add_libpython_rpath_link_args()` from its own
//! `build.rs` (with `pyo3` as a direct dependency, which that call needs), so
//! its binary loads that interpreter's libpython (README, "Use from Rust,
//! without HTTP", has the Cargo.toml). [`mlx_embed_core::Batcher::start`] blocks while
//! the model loads: call it outside async code, or in `spawn_blocking`.
//! A program that uses pyo3 itself must not wait for an `embed` while it holds
//! the GIL (inside `Python::attach`): the model thread takes the GIL for each
//! batch, so that wait never ends; wait inside `py.detach(|| ...)` instead.
//!
//! ```no_run
//! use mlx_embed_core::{Batcher, BatcherConfig, EmbedInput, EmbedOptions};
//! use mlx_embed_python::{PythonEmbedder, PythonModelOptions};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let options = PythonModelOptions::default(); // all-MiniLM-L6-v2
//! let batcher = tokio::task::spawn_blocking(move || {
//!     Batcher::start(BatcherConfig::default(), move || PythonEmbedder::load_for_batcher(&options))
//! })
//! .await??;
//! let out = batcher.embed(vec![EmbedInput::Text("hello".into())], EmbedOptions::default()).await?;
//! assert_eq!(out.vectors[0].len(), batcher.model_info().dim);
//! # Ok(()) }
//! ```
//!
//! [`Embedder`]: mlx_embed_core::Embedder

// Every public item is documented: clippy's -D warnings holds the line.
#![warn(missing_docs)]

mod embedder;
mod error;
pub mod interpreter;
mod live;
mod spec;
mod thread_state;

pub use embedder::{EngineOptions, PythonEmbedder, PythonModelOptions};
pub use error::BridgeError;
pub use live::PythonLiveStats;
/// The Rust tokenizer [`PythonEmbedder::hf_tokenizer`] hands out, so a user of
/// this crate can name its types without a dependency of its own.
pub use mlx_embed_tokenizer;
