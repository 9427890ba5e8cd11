//! Admission: `Overloaded` only past `max_waiting` or `max_queue_wait`, never below.

mod common;

use std::time::Duration;

use common::*;
use mlx_embed_core::{BatcherConfig, CoreError, EmbedOptions, OverloadReason};
use tokio::time::timeout;

#[tokio::test(flavor = "current_thread")]
async fn exactly_the_surplus_beyond_the_waiting_bound_is_refused() {
    let gate = Gate::closed();
    let config = BatcherConfig {
        max_concurrent_requests: 2,
        max_waiting: 5,
        ..BatcherConfig::default()
    };
    let (batcher, record) = start(config, Duration::ZERO, Some(gate.clone()));
    let mut handles = Vec::new();
    for i in 0..20 {
        let b = batcher.clone();
        handles.push(tokio::spawn(async move {
            let t = format!("caller {i}");
            b.embed(
                owned_texts(std::slice::from_ref(&t)),
                EmbedOptions::default(),
            )
            .await
            .map(|got| assert_answer(&[t], &got))
        }));
    }
    // 2 admitted (the model is held at the gate), 5 waiting, 13 refused at once.
    eventually("line formed", || {
        let m = batcher.metrics();
        m.in_flight_inputs == 2 && m.waiting_inputs == 5 && m.requests_overloaded == 13
    })
    .await;
    eventually("model busy", || !record.batches().is_empty()).await;
    gate.open();
    let mut ok = 0;
    let mut full = 0;
    for h in handles {
        match timeout(LIMIT, h).await.unwrap().unwrap() {
            Ok(()) => ok += 1,
            Err(CoreError::Overloaded {
                reason: OverloadReason::QueueFull,
                retry_after,
            }) => {
                assert!(
                    retry_after >= Duration::from_secs(1) && retry_after <= Duration::from_secs(60)
                );
                full += 1;
            }
            Err(e) => panic!("unexpected error {e}"),
        }
    }
    assert_eq!((ok, full), (7, 13));
    assert_eq!(batcher.metrics().requests_ok, 7);
}

#[tokio::test(flavor = "current_thread")]
async fn waiting_too_long_gives_queue_timeout() {
    let gate = Gate::closed();
    let config = BatcherConfig {
        max_concurrent_requests: 1,
        max_queue_wait: Duration::from_millis(100),
        ..BatcherConfig::default()
    };
    let (batcher, _record) = start(config, Duration::ZERO, Some(gate.clone()));
    let first = {
        let b = batcher.clone();
        tokio::spawn(async move { b.embed(texts(&["holder"]), EmbedOptions::default()).await })
    };
    eventually("first admitted", || batcher.metrics().in_flight_inputs == 1).await;
    let started = std::time::Instant::now();
    let err = timeout(
        LIMIT,
        batcher.embed(texts(&["late"]), EmbedOptions::default()),
    )
    .await
    .unwrap()
    .unwrap_err();
    let waited = started.elapsed();
    assert!(
        matches!(
            err,
            CoreError::Overloaded {
                reason: OverloadReason::QueueTimeout,
                ..
            }
        ),
        "got {err:?}"
    );
    assert!(
        waited >= Duration::from_millis(90) && waited < Duration::from_secs(5),
        "waited {waited:?}"
    );
    assert_eq!(
        batcher.metrics().waiting_inputs,
        0,
        "the timed-out caller left the line"
    );
    gate.open();
    assert!(timeout(LIMIT, first).await.unwrap().unwrap().is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lots_of_waiting_within_bounds_refuses_nobody() {
    let config = BatcherConfig {
        max_concurrent_requests: 4,
        max_waiting: 10_000,
        ..BatcherConfig::default()
    };
    let (batcher, _record) = start(config, Duration::from_micros(500), None);
    let mut handles = Vec::new();
    for i in 0..600 {
        let b = batcher.clone();
        handles.push(tokio::spawn(async move {
            let texts: Vec<String> = (0..(i % 3 + 1)).map(|j| format!("c{i}-{j}")).collect();
            let got = b
                .embed(owned_texts(&texts), EmbedOptions::default())
                .await
                .expect("never refused within bounds");
            assert_answer(&texts, &got);
        }));
    }
    let mut peak_waiting = 0;
    for h in handles {
        peak_waiting = peak_waiting.max(batcher.metrics().waiting_inputs);
        timeout(LIMIT, h).await.unwrap().unwrap();
    }
    let m = batcher.metrics();
    assert_eq!(m.requests_overloaded, 0);
    assert_eq!(m.requests_ok, 600);
    assert!(m.queue_wait_seconds.count == 600);
    let _ = peak_waiting;
}

#[tokio::test(flavor = "current_thread")]
async fn a_request_larger_than_the_bound_still_runs() {
    let config = BatcherConfig {
        max_concurrent_requests: 4,
        max_waiting: 0,
        ..BatcherConfig::default()
    };
    let (batcher, _record) = start(config, Duration::ZERO, None);
    let many: Vec<String> = (0..50).map(|i| format!("n{i}")).collect();
    let got = timeout(
        LIMIT,
        batcher.embed(owned_texts(&many), EmbedOptions::default()),
    )
    .await
    .unwrap()
    .unwrap();
    assert_answer(&many, &got);
    // And a sequential caller is never refused, even with no waiting room:
    // the previous request's room is free before its answer arrives.
    for i in 0..50 {
        let t = format!("seq {i}");
        batcher
            .embed(owned_texts(&[t]), EmbedOptions::default())
            .await
            .expect("room was free");
    }
}

#[tokio::test(flavor = "current_thread")]
async fn a_caller_that_gives_up_waiting_frees_its_place_in_line() {
    let gate = Gate::closed();
    let config = BatcherConfig {
        max_concurrent_requests: 1,
        max_waiting: 1,
        ..BatcherConfig::default()
    };
    let (batcher, _record) = start(config, Duration::ZERO, Some(gate.clone()));
    let holder = {
        let b = batcher.clone();
        tokio::spawn(async move { b.embed(texts(&["holder"]), EmbedOptions::default()).await })
    };
    eventually("holder admitted", || {
        batcher.metrics().in_flight_inputs == 1
    })
    .await;
    // Waits, then gives up (future dropped by the timeout).
    assert!(timeout(
        Duration::from_millis(20),
        batcher.embed(texts(&["impatient"]), EmbedOptions::default())
    )
    .await
    .is_err());
    assert_eq!(batcher.metrics().waiting_inputs, 0);
    let patient = {
        let b = batcher.clone();
        tokio::spawn(async move { b.embed(texts(&["patient"]), EmbedOptions::default()).await })
    };
    eventually("patient waiting", || batcher.metrics().waiting_inputs == 1).await;
    gate.open();
    assert!(timeout(LIMIT, holder).await.unwrap().unwrap().is_ok());
    assert!(timeout(LIMIT, patient).await.unwrap().unwrap().is_ok());
}

/// A request that fills its lane's room (or exceeds it) gives the room back
/// batch by batch, so a small caller behind it gets in and takes its turn in
/// the lane's round-robin; it once waited for the whole big request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_caller_gets_in_while_a_big_request_runs() {
    for (room, big) in [(8, 8), (4, 12)] {
        let config = BatcherConfig {
            max_concurrent_requests: room,
            max_batch_size: 2,
            batch_window: Duration::ZERO,
            ..BatcherConfig::default()
        };
        let (batcher, record) = start(config, Duration::from_millis(20), None);
        let bulk_texts: Vec<String> = (0..big).map(|i| format!("big-{i}")).collect();
        let b = batcher.clone();
        let sent = bulk_texts.clone();
        let bulk =
            tokio::spawn(async move { b.embed(owned_texts(&sent), EmbedOptions::default()).await });
        eventually("the big request's first batch", || {
            !record.batches().is_empty()
        })
        .await;
        let small = timeout(
            LIMIT,
            batcher.embed(texts(&["small"]), EmbedOptions::default()),
        )
        .await
        .unwrap()
        .unwrap();
        assert_answer(&["small".to_string()], &small);
        assert_answer(
            &bulk_texts,
            &timeout(LIMIT, bulk).await.unwrap().unwrap().unwrap(),
        );
        let batches = record.batches();
        let at = |text: &str| batches.iter().position(|b| b.iter().any(|t| t == text));
        let small_at = at("small").unwrap();
        let last_big = at(&format!("big-{}", big - 1)).unwrap();
        assert!(
            small_at < last_big,
            "room {room}, {big} inputs: the small caller ran in batch {small_at}, the big request ended in {last_big}: {batches:?}"
        );
    }
}

/// Calls in flight: each one's texts and its task.
type Calls = Vec<(
    Vec<String>,
    tokio::task::JoinHandle<Result<mlx_embed_core::Embeddings, CoreError>>,
)>;

/// Sends `calls` (each its texts) in order, the first alone until its first
/// batch runs, then waits until `waiting` inputs wait for room.
async fn send_calls_waiting_for_room(
    batcher: &mlx_embed_core::Batcher,
    record: &Record,
    calls: Vec<Vec<String>>,
    waiting: usize,
) -> Calls {
    let mut sent = Vec::new();
    for (k, texts) in calls.into_iter().enumerate() {
        let b = batcher.clone();
        let owned = texts.clone();
        sent.push((
            texts,
            tokio::spawn(
                async move { b.embed(owned_texts(&owned), EmbedOptions::default()).await },
            ),
        ));
        if k == 0 {
            eventually("the first call's batch", || !record.batches().is_empty()).await;
        }
    }
    eventually("the calls waiting", || {
        batcher.metrics().waiting_inputs == waiting as u64
    })
    .await;
    sent
}

/// Embeds one text as a short caller behind `calls`, checks every answer,
/// and returns the batches the model ran.
async fn short_call_then_all_answered(
    batcher: &mlx_embed_core::Batcher,
    record: &Record,
    text: &str,
    calls: Calls,
) -> Vec<Vec<String>> {
    let short = timeout(
        LIMIT,
        batcher.embed(texts(&[text]), EmbedOptions::default()),
    )
    .await
    .unwrap()
    .unwrap();
    assert_answer(&[text.to_string()], &short);
    for (sent, handle) in calls {
        assert_answer(
            &sent,
            &timeout(LIMIT, handle).await.unwrap().unwrap().unwrap(),
        );
    }
    record.batches()
}

/// A query-sized caller behind more calls of one batch than the room holds
/// waits for room in a line of its own, not behind them: with one line for
/// every call of one batch or less it waited for room until all but the
/// room's worth of them were done (16 calls of 64 long texts: 5.5 s against
/// 0.4 s for the running batch, on the CPU).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_behind_more_one_batch_calls_than_the_room_waits_for_its_turn_only() {
    let (room, mid, mids) = (4, 4, 4);
    let config = BatcherConfig {
        max_concurrent_requests: room,
        max_batch_size: 4,
        max_priority_batch_size: 1,
        batch_window: Duration::ZERO,
        ..BatcherConfig::default()
    };
    let (batcher, record) = start(config, Duration::from_millis(20), None);
    // The first call holds the whole room; the others wait for it.
    let calls = (0..mids)
        .map(|k| (0..mid).map(|i| format!("mid{k}-{i}")).collect())
        .collect();
    let calls = send_calls_waiting_for_room(&batcher, &record, calls, (mids - 1) * mid).await;
    let batches = short_call_then_all_answered(&batcher, &record, "query", calls).await;
    let at = |text: &str| batches.iter().position(|b| b.iter().any(|t| t == text));
    let query_at = at("query").unwrap();
    let second_starts = at("mid1-0").unwrap();
    assert!(
        query_at <= second_starts,
        "the query ran in batch {query_at}, after the second call began in \
         {second_starts}: {batches:?}"
    );
}

/// A one-text query behind more calls of a query's count of long texts than
/// the room holds runs in the batch after the running one: it is query-sized
/// by its tokens too, so it neither waits for room behind those calls nor for
/// a turn of each (40 calls of 16 long texts: 1.02 s, 8.7x the first call's
/// time, on the CPU, when lines and turns went by inputs only).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_behind_calls_of_few_long_texts_runs_in_the_next_batch() {
    // Turns of 1600 / 16 = 100 tokens: a call of 4 texts of 62 tokens takes
    // three, the query (3 tokens) one.
    let (room, per_call, calls) = (8, 4, 6);
    let config = BatcherConfig {
        max_concurrent_requests: room,
        max_batch_size: 8,
        max_priority_batch_size: per_call,
        max_batch_tokens: 1600,
        batch_window: Duration::ZERO,
        ..BatcherConfig::default()
    };
    let (batcher, record) = start(config, Duration::from_millis(30), None);
    // Two calls hold the room; the other four wait for it.
    let bulk = (0..calls)
        .map(|k| {
            (0..per_call)
                .map(|i| format!("long{k}-{i}-{}", "x".repeat(50)))
                .collect()
        })
        .collect();
    let bulk = send_calls_waiting_for_room(&batcher, &record, bulk, (calls - 2) * per_call).await;
    let running = record.batches().len();
    let batches = short_call_then_all_answered(&batcher, &record, "q", bulk).await;
    let query_at = batches
        .iter()
        .position(|b| b.iter().any(|t| t == "q"))
        .unwrap();
    // The batch running when it came, and at most one cut while it was
    // tokenized; with lines and turns by inputs only it ran last (batch 5).
    assert!(
        query_at <= running + 1,
        "the query ran in batch {query_at}, more than two after the batch \
         running when it came ({}): {batches:?}",
        running - 1
    );
}

/// Behind several big requests of its lane, a small caller waits for its
/// turn, not for them: in one FIFO line the second big request, waiting at
/// the line's head, gathered every permit the first gave back, so the small
/// caller behind it waited for the first to finish (7.6 s behind four bulk
/// calls, 0.25 s behind one, on the CPU). Requests of one batch have a line
/// of their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_caller_behind_several_big_requests_waits_for_its_turn_only() {
    let (room, big, bigs) = (4, 12, 3);
    let config = BatcherConfig {
        max_concurrent_requests: room,
        max_batch_size: 2,
        batch_window: Duration::ZERO,
        ..BatcherConfig::default()
    };
    let (batcher, record) = start(config, Duration::from_millis(20), None);
    // The other big requests wait for room (the first holds all of it).
    let bulk = (0..bigs)
        .map(|k| (0..big).map(|i| format!("big{k}-{i}")).collect())
        .collect();
    let bulk = send_calls_waiting_for_room(&batcher, &record, bulk, (bigs - 1) * big).await;
    let batches = short_call_then_all_answered(&batcher, &record, "small", bulk).await;
    let at = |text: &str| batches.iter().position(|b| b.iter().any(|t| t == text));
    let small_at = at("small").unwrap();
    let first_big_ends = at(&format!("big0-{}", big - 1)).unwrap();
    assert!(
        small_at < first_big_ends,
        "the small caller ran in batch {small_at}, after the first big request ended in \
         {first_big_ends}: {batches:?}"
    );
    // Big requests still take turns among themselves: the second starts
    // only as the first gives its room back.
    let second_starts = at("big1-0").unwrap();
    assert!(second_starts > at("big0-0").unwrap(), "{batches:?}");
}
