//! Metrics as plain data; the server renders them as Prometheus text.

/// A fixed-bucket histogram: `counts[i]` observations were `<= bounds[i]` and
/// above `bounds[i-1]` (NOT cumulative); `overflow` counts those above the last bound.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    pub bounds: Vec<f64>,
    pub counts: Vec<u64>,
    pub overflow: u64,
    pub sum: f64,
    pub count: u64,
}

/// A consistent-enough copy of every counter, taken without stopping the batcher.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MetricsSnapshot {
    /// Inputs waiting for admission right now.
    pub waiting_inputs: u64,
    /// Inputs admitted and not yet answered (queued for or in the model).
    pub in_flight_inputs: u64,
    /// Inputs queued for the model but not yet in a batch.
    pub queued_inputs: u64,
    pub requests_ok: u64,
    pub requests_overloaded: u64,
    pub requests_model_error: u64,
    pub requests_unavailable: u64,
    /// Requests whose caller went away before all their inputs were computed.
    pub requests_cancelled: u64,
    /// Inputs skipped because their caller went away before their batch started.
    pub inputs_cancelled_before_compute: u64,
    pub batches: u64,
    pub batch_size: Histogram,
    /// Estimated padded tokens per batch.
    pub batch_tokens: Histogram,
    /// Real tokens the model ran, and padded tokens it processed (padding ratio).
    pub real_tokens: u64,
    pub padded_tokens: u64,
    /// Seconds from submission to the start of the batch (admission + queue).
    pub queue_wait_seconds: Histogram,
    pub gil_wait_seconds: Histogram,
    pub model_seconds: Histogram,
}
