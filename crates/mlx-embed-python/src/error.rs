//! The bridge's one error type.

use mlx_embed_core::EmbedderError;

/// What can go wrong between Rust and the Python model.
#[derive(Debug, thiserror::Error)]
pub enum BridgeError {
    /// `mlx_embed` could not be imported; the message says where Python looked.
    #[error("cannot import the Python package `mlx_embed`: {message} (sys.prefix = {prefix}; sys.path = {path}). Install the project into a virtualenv (`make serve` does) and set VIRTUAL_ENV or run the binary from that virtualenv")]
    NotImportable {
        message: String,
        prefix: String,
        path: String,
    },
    /// Python raised while loading or running the model.
    #[error("python: {0}")]
    Python(String),
    /// The model answered with something the bridge cannot use.
    #[error("unexpected answer from the model: {0}")]
    Protocol(String),
}

impl From<pyo3::PyErr> for BridgeError {
    fn from(err: pyo3::PyErr) -> Self {
        BridgeError::Python(err.to_string())
    }
}

impl From<BridgeError> for EmbedderError {
    fn from(err: BridgeError) -> Self {
        match err {
            // The model's own message is what a client needs to see, unprefixed.
            BridgeError::Python(message) => EmbedderError::new(message),
            other => EmbedderError::new(other.to_string()),
        }
    }
}
