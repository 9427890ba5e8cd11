//! What the bridge's integration tests share: a fixture's folder and a
//! model's vectors for a few texts.

// Each test binary compiles this module and uses part of it.
#![allow(dead_code)]

use std::path::PathBuf;

use mlx_embed_core::{EmbedInput, EmbedOptions, Embedder, Encoded, Output, Tokenize};
use mlx_embed_python::PythonEmbedder;

/// The folder of `tests/fixtures/<name>` at the workspace's root.
pub fn fixture(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
        .to_string_lossy()
        .into_owned()
}

/// `texts` as the model's own tokenizer encodes them, default options.
pub fn encode(embedder: &PythonEmbedder, texts: &[&str]) -> Vec<Encoded> {
    let tokenizer = embedder.hf_tokenizer().clone();
    texts
        .iter()
        .map(|t| {
            tokenizer
                .encode(&EmbedInput::Text((*t).into()), &EmbedOptions::default())
                .unwrap()
        })
        .collect()
}

/// The pooled vectors of `inputs` in one batch, side by side.
pub fn embed(embedder: &mut PythonEmbedder, inputs: &[Encoded]) -> Vec<f32> {
    embedder
        .embed_batch(inputs, Output::Pooled)
        .expect("embeds")
        .vectors
}
