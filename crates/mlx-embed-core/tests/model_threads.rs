//! More than one model thread (`BatcherConfig::model_threads`): batches run
//! side by side on replicas of the one model, each caller still gets exactly
//! its own vectors, and starting, dying and stopping cover every thread.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use mlx_embed_core::{
    BatchOutput, Batcher, BatcherConfig, CoreError, EmbedOptions, Embedder, EmbedderError,
    EmbedderErrorKind, Encoded, ModelInfo, Output, Replica, Tokenize,
};
use tokio::time::timeout;

fn threads(n: usize) -> BatcherConfig {
    BatcherConfig {
        model_threads: n,
        max_batch_size: 1,
        cache_bytes: 0,
        ..BatcherConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_threads_run_three_batches_at_once() {
    let gate = Gate::closed();
    let (batcher, record) = start(threads(3), Duration::ZERO, Some(gate.clone()));
    let tasks: Vec<_> = ["a", "b", "c", "d"]
        .into_iter()
        .map(|t| {
            let b = batcher.clone();
            tokio::spawn(async move { b.embed(texts(&[t]), EmbedOptions::default()).await })
        })
        .collect();
    // One input per batch and the gate closed: three batches reach the model
    // at once, one per thread, and the fourth waits for a free thread.
    eventually("three batches on the model", || record.batches().len() == 3).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(record.batches().len(), 3, "only three threads");
    let names = record.threads_used();
    assert_eq!(names.len(), 3, "three distinct threads: {names:?}");
    assert!(
        names.iter().all(|n| n.starts_with("mlx-embed-model ")),
        "{names:?}"
    );
    gate.open();
    for (task, text) in tasks.into_iter().zip(["a", "b", "c", "d"]) {
        let got = timeout(LIMIT, task).await.unwrap().unwrap().unwrap();
        assert_answer(&[text.to_string()], &got);
    }
    let mut computed = record.computed();
    computed.sort();
    assert_eq!(computed, ["a", "b", "c", "d"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_callers_on_four_threads_each_get_their_own_vectors() {
    let config = BatcherConfig {
        max_batch_size: 8,
        ..threads(4)
    };
    let (batcher, record) = start(config, Duration::from_millis(2), None);
    let tasks: Vec<_> = (0..64)
        .map(|i| {
            let b = batcher.clone();
            let mine: Vec<String> = (0..1 + i % 5)
                .map(|k| format!("caller {i} text {k}"))
                .collect();
            tokio::spawn(async move {
                let got = b.embed(owned_texts(&mine), EmbedOptions::default()).await;
                (mine, got)
            })
        })
        .collect();
    let mut sent = Vec::new();
    for task in tasks {
        let (mine, got) = timeout(LIMIT, task).await.unwrap().unwrap();
        assert_answer(&mine, &got.unwrap());
        sent.extend(mine);
    }
    // Every input computed exactly once, by whichever thread cut it.
    let mut computed = record.computed();
    computed.sort();
    sent.sort();
    assert_eq!(computed, sent);
    let used = record.threads_used();
    assert!(used.len() >= 2, "batches ran on {used:?}");
}

#[test]
fn a_model_without_replicas_refuses_more_threads() {
    let record = Arc::new(Record::default());
    let rec = record.clone();
    let err = Batcher::start(threads(2), move || {
        Ok(Single(Fake {
            record: rec,
            delay: Duration::ZERO,
            gate: None,
        }))
    })
    .unwrap_err();
    // The loaded model is let go, not left on a thread waiting for work.
    assert_refused_and_dropped(
        err,
        (
            EmbedderErrorKind::InvalidInput,
            "serves from one thread only",
        ),
        &record,
        1,
    );
}

/// `err` is `LoadFailed` of the kind and saying the words of `why`, and
/// `fakes` fakes get dropped: no model thread is left waiting for work.
fn assert_refused_and_dropped(
    err: CoreError,
    why: (EmbedderErrorKind, &str),
    record: &Record,
    fakes: usize,
) {
    match err {
        CoreError::LoadFailed(err) => {
            assert_eq!(err.kind, why.0, "{err:?}");
            assert!(err.message.contains(why.1), "{err:?}");
        }
        other => panic!("unexpected {other:?}"),
    }
    let deadline = std::time::Instant::now() + LIMIT;
    while record.drops.load(Ordering::SeqCst) < fakes {
        assert!(
            std::time::Instant::now() < deadline,
            "model threads left running"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A fake whose second replica fails to build.
struct Flaky {
    fake: Fake,
    built: Arc<std::sync::atomic::AtomicUsize>,
}

impl Embedder for Flaky {
    fn info(&self) -> ModelInfo {
        self.fake.info()
    }
    fn tokenizer(&self) -> Option<Arc<dyn Tokenize>> {
        self.fake.tokenizer()
    }
    fn replica(&self) -> Option<Replica<Self>> {
        let built = self.built.clone();
        let fake = self.fake.replica()?;
        Some(Box::new(move || {
            if built.fetch_add(1, Ordering::SeqCst) == 1 {
                return Err(EmbedderError::model_failure("no room for a second replica"));
            }
            Ok(Flaky {
                fake: fake()?,
                built,
            })
        }))
    }
    fn embed_batch(
        &mut self,
        inputs: &[Encoded],
        output: Output,
    ) -> Result<BatchOutput, EmbedderError> {
        self.fake.embed_batch(inputs, output)
    }
}

#[test]
fn a_thread_that_fails_to_start_fails_the_start_and_stops_the_others() {
    let record = Arc::new(Record::default());
    let rec = record.clone();
    let err = Batcher::start(threads(3), move || {
        Ok(Flaky {
            fake: Fake {
                record: rec,
                delay: Duration::ZERO,
                gate: None,
            },
            built: Arc::default(),
        })
    })
    .unwrap_err();
    // The first model and the replica that did start exit and drop their fakes.
    // (The replicas build side by side: either may be the one that fails.)
    assert_refused_and_dropped(
        err,
        (
            EmbedderErrorKind::ModelFailure,
            "'s start failed: no room for a second replica",
        ),
        &record,
        2,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_panic_on_one_thread_fails_its_caller_and_takes_the_model_down() {
    let (batcher, record) = start(threads(2), Duration::ZERO, None);
    let ok = batcher
        .embed(texts(&["fine"]), EmbedOptions::default())
        .await
        .unwrap();
    assert_answer(&["fine".to_string()], &ok);
    let err = timeout(
        LIMIT,
        batcher.embed(texts(&[PANIC]), EmbedOptions::default()),
    )
    .await
    .unwrap()
    .unwrap_err();
    assert!(matches!(err, CoreError::ModelUnavailable(_)), "{err:?}");
    assert!(!batcher.is_healthy());
    let later = timeout(
        LIMIT,
        batcher.embed(texts(&["after"]), EmbedOptions::default()),
    )
    .await
    .unwrap();
    assert!(
        matches!(later, Err(CoreError::ModelUnavailable(_))),
        "{later:?}"
    );
    // Both threads end: the one that panicked, and the other on seeing the model dead.
    eventually("both model threads gone", || {
        record.drops.load(Ordering::SeqCst) == 2
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_batcher_ends_every_model_thread() {
    let (batcher, record) = start(threads(3), Duration::ZERO, None);
    let got = batcher
        .embed(texts(&["x", "y"]), EmbedOptions::default())
        .await
        .unwrap();
    assert_answer(&["x".to_string(), "y".to_string()], &got);
    drop(batcher);
    eventually("three fakes dropped", || {
        record.drops.load(Ordering::SeqCst) == 3
    })
    .await;
}
