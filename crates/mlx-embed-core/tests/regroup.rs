//! The regroup window (`BatcherConfig::regroup_window`): after a batch is
//! answered, the next cut waits for its callers to come back, so callers
//! that share a pass keep sharing one; a caller that comes straight back
//! alone never waits, and nothing waits past the window.

mod common;

use std::time::{Duration, Instant};

use common::*;
use mlx_embed_core::{BatcherConfig, EmbedOptions, Priority};
use tokio::time::timeout;

fn regrouping(window: Duration) -> BatcherConfig {
    BatcherConfig {
        regroup_window: window,
        ..BatcherConfig::default()
    }
}

fn high() -> EmbedOptions {
    EmbedOptions {
        priority: Priority::High,
        ..EmbedOptions::default()
    }
}

type Caller =
    tokio::task::JoinHandle<Result<mlx_embed_core::Embeddings, mlx_embed_core::CoreError>>;

/// One-text requests behind a busy model, queued one at a time so they
/// queue in this order.
async fn queue_in_order(batcher: &mlx_embed_core::Batcher, these: &[&'static str]) -> Vec<Caller> {
    let mut queued = Vec::new();
    for (k, &t) in these.iter().enumerate() {
        let b = batcher.clone();
        queued.push(tokio::spawn(async move {
            b.embed(texts(&[t]), EmbedOptions::default()).await
        }));
        eventually(&format!("{t} queued"), || {
            batcher.metrics().queued_inputs == k as u64 + 1
        })
        .await;
    }
    queued
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_answered_together_come_back_to_one_batch() {
    let (batcher, record) = start(regrouping(Duration::from_secs(5)), Duration::ZERO, None);
    let first = batcher
        .embed(texts(&["a1", "b1"]), EmbedOptions::default())
        .await
        .unwrap();
    assert_answer(&["a1".into(), "b1".into()], &first);
    // Two inputs were answered: "a2" alone waits for a second one.
    let started = Instant::now();
    let a = {
        let b = batcher.clone();
        tokio::spawn(async move { b.embed(texts(&["a2"]), EmbedOptions::default()).await })
    };
    eventually("a2 queued", || batcher.metrics().queued_inputs == 1).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let b2 = timeout(
        LIMIT,
        batcher.embed(texts(&["b2"]), EmbedOptions::default()),
    )
    .await
    .unwrap()
    .unwrap();
    let a2 = timeout(LIMIT, a).await.unwrap().unwrap().unwrap();
    assert_answer(&["a2".into()], &a2);
    assert_answer(&["b2".into()], &b2);
    assert_eq!(
        record.batches(),
        vec![
            vec!["a1".to_string(), "b1".to_string()],
            vec!["a2".to_string(), "b2".to_string()],
        ]
    );
    // It ended when "b2" came, not at the window's end.
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "current_thread")]
async fn a_lone_caller_coming_straight_back_never_waits() {
    let (batcher, record) = start(regrouping(Duration::from_secs(5)), Duration::ZERO, None);
    let took = lone_requests(&batcher, 100).await;
    // One wait for the window would take 5 s.
    assert!(
        took < Duration::from_secs(2),
        "100 lone requests took {took:?}"
    );
    assert_eq!(record.batches().len(), 100);
}

#[tokio::test(flavor = "current_thread")]
async fn the_wait_ends_at_the_window() {
    let window = Duration::from_millis(150);
    let (batcher, record) = start(regrouping(window), Duration::ZERO, None);
    batcher
        .embed(texts(&["x1", "y1", "z1"]), EmbedOptions::default())
        .await
        .unwrap();
    // Three answered, one comes back: it waits out the window, then runs alone.
    let started = Instant::now();
    let got = timeout(
        LIMIT,
        batcher.embed(texts(&["x2"]), EmbedOptions::default()),
    )
    .await
    .unwrap()
    .unwrap();
    let waited = started.elapsed();
    assert_answer(&["x2".into()], &got);
    assert!(
        waited >= Duration::from_millis(100),
        "ended early: {waited:?}"
    );
    assert!(waited < Duration::from_secs(3), "{waited:?}");
    assert_eq!(record.batches().last().unwrap(), &vec!["x2".to_string()]);
}

#[tokio::test(flavor = "current_thread")]
async fn a_high_priority_input_ends_the_wait() {
    let (batcher, record) = start(regrouping(Duration::from_secs(5)), Duration::ZERO, None);
    batcher
        .embed(texts(&["bulk1", "bulk2", "bulk3"]), EmbedOptions::default())
        .await
        .unwrap();
    let started = Instant::now();
    let got = timeout(LIMIT, batcher.embed(texts(&["query"]), high()))
        .await
        .unwrap()
        .unwrap();
    assert_answer(&["query".into()], &got);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(record.batches().last().unwrap(), &vec!["query".to_string()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_batch_goes_at_once() {
    let config = BatcherConfig {
        max_batch_size: 2,
        ..regrouping(Duration::from_secs(1))
    };
    let gate = Gate::closed();
    let (batcher, record) = start(config, Duration::ZERO, Some(gate.clone()));
    let m = occupy_model(&batcher, &record, "m").await;
    let mut queued = queue_in_order(&batcher, &["w1", "w2", "w3"]).await;
    let started = Instant::now();
    gate.open();
    timeout(LIMIT, m).await.unwrap().unwrap().unwrap();
    let w3 = queued.pop().unwrap();
    for task in queued {
        timeout(LIMIT, task).await.unwrap().unwrap().unwrap();
    }
    // "m" was answered with three inputs queued: a full batch of two went
    // without waiting for "m"'s caller.
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "{:?}",
        started.elapsed()
    );
    timeout(LIMIT, w3).await.unwrap().unwrap().unwrap();
    assert_eq!(
        record.batches(),
        vec![
            vec!["m".to_string()],
            vec!["w1".to_string(), "w2".to_string()],
            vec!["w3".to_string()],
        ]
    );
}

#[tokio::test(flavor = "current_thread")]
async fn a_request_cut_over_several_batches_waits_for_nobody() {
    let config = BatcherConfig {
        max_batch_size: 4,
        ..regrouping(Duration::from_secs(5))
    };
    let (batcher, record) = start(config, Duration::ZERO, None);
    let ten: Vec<String> = (0..10).map(|i| format!("t{i}")).collect();
    let started = Instant::now();
    for round in 0..3 {
        let inputs: Vec<String> = ten.iter().map(|t| format!("{t} r{round}")).collect();
        let got = timeout(
            LIMIT,
            batcher.embed(owned_texts(&inputs), EmbedOptions::default()),
        )
        .await
        .unwrap()
        .unwrap();
        assert_answer(&inputs, &got);
    }
    // Only the last batch of each round answers its caller; the first two
    // answer nobody, so nothing waits for a caller to come back.
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    let sizes: Vec<usize> = record.batches().iter().map(Vec::len).collect();
    assert_eq!(sizes, vec![4, 4, 2, 4, 4, 2, 4, 4, 2]);
}

#[tokio::test(flavor = "current_thread")]
async fn inputs_the_cache_answers_count_as_come_back() {
    let (batcher, record) = start(regrouping(Duration::from_secs(5)), Duration::ZERO, None);
    batcher
        .embed(texts(&["seen1", "seen2"]), EmbedOptions::default())
        .await
        .unwrap();
    // Two answered; two come back from the cache, the new one runs at once.
    let started = Instant::now();
    let got = timeout(
        LIMIT,
        batcher.embed(texts(&["seen1", "seen2", "new"]), EmbedOptions::default()),
    )
    .await
    .unwrap()
    .unwrap();
    assert_answer(&["seen1".into(), "seen2".into(), "new".into()], &got);
    assert_eq!(got.cache_hits, 2);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(record.batches().last().unwrap(), &vec!["new".to_string()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_full_by_tokens_goes_at_once() {
    // Each text is 8 tokens with its specials: two fill the 16-token budget.
    let config = BatcherConfig {
        max_batch_tokens: 16,
        ..regrouping(Duration::from_secs(5))
    };
    let gate = Gate::closed();
    let (batcher, record) = start(config, Duration::ZERO, Some(gate.clone()));
    let m = occupy_model(&batcher, &record, "m").await;
    let queued = queue_in_order(&batcher, &["aaaaaa", "bbbbbb"]).await;
    let started = Instant::now();
    gate.open();
    timeout(LIMIT, m).await.unwrap().unwrap().unwrap();
    for task in queued {
        timeout(LIMIT, task).await.unwrap().unwrap().unwrap();
    }
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        record.batches(),
        vec![
            vec!["m".to_string()],
            vec!["aaaaaa".to_string(), "bbbbbb".to_string()],
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_batching_nothing_waits() {
    let config = BatcherConfig {
        enable_batching: false,
        ..regrouping(Duration::from_secs(5))
    };
    let (batcher, _record) = start(config, Duration::ZERO, None);
    batcher
        .embed(texts(&["x1", "y1", "z1"]), EmbedOptions::default())
        .await
        .unwrap();
    let started = Instant::now();
    timeout(
        LIMIT,
        batcher.embed(texts(&["x2"]), EmbedOptions::default()),
    )
    .await
    .unwrap()
    .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
}
