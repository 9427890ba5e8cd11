//! Per-call phase times (`Embeddings::timings`): each phase measured where
//! it happens, and together never more than the call took.

mod common;

use std::time::{Duration, Instant};

use common::*;
use mlx_embed_core::{BatcherConfig, EmbedOptions, Timings};
use tokio::time::timeout;

fn phases(t: &Timings) -> Duration {
    t.tokenization + t.queue + t.inference
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inference_is_the_model_time_of_every_batch_that_computed_the_call() {
    let delay = Duration::from_millis(30);
    let config = BatcherConfig {
        max_batch_size: 2,
        cache_bytes: 0,
        ..BatcherConfig::default()
    };
    let (batcher, record) = start(config, delay, None);
    let started = Instant::now();
    let got = batcher
        .embed(texts(&["a", "b", "c"]), EmbedOptions::default())
        .await
        .unwrap();
    let took = started.elapsed();
    assert_eq!(record.batches().len(), 2, "three inputs in batches of two");
    let t = got.timings;
    assert!(t.inference >= 2 * delay, "{t:?}");
    assert!(t.tokenization > Duration::ZERO, "{t:?}");
    assert!(phases(&t) <= took, "{t:?} within {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_is_the_wait_behind_a_busy_model() {
    let gate = Gate::closed();
    let config = BatcherConfig {
        cache_bytes: 0,
        ..BatcherConfig::default()
    };
    let (batcher, record) = start(config, Duration::ZERO, Some(gate.clone()));
    let first = occupy_model(&batcher, &record, "first").await;
    let b = batcher.clone();
    let started = Instant::now();
    let second = tokio::spawn(async move {
        let got = b.embed(texts(&["second"]), EmbedOptions::default()).await;
        (got, started.elapsed())
    });
    let held = Duration::from_millis(60);
    tokio::time::sleep(held).await;
    gate.open();
    let first = timeout(LIMIT, first).await.unwrap().unwrap().unwrap();
    let (second, took) = timeout(LIMIT, second).await.unwrap().unwrap();
    let second = second.unwrap();
    // The first call's batch sat on the model while the gate was shut.
    assert!(first.timings.inference >= held, "{:?}", first.timings);
    assert!(first.timings.queue < held, "{:?}", first.timings);
    // The second waited in the queue for it, and ran in no time.
    assert!(second.timings.queue >= held, "{:?}", second.timings);
    assert!(second.timings.inference < held, "{:?}", second.timings);
    assert!(phases(&second.timings) <= took);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_the_cache_answers_whole_has_no_queue_or_inference() {
    let (batcher, _record) = start(BatcherConfig::default(), Duration::from_millis(5), None);
    let first = batcher
        .embed(texts(&["cached"]), EmbedOptions::default())
        .await
        .unwrap();
    assert!(first.timings.inference >= Duration::from_millis(5));
    let again = batcher
        .embed(texts(&["cached"]), EmbedOptions::default())
        .await
        .unwrap();
    assert_eq!(again.cache_hits, 1);
    assert_eq!(again.timings.queue, Duration::ZERO);
    assert_eq!(again.timings.inference, Duration::ZERO);
    assert!(again.timings.tokenization > Duration::ZERO);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenization_is_the_time_the_tokenizer_took() {
    let (batcher, _record) = start(BatcherConfig::default(), Duration::ZERO, None);
    let text = format!("a {SLOW_TOKENIZE} text");
    let got = batcher
        .embed(owned_texts(&[text]), EmbedOptions::default())
        .await
        .unwrap();
    assert!(
        got.timings.tokenization >= SLOW_TOKENIZE_TIME,
        "{:?}",
        got.timings
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_input_s_tokens_are_counted_cache_hits_too() {
    let (batcher, _record) = start(BatcherConfig::default(), Duration::ZERO, None);
    for _ in 0..2 {
        batcher
            .embed(texts(&["ab", "abcdefgh"]), EmbedOptions::default())
            .await
            .unwrap();
    }
    let m = batcher.metrics();
    // One batch (the second call was the cache's): TEI's batch tokens are
    // the real ones, 4 + 10, where the padded count is 2 x 10.
    assert_eq!(m.batches, 1);
    let real = &m.batch_real_tokens;
    assert_eq!((real.count, real.sum), (1, 14.0));
    assert_eq!(m.batch_tokens.sum, 20.0);
    assert_eq!(real.sum, m.real_tokens as f64);
    let h = m.input_tokens;
    // Two markers around a token per byte: 4 and 10 tokens, twice each.
    assert_eq!((h.count, h.sum), (4, 28.0));
    assert_eq!(
        h.counts[h.bounds.iter().position(|&b| b == 4.0).unwrap()],
        2
    );
    assert_eq!(
        h.counts[h.bounds.iter().position(|&b| b == 16.0).unwrap()],
        2
    );
}
