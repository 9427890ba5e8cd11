//! The tokenizer crate's one error type.

/// Why a tokenizer could not be built from its spec.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// `tokenizer.json` is missing or not a tokenizer the `tokenizers` crate reads.
    #[error("cannot load the tokenizer {path}: {message}")]
    Load {
        /// The file.
        path: String,
        /// What the `tokenizers` crate said.
        message: String,
    },
    /// The spec contradicts itself or the tokenizer.
    #[error("invalid tokenizer spec: {0}")]
    Spec(String),
}
