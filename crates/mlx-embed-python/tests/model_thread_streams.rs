//! A Rust thread that calls the model again and again (the batcher's model
//! thread) with `streams > 1`: the pipelined path's extra streams are made
//! once and reused, not made on every call. The engine keeps them per
//! Python thread state (`Scheduler._thread_streams`), so this checks that a
//! Rust thread keeps one Python thread state from call to call; on the CPU
//! every MLX stream that runs work starts a scheduler thread that never
//! ends, so streams made per call show as threads. Its own binary, so no
//! other test's threads come and go meanwhile.

mod common;

use common::{embed, encode, fixture};
use mlx_embed_python::{EngineOptions, PythonEmbedder, PythonModelOptions};

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

#[test]
fn extra_streams_are_made_once_per_model_thread() {
    let mut embedder = PythonEmbedder::load(&PythonModelOptions {
        model: Some(fixture("tiny-modernbert")),
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
    let inputs = encode(
        &embedder,
        &[
            "hello world",
            "rivers meet the sea at the end of a long valley",
            "a third text",
            "the fourth one is a little longer than the others",
        ],
    );
    let mut call = || embed(&mut embedder, &inputs);
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
