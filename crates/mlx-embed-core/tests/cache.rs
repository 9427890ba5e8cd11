//! The embedding cache through the batcher: one computation per distinct
//! input however many ask at once, answers identical to the model's, no
//! admission for hits, and nobody stranded when a leader gives up.

mod common;

use std::time::Duration;

use common::*;
use mlx_embed_core::{BatcherConfig, CoreError, EmbedOptions, Embeddings};
use tokio::time::timeout;

/// Waits (bounded) for each task, checks it got exactly `text`'s vector and
/// returns the answers.
async fn answers_of(
    tasks: Vec<tokio::task::JoinHandle<Result<Embeddings, CoreError>>>,
    text: &str,
) -> Vec<Embeddings> {
    let mut out = Vec::new();
    for task in tasks {
        let got = timeout(LIMIT, task)
            .await
            .expect("not stranded")
            .unwrap()
            .unwrap();
        assert_answer(&[text.to_owned()], &got);
        out.push(got);
    }
    out
}

fn no_cache() -> BatcherConfig {
    BatcherConfig {
        cache_bytes: 0,
        ..BatcherConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_concurrent_requests_for_ten_texts_compute_ten() {
    let (batcher, record) = start(BatcherConfig::default(), Duration::from_millis(2), None);
    let names: Vec<String> = (0..10).map(|k| format!("entity {k}")).collect();
    let mut tasks = Vec::new();
    for i in 0..1000 {
        let b = batcher.clone();
        let text = names[i % 10].clone();
        tasks.push(tokio::spawn(async move {
            let got = b
                .embed(
                    owned_texts(std::slice::from_ref(&text)),
                    EmbedOptions::default(),
                )
                .await
                .expect("embed");
            assert_answer(std::slice::from_ref(&text), &got);
            got.cache_hits
        }));
    }
    let mut hits = 0;
    for t in tasks {
        hits += timeout(LIMIT, t).await.unwrap().unwrap();
    }
    let mut computed = record.computed();
    computed.sort();
    assert_eq!(computed, names, "each distinct text computed exactly once");
    assert_eq!(hits, 990);
    let m = batcher.metrics();
    assert_eq!(
        (m.cache.hits, m.cache.misses, m.cache.entries),
        (990, 10, 10)
    );
    assert_eq!(m.requests_ok, 1000);
}

#[tokio::test(flavor = "current_thread")]
async fn cached_answers_are_bitwise_the_models() {
    let texts: Vec<String> = (0..40).map(|i| format!("golden text {i}")).collect();
    let (cached, record) = start(BatcherConfig::default(), Duration::ZERO, None);
    let (plain, _) = start(no_cache(), Duration::ZERO, None);
    let first = cached
        .embed(owned_texts(&texts), EmbedOptions::default())
        .await
        .unwrap();
    let second = cached
        .embed(owned_texts(&texts), EmbedOptions::default())
        .await
        .unwrap();
    let without = plain
        .embed(owned_texts(&texts), EmbedOptions::default())
        .await
        .unwrap();
    assert_eq!(
        (first.cache_hits, second.cache_hits, without.cache_hits),
        (0, 40, 0)
    );
    for (a, b) in [(&first, &second), (&first, &without)] {
        assert_eq!(a.token_counts, b.token_counts);
        for (x, y) in a.vectors.iter().zip(&b.vectors) {
            let bits = |v: &Vec<f32>| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(x), bits(y));
        }
    }
    assert_answer(&texts, &second);
    assert_eq!(
        record.computed().len(),
        40,
        "the second call computed nothing"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn repeats_inside_one_request_compute_once() {
    let (batcher, record) = start(BatcherConfig::default(), Duration::ZERO, None);
    let texts: Vec<String> = ["a", "b", "a", "c", "b", "a"].map(String::from).to_vec();
    let got = batcher
        .embed(owned_texts(&texts), EmbedOptions::default())
        .await
        .unwrap();
    assert_answer(&texts, &got);
    assert_eq!(got.cache_hits, 3);
    assert_eq!(record.computed(), vec!["a", "b", "c"]);
}

#[tokio::test(flavor = "current_thread")]
async fn the_cache_off_computes_every_time() {
    let (batcher, record) = start(no_cache(), Duration::ZERO, None);
    for _ in 0..3 {
        let got = batcher
            .embed(texts(&["same", "same"]), EmbedOptions::default())
            .await
            .unwrap();
        assert_eq!(got.cache_hits, 0);
    }
    assert_eq!(record.computed().len(), 6);
    assert_eq!(batcher.metrics().cache, Default::default());
}

#[tokio::test(flavor = "current_thread")]
async fn hits_need_no_admission_and_no_model() {
    let gate = Gate::closed();
    let config = BatcherConfig {
        max_concurrent_requests: 1,
        max_waiting: 0,
        ..BatcherConfig::default()
    };
    let (batcher, record) = start(config, Duration::ZERO, Some(gate.clone()));
    gate.open();
    batcher
        .embed(texts(&["known"]), EmbedOptions::default())
        .await
        .unwrap();
    gate.close();
    let b = batcher.clone();
    let holder =
        tokio::spawn(async move { b.embed(texts(&["holder"]), EmbedOptions::default()).await });
    eventually("holder running", || record.batches().len() == 2).await;
    // The model is busy and the only admission permit taken: a miss is refused...
    let refused = batcher
        .embed(texts(&["new"]), EmbedOptions::default())
        .await;
    assert!(
        matches!(refused, Err(CoreError::Overloaded { .. })),
        "{refused:?}"
    );
    // ...a hit needs neither.
    let hit = timeout(
        Duration::from_secs(2),
        batcher.embed(texts(&["known"]), EmbedOptions::default()),
    )
    .await
    .expect("a hit does not wait")
    .unwrap();
    assert_answer(&["known".into()], &hit);
    assert_eq!(hit.cache_hits, 1);
    gate.open();
    timeout(LIMIT, holder).await.unwrap().unwrap().unwrap();
    assert_eq!(record.computed(), vec!["known", "holder"]);
}

#[tokio::test(flavor = "current_thread")]
async fn a_follower_takes_over_when_its_leader_is_cancelled() {
    let gate = Gate::closed();
    let (batcher, record) = start(BatcherConfig::default(), Duration::ZERO, Some(gate.clone()));
    let holder = occupy_model(&batcher, &record, "holder").await;
    let spawn = |text: &'static str| {
        let b = batcher.clone();
        tokio::spawn(async move { b.embed(texts(&[text]), EmbedOptions::default()).await })
    };
    let leader = spawn("shared");
    eventually("leader queued", || batcher.metrics().in_flight_inputs == 2).await;
    let followers: Vec<_> = (0..3).map(|_| spawn("shared")).collect();
    // The followers wait on the leader: nothing more is admitted.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(batcher.metrics().in_flight_inputs, 2);
    leader.abort();
    assert!(leader.await.unwrap_err().is_cancelled());
    // One follower leads the next try; the others follow it.
    eventually("a follower queued", || {
        batcher.metrics().in_flight_inputs == 2
    })
    .await;
    gate.open();
    timeout(LIMIT, holder).await.unwrap().unwrap().unwrap();
    answers_of(followers, "shared").await;
    assert_eq!(record.computed(), vec!["holder", "shared"]);
    let m = batcher.metrics();
    assert_eq!(
        m.cache.misses, 2,
        "holder and the successor: the cancelled leader computed nothing"
    );
    assert_eq!(m.cache.hits, 2);
}

#[tokio::test(flavor = "current_thread")]
async fn a_vector_computed_for_a_caller_that_left_still_answers_its_followers() {
    let gate = Gate::closed();
    let (batcher, record) = start(BatcherConfig::default(), Duration::ZERO, Some(gate.clone()));
    // The leader's batch is on the model when its caller leaves.
    let leader = occupy_model(&batcher, &record, "shared").await;
    let spawn = || {
        let b = batcher.clone();
        tokio::spawn(async move { b.embed(texts(&["shared"]), EmbedOptions::default()).await })
    };
    let followers: Vec<_> = (0..3).map(|_| spawn()).collect();
    tokio::time::sleep(Duration::from_millis(20)).await;
    leader.abort();
    assert!(leader.await.unwrap_err().is_cancelled());
    gate.open();
    for got in answers_of(followers, "shared").await {
        assert_eq!(got.cache_hits, 1);
    }
    // Computed once, for the caller that left; the followers joined it.
    assert_eq!(record.computed(), vec!["shared"]);
    let m = batcher.metrics();
    assert_eq!((m.cache.misses, m.cache.hits, m.cache.entries), (1, 3, 1));
    assert_eq!(
        (m.requests_cancelled, m.inputs_cancelled_before_compute),
        (1, 0)
    );
    // Later callers find it stored.
    let again = batcher
        .embed(texts(&["shared"]), EmbedOptions::default())
        .await
        .unwrap();
    assert_eq!(again.cache_hits, 1);
    assert_eq!(record.computed(), vec!["shared"]);
}

#[tokio::test(flavor = "current_thread")]
async fn followers_of_a_failing_leader_get_their_own_answer() {
    let gate = Gate::closed();
    let (batcher, record) = start(BatcherConfig::default(), Duration::ZERO, Some(gate.clone()));
    let holder = occupy_model(&batcher, &record, "holder").await;
    let bad = format!("always {FAIL}");
    let spawn = |text: String| {
        let b = batcher.clone();
        tokio::spawn(async move { b.embed(owned_texts(&[text]), EmbedOptions::default()).await })
    };
    let leader = spawn(bad.clone());
    eventually("leader queued", || batcher.metrics().in_flight_inputs == 2).await;
    let followers: Vec<_> = (0..3).map(|_| spawn(bad.clone())).collect();
    tokio::time::sleep(Duration::from_millis(20)).await;
    gate.open();
    timeout(LIMIT, holder).await.unwrap().unwrap().unwrap();
    for t in std::iter::once(leader).chain(followers) {
        let err = timeout(LIMIT, t).await.expect("not stranded").unwrap();
        assert_eq!(err, Err(CoreError::Model(format!("cannot embed {bad}"))));
    }
    // Each retried for itself: failures are never cached.
    assert_eq!(record.computed().iter().filter(|t| **t == bad).count(), 4);
    assert_eq!(batcher.metrics().cache.entries, 1);
}

#[tokio::test(flavor = "current_thread")]
async fn a_query_never_waits_on_a_bulk_computation_of_the_same_input() {
    use mlx_embed_core::Priority;
    let gate = Gate::closed();
    let (batcher, record) = start(BatcherConfig::default(), Duration::ZERO, Some(gate.clone()));
    let holder = occupy_model(&batcher, &record, "holder").await;
    let lane = |priority| EmbedOptions {
        priority,
        ..EmbedOptions::default()
    };
    let b = batcher.clone();
    let bulk = tokio::spawn(async move {
        b.embed(texts(&["backlog", "alice"]), lane(Priority::Low))
            .await
    });
    eventually("bulk queued", || batcher.metrics().in_flight_inputs == 3).await;
    let b = batcher.clone();
    let query = tokio::spawn(async move { b.embed(texts(&["alice"]), lane(Priority::High)).await });
    // The query leads its own computation in the high lane instead of
    // following the low-lane one.
    eventually("query queued", || batcher.metrics().in_flight_inputs == 4).await;
    gate.open();
    let got = timeout(LIMIT, query).await.unwrap().unwrap().unwrap();
    assert_answer(&["alice".into()], &got);
    assert_eq!(got.cache_hits, 0);
    timeout(LIMIT, holder).await.unwrap().unwrap().unwrap();
    timeout(LIMIT, bulk).await.unwrap().unwrap().unwrap();
    // The query's input comes first; the bulk request tops the batch up.
    assert_eq!(
        record.batches(),
        vec![
            vec!["holder".to_string()],
            vec![
                "alice".to_string(),
                "backlog".to_string(),
                "alice".to_string()
            ],
        ]
    );
}

/// The counters and histograms start again from zero; the cache's entries
/// stay, and answer (a server also clears them after its warm-up).
#[tokio::test(flavor = "current_thread")]
async fn reset_metrics_zeroes_the_counts_and_keeps_the_entries() {
    let (batcher, _) = start(BatcherConfig::default(), Duration::ZERO, None);
    let warm = owned_texts(&["warm-up text".to_string()]);
    batcher
        .embed(warm.clone(), EmbedOptions::default())
        .await
        .expect("warm-up");
    let m = batcher.metrics();
    assert_eq!((m.requests_ok, m.batches, m.cache.misses), (1, 1, 1));
    assert!(m.real_tokens > 0 && m.model_seconds.count == 1);
    batcher.reset_metrics();
    let m = batcher.metrics();
    assert_eq!(
        (m.requests_ok, m.batches, m.real_tokens, m.padded_tokens),
        (0, 0, 0, 0)
    );
    assert_eq!(
        (
            m.batch_size.count,
            m.model_seconds.count,
            m.queue_wait_seconds.count
        ),
        (0, 0, 0)
    );
    assert_eq!((m.cache.hits, m.cache.misses, m.cache.entries), (0, 0, 1));
    assert!(m.lanes.iter().all(|l| l.queue_wait_seconds.count == 0));
    // Counting starts again: the same text is a hit, a new one a miss and a batch.
    let texts = owned_texts(&["warm-up text".to_string(), "a client's text".to_string()]);
    let got = batcher
        .embed(texts, EmbedOptions::default())
        .await
        .expect("embed");
    assert_eq!(got.cache_hits, 1);
    let m = batcher.metrics();
    assert_eq!(
        (m.requests_ok, m.batches, m.cache.hits, m.cache.misses),
        (1, 1, 1, 1)
    );
    assert_eq!(m.batch_size.count, 1);
}

#[tokio::test(flavor = "current_thread")]
async fn clear_cache_drops_the_entries_and_spares_computations_in_flight() {
    let gate = Gate::closed();
    let config = BatcherConfig {
        // Room for three entries of a short text (each about 370 bytes: its
        // vector, its ids and the per-entry overhead): clearing must leave the
        // LRU evicting as before.
        cache_bytes: 1200,
        ..BatcherConfig::default()
    };
    let (batcher, record) = start(config, Duration::ZERO, Some(gate.clone()));
    gate.open();
    let stored = batcher.embed(texts(&["stored"]), EmbedOptions::default());
    assert_answer(&["stored".into()], &stored.await.unwrap());
    assert_eq!(batcher.metrics().cache.entries, 1);
    gate.close();
    let holder = occupy_model(&batcher, &record, "holder").await;
    let spawn = |text: &'static str| {
        let b = batcher.clone();
        tokio::spawn(async move { b.embed(texts(&[text]), EmbedOptions::default()).await })
    };
    let leader = spawn("flying");
    eventually("leader queued", || batcher.metrics().in_flight_inputs == 2).await;
    let follower = spawn("flying");
    tokio::time::sleep(Duration::from_millis(20)).await;
    batcher.clear_cache();
    assert_eq!(batcher.metrics().cache.entries, 0, "\"stored\" is gone");
    gate.open();
    timeout(LIMIT, holder).await.unwrap().unwrap().unwrap();
    for caller in [leader, follower] {
        let got = timeout(LIMIT, caller).await.unwrap().unwrap().unwrap();
        assert_answer(&["flying".into()], &got);
    }
    let m = batcher.metrics();
    // The holder's and the leader's vectors, stored once computed; the
    // follower got the leader's.
    assert_eq!((m.cache.entries, m.cache.hits), (2, 1), "{:?}", m.cache);
    // Cleared, the LRU still stores, evicts and answers.
    batcher.clear_cache();
    let m = batcher.metrics();
    assert_eq!((m.cache.entries, m.cache.bytes), (0, 0));
    for text in ["a", "b", "c", "d", "e", "a"] {
        let got = batcher.embed(texts(&[text]), EmbedOptions::default()).await;
        assert_answer(&[text.into()], &got.unwrap());
    }
    let m = batcher.metrics();
    assert!(
        m.cache.entries <= 3 && m.cache.bytes <= m.cache.capacity_bytes,
        "{:?}",
        m.cache
    );
    assert_eq!(
        record.computed(),
        vec!["stored", "holder", "flying", "a", "b", "c", "d", "e", "a"],
        "\"a\" was evicted, computed again"
    );
}
