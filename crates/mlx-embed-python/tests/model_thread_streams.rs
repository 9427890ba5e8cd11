//! A Rust thread that calls the model again and again (the batcher's model
//! thread) with `streams > 1`: the pipelined path's extra streams are made
//! once and reused, not made on every call. The engine keeps them per
//! Python thread state (`Scheduler._thread_streams`), so this checks that a
//! Rust thread keeps one Python thread state from call to call; on the CPU
//! every MLX stream that runs work starts a scheduler thread that never
//! ends, so streams made per call show as threads. Its own binary, so no
//! other test's threads come and go meanwhile.

use std::path::PathBuf;

use mlx_embed_core::{EmbedInput, EmbedOptions, Embedder, Output, Tokenize};
use mlx_embed_python::{EngineOptions, PythonEmbedder, PythonModelOptions};

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

#[test]
fn extra_streams_are_made_once_per_model_thread() {
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny-modernbert")
        .to_string_lossy()
        .into_owned();
    let mut embedder = PythonEmbedder::load(&PythonModelOptions {
        model: Some(model),
        engine: EngineOptions {
            pipeline: Some(true),
            streams: Some(3),
            // A pass or two per text, so every call runs on all three streams.
            batch_tokens: Some(16),
            ..EngineOptions::default()
        },
        ..PythonModelOptions::default()
    })
    .expect("model loads");
    let tokenizer = embedder.hf_tokenizer().clone();
    let inputs: Vec<_> = [
        "hello world",
        "rivers meet the sea at the end of a long valley",
        "a third text",
        "the fourth one is a little longer than the others",
    ]
    .iter()
    .map(|t| {
        Tokenize::encode(
            tokenizer.as_ref(),
            &EmbedInput::Text((*t).into()),
            &EmbedOptions::default(),
        )
        .unwrap()
    })
    .collect();
    let mut call = || {
        embedder
            .embed_batch(&inputs, Output::Pooled)
            .expect("embeds")
            .vectors
    };
    // The first calls make the streams (and MLX's own threads).
    let first = call();
    for _ in 0..3 {
        assert_eq!(call(), first);
    }
    let before = threads();
    for _ in 0..12 {
        assert_eq!(call(), first, "the same vectors on every stream");
    }
    assert_eq!(
        threads(),
        before,
        "12 more calls started threads: streams made per call"
    );
}
