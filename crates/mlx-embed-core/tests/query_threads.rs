//! Query threads (`BatcherConfig::query_threads`): a query-sized call of the
//! high or normal lane is answered while a long batch holds the model
//! thread, by a thread that takes nothing else; without one it waits for
//! that batch. Each caller still gets exactly its own vectors.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use mlx_embed_core::{
    BatchOutput, Batcher, BatcherConfig, CoreError, EmbedOptions, Embedder, EmbedderError,
    Embeddings, Encoded, ModelInfo, Output, Priority, Replica, Tokenize,
};
use tokio::task::JoinHandle;
use tokio::time::timeout;

/// Texts with this marker hold their batch until the gate opens: a long
/// batch on the model.
const BULK: &str = "BULK";

/// A fake whose batches holding a [`BULK`] text wait on `gate`; the others run at once.
struct Holding {
    fake: Fake,
    gate: Arc<Gate>,
}

impl Embedder for Holding {
    fn info(&self) -> ModelInfo {
        self.fake.info()
    }
    fn tokenizer(&self) -> Option<Arc<dyn Tokenize>> {
        self.fake.tokenizer()
    }
    fn replica(&self) -> Option<Replica<Self>> {
        let (fake, gate) = (self.fake.replica()?, self.gate.clone());
        Some(Box::new(move || {
            Ok(Holding {
                fake: fake()?,
                gate,
            })
        }))
    }
    fn embed_batch(
        &mut self,
        inputs: &[Encoded],
        output: Output,
    ) -> Result<BatchOutput, EmbedderError> {
        // Recorded first, so a test sees the batch on the model while it is held.
        let out = self.fake.embed_batch(inputs, output);
        if inputs.iter().any(|e| text_of_ids(&e.ids).contains(BULK)) {
            self.gate.pass();
        }
        out
    }
}

fn config(query_threads: usize) -> BatcherConfig {
    BatcherConfig {
        query_threads,
        cache_bytes: 0,
        ..BatcherConfig::default()
    }
}

fn start_holding(config: BatcherConfig) -> (Batcher, Arc<Record>, Arc<Gate>) {
    let record = Arc::new(Record::default());
    let gate = Gate::closed();
    let (rec, g) = (record.clone(), gate.clone());
    let batcher = Batcher::start(config, move || {
        Ok(Holding {
            fake: Fake {
                record: rec,
                delay: Duration::ZERO,
                gate: None,
            },
            gate: g,
        })
    })
    .expect("fake loads");
    (batcher, record, gate)
}

/// 20 bulk texts (more than a query's 16): one batch, held on the model.
fn bulk_texts() -> Vec<String> {
    (0..20).map(|i| format!("{BULK} text {i}")).collect()
}

fn send(
    batcher: &Batcher,
    mine: Vec<String>,
    priority: Priority,
) -> JoinHandle<Result<Embeddings, CoreError>> {
    let b = batcher.clone();
    tokio::spawn(async move {
        let options = EmbedOptions {
            priority,
            ..EmbedOptions::default()
        };
        b.embed(owned_texts(&mine), options).await
    })
}

/// Starts the bulk call and waits until its batch holds the model thread.
async fn hold_model(
    batcher: &Batcher,
    record: &Record,
) -> JoinHandle<Result<Embeddings, CoreError>> {
    let bulk = send(batcher, bulk_texts(), Priority::Normal);
    eventually("the bulk batch on the model", || {
        record.batches().len() == 1
    })
    .await;
    bulk
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_query_is_answered_while_a_long_batch_holds_the_model_thread() {
    let (batcher, record, gate) = start_holding(config(1));
    assert_eq!(batcher.query_threads(), 1);
    let bulk = hold_model(&batcher, &record).await;
    // One normal and one high query, each answered with the bulk batch still held.
    for (text, priority) in [
        ("query one", Priority::Normal),
        ("query two", Priority::High),
    ] {
        let got = timeout(LIMIT, send(&batcher, vec![text.into()], priority))
            .await
            .expect("the query is answered while the bulk batch runs")
            .unwrap()
            .unwrap();
        assert_answer(&[text.to_string()], &got);
    }
    assert!(!bulk.is_finished(), "the bulk batch is still held");
    assert_eq!(batcher.metrics().query_thread_batches, 2);
    assert_eq!(record.batches().len(), 3, "{:?}", record.batches());
    assert_eq!(record.threads_used().len(), 2, "two threads ran batches");
    gate.open();
    let got = timeout(LIMIT, bulk).await.unwrap().unwrap().unwrap();
    assert_answer(&bulk_texts(), &got);
    let m = batcher.metrics();
    assert_eq!((m.batches, m.query_thread_batches), (3, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_a_query_thread_the_query_waits_for_the_batch() {
    let (batcher, record, gate) = start_holding(config(0));
    assert_eq!(batcher.query_threads(), 0);
    let bulk = hold_model(&batcher, &record).await;
    let query = send(&batcher, vec!["query".into()], Priority::High);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!query.is_finished(), "no thread was free for the query");
    assert_eq!(record.batches().len(), 1);
    gate.open();
    let got = timeout(LIMIT, query).await.unwrap().unwrap().unwrap();
    assert_answer(&["query".to_string()], &got);
    assert_answer(
        &bulk_texts(),
        &timeout(LIMIT, bulk).await.unwrap().unwrap().unwrap(),
    );
    let m = batcher.metrics();
    assert_eq!((m.batches, m.query_thread_batches), (2, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_query_thread_leaves_low_and_longer_calls_to_the_model_thread() {
    let (batcher, record, gate) = start_holding(config(1));
    let bulk = hold_model(&batcher, &record).await;
    // A one-text call of the low lane (bulk by its name), and a normal call of
    // 17 texts (one more than a query): neither runs beside the bulk batch.
    let low = send(&batcher, vec!["low one".into()], Priority::Low);
    let longer: Vec<String> = (0..17).map(|i| format!("longer {i}")).collect();
    let long_call = send(&batcher, longer.clone(), Priority::Normal);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!low.is_finished() && !long_call.is_finished());
    assert_eq!(record.batches().len(), 1);
    assert_eq!(batcher.metrics().query_thread_batches, 0);
    gate.open();
    assert_answer(
        &["low one".to_string()],
        &timeout(LIMIT, low).await.unwrap().unwrap().unwrap(),
    );
    assert_answer(
        &longer,
        &timeout(LIMIT, long_call).await.unwrap().unwrap().unwrap(),
    );
    assert_answer(
        &bulk_texts(),
        &timeout(LIMIT, bulk).await.unwrap().unwrap().unwrap(),
    );
    assert_eq!(batcher.metrics().query_thread_batches, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_queries_beside_bulk_calls_each_get_their_own_vectors() {
    let config = BatcherConfig {
        max_batch_size: 8,
        max_priority_batch_size: 4,
        ..config(1)
    };
    let (batcher, record) = start(config, Duration::from_millis(1), None);
    let tasks: Vec<_> = (0..60)
        .map(|i| {
            let n = if i % 3 == 0 { 9 + i % 7 } else { 1 + i % 4 };
            let priority = Priority::ALL[i % 3];
            let mine: Vec<String> = (0..n).map(|k| format!("caller {i} text {k}")).collect();
            (mine.clone(), send(&batcher, mine, priority))
        })
        .collect();
    let mut sent = Vec::new();
    for (mine, task) in tasks {
        assert_answer(
            &mine,
            &timeout(LIMIT, task).await.unwrap().unwrap().unwrap(),
        );
        sent.extend(mine);
    }
    // Every input computed exactly once, by whichever thread cut it.
    let mut computed = record.computed();
    computed.sort();
    sent.sort();
    assert_eq!(computed, sent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_model_serving_from_one_thread_runs_no_query_thread() {
    let record = Arc::new(Record::default());
    let rec = record.clone();
    let batcher = Batcher::start(config(1), move || {
        Ok(Single(Fake {
            record: rec,
            delay: Duration::ZERO,
            gate: None,
        }))
    })
    .expect("no query thread is no error");
    assert_eq!(batcher.query_threads(), 0);
    assert_eq!(batcher.config().query_threads, 1, "the config as given");
    let got = batcher
        .embed(texts(&["alone"]), EmbedOptions::default())
        .await
        .unwrap();
    assert_answer(&["alone".to_string()], &got);
    assert_eq!(batcher.metrics().query_thread_batches, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_drain_finishes_both_threads_work() {
    let (batcher, record, gate) = start_holding(config(1));
    let bulk = hold_model(&batcher, &record).await;
    let query = send(&batcher, vec!["last query".into()], Priority::High);
    assert_answer(
        &["last query".to_string()],
        &timeout(LIMIT, query).await.unwrap().unwrap().unwrap(),
    );
    batcher.close();
    let refused = batcher
        .embed(texts(&["late"]), EmbedOptions::default())
        .await;
    assert!(
        matches!(refused, Err(CoreError::ShuttingDown)),
        "{refused:?}"
    );
    gate.open();
    timeout(LIMIT, batcher.drained()).await.expect("drained");
    assert_answer(
        &bulk_texts(),
        &timeout(LIMIT, bulk).await.unwrap().unwrap().unwrap(),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_query_thread_leaves_a_model_thread_its_regroup_window() {
    let config = BatcherConfig {
        regroup_window: Duration::from_secs(5),
        ..config(1)
    };
    let (batcher, record) = start(config, Duration::ZERO, None);
    let two = ["first".to_string(), "second".to_string()];
    assert_answer(
        &two,
        &batcher
            .embed(owned_texts(&two), EmbedOptions::default())
            .await
            .unwrap(),
    );
    // One of the two callers comes back: the free model thread waits for the
    // other, and the query thread does not run it alone.
    let back = send(&batcher, vec!["back one".into()], Priority::Normal);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!back.is_finished(), "the model thread waits out its window");
    let other = send(&batcher, vec!["back two".into()], Priority::Normal);
    assert_answer(
        &["back one".to_string()],
        &timeout(LIMIT, back).await.unwrap().unwrap().unwrap(),
    );
    assert_answer(
        &["back two".to_string()],
        &timeout(LIMIT, other).await.unwrap().unwrap().unwrap(),
    );
    assert_eq!(record.batches().len(), 2, "{:?}", record.batches());
    assert_eq!(batcher.metrics().query_thread_batches, 0);
}
