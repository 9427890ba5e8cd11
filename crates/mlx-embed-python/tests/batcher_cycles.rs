//! A program that starts and drops batchers again and again (a vector
//! database swapping its embedder) keeps a bounded number of threads: MLX
//! never frees the stream thread of an OS thread that used it, so each
//! model thread is kept for the next batcher. Its own test binary, so no
//! other test's threads come and go meanwhile.

use mlx_embed_core::{Batcher, BatcherConfig, EmbedInput, EmbedOptions};
use mlx_embed_python::{PythonEmbedder, PythonModelOptions};

#[cfg(target_os = "linux")]
fn os_threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

#[cfg(target_os = "linux")]
#[test]
fn starting_and_dropping_batchers_does_not_add_a_thread_each_time() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut first = None;
    let mut counts = Vec::new();
    for cycle in 0..12 {
        let options = PythonModelOptions::default();
        let batcher = Batcher::start(
            BatcherConfig {
                cache_bytes: 0,
                ..BatcherConfig::default()
            },
            move || PythonEmbedder::load_for_batcher(&options),
        )
        .expect("model loads");
        let out = runtime
            .block_on(batcher.embed(
                vec![EmbedInput::Text(format!("cycle {cycle}"))],
                EmbedOptions::default(),
            ))
            .unwrap();
        first.get_or_insert_with(|| out.vectors[0].clone());
        assert_eq!(out.vectors[0].len(), 384);
        drop(batcher);
        // The model thread leaves the model once it sees the batcher gone.
        std::thread::sleep(std::time::Duration::from_millis(200));
        counts.push(os_threads());
    }
    // Each cycle once added one (MLX's stream thread of a new model thread).
    assert!(
        counts[11] <= counts[1] + 2,
        "OS threads after each cycle: {counts:?}"
    );
}
