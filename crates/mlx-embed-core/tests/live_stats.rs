//! The model's live figures ([`LiveStats`]) reach callers through the
//! batcher, read without the model thread: they answer while it is busy.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use mlx_embed_core::{
    BatchOutput, Batcher, BatcherConfig, DeviceMemory, Embedder, EmbedderError, Encoded, LiveStats,
    ModelInfo, Output, Tokenize,
};

/// Counts the batches its model has started; memory grows 1 KiB per batch.
#[derive(Default)]
struct Counting {
    started: AtomicU64,
}

impl LiveStats for Counting {
    fn memory(&self) -> Result<DeviceMemory, EmbedderError> {
        let kib = self.started.load(Ordering::SeqCst) * 1024;
        Ok(DeviceMemory {
            active_bytes: kib,
            cache_bytes: 7,
            peak_bytes: kib,
            cache_limit_bytes: None,
        })
    }

    fn details(&self) -> Result<BTreeMap<String, String>, EmbedderError> {
        let n = self.started.load(Ordering::SeqCst);
        Ok(BTreeMap::from([("started".into(), n.to_string())]))
    }
}

/// The shared fake, plus live figures it moves before each batch.
struct WithStats {
    fake: Fake,
    stats: Arc<Counting>,
}

impl Embedder for WithStats {
    fn info(&self) -> ModelInfo {
        self.fake.info()
    }
    fn tokenizer(&self) -> Option<Arc<dyn Tokenize>> {
        self.fake.tokenizer()
    }
    fn live_stats(&self) -> Option<Arc<dyn LiveStats>> {
        Some(self.stats.clone())
    }
    fn embed_batch(
        &mut self,
        inputs: &[Encoded],
        output: Output,
    ) -> Result<BatchOutput, EmbedderError> {
        self.stats.started.fetch_add(1, Ordering::SeqCst);
        self.fake.embed_batch(inputs, output)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_stats_answer_while_the_model_is_busy() {
    let record = Arc::new(Record::default());
    let gate = Gate::closed();
    let stats = Arc::new(Counting::default());
    let batcher = Batcher::start(BatcherConfig::default(), {
        let (record, gate, stats) = (record.clone(), gate.clone(), stats.clone());
        move || {
            Ok(WithStats {
                fake: Fake {
                    record,
                    delay: Duration::ZERO,
                    gate: Some(gate),
                },
                stats,
            })
        }
    })
    .expect("fake loads");
    let live = batcher
        .live_stats()
        .expect("the model reports live stats")
        .clone();
    let memory = live.memory().unwrap();
    assert_eq!((memory.active_bytes, memory.cache_bytes), (0, 7));

    // The model thread is stuck in a batch behind the closed gate; the
    // figures still answer, and already count that batch.
    let task = occupy_model(&batcher, &record, "busy").await;
    let memory = live.memory().unwrap();
    assert_eq!(memory.active_bytes, 1024);
    assert_eq!(memory.peak_bytes, 1024);
    assert_eq!(memory.cache_limit_bytes, None);
    assert_eq!(live.details().unwrap()["started"], "1");

    gate.open();
    let got = tokio::time::timeout(LIMIT, task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_answer(&["busy".to_string()], &got);
}

#[test]
fn a_model_without_live_stats_reports_none() {
    let (batcher, _record) = start(BatcherConfig::default(), Duration::ZERO, None);
    assert!(batcher.live_stats().is_none());
}
