//! Batcher overhead with a zero-cost model: per-request latency with one
//! caller, and requests/s through the queue with many concurrent callers.
//!
//! `cargo bench -p mlx-embed-core --bench batcher_overhead` (release build).
//! Optional argument: requests per scenario (default 200000).

use std::time::{Duration, Instant};

use std::sync::Arc;

use mlx_embed_core::{
    BatchOutput, Batcher, BatcherConfig, EmbedInput, EmbedOptions, Embedder, EmbedderError,
    Encoded, ModelInfo, Output, Tokenize,
};

const DIM: usize = 8;

/// Returns zeros at once, so everything measured is the batcher's own cost.
struct ZeroCost;

/// Four ids per input, from a hash of its text (so distinct texts are
/// distinct to the embedding cache): the batcher's tokenize step without a
/// tokenizer's cost.
struct FourIds;

impl Tokenize for FourIds {
    fn encode(&self, input: &EmbedInput, _: &EmbedOptions) -> Result<Encoded, EmbedderError> {
        let EmbedInput::Text(text) = input else {
            return Err(EmbedderError::invalid_input("text only"));
        };
        let h = text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        Ok(Encoded {
            ids: vec![1, h as u32, (h >> 32) as u32, 2],
            type_ids: None,
            untruncated_len: 4,
            pool_start: 0,
            token_pooling: None,
            adapter: None,
        })
    }
}

impl Embedder for ZeroCost {
    fn info(&self) -> ModelInfo {
        ModelInfo {
            name: "zero-cost".into(),
            dim: DIM,
            max_input_tokens: 512,
            ..ModelInfo::default()
        }
    }
    fn tokenizer(&self) -> Option<Arc<dyn Tokenize>> {
        Some(Arc::new(FourIds))
    }
    fn embed_batch(
        &mut self,
        inputs: &[Encoded],
        output: Output,
    ) -> Result<BatchOutput, EmbedderError> {
        if output != Output::Pooled {
            return Err(EmbedderError::invalid_input("pooled vectors only"));
        }
        Ok(BatchOutput {
            vectors: vec![0.0; inputs.len() * DIM],
            rows: vec![1; inputs.len()],
            padded_tokens: 4 * inputs.len() as u64,
            gil_wait: Duration::ZERO,
        })
    }
}

struct Outcome {
    requests: usize,
    elapsed: Duration,
    latencies: Vec<Duration>,
    batches: u64,
}

/// Request `i` of caller `c`: distinct texts (every one a cache miss), or a
/// few texts over and over (cache hits once seen).
fn distinct(c: usize, i: usize) -> String {
    format!("caller {c} request {i}")
}

fn repeated(_c: usize, i: usize) -> String {
    format!("popular text {}", i % 16)
}

fn run(
    runtime: &tokio::runtime::Runtime,
    config: BatcherConfig,
    callers: usize,
    requests: usize,
    text: fn(usize, usize) -> String,
) -> Outcome {
    let batcher = Batcher::start(config, || Ok(ZeroCost)).expect("start");
    let per_caller = requests / callers;
    let (elapsed, latencies) = runtime.block_on(async {
        // Warm-up: threads running, allocator primed (distinct texts, so a
        // cache does not answer them).
        for i in 0..1000 {
            batcher
                .embed(
                    vec![EmbedInput::Text(format!("warm up {i}"))],
                    EmbedOptions::default(),
                )
                .await
                .unwrap();
        }
        let started = Instant::now();
        let tasks: Vec<_> = (0..callers)
            .map(|c| {
                let b = batcher.clone();
                tokio::spawn(async move {
                    let mut lat = Vec::with_capacity(per_caller);
                    for i in 0..per_caller {
                        let input = EmbedInput::Text(text(c, i));
                        let t = Instant::now();
                        b.embed(vec![input], EmbedOptions::default()).await.unwrap();
                        lat.push(t.elapsed());
                    }
                    lat
                })
            })
            .collect();
        let mut all = Vec::with_capacity(requests);
        for t in tasks {
            all.extend(t.await.unwrap());
        }
        (started.elapsed(), all)
    });
    let batches = batcher.metrics().batches;
    Outcome {
        requests: per_caller * callers,
        elapsed,
        latencies,
        batches: batches.saturating_sub(1000),
    }
}

type Job = (EmbedInput, tokio::sync::oneshot::Sender<Vec<f32>>);

async fn round_trip(tx: &std::sync::mpsc::Sender<Job>, i: usize) {
    let (reply, answer) = tokio::sync::oneshot::channel();
    tx.send((EmbedInput::Text(format!("request {i}")), reply))
        .unwrap();
    answer.await.unwrap();
}

/// The floor for any design with a dedicated model thread: one caller
/// sending each request to a bare thread and waiting for its reply, with no
/// admission, queue or batching at all.
fn bare_round_trip(runtime: &tokio::runtime::Runtime, requests: usize) -> Outcome {
    let (tx, rx) = std::sync::mpsc::channel::<Job>();
    let worker = std::thread::spawn(move || {
        for (_input, reply) in rx {
            let _ = reply.send(vec![0.0; DIM]);
        }
    });
    let (elapsed, latencies) = runtime.block_on(async move {
        for i in 0..1000 {
            round_trip(&tx, i).await;
        }
        let task = tokio::spawn(async move {
            let mut lat = Vec::with_capacity(requests);
            let started = Instant::now();
            for i in 0..requests {
                let t = Instant::now();
                round_trip(&tx, i).await;
                lat.push(t.elapsed());
            }
            (started.elapsed(), lat)
        });
        task.await.unwrap()
    });
    worker.join().unwrap();
    Outcome {
        requests,
        elapsed,
        latencies,
        batches: requests as u64,
    }
}

fn report(label: &str, mut o: Outcome) {
    o.latencies.sort();
    let pct =
        |p: f64| o.latencies[((o.latencies.len() - 1) as f64 * p) as usize].as_secs_f64() * 1e6;
    let mean = o.latencies.iter().sum::<Duration>().as_secs_f64() * 1e6 / o.latencies.len() as f64;
    let per_request = o.elapsed.as_secs_f64() * 1e6 / o.requests as f64;
    println!(
        "| {label} | {} | {:.0} | {per_request:.2} | {mean:.1} | {:.1} | {:.1} | {:.1} |",
        o.requests,
        o.requests as f64 / o.elapsed.as_secs_f64(),
        pct(0.5),
        pct(0.99),
        o.requests as f64 / o.batches.max(1) as f64,
    );
}

fn main() {
    // `cargo bench` passes `--bench`; take the first numeric argument, if any.
    let requests: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(200_000);
    let multi = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let current = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // The batcher alone: no embedding cache (its rows are below).
    let batching = BatcherConfig {
        max_concurrent_requests: 4096,
        cache_bytes: 0,
        ..BatcherConfig::default()
    };
    let cached = BatcherConfig {
        cache_bytes: BatcherConfig::default().cache_bytes,
        ..batching.clone()
    };
    let serial = BatcherConfig {
        enable_batching: false,
        ..batching.clone()
    };

    println!(
        "cores: {}",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!("| scenario | requests | requests/s | wall µs per request | mean latency µs | p50 µs | p99 µs | inputs per batch |");
    println!("|---|---|---|---|---|---|---|---|");
    report(
        "baseline: bare thread round trip, current-thread",
        bare_round_trip(&current, requests / 4),
    );
    report(
        "baseline: bare thread round trip, multi-thread",
        bare_round_trip(&multi, requests / 4),
    );
    report(
        "1 caller, current-thread runtime",
        run(&current, batching.clone(), 1, requests / 4, distinct),
    );
    report(
        "1 caller, multi-thread runtime (2 workers)",
        run(&multi, batching.clone(), 1, requests / 4, distinct),
    );
    report(
        "64 callers, multi-thread (2 workers)",
        run(&multi, batching.clone(), 64, requests, distinct),
    );
    report(
        "256 callers, multi-thread (2 workers)",
        run(&multi, batching.clone(), 256, requests, distinct),
    );
    report(
        "64 callers, current-thread runtime",
        run(&current, batching.clone(), 64, requests, distinct),
    );
    report(
        "64 callers, multi-thread, enable_batching=false",
        run(&multi, serial, 64, requests / 4, distinct),
    );
    report(
        "64 callers, multi-thread, cache on, every text new (misses)",
        run(&multi, cached.clone(), 64, requests, distinct),
    );
    report(
        "64 callers, multi-thread, cache on, 16 texts repeated (hits)",
        run(&multi, cached, 64, requests, repeated),
    );
}
