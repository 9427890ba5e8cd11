//! Batching: right answers, FIFO, budgets, fairness for huge requests, serial mode.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use mlx_embed_core::{Batcher, BatcherConfig, EmbedInput, EmbedOptions};
use tokio::time::timeout;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_concurrent_callers_get_their_own_vectors() {
    let (batcher, record) = start(BatcherConfig::default(), Duration::from_micros(200), None);
    let mut tasks = Vec::new();
    for i in 0..1000 {
        let b = batcher.clone();
        tasks.push(tokio::spawn(async move {
            // Some callers send several inputs, so requests of different sizes share batches.
            let texts: Vec<String> = (0..(i % 3 + 1))
                .map(|j| format!("caller {i} input {j}"))
                .collect();
            let got = b
                .embed(owned_texts(&texts), EmbedOptions::default())
                .await
                .expect("embed");
            assert_answer(&texts, &got);
        }));
    }
    for t in tasks {
        timeout(LIMIT, t).await.expect("in time").expect("task");
    }
    let m = batcher.metrics();
    assert_eq!(m.requests_ok, 1000);
    assert_eq!(m.in_flight_inputs, 0);
    assert_eq!(m.queued_inputs, 0);
    assert_eq!(m.waiting_inputs, 0);
    let computed = record.computed().len() as u64;
    assert_eq!(
        computed,
        (0..1000u64).map(|i| i % 3 + 1).sum::<u64>(),
        "each input computed once"
    );
    assert!(
        m.batches < 1000,
        "concurrent callers were batched ({} batches)",
        m.batches
    );
    assert_eq!(m.batch_size.count, m.batches);
    assert_eq!(m.model_seconds.count, m.batches);
    assert_eq!(m.gil_wait_seconds.count, m.batches);
    assert_eq!(m.queue_wait_seconds.count, 1000);
    assert!(m.real_tokens > 0 && m.padded_tokens >= m.real_tokens);
    assert_eq!(
        record.thread_name.lock().unwrap().as_deref(),
        Some("mlx-embed-model")
    );
}

#[tokio::test(flavor = "current_thread")]
async fn batches_are_fifo_and_within_budgets() {
    let gate = Gate::closed();
    let config = BatcherConfig {
        max_batch_size: 8,
        max_batch_tokens: 120,
        ..BatcherConfig::default()
    };
    let (batcher, record) = start(config.clone(), Duration::ZERO, Some(gate.clone()));
    // Text lengths vary so the token budget, not only the size, cuts batches;
    // one input alone is bigger than the whole budget. Every text is longer
    // than a turn of tokens (120 / 16 = 7), so none is query-sized (those go
    // first, see queue.rs) and the lane serves them strictly in turn.
    let mut order = Vec::new();
    let mut handles = Vec::new();
    for i in 0..300 {
        let len = match i {
            150 => 1000,
            200..260 => 2,
            _ => 2 + (i * 37) % 88,
        };
        let text = format!("{i:04}{}", "x".repeat(len));
        order.push(text.clone());
        let b = batcher.clone();
        handles.push(tokio::spawn(async move {
            let got = b
                .embed(
                    vec![EmbedInput::Text(text.clone())],
                    EmbedOptions::default(),
                )
                .await
                .expect("embed");
            assert_answer(&[text], &got);
        }));
        // Requests are tokenized on the blocking pool before they queue, so
        // queue order is the order tokenization finishes: admit one at a time.
        eventually("admitted", || {
            batcher.metrics().in_flight_inputs == i as u64 + 1
        })
        .await;
    }
    gate.open();
    for h in handles {
        timeout(LIMIT, h).await.unwrap().unwrap();
    }
    let batches = record.batches();
    assert_eq!(batches.concat(), order, "inputs computed in FIFO order");
    for batch in &batches {
        assert!(batch.len() <= config.max_batch_size);
        let padded = batch.iter().map(|t| tokens_for(t) as usize).max().unwrap() * batch.len();
        assert!(
            padded <= config.max_batch_tokens || batch.len() == 1,
            "batch over token budget: {padded}"
        );
    }
    assert!(
        batches.iter().any(|b| b.len() == 1 && b[0].len() > 1000),
        "oversized input ran alone"
    );
    assert!(
        batches.iter().any(|b| b.len() == config.max_batch_size),
        "size budget was reached"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_request_is_split_in_order_and_does_not_starve_small_ones() {
    let config = BatcherConfig {
        max_batch_size: 32,
        max_concurrent_requests: 10_000,
        ..BatcherConfig::default()
    };
    let (batcher, record) = start(config, Duration::from_micros(300), None);
    let big: Vec<String> = (0..5000).map(|i| format!("big {i}")).collect();
    let big_done = {
        let b = batcher.clone();
        let big = big.clone();
        tokio::spawn(async move {
            let got = b
                .embed(owned_texts(&big), EmbedOptions::default())
                .await
                .expect("big embed");
            assert_answer(&big, &got);
            Instant::now()
        })
    };
    eventually("big request started", || !record.batches().is_empty()).await;
    let mut small = Vec::new();
    for i in 0..20 {
        let b = batcher.clone();
        small.push(tokio::spawn(async move {
            let texts = vec![format!("small {i} a"), format!("small {i} b")];
            let got = b
                .embed(owned_texts(&texts), EmbedOptions::default())
                .await
                .expect("small embed");
            assert_answer(&texts, &got);
            Instant::now()
        }));
    }
    let mut last_small = None;
    for s in small {
        let t = timeout(LIMIT, s).await.unwrap().unwrap();
        last_small = last_small.max(Some(t));
    }
    let big_at = timeout(LIMIT, big_done).await.unwrap().unwrap();
    assert!(
        last_small.unwrap() < big_at,
        "small requests finished before the huge one"
    );
    let batches = record.batches();
    assert!(batches.iter().all(|b| b.len() <= 32));
    let big_seen: Vec<String> = batches
        .concat()
        .into_iter()
        .filter(|t| t.starts_with("big"))
        .collect();
    assert_eq!(big_seen, big, "big request computed once, in order");
    // The small ones ran early, not after the 5,000 inputs.
    let first_small = batches
        .iter()
        .position(|b| b.iter().any(|t| t.starts_with("small")))
        .unwrap();
    let last_small_batch = batches
        .iter()
        .rposition(|b| b.iter().any(|t| t.starts_with("small")))
        .unwrap();
    assert!(
        last_small_batch < batches.len() / 2,
        "smalls interleaved early (first {first_small}, last {last_small_batch} of {})",
        batches.len()
    );
}

#[tokio::test(flavor = "current_thread")]
async fn serial_mode_never_mixes_requests() {
    let gate = Gate::closed();
    let config = BatcherConfig {
        enable_batching: false,
        max_batch_size: 4,
        ..BatcherConfig::default()
    };
    let (batcher, record) = start(config, Duration::ZERO, Some(gate.clone()));
    let mut handles = Vec::new();
    let mut total = 0;
    for r in 0..40 {
        let n = r % 7 + 1;
        total += n;
        let texts: Vec<String> = (0..n).map(|j| format!("r{r}-{j}")).collect();
        let b = batcher.clone();
        handles.push(tokio::spawn(async move {
            let got = b
                .embed(owned_texts(&texts), EmbedOptions::default())
                .await
                .expect("embed");
            assert_answer(&texts, &got);
        }));
    }
    eventually("all admitted", || {
        batcher.metrics().in_flight_inputs as usize == total
    })
    .await;
    gate.open();
    for h in handles {
        timeout(LIMIT, h).await.unwrap().unwrap();
    }
    for batch in record.batches() {
        assert!(batch.len() <= 4);
        let owner = |t: &String| t.split('-').next().unwrap().to_string();
        assert!(
            batch.iter().all(|t| owner(t) == owner(&batch[0])),
            "two requests in one batch: {batch:?}"
        );
    }
}

#[tokio::test(flavor = "current_thread")]
async fn batch_window_gathers_company_on_an_idle_model() {
    let config = BatcherConfig {
        batch_window: Duration::from_millis(100),
        ..BatcherConfig::default()
    };
    let (batcher, record) = start(config, Duration::ZERO, None);
    let a = {
        let b = batcher.clone();
        tokio::spawn(async move { b.embed(texts(&["first"]), EmbedOptions::default()).await })
    };
    tokio::time::sleep(Duration::from_millis(10)).await;
    let second = timeout(
        LIMIT,
        batcher.embed(texts(&["second"]), EmbedOptions::default()),
    )
    .await
    .unwrap()
    .unwrap();
    assert_answer(&["second".into()], &second);
    timeout(LIMIT, a).await.unwrap().unwrap().unwrap();
    assert_eq!(
        record.batches(),
        vec![vec!["first".to_string(), "second".to_string()]]
    );
}

/// `Duration::MAX` windows ("wait for company however long"): a full batch
/// and a high-priority input still end them, and the model thread lives.
/// Before, it panicked computing the window's end (`Instant` overflow), and
/// every caller got `ModelUnavailable`.
#[tokio::test(flavor = "current_thread")]
async fn windows_too_long_for_an_instant_still_end_at_company() {
    let config = BatcherConfig {
        batch_window: Duration::MAX,
        regroup_window: Duration::MAX,
        max_batch_size: 2,
        ..BatcherConfig::default()
    };
    let (batcher, record) = start(config, Duration::ZERO, None);
    let full = ["a full", "batch"].map(String::from);
    let got = timeout(
        LIMIT,
        batcher.embed(owned_texts(&full), EmbedOptions::default()),
    )
    .await
    .expect("a full batch ends the window")
    .expect("answered");
    assert_answer(&full, &got);
    // The regroup window after that batch waits for two inputs; a query does not wait.
    let query = EmbedOptions {
        priority: mlx_embed_core::Priority::High,
        ..EmbedOptions::default()
    };
    let got = timeout(LIMIT, batcher.embed(texts(&["urgent"]), query))
        .await
        .expect("a high-priority input ends the windows")
        .expect("answered");
    assert_answer(&["urgent".into()], &got);
    assert!(batcher.is_healthy(), "{:?}", batcher.model_failure());
    assert_eq!(record.batches().len(), 2);
    assert_eq!(
        batcher.config().batch_window,
        Duration::from_secs(365 * 24 * 60 * 60)
    );
}

#[tokio::test(flavor = "current_thread")]
async fn idle_model_starts_a_lone_request_at_once() {
    let (batcher, _record) = start(BatcherConfig::default(), Duration::ZERO, None);
    // Warm up, then time one request on an idle model: no window, no waiting.
    batcher
        .embed(texts(&["warm"]), EmbedOptions::default())
        .await
        .unwrap();
    let took = lone_requests(&batcher, 100).await;
    assert!(
        took < Duration::from_secs(1),
        "100 lone requests took {took:?}"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn tokens_inputs_and_multi_input_requests_keep_order() {
    let (batcher, _record) = start(
        BatcherConfig {
            max_batch_size: 3,
            ..BatcherConfig::default()
        },
        Duration::ZERO,
        None,
    );
    let inputs = vec![
        EmbedInput::Tokens(vec![1, 2, 3]),
        EmbedInput::Text("hello".into()),
        EmbedInput::Tokens(vec![4]),
        EmbedInput::Text("world".into()),
        EmbedInput::Text("!".into()),
    ];
    let names: Vec<String> = inputs.iter().map(text_of).collect();
    let got = batcher
        .embed(inputs, EmbedOptions::default())
        .await
        .unwrap();
    assert_eq!(got.vectors.len(), names.len());
    for (i, name) in names.iter().enumerate() {
        assert_eq!(got.vectors[i], vector_for(name), "vector {i} ({name})");
    }
    // Exact tokens: the ids or the text's bytes, plus the two markers.
    assert_eq!(got.token_counts, vec![5, 7, 3, 7, 3]);
}

#[test]
fn embed_futures_are_send_and_batcher_is_shareable() {
    fn assert_send<T: Send>(_: &T) {}
    fn assert_sync<T: Send + Sync + Clone + 'static>() {}
    assert_sync::<Batcher>();
    let (batcher, _record) = start(BatcherConfig::default(), Duration::ZERO, None);
    let fut = batcher.embed(texts(&["x"]), EmbedOptions::default());
    assert_send(&fut);
    // Works from a runtime that only exists for this call, too.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let got = rt.block_on(fut).unwrap();
    assert_answer(&["x".into()], &got);
    let _ = Arc::new(batcher);
}

/// Three requests of three batches each, queued behind a held model: taking
/// turns they interleave batch by batch (each finishes in the last three
/// batches); for a drain they are finished one after another, oldest first.
#[tokio::test(flavor = "current_thread")]
async fn a_drain_finishes_queued_requests_whole_oldest_first() {
    for drain in [false, true] {
        let config = BatcherConfig {
            max_batch_size: 2,
            max_priority_batch_size: 1,
            cache_bytes: 0,
            ..BatcherConfig::default()
        };
        let gate = Gate::closed();
        let (batcher, record) = start(config, Duration::ZERO, Some(gate.clone()));
        let holder = occupy_model(&batcher, &record, "holder").await;
        let mut calls = Vec::new();
        for name in ["a", "b", "c"] {
            let texts: Vec<String> = (0..6).map(|i| format!("{name}{i}")).collect();
            let b = batcher.clone();
            let queued = batcher.metrics().in_flight_inputs;
            calls.push(tokio::spawn(async move {
                let got = b
                    .embed(owned_texts(&texts), EmbedOptions::default())
                    .await
                    .unwrap();
                assert_answer(&texts, &got);
            }));
            eventually("queued in arrival order", || {
                batcher.metrics().in_flight_inputs == queued + 6
            })
            .await;
        }
        if drain {
            batcher.finish_requests_whole();
        }
        gate.open();
        timeout(LIMIT, holder).await.unwrap().unwrap().unwrap();
        for c in calls {
            timeout(LIMIT, c).await.unwrap().unwrap();
        }
        let owners: String = record.batches()[1..]
            .iter()
            .map(|b| {
                assert!(b.iter().all(|t| t[..1] == b[0][..1]), "{b:?}");
                &b[0][..1]
            })
            .collect();
        let want = if drain { "aaabbbccc" } else { "abcabcabc" };
        assert_eq!(owners, want, "drain: {drain}");
    }
}
