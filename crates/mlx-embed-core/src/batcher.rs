//! PUBLIC API CONTRACT (implementation to be written): other crates compile against these signatures.

use crate::{BatcherConfig, CoreError, EmbedInput, Embedder, EmbedderError, MetricsSnapshot, ModelInfo};

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
#[derive(Clone)]
pub struct Batcher {}

impl Batcher {
    /// Spawns the model thread, builds the model there with `load`, and returns
    /// once it is loaded (or with `ModelUnavailable` if loading failed).
    /// Blocking: call it before or outside async code (or in `spawn_blocking`).
    pub fn start<E, F>(config: BatcherConfig, load: F) -> Result<Self, CoreError>
    where
        E: Embedder + 'static,
        F: FnOnce() -> Result<E, EmbedderError> + Send + 'static,
    {
        let _ = (config, load);
        todo!()
    }

    /// Embeds `inputs` (non-empty) and returns exactly their vectors, in order.
    /// Waits for admission; `Overloaded` only past `max_waiting` or `max_queue_wait`.
    /// Dropping the future before its batch starts means its inputs are never computed.
    pub async fn embed(&self, inputs: Vec<EmbedInput>) -> Result<Embeddings, CoreError> {
        let _ = inputs;
        todo!()
    }

    pub fn model_info(&self) -> &ModelInfo {
        todo!()
    }

    pub fn config(&self) -> &BatcherConfig {
        todo!()
    }

    /// True while the model thread is alive and the batcher accepts work.
    pub fn is_healthy(&self) -> bool {
        todo!()
    }

    pub fn metrics(&self) -> MetricsSnapshot {
        todo!()
    }

    /// Stops accepting new work (`ShuttingDown`); admitted work still completes.
    pub fn close(&self) {
        todo!()
    }

    /// Waits until every admitted request has been answered.
    pub async fn drained(&self) {
        todo!()
    }
}
