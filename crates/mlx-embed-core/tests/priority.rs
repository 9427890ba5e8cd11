//! Priority lanes: exact order high > normal > low, the aging bound, and
//! admission per lane.

mod common;

use std::time::Duration;

use common::*;
use mlx_embed_core::{Batcher, BatcherConfig, CoreError, EmbedOptions, OverloadReason, Priority};
use tokio::task::JoinHandle;
use tokio::time::timeout;

type Answer = Result<mlx_embed_core::Embeddings, CoreError>;

fn options(priority: Priority) -> EmbedOptions {
    EmbedOptions {
        priority,
        ..EmbedOptions::default()
    }
}

fn spawn(batcher: &Batcher, priority: Priority, names: &[&str]) -> JoinHandle<Answer> {
    let b = batcher.clone();
    let texts: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    tokio::spawn(async move {
        let got = b.embed(owned_texts(&texts), options(priority)).await?;
        assert_answer(&texts, &got);
        Ok(got)
    })
}

/// Spawns the request and waits until it is queued: tokenizing runs on the
/// blocking pool, so spawn order alone does not fix the order of arrival.
async fn queue(batcher: &Batcher, priority: Priority, names: &[&str]) -> JoinHandle<Answer> {
    let before = batcher.metrics().in_flight_inputs;
    let task = spawn(batcher, priority, names);
    let want = before + names.len() as u64;
    eventually("queued", || batcher.metrics().in_flight_inputs == want).await;
    task
}

fn strings(batches: &[&[&str]]) -> Vec<Vec<String>> {
    batches
        .iter()
        .map(|b| b.iter().map(|s| s.to_string()).collect())
        .collect()
}

#[tokio::test(flavor = "current_thread")]
async fn batches_take_high_then_normal_then_low() {
    use Priority::{High, Low, Normal};
    let gate = Gate::closed();
    let config = BatcherConfig {
        max_batch_size: 4,
        max_priority_batch_size: 4,
        ..BatcherConfig::default()
    };
    let (batcher, record) = start(config, Duration::ZERO, Some(gate.clone()));
    let holder = occupy_model(&batcher, &record, "holder").await;
    // Arrival order mixes the lanes.
    let tasks = vec![
        queue(&batcher, Low, &["l1a", "l1b"]).await,
        queue(&batcher, Normal, &["n1a", "n1b"]).await,
        queue(&batcher, High, &["h1"]).await,
        queue(&batcher, Normal, &["n2"]).await,
        queue(&batcher, High, &["h2a", "h2b"]).await,
        queue(&batcher, Low, &["l2"]).await,
    ];
    eventually("all queued", || batcher.metrics().in_flight_inputs == 10).await;
    let m = batcher.metrics();
    let queued: Vec<u64> = m.lanes.iter().map(|l| l.queued_inputs).collect();
    assert_eq!(queued, vec![3, 3, 3], "per-lane queue depth");
    gate.open();
    timeout(LIMIT, holder).await.unwrap().unwrap().unwrap();
    for t in tasks {
        timeout(LIMIT, t).await.unwrap().unwrap().unwrap();
    }
    assert_eq!(
        record.batches(),
        strings(&[
            &["holder"],
            &["h1", "h2a", "h2b", "n1a"],
            &["n1b", "n2", "l1a", "l1b"],
            &["l2"],
        ])
    );
    let m = batcher.metrics();
    let waits: Vec<u64> = m.lanes.iter().map(|l| l.queue_wait_seconds.count).collect();
    assert_eq!(
        waits,
        vec![2, 3, 2],
        "queue wait observed per lane, per request"
    );
    assert_eq!(m.queue_wait_seconds.count, 7);
}

#[tokio::test(flavor = "current_thread")]
async fn normal_is_passed_over_at_most_aging_batches_times_low_twice_that() {
    let gate = Gate::closed();
    let config = BatcherConfig {
        max_batch_size: 2,
        max_priority_batch_size: 2,
        aging_batches: 2,
        ..BatcherConfig::default()
    };
    let (batcher, record) = start(config, Duration::ZERO, Some(gate.clone()));
    let holder = occupy_model(&batcher, &record, "holder").await;
    let mut tasks = vec![
        queue(&batcher, Priority::Low, &["low"]).await,
        queue(&batcher, Priority::Normal, &["normal"]).await,
    ];
    let high: Vec<[String; 2]> = (0..6)
        .map(|i| [format!("h{i}a"), format!("h{i}b")])
        .collect();
    for pair in &high {
        tasks.push(queue(&batcher, Priority::High, &[&pair[0], &pair[1]]).await);
    }
    eventually("all queued", || batcher.metrics().in_flight_inputs == 15).await;
    gate.open();
    timeout(LIMIT, holder).await.unwrap().unwrap().unwrap();
    for t in tasks {
        timeout(LIMIT, t).await.unwrap().unwrap().unwrap();
    }
    // High fills two batches; then normal has been passed over twice and
    // goes first; low, whose limit is twice that, after four.
    assert_eq!(
        record.batches(),
        strings(&[
            &["holder"],
            &["h0a", "h0b"],
            &["h1a", "h1b"],
            &["normal", "h2a"],
            &["h2b", "h3a"],
            &["low", "h3b"],
            &["h4a", "h4b"],
            &["h5a", "h5b"],
        ])
    );
}

#[tokio::test(flavor = "current_thread")]
async fn each_lane_has_its_own_admission_room() {
    let gate = Gate::closed();
    let config = BatcherConfig {
        max_concurrent_requests: 2,
        max_waiting: 0,
        ..BatcherConfig::default()
    };
    let (batcher, record) = start(config, Duration::ZERO, Some(gate.clone()));
    let holder = occupy_model(&batcher, &record, "bulk 0").await;
    let bulk = queue(&batcher, Priority::Normal, &["bulk 1"]).await;
    // The normal lane has no room and no waiting room: refused at once.
    let refused = batcher
        .embed(texts(&["bulk 2"]), options(Priority::Normal))
        .await;
    assert!(
        matches!(
            refused,
            Err(CoreError::Overloaded {
                reason: OverloadReason::QueueFull,
                ..
            })
        ),
        "{refused:?}"
    );
    // The high lane's room is its own.
    let query = queue(&batcher, Priority::High, &["query"]).await;
    let m = batcher.metrics();
    let refusals: Vec<u64> = m.lanes.iter().map(|l| l.requests_overloaded).collect();
    assert_eq!(refusals, vec![0, 1, 0]);
    assert_eq!(m.requests_overloaded, 1);
    gate.open();
    for t in [holder, bulk, query] {
        timeout(LIMIT, t).await.unwrap().unwrap().unwrap();
    }
    assert_eq!(
        record.batches(),
        strings(&[&["bulk 0"], &["query", "bulk 1"]])
    );
}
