//! The public handle: admission, hand-off to the collector, and the answer.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::oneshot;

use crate::admission::Refusal;
use crate::queue::Pending;
use crate::request::{ActiveGuard, CallerGuard, Request, Ticket};
use crate::shared::Shared;
use crate::{collector, model_thread, tokenize};
use crate::{
    BatcherConfig, CoreError, EmbedInput, EmbedOptions, Embedder, EmbedderError, MetricsSnapshot,
    ModelInfo, Tokenize,
};

/// What one caller gets back: its own inputs' vectors, in its order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Embeddings {
    /// Pooled, not normalized, one per input in input order.
    pub vectors: Vec<Vec<f32>>,
    /// Exact tokens the model ran per input (after truncation, special tokens included).
    pub token_counts: Vec<u32>,
    /// How many of the inputs were answered from the embedding cache.
    pub cache_hits: u32,
}

/// Handle to a running batcher; cheap to clone, shareable across tasks.
///
/// Callers are admitted by a fair semaphore counted in inputs, batched by one
/// collector thread, and computed by one model thread. When the last clone is
/// dropped both threads finish what they hold and exit.
#[derive(Clone)]
pub struct Batcher {
    inner: Arc<Inner>,
}

/// Owned only by `Batcher` handles (the threads hold `Shared`), so its drop
/// means "no handle left".
struct Inner {
    shared: Arc<Shared>,
    info: ModelInfo,
    tokenizer: Option<Arc<dyn Tokenize>>,
}

impl std::fmt::Debug for Batcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batcher")
            .field("model", &self.inner.info.name)
            .field("healthy", &self.is_healthy())
            .field("config", &self.inner.shared.config)
            .finish()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.shared.stop();
    }
}

impl Batcher {
    /// Spawns the model thread, builds the model there with `load`, and returns
    /// once it is loaded (or with `ModelUnavailable` if loading failed).
    /// Blocking: call it before or outside async code (or in `spawn_blocking`).
    ///
    /// `embed` uses tokio's timer for `max_queue_wait`: the runtime it is
    /// polled on needs the time driver (`enable_time`/`enable_all`, as
    /// `#[tokio::main]` and `#[tokio::test]` have). `max_concurrent_requests`
    /// of zero is taken as one, and `max_batch_size` of zero as one.
    pub fn start<E, F>(config: BatcherConfig, load: F) -> Result<Self, CoreError>
    where
        E: Embedder + 'static,
        F: FnOnce() -> Result<E, EmbedderError> + Send + 'static,
    {
        let shared = Arc::new(Shared::new(config));
        let loaded = model_thread::spawn(shared.clone(), load).map_err(|e| {
            CoreError::ModelUnavailable(format!("cannot spawn the model thread: {e}"))
        })?;
        let (info, tokenizer) = match loaded.recv() {
            Ok(Ok(loaded)) => loaded,
            Ok(Err(message)) => return Err(CoreError::ModelUnavailable(message)),
            Err(_) => {
                return Err(CoreError::ModelUnavailable(
                    "model thread exited while loading".into(),
                ))
            }
        };
        let collector_shared = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("mlx-embed-batcher".into())
            .spawn(move || collector::run(collector_shared));
        if let Err(e) = spawned {
            shared.stop();
            return Err(CoreError::ModelUnavailable(format!(
                "cannot spawn the batch collector: {e}"
            )));
        }
        tracing::info!(model = %info.name, dim = info.dim, config = ?shared.config, "batcher started");
        // Both threads are detached: they exit on their own after `stop`, and
        // joining a thread mid-batch from a drop could block an async runtime.
        Ok(Self {
            inner: Arc::new(Inner {
                shared,
                info,
                tokenizer,
            }),
        })
    }

    /// Embeds `inputs` (non-empty) and returns exactly their vectors, in order.
    ///
    /// The inputs are tokenized first (on tokio's blocking pool, with the
    /// model's [`Tokenize`]): an unknown prompt name or a bad token id is
    /// `InvalidInput`, and with `options.truncate == false` an input over the
    /// model's maximum is `InputTooLong`, before anything is queued. Then the
    /// request waits for admission; `Overloaded` only past `max_waiting` or
    /// `max_queue_wait`. Dropping the future before its batch starts means its
    /// inputs are never computed.
    ///
    /// The future is `Send` and runs on any tokio runtime flavor; it needs
    /// the runtime's time driver (admission waits with tokio's timer) and
    /// its blocking pool.
    pub async fn embed(
        &self,
        inputs: Vec<EmbedInput>,
        options: EmbedOptions,
    ) -> Result<Embeddings, CoreError> {
        let shared = &*self.inner.shared;
        let result = self.embed_inner(inputs, options).await;
        shared.recorder.count_outcome(&result);
        result
    }

    async fn embed_inner(
        &self,
        inputs: Vec<EmbedInput>,
        options: EmbedOptions,
    ) -> Result<Embeddings, CoreError> {
        let shared = &*self.inner.shared;
        let n = inputs.len();
        if n == 0 {
            return Err(CoreError::InvalidInput("no inputs to embed".into()));
        }
        if shared.dead.get().is_some() || shared.closed.load(Ordering::Acquire) {
            return Err(shared.refusal());
        }
        let active = ActiveGuard::new(shared.recorder.clone());
        let inner = &*self.inner;
        let encoded =
            tokenize::encode_all(inner.tokenizer.clone(), &inner.info, inputs, &options).await?;
        let token_counts: Vec<u32> = encoded.iter().map(|e| e.len() as u32).collect();
        // Queue wait (and its bound) starts once the request is ready to queue.
        let arrived = Instant::now();
        let permit = match shared.admission.admit(n, arrived).await {
            Ok(permit) => permit,
            Err(Refusal::Closed) => return Err(shared.refusal()),
            Err(Refusal::Overloaded(reason)) => {
                let retry_after = shared.admission.retry_after(&shared.recorder);
                return Err(CoreError::Overloaded {
                    reason,
                    retry_after,
                });
            }
        };
        let ticket = Ticket::new(permit, n, shared.recorder.clone());
        let (reply, answer) = oneshot::channel();
        let request = Arc::new(Request::new(token_counts, arrived, reply, ticket, active));
        let caller = CallerGuard::new(&request);
        shared.submit(Pending::new(request, encoded))?;
        let result = answer.await;
        caller.disarm();
        // No answer means the request was dropped unanswered: the model is gone.
        result.unwrap_or_else(|_| Err(shared.unavailable()))
    }

    /// What the model reported about itself when it loaded.
    pub fn model_info(&self) -> &ModelInfo {
        &self.inner.info
    }

    /// The model's tokenizer (`None` for a model that takes token ids only):
    /// what `embed` runs, for callers that want the ids without embedding.
    pub fn tokenizer(&self) -> Option<&Arc<dyn Tokenize>> {
        self.inner.tokenizer.as_ref()
    }

    /// The configuration this batcher runs with.
    pub fn config(&self) -> &BatcherConfig {
        &self.inner.shared.config
    }

    /// True while the model thread is alive and the batcher accepts work.
    pub fn is_healthy(&self) -> bool {
        let shared = &self.inner.shared;
        shared.dead.get().is_none() && !shared.closed.load(Ordering::Acquire)
    }

    /// Why the model is unavailable, once it is (`None` while it is alive).
    pub fn model_failure(&self) -> Option<&str> {
        self.inner.shared.dead.get().map(String::as_str)
    }

    /// A copy of every counter and histogram, taken without stopping anything.
    pub fn metrics(&self) -> MetricsSnapshot {
        let shared = &self.inner.shared;
        shared
            .recorder
            .snapshot(shared.admission.waiting_inputs() as u64)
    }

    /// Stops accepting new work (`ShuttingDown`); admitted work still completes.
    /// Callers still waiting for admission are refused with `ShuttingDown`.
    pub fn close(&self) {
        let shared = &self.inner.shared;
        if !shared.closed.swap(true, Ordering::AcqRel) {
            tracing::info!("batcher closed to new work");
        }
        shared.admission.close();
    }

    /// Waits until every admitted request has been answered.
    pub async fn drained(&self) {
        self.inner.shared.recorder.idle().await;
    }
}
