//! Rust threads that come and go (a thread per load, a burst of threads at
//! once, tokio's blocking pool) borrow the engine's MLX streams and give
//! them back as they end: the process keeps as many MLX stream threads as
//! calls ran at once, a second round of the same work adds no thread and no
//! stream, every vector is the main thread's bit for bit, and the process
//! exits cleanly (an abort at exit fails the test binary). Before, each such
//! thread kept MLX's own default stream, with its scheduler thread and
//! buffers, for good. Its own binary, so no other test's threads come and go
//! meanwhile; one test, so the phases run in order.

#![cfg(target_os = "linux")]

mod common;

use std::sync::{Arc, Barrier};
use std::time::Duration;

use common::{encode, fixture};
use mlx_embed_core::{DeviceKind, Embedder};
use mlx_embed_python::{EngineOptions, PythonEmbedder, PythonModelOptions};
use pyo3::prelude::*;

fn options(engine: EngineOptions) -> PythonModelOptions {
    PythonModelOptions {
        model: Some(fixture("tiny-modernbert")),
        engine,
        ..PythonModelOptions::default()
    }
}

const TEXTS: [&str; 3] = [
    "hello world",
    "rivers meet the sea",
    "a third text, a little longer than the other two",
];

fn embed(embedder: &mut PythonEmbedder) -> Vec<f32> {
    let inputs = encode(embedder, &TEXTS);
    common::embed(embedder, &inputs)
}

fn load_and_embed() -> Vec<f32> {
    let mut embedder = PythonEmbedder::load(&options(EngineOptions::default())).expect("loads");
    embed(&mut embedder)
}

/// The process's OS threads, once the count holds still (a joined thread's
/// OS thread may still be finishing its exit, and MLX's stream threads end
/// a moment after their stream is dropped).
fn threads() -> usize {
    let count = || std::fs::read_dir("/proc/self/task").unwrap().count();
    let mut n = count();
    for _ in 0..100 {
        std::thread::sleep(Duration::from_millis(10));
        let again = count();
        if again == n {
            return n;
        }
        n = again;
    }
    n
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot = |x: &[f32], y: &[f32]| -> f64 {
        x.iter()
            .zip(y)
            .map(|(p, q)| f64::from(*p) * f64::from(*q))
            .sum()
    };
    dot(a, b) / (dot(a, a).sqrt() * dot(b, b).sqrt())
}

/// Streams the engine has made for lending (`mlx_embed.device.lent_streams`).
fn lent() -> usize {
    Python::attach(|py| {
        py.import("mlx_embed.device")?
            .getattr("lent_streams")?
            .call0()?
            .extract()
    })
    .unwrap()
}

/// Streams back in the engine's free list, ready to lend: all the lent ones
/// once every thread that borrowed has ended.
fn free() -> usize {
    Python::attach(|py| {
        py.eval(
            c"sum(map(len, __import__('mlx_embed.device').device._free_streams.values()))",
            None,
            None,
        )?
        .extract()
    })
    .unwrap()
}

/// One round: 8 threads one after another, each loading the model and
/// embedding; 4 threads at once on one model, each holding its lease until
/// all four have called; 16 calls on tokio's blocking pool, whose threads
/// end once idle. Returns every vector.
fn round(model: &PythonEmbedder) -> Vec<Vec<f32>> {
    let mut out = Vec::new();
    for _ in 0..8 {
        out.push(std::thread::spawn(load_and_embed).join().unwrap());
    }
    let all_called = Arc::new(Barrier::new(4));
    let burst: Vec<_> = (0..4)
        .map(|_| {
            let mut replica = (model.replica().unwrap())().unwrap();
            let all_called = all_called.clone();
            std::thread::spawn(move || {
                let v = embed(&mut replica);
                all_called.wait();
                v
            })
        })
        .collect();
    out.extend(burst.into_iter().map(|t| t.join().unwrap()));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .max_blocking_threads(2)
        .thread_keep_alive(Duration::from_millis(5))
        .build()
        .unwrap();
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let mut replica = (model.replica().unwrap())().unwrap();
            runtime.spawn_blocking(move || embed(&mut replica))
        })
        .collect();
    for task in tasks {
        out.push(runtime.block_on(task).unwrap());
        // Idle long enough that the pool lets a thread go now and then.
        std::thread::sleep(Duration::from_millis(20));
    }
    // Waits for the blocking pool's threads to end.
    drop(runtime);
    out
}

#[test]
fn rust_threads_that_come_and_go_give_their_streams_back() {
    // The thread that starts the interpreter keeps MLX's own streams.
    let mut model = PythonEmbedder::load(&options(EngineOptions::default())).expect("loads");
    let reference = embed(&mut model);
    let (t0, s0) = (threads(), lent());
    assert_eq!(s0, 0, "the interpreter's first thread borrows nothing");

    let first = round(&model);
    let (t1, s1) = (threads(), lent());
    let second = round(&model);
    let (t2, s2) = (threads(), lent());

    assert_eq!(first.len(), 28);
    for v in first.iter().chain(&second) {
        assert_eq!(
            v, &reference,
            "a Rust thread's vectors are the main thread's"
        );
    }
    // The burst's four held a lease each at once: four streams, no more,
    // whatever the 24 other threads that called (on a GPU each thread also
    // borrows a CPU stream).
    let per_thread = match mlx_embed_python::interpreter::default_device().unwrap() {
        DeviceKind::Cpu => 1,
        DeviceKind::Accelerator => 2,
    };
    assert_eq!(s1, 4 * per_thread, "streams lent after the first round");
    assert_eq!(s2, s1, "the second round made streams");
    assert_eq!(free(), s2, "every thread that ended gave its streams back");
    // On the CPU one MLX scheduler thread per lent stream, not one per
    // thread that called (28 threads, 14 more a round before).
    assert!(
        t1 <= t0 + s1,
        "threads: {t0} before, {t1} after 28 calling threads ({s1} streams lent)"
    );
    assert!(
        t2 <= t1,
        "threads: {t1} after the first round, {t2} after the second"
    );

    // A long-lived Rust thread (a batcher's model thread) with 3 streams a
    // call: its two extra streams are borrowed once and kept, call after call.
    let kept = std::thread::spawn(move || {
        let mut model = PythonEmbedder::load(&options(EngineOptions {
            pipeline: Some(true),
            streams: Some(3),
            batch_tokens: Some(16),
            ..EngineOptions::default()
        }))
        .expect("loads");
        let first = embed(&mut model);
        let after_first = lent();
        for _ in 0..12 {
            assert_eq!(embed(&mut model), first);
        }
        (first, after_first, lent())
    });
    let (vectors, after_first, after_13) = kept.join().unwrap();
    // Not bit for bit: 16 tokens a batch splits the texts into other
    // batches, padded to other lengths, than the reference's one batch.
    assert_eq!(vectors.len(), reference.len());
    let dim = reference.len() / TEXTS.len();
    for (got, want) in vectors.chunks(dim).zip(reference.chunks(dim)) {
        let c = cosine(got, want);
        assert!(c >= 0.99999, "3 streams, 16 tokens a batch: cosine {c}");
    }
    // Its default and two extras, from the free list, which had them.
    assert_eq!(after_first, s2, "streams made for its first call");
    assert_eq!(after_13, after_first, "12 more calls borrowed more streams");
    // And they came back: a second such thread makes none.
    let again = std::thread::spawn(move || {
        let mut model = PythonEmbedder::load(&options(EngineOptions {
            pipeline: Some(true),
            streams: Some(3),
            ..EngineOptions::default()
        }))
        .expect("loads");
        embed(&mut model)
    })
    .join()
    .unwrap();
    assert_eq!(again, reference);
    assert_eq!(
        lent(),
        after_first,
        "the model thread kept its streams at its end"
    );

    // A thread that panics after its call gives its streams back as it unwinds.
    let panicked = std::thread::spawn(|| {
        load_and_embed();
        panic!("after a model call");
    })
    .join();
    assert!(panicked.is_err());
    assert_eq!(
        (lent(), free()),
        (after_first, after_first),
        "streams made and free after a thread that panicked"
    );
}
