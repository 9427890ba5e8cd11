//! The public handle: admission, hand-off to the collector, and the answer.

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::oneshot;

use crate::admission::Refusal;
use crate::model_thread;
use crate::queue::Pending;
use crate::request::{ActiveGuard, CallerGuard, Request, Ticket};
use crate::shared::Shared;
use crate::{
    BatcherConfig, CoreError, EmbedInput, Embedder, EmbedderError, MetricsSnapshot, ModelInfo,
    Priority,
};

/// What one caller gets back: its own inputs' vectors, in its order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Embeddings {
    /// Pooled, not normalized, one per input in input order.
    pub vectors: Vec<Vec<f32>>,
    /// Tokens the model ran per input (after truncation).
    pub token_counts: Vec<u32>,
    /// Tokens per input before truncation.
    pub untruncated_token_counts: Vec<u32>,
}

/// Handle to a running batcher; cheap to clone, shareable across tasks.
///
/// Callers are admitted by a fair semaphore per priority lane, counted in
/// inputs; the model thread cuts each batch from the lanes and computes it.
/// When the last clone is dropped the model thread finishes its batch and exits.
#[derive(Clone)]
pub struct Batcher {
    inner: Arc<Inner>,
}

/// Owned only by `Batcher` handles (the model thread holds `Shared`), so its
/// drop means "no handle left".
struct Inner {
    shared: Arc<Shared>,
    info: ModelInfo,
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
        let info = match loaded.recv() {
            Ok(Ok(info)) => info,
            Ok(Err(message)) => return Err(CoreError::ModelUnavailable(message)),
            Err(_) => {
                return Err(CoreError::ModelUnavailable(
                    "model thread exited while loading".into(),
                ))
            }
        };
        tracing::info!(model = %info.name, dim = info.dim, config = ?shared.config, "batcher started");
        // The model thread is detached: it exits on its own after `stop`, and
        // joining it mid-batch from a drop could block an async runtime.
        Ok(Self {
            inner: Arc::new(Inner { shared, info }),
        })
    }

    /// Embeds `inputs` (non-empty) and returns exactly their vectors, in order.
    /// Waits for admission; `Overloaded` only past `max_waiting` or `max_queue_wait`.
    /// Dropping the future before its batch starts means its inputs are never computed.
    ///
    /// The future is `Send` and runs on any tokio runtime flavor; waiting for
    /// admission uses tokio's timer, so the runtime needs its time driver.
    pub async fn embed(&self, inputs: Vec<EmbedInput>) -> Result<Embeddings, CoreError> {
        self.embed_with_priority(inputs, Priority::Normal).await
    }

    /// [`Batcher::embed`] in the lane of `priority`: high-priority inputs go
    /// into the next batch ahead of waiting normal and low ones; each lane
    /// has its own admission bounds.
    pub async fn embed_with_priority(
        &self,
        inputs: Vec<EmbedInput>,
        priority: Priority,
    ) -> Result<Embeddings, CoreError> {
        let shared = &*self.inner.shared;
        let result = self.embed_inner(inputs, priority).await;
        shared.recorder.count_outcome(priority, &result);
        result
    }

    async fn embed_inner(
        &self,
        inputs: Vec<EmbedInput>,
        priority: Priority,
    ) -> Result<Embeddings, CoreError> {
        let shared = &*self.inner.shared;
        let arrived = Instant::now();
        let n = inputs.len();
        if n == 0 {
            return Err(CoreError::InvalidInput("no inputs to embed".into()));
        }
        shared.check_open()?;
        let active = ActiveGuard::new(shared.recorder.clone());
        let admission = shared.admission(priority);
        let permit = match admission.admit(n, arrived).await {
            Ok(permit) => permit,
            Err(Refusal::Closed) => return Err(shared.refusal()),
            Err(Refusal::Overloaded(reason)) => {
                let retry_after = admission.retry_after(&shared.recorder);
                return Err(CoreError::Overloaded {
                    reason,
                    retry_after,
                });
            }
        };
        let ticket = Ticket::new(permit, n, shared.recorder.clone());
        let (reply, answer) = oneshot::channel();
        let request = Arc::new(Request::new(n, priority, arrived, reply, ticket, active));
        let caller = CallerGuard::new(&request);
        shared.submit(Pending::new(request, inputs))?;
        let result = answer.await;
        caller.disarm();
        // No answer means the request was dropped unanswered: the model is gone.
        result.unwrap_or_else(|_| Err(shared.unavailable()))
    }

    /// What the model reported about itself when it loaded.
    pub fn model_info(&self) -> &ModelInfo {
        &self.inner.info
    }

    /// The configuration this batcher runs with.
    pub fn config(&self) -> &BatcherConfig {
        &self.inner.shared.config
    }

    /// True while the model thread is alive and the batcher accepts work.
    pub fn is_healthy(&self) -> bool {
        self.inner.shared.is_healthy()
    }

    /// Why the model is unavailable, once it is (`None` while it is alive).
    pub fn model_failure(&self) -> Option<&str> {
        self.inner.shared.dead_reason()
    }

    /// A copy of every counter and histogram, taken without stopping anything.
    pub fn metrics(&self) -> MetricsSnapshot {
        self.inner.shared.metrics()
    }

    /// Stops accepting new work (`ShuttingDown`); admitted work still completes.
    /// Callers still waiting for admission are refused with `ShuttingDown`.
    pub fn close(&self) {
        self.inner.shared.close();
    }

    /// Waits until every admitted request has been answered.
    pub async fn drained(&self) {
        self.inner.shared.recorder.idle().await;
    }
}
