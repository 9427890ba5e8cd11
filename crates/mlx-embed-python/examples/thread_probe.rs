//! The threads and memory a Rust program keeps after loading a model on
//! threads that come and go (`scripts/bench_rust_threads.py` runs it):
//! `thread_probe fresh N` loads the model and embeds once on each of N
//! fresh threads, one after another; `thread_probe batcher N` does the same
//! inside N `Batcher::start`s, one after another. Both first load once on
//! the main thread (the interpreter's first thread), then print one JSON
//! line: OS threads and resident MB before and after the N, and the
//! streams the engine lent (`mlx_embed.device.lent_streams`). Linux only.

use mlx_embed_core::{
    Batcher, BatcherConfig, EmbedInput, EmbedOptions, Embedder, Output, Tokenize,
};
use mlx_embed_python::{PythonEmbedder, PythonModelOptions};
use pyo3::prelude::*;

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

fn rss_mb() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    // SAFETY: a plain libc call.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
    pages * page / (1024 * 1024)
}

fn lent() -> usize {
    Python::attach(|py| {
        py.import("mlx_embed.device")?
            .getattr("lent_streams")?
            .call0()?
            .extract()
    })
    .unwrap()
}

fn load_and_embed() -> usize {
    let mut model = PythonEmbedder::load(&PythonModelOptions::default()).expect("model loads");
    let input = Tokenize::encode(
        model.hf_tokenizer().as_ref(),
        &EmbedInput::Text("a text to embed".into()),
        &EmbedOptions::default(),
    )
    .unwrap();
    model
        .embed_batch(&[input], Output::Pooled)
        .expect("embeds")
        .vectors
        .len()
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "fresh".into());
    let n: usize = args.next().map_or(20, |n| n.parse().expect("N"));
    load_and_embed();
    // A joined thread's OS thread may still be ending.
    let settle = || std::thread::sleep(std::time::Duration::from_millis(300));
    settle();
    let before = (threads(), rss_mb());
    match mode.as_str() {
        "fresh" => {
            for _ in 0..n {
                std::thread::spawn(load_and_embed).join().unwrap();
            }
        }
        "batcher" => {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            for _ in 0..n {
                let batcher = Batcher::start(
                    BatcherConfig {
                        cache_bytes: 0,
                        ..BatcherConfig::default()
                    },
                    || PythonEmbedder::load_for_batcher(&PythonModelOptions::default()),
                )
                .expect("model loads");
                runtime
                    .block_on(batcher.embed(
                        vec![EmbedInput::Text("a text to embed".into())],
                        EmbedOptions::default(),
                    ))
                    .unwrap();
                drop(batcher);
                // The model thread leaves the model once it sees the batcher gone.
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
        }
        other => panic!("mode is fresh or batcher, not {other}"),
    }
    settle();
    let after = (threads(), rss_mb());
    println!(
        "{{\"mode\": \"{mode}\", \"n\": {n}, \"threads\": [{}, {}], \"rss_mb\": [{}, {}], \"lent_streams\": {}}}",
        before.0,
        after.0,
        before.1,
        after.1,
        lent()
    );
}
