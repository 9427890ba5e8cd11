//! A program that loads a model on a thread that then exits, and goes on on
//! other threads (a Rust program's worker pool, a test harness): the
//! extension's allocator must keep serving them. With mimalloc 3 in the
//! extension the second thread's first allocation in it crashed (SIGSEGV
//! in `mi_thread_init`): the thread that first used it had been its main
//! thread, and its state went with it. One test in its own binary, so the
//! first thread to reach Python is the one this test spawns (which, as the
//! interpreter's first thread, keeps MLX's own streams; the later ones
//! borrow the engine's and give them back: `rust_thread_streams.rs`).

mod common;

use common::{embed, encode, fixture};
use mlx_embed_python::{PythonEmbedder, PythonModelOptions};

/// Loads `model` (None: the default) and embeds two texts, on the calling thread.
fn load_and_embed(model: Option<String>) -> Vec<f32> {
    let mut embedder = PythonEmbedder::load(&PythonModelOptions {
        model,
        ..PythonModelOptions::default()
    })
    .expect("model loads");
    let inputs = encode(&embedder, &["hello world", "rivers meet the sea"]);
    embed(&mut embedder, &inputs)
}

#[test]
fn threads_that_come_after_the_first_one_exits_are_served() {
    let first = std::thread::spawn(|| load_and_embed(None))
        .join()
        .expect("first thread");
    assert_eq!(first.len(), 2 * 384);
    for model in [Some(fixture("tiny-t5")), None, Some(fixture("tiny-mpnet"))] {
        let vectors = std::thread::spawn(move || load_and_embed(model))
            .join()
            .expect("a later thread");
        assert!(vectors.len() >= 2 && vectors.iter().all(|v| v.is_finite()));
    }
    let again = std::thread::spawn(|| load_and_embed(None)).join().unwrap();
    assert_eq!(again, first);
}
